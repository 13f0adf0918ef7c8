"""A small client of the gRPC serving API (what `jaxdisagg generate --server` uses)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxdisagg.serve.proto import jaxdisagg_pb2 as pb
from jaxdisagg.serve.proto import jaxdisagg_pb2_grpc as pb_grpc


def request(prompt: str | Sequence[int], *, max_tokens: int | None = None,
            temperature: float | None = None, top_k: int | None = None,
            top_p: float | None = None, seed: int | None = None, logprobs: bool = False,
            stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
            ignore_eos: bool = False, request_id: str = "") -> pb.GenerateRequest:
    given = {k: v for k, v in dict(max_tokens=max_tokens, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=seed).items()
             if v is not None}
    sampling = pb.Sampling(**given, logprobs=logprobs, stop=list(stop),
                           stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling=sampling, request_id=request_id)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(prompt)), sampling=sampling,
                              request_id=request_id)


class Client:
    def __init__(self, target: str):
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def stream(self, prompt, timeout: float | None = None, **kwargs
               ) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request(prompt, **kwargs), timeout=timeout)

    def generate(self, prompt, timeout: float | None = None, **kwargs) -> dict:
        """The whole request: token ids, text, finish reason and timings."""
        ids, text, last = [], [], None
        for r in self.stream(prompt, timeout=timeout, **kwargs):
            ids += r.token_ids
            text.append(r.text)
            last = r
        return {"request_id": last.request_id, "token_ids": ids, "text": "".join(text),
                "finish_reason": last.finish_reason, "timings": last.timings}

    def abort(self, request_id: str) -> None:
        self.stub.Abort(pb.AbortRequest(request_id=request_id))

    def info(self) -> pb.InfoResponse:
        return self.stub.Info(pb.InfoRequest())

    def health(self, service: str = "") -> str:
        reply = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
