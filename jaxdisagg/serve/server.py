"""The gRPC serving front end: `jaxdisagg serve --config FILE`.

One process holds an engine (disaggregated or colocated, in-process pools) and
serves `jaxdisagg.v1.Generator` (Generate streams, Abort, Info) next to the standard
health checking and reflection services, so stock tools (grpcurl,
grpc_health_probe) work. Prometheus metrics are served over HTTP on their own port.

Nothing from the wire is unpickled or evaluated: requests are protobuf messages,
checked field by field against the server's limits before the engine sees them.
Status codes: INVALID_ARGUMENT (bad request, field named), RESOURCE_EXHAUSTED
(the engine holds router.max_requests already), UNAVAILABLE (a pool failed, or the
server is shutting down), NOT_FOUND (abort of an unknown id); a client's deadline
or cancel ends the request and frees its blocks.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import signal
import sys
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxdisagg.model.sampling import SamplingParams
from jaxdisagg.serve.engine import Engine, QueueFull, Result, UnknownRequestError
from jaxdisagg.serve.metrics import PrometheusExporter
from jaxdisagg.serve.proto import jaxdisagg_pb2 as pb
from jaxdisagg.serve.proto import jaxdisagg_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name


@dataclass(frozen=True)
class ServerLimits:
    max_prompt_tokens: int | None = None  # None: the deployment's context
    max_new_tokens: int = 4096
    max_message_bytes: int = 4 * 2**20
    max_stop_strings: int = 16


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, engine: Engine, limits: ServerLimits):
        self.engine, self.limits = engine, limits
        self.closing = threading.Event()

    # ------------------------------------------------------------ parsing

    def _sampling(self, s: pb.Sampling) -> tuple[SamplingParams, list[int] | None]:
        lim = self.limits
        kwargs = {}
        for name in ("temperature", "top_k", "top_p", "seed", "max_tokens"):
            if s.HasField(name):
                kwargs[name] = getattr(s, name)
        if kwargs.get("max_tokens", 1) > lim.max_new_tokens:
            raise ValueError(f"sampling.max_tokens: {kwargs['max_tokens']} exceeds the server "
                             f"limit of {lim.max_new_tokens}")
        if not 0 <= kwargs.get("seed", 0) < 2**32:
            raise ValueError(f"sampling.seed: must be in [0, 2^32), got {kwargs['seed']}")
        if len(s.stop) > lim.max_stop_strings:
            raise ValueError(f"sampling.stop: at most {lim.max_stop_strings} stop strings")
        try:
            params = SamplingParams(**kwargs, logprobs=s.logprobs, stop=tuple(s.stop))
        except ValueError as e:
            raise ValueError(str(e).replace("SamplingParams.", "sampling.")) from None
        stop_ids = list(s.stop_token_ids)
        if s.ignore_eos or stop_ids:
            return params, stop_ids
        return params, None

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("prompt: set text or token_ids")
        ids = self.engine.encode(request.text if kind == "text" else list(request.token_ids.ids))
        cap = self.limits.max_prompt_tokens
        if cap is not None and len(ids) > cap:
            raise ValueError(f"prompt: {len(ids)} tokens exceed the server limit of {cap}")
        return ids

    # ------------------------------------------------------------ RPCs

    def Generate(self, request, context):
        if self.closing.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        events: queue.Queue = queue.Queue()
        try:
            prompt = self._prompt(request)
            params, stop_ids = self._sampling(request.sampling)
            rid = self.engine.submit(prompt, params, request_id=request.request_id or None,
                                     stop_token_ids=stop_ids, _sink=events.put)
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:  # UnknownRequestError is one too, but submit never raises it
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:  # the engine is closed
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        done = threading.Event()
        # Deadline, client cancel or disconnect: the request ends and frees its blocks.
        context.add_callback(lambda: None if done.is_set() else self._cancel(rid))
        first = True
        while True:
            try:
                event = events.get(timeout=0.25)
            except queue.Empty:
                if not context.is_active():
                    self._cancel(rid)
                    return
                continue
            if event[0] == "done":
                done.set()
                result: Result = event[1]
                if result.finish_reason.startswith("error"):
                    context.abort(grpc.StatusCode.UNAVAILABLE, result.finish_reason)
                yield pb.GenerateResponse(request_id=rid, finish_reason=result.finish_reason,
                                          timings=_timings(result))
                return
            _, token, text, logprob = event
            yield pb.GenerateResponse(
                request_id=rid, token_ids=[] if token is None else [token], text=text,
                logprobs=[logprob] if params.logprobs and logprob is not None else [],
                prompt_tokens=len(prompt) if first else 0)
            first = False

    def _cancel(self, rid: str) -> None:
        try:
            self.engine.cancel(rid)
        except UnknownRequestError:
            pass  # it finished meanwhile

    def Abort(self, request, context):
        try:
            self.engine.cancel(request.request_id)
        except UnknownRequestError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.AbortResponse()

    def Info(self, request, context):
        engine = self.engine
        return pb.InfoResponse(
            model=engine.deployment.model.config.name, mode=engine.config.mode,
            config_json=json.dumps(dataclasses.asdict(engine.config)),
            metrics_json=json.dumps(engine.metrics()), max_context=engine.max_context,
            vocab_size=engine.vocab_size)


class _Garbled:
    """A request body that did not parse: the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: str):
        self.error = error


