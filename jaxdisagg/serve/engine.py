"""The Python API over the disaggregated core: submit, stream, generate, cancel.

One background thread owns the core (and so both pools' programs and pages) and
steps it while there is work. Callers talk to it only through a lock-protected
inbox and per-request event queues, so `stream()` yields tokens as they are
produced and `cancel()` works from any thread. `close()` (or leaving the `with`
block) stops the thread and joins it.

This is the first cut of issue 5's API: one prefill and one decode instance, in-process
transfer. The router over several instances, the colocated engine, the asyncio
variant and metrics build on it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from jaxdisagg.mesh.config import DeploymentConfig
from jaxdisagg.mesh.deployment import Deployment
from jaxdisagg.model.sampling import SamplingParams
from jaxdisagg.model.tokenizer import IncrementalDecoder
from jaxdisagg.serve.core import DisaggregatedCore


@dataclass
class Result:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    cached_tokens: int = 0
    ttft_s: float | None = None
    tbt_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    events: queue.Queue = field(default_factory=queue.Queue)  # ("token", id) | ("done", Result)
    arrival: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)


class Engine:
    def __init__(self, deployment: Deployment):
        self.deployment = deployment
        self.tokenizer = deployment.tokenizer
        self.vocab_size = deployment.model.config.vocab_size
        self._core = DisaggregatedCore(deployment)
        self._cap = self._core.prefill.inst.max_pages * self._core.prefill_blocks.block_size
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple[str, object]] = []
        self._live: dict[str, _Request] = {}  # in flight
        self._requests: dict[str, _Request] = {}  # submitted, result not yet taken
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jaxdisagg-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: str | DeploymentConfig, progress: bool = False) -> Engine:
        return cls(Deployment.build(config, progress=progress))

    # ------------------------------------------------------------ requests

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids outside the vocabulary [0, {self.vocab_size}): "
                             f"{bad[:5]}")
        return ids

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, stop_token_ids: Sequence[int] | None = None
               ) -> str:
        """Queues a request; returns its id. Bad input raises ValueError naming the field."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        if len(ids) + params.max_tokens > self._cap:
            raise ValueError(f"prompt: {len(ids)} tokens + max_tokens {params.max_tokens} "
                             f"exceed the context of {self._cap} tokens")
        stops = frozenset(self.deployment.model.config.eos_token_ids if stop_token_ids is None
                          else stop_token_ids)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is closed")
            request_id = request_id or f"req-{next(self._ids)}"
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            req = _Request(request_id, ids, params, stops)
            self._live[request_id] = self._requests[request_id] = req
            self._inbox.append(("add", req))
        self._wake.set()
        return request_id

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._live:
                raise KeyError(f"request_id: no request {request_id!r} in flight")
            self._inbox.append(("cancel", request_id))
        self._wake.set()

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               **kwargs) -> Iterator[tuple[int, str]]:
        """Yields (token id, text delta) as tokens are produced; cancels if abandoned."""
        rid = self.submit(prompt, params, **kwargs)
        req = self._requests[rid]
        decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer else None
        finished = False
        try:
            while True:
                kind, value = req.events.get()
                if kind == "done":
                    finished = True
                    self._requests.pop(rid, None)
                    return
                yield value, decoder.push(value) if decoder else ""
        finally:
            if not finished:
                try:
                    self.cancel(rid)
                except KeyError:
                    pass
                self._requests.pop(rid, None)

    def result(self, request_id: str, timeout: float | None = None) -> Result:
        """Waits for a submitted request's Result (each result can be taken once)."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"request_id: no pending request {request_id!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            kind, value = req.events.get(timeout=left)
            if kind == "done":
                self._requests.pop(request_id, None)
                return value

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Result]:
        params = params or SamplingParams()
        many = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.submit(p, sp) for p, sp in zip(prompts, many, strict=True)]
        return [self.result(rid) for rid in ids]

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        core = self._core
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            for kind, item in inbox:
                if kind == "add":
                    try:
                        core.add_request(item.request_id, item.prompt, item.params,
                                         item.stop_ids)
                    except ValueError as e:  # the request fails, the loop goes on
                        core.finish(item.request_id, [], f"error: {e}")
                elif kind == "cancel":
                    core.cancel(item)
            if stopping:
                for rid in list(self._live):
                    core.cancel(rid)
                self._deliver([])
                return
            if core.idle:
                self._deliver([])  # cancellations finish without a step
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                emitted = core.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep the thread alive
                for rid in list(self._live):
                    if core.cancel(rid):
                        core.finished[rid].finish_reason = f"error: {type(e).__name__}: {e}"
                emitted = []
            self._deliver(emitted)

    def _deliver(self, emitted: list[tuple[str, int]]) -> None:
        now = time.perf_counter()
        for rid, token in emitted:
            req = self._live.get(rid)
            if req is not None:
                req.token_times.append(now)
                req.events.put(("token", token))
        for rid in list(self._core.finished):
            fin = self._core.finished.pop(rid)
            with self._lock:
                req = self._live.pop(rid, None)
            if req is None:
                continue
            times = req.token_times
            text = self.tokenizer.decode(fin.tokens) if self.tokenizer else None
            req.events.put(("done", Result(
                rid, req.prompt, fin.tokens, text, fin.finish_reason, fin.cached_tokens,
                ttft_s=times[0] - req.arrival if times else None,
                tbt_s=[b - a for a, b in zip(times, times[1:], strict=False)],
                e2e_s=now - req.arrival)))

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=60)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
