"""The Python API: `Engine.from_config(...)`, then submit / stream / generate / cancel.

An engine is a router in front of pool workers (`workers.py`), one thread per
worker, so the prefill pool and the decode pool run at the same time on their own
devices. `DisaggregatedEngine` sends a prompt to the prefill instance with the best
prefix hit and its KV on to the least loaded decode instance (prompts of at most
`router.local_prefill_threshold` tokens are prefilled on the decode instance
itself); `ColocatedEngine` gives each prompt to one instance that piggybacks its
prefill chunks onto its decode batch, the founding article's baseline.

Callers see requests only through the engine's lock-protected tables and
per-request event sinks; workers report through the `Listener` methods below
(token, mark, finish, is_cancelled). `close()`, or leaving the `with` block,
stops and joins every thread, then frees whatever was still in flight.
"""

from __future__ import annotations

import functools
import logging
import queue
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from jaxdisagg.mesh.config import ConfigError, DeploymentConfig, RouterConfig, load_config
from jaxdisagg.mesh.deployment import Deployment
from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.model.sampling import SamplingParams
from jaxdisagg.model.tokenizer import IncrementalDecoder
from jaxdisagg.serve.kv_cache import BlockManager
from jaxdisagg.serve.prefill import PrefillJob
from jaxdisagg.serve.validation import (
    RequestLimits,
    check_params,
    check_prompt_size,
    check_request_id,
    check_stop_token_ids,
    check_token_ids,
    check_tokens,
    new_request_id,
)
from jaxdisagg.serve.workers import DecodeWorker, PrefillWorker

log = logging.getLogger(__name__)

# Lifecycle marks, in the order a disaggregated request passes them.
# pull_start: the decode thread starts landing the KV (a cross-process pull runs on that
# thread, so pull_start .. transfer_end is time the decode batch waits too).
STAGES = ("arrival", "prefill_start", "prefill_end", "transfer_start", "pull_start",
          "transfer_end", "transfer_failed", "decode_insert", "first_token", "finish")


class QueueFull(RuntimeError):
    """The engine holds router.max_requests requests already; retry later."""