def _parser(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            return _Garbled(f"request: not a valid {message_cls.DESCRIPTOR.name} ({e})")
    return parse


def _checked(method):
    """Garbled bytes get INVALID_ARGUMENT (grpc's own deserializer failure is INTERNAL)."""
    def handler(request, context):
        if isinstance(request, _Garbled):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return method(request, context)
    return handler


def _handlers(service: GeneratorService) -> grpc.GenericRpcHandler:
    def stream_handler(request, context):
        if isinstance(request, _Garbled):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        yield from service.Generate(request, context)

    unary = {"Abort": (pb.AbortRequest, pb.AbortResponse),
             "Info": (pb.InfoRequest, pb.InfoResponse)}
    methods = {name: grpc.unary_unary_rpc_method_handler(
        _checked(getattr(service, name)), request_deserializer=_parser(req),
        response_serializer=resp.SerializeToString) for name, (req, resp) in unary.items()}
    methods["Generate"] = grpc.unary_stream_rpc_method_handler(
        stream_handler, request_deserializer=_parser(pb.GenerateRequest),
        response_serializer=pb.GenerateResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def _timings(r: Result) -> pb.Timings:
    return pb.Timings(ttft_s=r.ttft_s or 0.0, e2e_s=r.e2e_s or 0.0, tbt_s=r.tbt_s,
                      timeline=r.timeline, transfer_bytes=r.transfer_bytes,
                      cached_tokens=r.cached_tokens, preemptions=r.preemptions)


class Server:
    """An engine behind a gRPC server (plus health, reflection and Prometheus)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0,
                 limits: ServerLimits | None = None, metrics_port: int | None = None,
                 workers: int | None = None):
        self.engine = engine
        # A stream holds a thread while it lasts: room for every request the engine
        # admits (router.max_requests), plus some for Abort, Info and health checks.
        workers = workers or engine.router.max_requests + 16
        self.limits = limits or ServerLimits()
        opts = [("grpc.max_receive_message_length", self.limits.max_message_bytes),
                ("grpc.max_send_message_length", self.limits.max_message_bytes)]
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=opts,
                                maximum_concurrent_rpcs=workers)
        self.service = GeneratorService(engine, self.limits)
        self.grpc.add_generic_rpc_handlers((_handlers(self.service),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        self.port = self.grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.host = host
        self.exporter = PrometheusExporter(engine)
        self.metrics_port = (self.exporter.serve(host, metrics_port)
                             if metrics_port is not None else None)

    def start(self) -> Server:
        self.grpc.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float = 30.0) -> None:
        """Drain: refuse new requests, let those in flight finish (up to `grace`), then
        close the engine (cancelling whatever is left) and the servers."""
        self.service.closing.set()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.stop(grace).wait()
        self.engine.close()
        self.exporter.close()


def serve_forever(server: Server, out=sys.stdout) -> None:
    """Starts the server, prints READY, and drains on SIGTERM / SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    metrics = f" metrics http://{server.host}:{server.metrics_port}/metrics" \
        if server.metrics_port else ""
    print(f"READY {server.host}:{server.port}{metrics}", file=out, flush=True)
    stop.wait()
    print("draining", file=out, flush=True)
    server.stop()
    print("stopped", file=out, flush=True)