class UnknownRequestError(KeyError, ValueError):
    """No such request in flight (or its result was already taken)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class Result:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "cancelled" | "error: ..."
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[float] | None = None  # when SamplingParams.logprobs
    ttft_s: float | None = None
    tbt_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    timeline: dict[str, float] = field(default_factory=dict)  # STAGES, seconds from arrival
    transfer_bytes: int = 0
    route: dict[str, str] = field(default_factory=dict)  # stage -> worker name
    preemptions: int = 0


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    # ("token", id, text delta, logprob) | ("text", None, held-back text, None) | ("done", Result)
    sink: Callable[[tuple], None]
    decoder: IncrementalDecoder | None
    arrival: float = field(default_factory=time.perf_counter)
    marks: dict[str, float] = field(default_factory=dict)
    info: Counter = field(default_factory=Counter)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already streamed
    stopped: bool = False  # a stop string matched: later tokens are dropped
    route: dict[str, str] = field(default_factory=dict)
    load_slot: int | None = None  # the decode worker counted in the router's load
    prefill_slot: int | None = None  # the prefill worker whose queued tokens count it


def pool_blocks(inst: PoolInstance, prefix_cache: bool) -> BlockManager:
    """The block manager of one pool instance; evicted prefix blocks spill to host memory
    when the pool config gives them room (`host_cache_blocks`)."""
    spill = inst.pool.host_cache_blocks if prefix_cache else 0
    return BlockManager(inst.layout.num_blocks, inst.layout.block_size,
                        prefix_cache=prefix_cache,
                        spill=inst.read_block if spill else None,
                        restore=inst.write_block if spill else None, host_capacity=spill)


class Engine:
    """Common API; the subclasses build their workers and route requests."""

    # Results nobody collects (a caller that submitted and went away) expire.
    RESULT_TTL_S = 600.0
    MAX_UNCOLLECTED = 4096

    def __init__(self, deployment: Deployment, *, start: bool = True,
                 router: RouterConfig | None = None, limits: RequestLimits | None = None):
        self.deployment = deployment
        self.limits = limits or RequestLimits()
        self.config: DeploymentConfig = deployment.config
        self.router = router or self.config.router
        self.tokenizer = deployment.tokenizer
        self.vocab_size = deployment.model.config.vocab_size
        self.eos_ids = frozenset(deployment.model.config.eos_token_ids)
        self._lock = threading.Lock()
        self._live: dict[str, _Request] = {}  # in flight
        self._results: dict[str, queue.SimpleQueue] = {}  # submitted, result not yet taken
        self._cancelled: set[str] = set()
        self._uncollected: deque[tuple[float, str]] = deque()  # (finished at, id)
        self._recent: deque[Result] = deque(maxlen=1024)
        self._counts: Counter = Counter()
        self._stopping = threading.Event()
        self._on_finish: list[Callable[[Result], None]] = []
        self.decoders: list[DecodeWorker] = []
        self.prefillers: list[PrefillWorker] = []
        self._build_workers()
        self._load = [0] * len(self.decoders)  # requests routed to each decode worker
        self._queued = [0] * len(self.prefillers)  # prompt tokens routed, not yet prefilled
        for j, w in enumerate(self.decoders):  # an int read without the lock: a snapshot
            w.routed = functools.partial(self._load.__getitem__, j)
        self._cap = min(w.capacity for w in self.workers)
        self._threads: list[threading.Thread] = []
        # Tokens and ends go to one output thread (detokenizing, stop strings, results,
        # metrics, the consumers' sinks), so a worker's loop only samples and moves on.
        # With start=False they are handled inline, in the stepping thread.
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._output: threading.Thread | None = None
        for w in self.workers:
            w.wake = threading.Event()
        if start:
            self._output = threading.Thread(target=self._output_loop, daemon=True,
                                            name="jaxdisagg-output")
            self._output.start()
            for w in self.workers:
                t = threading.Thread(target=self._run, args=(w,), name=f"jaxdisagg-{w.name}",
                                     daemon=True)
                t.start()
                self._threads.append(t)

    @classmethod
    def from_config(cls, config: str | DeploymentConfig, *, progress: bool = False,
                    start: bool = True, router: RouterConfig | None = None,
                    limits: RequestLimits | None = None) -> Engine:
        """The engine the config's mode asks for, built, warmed up and running."""
        cfg = load_config(config) if isinstance(config, str) else config
        if cfg.transfer.kind == "cross_process":
            raise ConfigError("transfer.kind: 'cross_process' pools run in separate "
                              "processes; start them with `jaxdisagg launch --config ...`")
        engine_cls = ColocatedEngine if cfg.mode == "colocated" else DisaggregatedEngine
        if cls not in (Engine, engine_cls):
            raise ConfigError(f"mode: {cfg.mode!r} configs run on {engine_cls.__name__}, "
                              f"not {cls.__name__}")
        return engine_cls(Deployment.build(cfg, progress=progress), start=start, router=router,
                          limits=limits)

    @property
    def workers(self) -> list:
        return [*self.prefillers, *self.decoders]

    def _build_workers(self) -> None:
        raise NotImplementedError

    def _route(self, req: _Request) -> None:
        raise NotImplementedError

    def _least_loaded(self, candidates) -> int:
        return min(candidates, key=lambda j: (self._load[j],
                                              self.decoders[j].gauges()["kv_blocks_used"]))

    # ------------------------------------------------------------ requests

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Text or ids -> checked token ids (ValueError naming `prompt` otherwise).
        Sizes are checked first: a huge text is refused before it is tokenized."""
        check_prompt_size(prompt, self.limits)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = check_token_ids(prompt, self.vocab_size)
        if not ids:
            raise ValueError("prompt: must not be empty")
        return ids

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, stop_token_ids: Sequence[int] | None = None,
               *, _sink: Callable[[tuple], None] | None = None, _internal: bool = False) -> str:
        """Queues a request; returns its id. Bad input raises ValueError naming the field;
        a full engine raises QueueFull.

        Without a `request_id` the engine picks an unguessable one (`jd-` + 128 random
        bits); a caller's own id must not start with `jd-` (`_internal` callers, the
        router, pass ids the server made).
        """
        params = check_params(params or SamplingParams(), self.limits)
        check_request_id(request_id, self.limits, internal=_internal)
        stop_token_ids = check_stop_token_ids(stop_token_ids, self.vocab_size, self.limits)
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop: stop strings need a tokenizer")
        ids = self.encode(prompt)
        check_tokens(ids, self.limits, params, self._cap)
        stops = self.eos_ids if stop_token_ids is None else frozenset(stop_token_ids)
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the engine is closed")
            if len(self._live) >= self.router.max_requests:
                raise QueueFull(f"{len(self._live)} requests in flight "
                                f"(router.max_requests = {self.router.max_requests})")
            self._expire_results()
            request_id = request_id or new_request_id()
            if request_id in self._results or request_id in self._live:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            results: queue.SimpleQueue = queue.SimpleQueue()
            # result() waits for the end only: a token event would be work for nothing.
            keep = _sink or (lambda event: event[0] == "done" and results.put(event))
            req = _Request(request_id, ids, params, stops, keep,
                           IncrementalDecoder(self.tokenizer) if self.tokenizer else None)
            req.marks["arrival"] = req.arrival
            self._live[request_id] = req
            if _sink is None:
                self._results[request_id] = results
            self._route(req)
        log.debug("%s: queued, %d prompt tokens, route %s", request_id, len(ids), req.route)
        return request_id

    def _expire_results(self) -> None:
        """Drops results nobody collected: older than RESULT_TTL_S, or beyond
        MAX_UNCOLLECTED of them (called with the lock held)."""
        now = time.monotonic()
        while self._uncollected and (now - self._uncollected[0][0] > self.RESULT_TTL_S
                                     or len(self._uncollected) > self.MAX_UNCOLLECTED):
            _, rid = self._uncollected.popleft()
            if rid not in self._live and self._results.pop(rid, None) is not None:
                log.info("%s: result expired uncollected", rid)

    def cancel(self, request_id: str) -> None:
        """Stops a request wherever it is; its Result ends with finish_reason 'cancelled'."""
        with self._lock:
            req = self._live.get(request_id)
            if req is None:
                raise UnknownRequestError(f"request_id: no request {request_id!r} in flight")
            self._cancelled.add(request_id)
        self._post_cancel(req)

    def _post_cancel(self, req: _Request) -> None:
        for w in self.workers:
            if w.name in req.route.values():
                w.post("cancel", req.request_id)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               **kwargs) -> Iterator[tuple[int, str]]:
        """Yields (token id, text delta) as tokens are produced; cancels if abandoned.

        Text that may still be the start of a stop string (or of a multi-byte
        character) is held back; a final (None, text) pair flushes it at the end.
        The generator returns the request's Result (StopIteration.value).
        """
        events: queue.SimpleQueue = queue.SimpleQueue()
        rid = self.submit(prompt, params, _sink=events.put, **kwargs)
        finished = False
        try:
            while True:
                event = events.get()
                if event[0] == "done":
                    finished = True
                    return event[1]  # the Result: StopIteration.value
                yield event[1], event[2]
        finally:
            if not finished:
                try:
                    self.cancel(rid)
                except KeyError:
                    pass

    def result(self, request_id: str, timeout: float | None = None) -> Result:
        """Waits for a submitted request's Result (each result can be taken once)."""
        results = self._results.get(request_id)
        if results is None:
            raise UnknownRequestError(f"request_id: no pending request {request_id!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            event = results.get(timeout=left)
            if event[0] == "done":
                self._results.pop(request_id, None)
                return event[1]

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Result]:
        params = params or SamplingParams()
        many = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.submit(p, sp) for p, sp in zip(prompts, many, strict=True)]
        return [self.result(rid) for rid in ids]

    # ------------------------------------------------------------ the Listener side

    def tokens(self, items: list[tuple[str, int, float]]) -> None:
        self._emit(self._handle_tokens, items, time.perf_counter())

    def finish(self, request_id: str, tokens: list[int], reason: str,
               cached_tokens: int = 0) -> None:
        self._emit(self._handle_finish, request_id, list(tokens), reason, cached_tokens,
                   time.perf_counter())

    def _emit(self, fn, *args) -> None:
        if self._output is None:
            fn(*args)
        else:
            self._out.put((fn, args))

    def _output_loop(self) -> None:
        while True:
            item = self._out.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one request's output must not stop the rest
                log.exception("output of %s failed", args[0])

    def _handle_tokens(self, items: list[tuple[str, int, float]], now: float) -> None:
        for request_id, token, logprob in items:
            try:
                self._handle_token(request_id, token, logprob, now)
            except Exception:  # noqa: BLE001 - one request's output must not stop the rest
                log.exception("output of %s failed", request_id)

    def _handle_token(self, request_id: str, token: int, logprob: float, now: float) -> None:
        req = self._live.get(request_id)
        if req is None or req.stopped:
            return
        req.tokens.append(token)
        req.logprobs.append(logprob)
        req.token_times.append(now)
        req.marks.setdefault("first_token", now)
        if req.decoder is not None:
            req.text += req.decoder.push(token)
        hit = -1
        if req.params.stop:  # only text not yet sent, plus a stop string's reach, is new
            start = max(0, req.sent - max(map(len, req.params.stop)) + 1)
            hit = min((i for i in (req.text.find(s, start) for s in req.params.stop) if i >= 0),
                      default=-1)
        if hit >= 0:  # cut the text before the stop string and end the request
            req.stopped = True
            req.text = req.text[:hit]
            delta = req.text[req.sent:]
            req.sent = len(req.text)
            with self._lock:
                self._cancelled.add(request_id)
            self._post_cancel(req)
        else:
            delta = self._releasable(req)
        self._send(req, ("token", token, delta, logprob))

    @staticmethod
    def _send(req: _Request, event: tuple) -> None:
        """A consumer that went away (a closed event loop) must not stop a worker."""
        try:
            req.sink(event)
        except Exception:  # noqa: BLE001
            pass

    @staticmethod
    def _releasable(req: _Request) -> str:
        """Text that can go out now: all of it, except a tail that might still grow
        into a stop string (it goes out once it cannot, or when the request ends)."""
        hold = 0
        for stop in req.params.stop:
            for k in range(min(len(stop) - 1, len(req.text)), hold, -1):
                if req.text.endswith(stop[:k]):
                    hold = k
                    break
        end = max(req.sent, len(req.text) - hold)
        delta = req.text[req.sent:end]
        req.sent = end
        return delta

    def mark(self, request_id: str, event: str, at: float | None = None, **info) -> None:
        req = self._live.get(request_id)
        if req is None:
            return
        if event == "prefill_end":
            self._unqueue(req)
        if event == "preempted":
            req.info["preemptions"] += 1
        else:
            req.marks.setdefault(event, at or time.perf_counter())
        req.info.update(info)

    def _unqueue(self, req: _Request) -> None:
        with self._lock:
            if req.prefill_slot is not None:
                self._queued[req.prefill_slot] -= len(req.prompt)
                req.prefill_slot = None

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    def _handle_finish(self, request_id: str, tokens: list[int], reason: str,
                       cached_tokens: int, now: float) -> None:
        with self._lock:
            req = self._live.pop(request_id, None)
            self._cancelled.discard(request_id)
            if req is None:
                return  # already finished: every request ends exactly once
            if req.load_slot is not None:
                self._load[req.load_slot] -= 1
        self._unqueue(req)
        if req.stopped:
            tokens, reason = req.tokens, "stop"
        elif req.decoder is not None:
            req.text += req.decoder.flush()
            if len(req.text) > req.sent:  # held back: a partial character or stop string
                self._send(req, ("text", None, req.text[req.sent:], None))
                req.sent = len(req.text)
        req.marks["finish"] = now
        times = req.token_times
        text = None
        if self.tokenizer is not None:
            text = req.text if req.params.stop else self.tokenizer.decode(tokens)
            # (req.text is what was streamed; with no stop strings the two are equal)
        result = Result(
            request_id, req.prompt, list(tokens), text, reason,
            cached_tokens or int(req.info.get("cached_tokens", 0)),
            logprobs=list(req.logprobs[:len(tokens)]) if req.params.logprobs else None,
            ttft_s=times[0] - req.arrival if times else None,
            tbt_s=[b - a for a, b in zip(times, times[1:], strict=False)],
            e2e_s=now - req.arrival,
            timeline={k: req.marks[k] - req.arrival for k in STAGES if k in req.marks},
            transfer_bytes=int(req.info.get("transfer_bytes", 0)), route=dict(req.route),
            preemptions=int(req.info.get("preemptions", 0)))
        with self._lock:
            if request_id in self._results:
                self._uncollected.append((time.monotonic(), request_id))
            self._recent.append(result)
            self._counts["finished"] += 1
            self._counts[reason.split(":")[0]] += 1
            self._counts["generated_tokens"] += len(tokens)
        for fn in self._on_finish:
            try:
                fn(result)
            except Exception:  # noqa: BLE001 - an observer must not stop a worker
                pass
        self._send(req, ("done", result))

    # ------------------------------------------------------------ the threads

    def _run(self, worker) -> None:
        while not self._stopping.is_set():
            worker.wake.clear()
            try:
                busy = worker.step()
            except Exception as e:  # noqa: BLE001 - fail its requests, keep serving the rest
                log.exception("%s: step failed; failing the requests it holds", worker.name)
                try:
                    self._fail(worker, e)
                except Exception:  # noqa: BLE001
                    pass
                busy = False
            if not busy:  # blocked work (a full queue, no blocks) is retried soon
                worker.wake.wait(0.05 if worker.idle else 0.002)

    def _fail(self, worker, error: Exception) -> None:
        prefill_only = worker not in self.decoders  # requests past prefill are not its
        with self._lock:
            held = [r for r in self._live.values() if worker.name in r.route.values()
                    and not (prefill_only and "prefill_end" in r.marks)]
        for req in held:
            self.finish(req.request_id, req.tokens, f"error: {type(error).__name__}: {error}")
            self._post_cancel(req)  # other workers holding it free their blocks

    def step_all(self) -> bool:
        """Steps every worker once in the caller's thread (engines built with
        start=False: deterministic tests and single-threaded tools)."""
        if self._threads:
            raise RuntimeError("the engine runs its own threads; step_all needs start=False")
        busy = False
        for w in self.workers:
            busy |= w.step()
        return busy

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self._live:
                return
            self.step_all()
        raise RuntimeError(f"requests still in flight after {max_steps} steps")

    # ------------------------------------------------------------ metrics

    def metrics(self) -> dict:
        """Engine counters, latency percentiles over the last 1024 results, and every
        worker's gauges (queues, slots, KV blocks, prefix hit rate, transfer bytes)."""
        with self._lock:
            recent = list(self._recent)
            counts = dict(self._counts)
            in_flight = len(self._live)

        def pct(values, q):
            if not values:
                return None
            values = sorted(values)
            return values[min(len(values) - 1, int(q / 100 * len(values)))]

        ttft = [r.ttft_s for r in recent if r.ttft_s is not None]
        tbt = [t for r in recent for t in r.tbt_s]
        e2e = [r.e2e_s for r in recent if r.e2e_s is not None]
        latency = {f"{name}_p{q}_s": pct(v, q) for name, v in
                   (("ttft", ttft), ("tbt", tbt), ("e2e", e2e)) for q in (50, 90, 99)}
        latency["tbt_mean_s"] = statistics.fmean(tbt) if tbt else None
        return {"mode": self.config.mode, "in_flight": in_flight,
                "requests": {k: counts.get(k, 0) for k in
                             ("finished", "stop", "length", "cancelled", "error")},
                "generated_tokens": counts.get("generated_tokens", 0),
                "latency": latency, "pools": {w.name: w.gauges() for w in self.workers}}

    def healthy(self) -> bool:
        """Whether every pool this engine needs is reachable (in-process: always)."""
        return not self._stopping.is_set()

    def add_finish_listener(self, fn: Callable[[Result], None]) -> None:
        """Calls fn(result) for every request that ends (metrics exporters)."""
        self._on_finish.append(fn)

    @property
    def max_context(self) -> int:
        return self._cap

    def block_managers(self) -> dict[str, BlockManager]:
        """The block managers of this process's pools (a remote pool keeps its own)."""
        return {w.name: w.blocks for w in self.workers if getattr(w, "blocks", None)}

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stops the threads, then cancels what is left so every block comes back."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            left = list(self._live.values())
            self._cancelled.update(r.request_id for r in left)
        for w in self.workers:
            w.wake.set()
        for t in self._threads:
            t.join(timeout=120)
        for req in left:
            self._post_cancel(req)
        for _ in range(3):  # cancels reach every holder (a handoff may sit in a queue)
            for w in self.workers:
                w.drain()
        for req in left:
            self.finish(req.request_id, req.tokens, "cancelled")
        if self._output is not None:  # everything above is queued before the stop mark
            self._out.put(None)
            self._output.join(timeout=120)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DisaggregatedEngine(Engine):
    """Prefill instances -> KV transfer -> decode instances, each on its own thread."""

    def _build_workers(self) -> None:
        dep = self.deployment
        if self.config.mode != "disaggregated" or not dep.transfers:
            raise ValueError("DisaggregatedEngine needs an in-process disaggregated deployment")
        for j, inst in enumerate(dep.pools["decode"]):
            blocks = pool_blocks(inst, prefix_cache=False)
            transfers = {i: t for (i, jj), t in dep.transfers.items() if jj == j}
            self.decoders.append(DecodeWorker(f"decode[{j}]", inst, blocks, transfers, self,
                                              self.router.handoff_queue))
            self.decoders[-1].on_transfer_failure = self.config.transfer.on_failure
        for i, inst in enumerate(dep.pools["prefill"]):
            blocks = pool_blocks(inst, self.router.prefix_cache)
            transfers = {j: t for (ii, j), t in dep.transfers.items() if ii == i}
            self.prefillers.append(PrefillWorker(i, inst, blocks, transfers, self.decoders,
                                                 self))

    def _route(self, req: _Request) -> None:
        j = self._least_loaded(range(len(self.decoders)))
        self._load[j] += 1
        req.load_slot = j
        job = PrefillJob(req.request_id, req.prompt, req.params, req.stop_ids, target=j)
        decode = self.decoders[j]
        req.route["decode"] = decode.name
        if len(req.prompt) <= self.router.local_prefill_threshold:
            req.route["prefill"] = decode.name  # conditional disaggregation: no transfer
            decode.post("job", job)
            return
        # Best prefix hit first (skipped tokens), then the shortest queue.
        # Healthy instances only (all of them if none is: the request then fails fast).
        alive = [i for i, w in enumerate(self.prefillers) if w.healthy]
        i = max(alive or range(len(self.prefillers)),
                key=lambda i: (self.prefillers[i].prefix_hit(req.prompt), -self._queued[i]))
        self._queued[i] += len(req.prompt)
        req.prefill_slot = i
        req.route["prefill"] = self.prefillers[i].name
        self.prefillers[i].post("job", job)


class ColocatedEngine(Engine):
    """One pool: every instance prefills (piggybacked on its decode batch) and decodes."""

    def _build_workers(self) -> None:
        if self.config.mode != "colocated":
            raise ValueError("ColocatedEngine needs a colocated deployment")
        for j, inst in enumerate(self.deployment.pools["colocated"]):
            blocks = pool_blocks(inst, self.router.prefix_cache)
            self.decoders.append(DecodeWorker(f"colocated[{j}]", inst, blocks, {}, self,
                                              self.router.handoff_queue))

    def _route(self, req: _Request) -> None:
        j = max(range(len(self.decoders)),
                key=lambda j: (self.decoders[j].prefix_hit(req.prompt), -self._load[j]))
        self._load[j] += 1
        req.load_slot = j
        w = self.decoders[j]
        req.route["prefill"] = req.route["decode"] = w.name
        w.post("job", PrefillJob(req.request_id, req.prompt, req.params, req.stop_ids,
                                 target=j))
