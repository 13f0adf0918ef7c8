"""Pools in separate processes: the prefill service and the decode side's proxy of it.

    prefill process:  PrefillService  = PrefillWorker + KVSender + a control server
    decode process:   CrossProcessEngine = DecodeWorker + KVReceiver + RemotePrefill

The decode process is the front end (it runs the gRPC Generator service). For each
request, `RemotePrefill` (a worker that only forwards) calls the prefill process's
`prefill` control method; the prefill process runs chunked prefill, offers the KV
through `jax.experimental.transfer` (held under a lease) and answers with the offers
and the first token. The calling thread pulls the offers onto the decode devices
under the receiver's watchdog and releases them; the decode worker then only
scatters the pages in when a slot and blocks are free, so a slow pull never stalls
the decode batch. Control messages are JSON
(`mesh/control.py`): nothing is unpickled.

Failures stay per request: a prefill process that is down fails its requests with
UNAVAILABLE-style errors ("error: prefill pool unavailable"); a pull that times out
fails the request, or prefills it again on the decode instance when
`transfer.on_failure: recompute`; offers nobody pulls are freed when the lease ends.

Every control call carries the deployment secret (`mesh/control.py`), and the
prefill process checks each message with the same validation as the public front
ends: a message that passes can never fail inside a prefill step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from concurrent import futures

import grpc
import jax

from jaxdisagg.mesh.config import DeploymentConfig
from jaxdisagg.mesh.control import ControlClient, ControlServer, load_secret
from jaxdisagg.mesh.deployment import Deployment
from jaxdisagg.mesh.xproc import KVOffer, KVReceiver, KVSender
from jaxdisagg.model.sampling import SamplingParams
from jaxdisagg.serve.engine import DisaggregatedEngine, pool_blocks
from jaxdisagg.serve.faults import failpoint
from jaxdisagg.serve.prefill import Handoff, PrefillJob
from jaxdisagg.serve.validation import RequestLimits, check_request_id, check_token_ids
from jaxdisagg.serve.workers import DecodeWorker, PrefillWorker

log = logging.getLogger(__name__)
_PARAMS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "logprobs", "stop")


def _warm(label: str, compile_all) -> None:
    """Compiles a transfer side's programs before serving (the first request of each
    page bucket would otherwise pay a compile: ~1 s on a GPU)."""
    t0 = time.perf_counter()
    compile_all()
    log.info("warm-up: %s compiled in %.1f s", label, time.perf_counter() - t0)


def params_to_json(p: SamplingParams) -> dict:
    return {k: list(v) if k == "stop" else v for k, v in dataclasses.asdict(p).items()
            if k in _PARAMS}


def params_from_json(d) -> SamplingParams:
    """SamplingParams from a control message; unknown or mistyped fields are refused."""
    if not isinstance(d, dict):
        raise ValueError("params: expected an object")
    unknown = set(d) - set(_PARAMS)
    if unknown:
        raise ValueError(f"params: unknown fields {sorted(unknown)}")
    stop = d.get("stop", [])
    if not isinstance(stop, list):
        raise ValueError("params.stop: expected a list of strings")
    return SamplingParams(**{**d, "stop": tuple(stop)})


class _Outbox:
    """Stands in for the decode worker in the prefill process: handoffs land here."""

    def __init__(self, maxsize: int):
        self.handoffs: queue.Queue[Handoff] = queue.Queue(maxsize=maxsize)
        self.wake = threading.Event()


@dataclasses.dataclass
class _Pending:
    received: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    reply: dict = dataclasses.field(default_factory=dict)
    marks: dict = dataclasses.field(default_factory=dict)


class PrefillService:
    """The prefill process: one instance of the deployment's prefill pool."""

    def __init__(self, dep: Deployment, host: str = "127.0.0.1", port: int = 0,
                 secret: str | None = None):
        # Fault injection for tests (a failpoint): "die_after_offer" answers the first
        # prefill call with offers that are never served, then kills this process, as
        # if it died while the decode side pulls.
        self._failpoint = os.environ.get("JAXDISAGG_FAILPOINT", "")
        cfg = dep.config
        inst = dep.pools["prefill"][0]
        self.config = cfg
        self.sender = KVSender(inst, lease_s=cfg.transfer.lease_s, secret=secret)
        _warm("KV gather", self.sender.source.warmup)
        self.vocab_size = inst.config.vocab_size
        self.limits = RequestLimits()
        self.outbox = _Outbox(cfg.router.handoff_queue)
        self.blocks = pool_blocks(inst, cfg.router.prefix_cache)
        self.worker = PrefillWorker(0, inst, self.blocks, {0: self.sender}, [self.outbox], self)
        self.worker.wake = threading.Event()
        self._pending: dict[str, _Pending] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=fn, daemon=True, name=name)
                         for fn, name in ((self._run, "prefill"), (self._ship, "handoffs"))]
        for t in self._threads:
            t.start()
        self.control = ControlServer({"prefill": self._prefill, "cancel": self._cancel,
                                      "stats": self._stats}, host=host, port=port, workers=64,
                                     secret=secret)
        self.address = self.control.address

    # ---------------------------------------------------------------- the worker side

    def _run(self) -> None:
        while not self._stop.is_set():
            self.worker.wake.clear()
            offered = self.worker.transfers_done
            try:
                busy = self.worker.step()
            except Exception as e:  # noqa: BLE001 - fail what is waiting, keep serving
                log.exception("prefill step failed; failing the requests it holds")
                with self._lock:
                    waiting = list(self._pending)
                for rid in waiting:
                    self.worker.post("cancel", rid)
                    self.finish(rid, [], f"error: prefill failed: {type(e).__name__}: {e}")
                busy = False
            if busy and self.worker.transfers_done > offered:
                # The pull comes within milliseconds; computing meanwhile would delay it
                # by a whole chunk, and then the next request's first token by the pull.
                self.sender.wait_released(self.config.transfer.pull_hold_s)
            if busy and self.sender.held():
                # A pull is served only after every computation dispatched before it
                # arrives (this CPU client queues them in order: a pull waited out a
                # whole next prefill, `benchmarks/pull_stall.py`). While offers wait,
                # dispatch one step at a time, so a pull waits for one chunk at most.
                jax.block_until_ready(self.worker.inst.kv)
            if not busy:
                self.worker.wake.wait(0.05 if self.worker.idle else 0.002)

    def _ship(self) -> None:
        """Answers each request's `prefill` call with its offers and first token."""
        while not self._stop.is_set():
            try:
                h = self.outbox.handoffs.get(timeout=0.1)
            except queue.Empty:
                continue
            if self._failpoint == "die_after_offer":
                self.sender.drop_offers()
                threading.Timer(0.5, os._exit, (3,)).start()
            self._resolve(h.job.request_id, {
                "offers": [t.to_json() for t in h.tickets], "first_token": h.first_token,
                "first_logprob": h.first_logprob, "num_blocks": h.num_blocks,
                "cached_tokens": h.job.cached_tokens, "nbytes": h.nbytes})

    def _resolve(self, request_id: str, reply: dict) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
            self._cancelled.discard(request_id)
        if pending is not None:
            t0 = pending.received
            reply["marks"] = {k: v - t0 for k, v in pending.marks.items()}
            pending.reply = reply
            pending.done.set()

    # Listener (called by the worker thread)
    def tokens(self, items) -> None:
        now = time.perf_counter()
        for request_id, _, _ in items:
            with self._lock:
                pending = self._pending.get(request_id)
            if pending is not None:
                pending.marks.setdefault("first_token_at_prefill", now)

    def mark(self, request_id, event, at=None, **info) -> None:
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is not None and event in ("prefill_start", "prefill_end"):
            pending.marks.setdefault(event, at or time.perf_counter())

    def finish(self, request_id, tokens, reason, cached_tokens=0) -> None:
        self._resolve(request_id, {"finished": reason, "tokens": list(tokens),
                                   "cached_tokens": cached_tokens})

    def is_cancelled(self, request_id) -> bool:
        return request_id in self._cancelled

    # ---------------------------------------------------------------- control methods

    def _prefill(self, msg: dict) -> dict:
        """Checked like a public request: ids, prompt, params, stop ids, timeout."""
        rid = msg.get("request_id")
        check_request_id(rid, self.limits, internal=True)
        if rid is None:
            raise ValueError("request_id: required")
        prompt = msg.get("prompt")
        if not isinstance(prompt, list) or not 0 < len(prompt) <= self.worker.capacity:
            raise ValueError(f"prompt: expected 1..{self.worker.capacity} token ids")
        prompt = check_token_ids(prompt, self.vocab_size)
        stop_ids = msg.get("stop_ids", [])
        if not isinstance(stop_ids, list) or len(stop_ids) > self.limits.max_stop_token_ids:
            raise ValueError("stop_ids: expected a list of token ids")
        stop_ids = check_token_ids(stop_ids, self.vocab_size, "stop_ids")
        timeout = msg.get("timeout_s", 300)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 < timeout <= 3600:
            raise ValueError("timeout_s: expected a number of seconds in (0, 3600]")
        job = PrefillJob(rid, prompt, params_from_json(msg.get("params", {})),
                         frozenset(stop_ids))
        pending = _Pending(time.perf_counter())
        with self._lock:
            if rid in self._pending:
                raise ValueError(f"request_id: {rid!r} is already being prefilled")
            self._pending[rid] = pending
        self.worker.post("job", job)
        if not pending.done.wait(float(timeout)):
            self._cancel({"request_id": rid})
            raise TimeoutError(f"request {rid!r}: prefill did not finish in time")
        return pending.reply

    def _cancel(self, msg: dict) -> dict:
        rid = msg.get("request_id")
        check_request_id(rid, self.limits, internal=True)
        with self._lock:
            if rid in self._pending:
                self._cancelled.add(rid)
        self.worker.post("cancel", rid)
        return {}

    def _stats(self, msg: dict) -> dict:
        return {"capacity": self.worker.capacity, "block_size": self.blocks.block_size,
                "gauges": {**self.worker.gauges(), "offers_held": self.sender.held()},
                "model": self.worker.inst.config.name}

    def close(self) -> None:
        self._stop.set()
        self.worker.wake.set()
        for t in self._threads:
            t.join(timeout=30)
        self.control.stop()
        self.worker.drain()
        self.sender.close()


class RemotePrefill:
    """The decode process's view of the prefill process: a worker that forwards.

    `post("job")` calls the prefill process from a thread pool; its answer becomes a
    handoff in the target decode worker's queue (a blocking put: when the decode side
    is full, the calls wait, and the prefill process's own bounded queue holds the
    rest: backpressure across processes).
    """

    def __init__(self, address: str, decoders: list[DecodeWorker], listener,
                 receiver: KVReceiver, on_failure: str = "fail", rpc_timeout_s: float = 300.0,
                 name: str = "prefill[0]", health_every_s: float = 1.0,
                 secret: str | None = None):
        self.name = name
        self.address, self.decoders, self.listener = address, decoders, listener
        self.receiver, self.on_failure = receiver, on_failure
        self.transfer_failures = 0
        self._closed = threading.Event()
        self.client = ControlClient(address, secret)
        self.rpc_timeout_s = rpc_timeout_s
        stats = self.client.call("stats", {}, timeout=30)  # fails fast if it is not there
        self.capacity = int(stats["capacity"])
        self._gauges = stats["gauges"]
        self._calls = futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="rprefill")
        self._inflight = 0  # calls on the pool's threads: under the lock
        self._lock = threading.Lock()
        self.wake = None
        self.healthy = True  # the router skips an unhealthy prefill process
        self._health_every_s = health_every_s
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="rprefill-health")
        self._watcher.start()

    def _watch(self) -> None:
        """Health checks: a process that stops answering is routed around until it is back."""
        while not self._closed.wait(self._health_every_s):
            try:
                self._gauges = self.client.call("stats", {}, timeout=self._health_every_s)[
                    "gauges"]
                self.healthy = True
            except grpc.RpcError as e:
                if self.healthy:
                    log.warning("%s at %s is unreachable: %s", self.name, self.address,
                                e.code().name)
                self.healthy = False

    def prefix_hit(self, prompt) -> int:
        return 0  # the prefill process routes on its own cache; one instance here

    def post(self, kind: str, item) -> None:
        if kind == "job":
            with self._lock:
                self._inflight += 1
            self._calls.submit(self._prefill_guarded, item)
        elif kind == "cancel":
            self._calls.submit(self._cancel, item)

    def _prefill_guarded(self, job: PrefillJob) -> None:
        """No error on the pool's threads is lost: the request fails with the reason."""
        try:
            self._prefill(job)
        except Exception as e:  # noqa: BLE001
            log.exception("%s: remote prefill failed", job.request_id)
            self.listener.finish(job.request_id, [], f"error: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._inflight -= 1

    def _cancel(self, request_id: str) -> None:
        try:
            self.client.call("cancel", {"request_id": request_id}, timeout=5)
        except grpc.RpcError:
            pass  # a prefill process that is gone holds nothing of ours

    def _prefill(self, job: PrefillJob) -> None:
        rid = job.request_id
        sent = time.perf_counter()
        try:
            reply = self.client.call("prefill", {
                "request_id": rid, "prompt": job.prompt, "params": params_to_json(job.params),
                "stop_ids": sorted(job.stop_ids), "timeout_s": self.rpc_timeout_s},
                timeout=self.rpc_timeout_s + 5)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.healthy = False
            self.listener.finish(rid, [], f"error: prefill pool unavailable "
                                          f"({e.code().name}: {e.details()})")
            return
        self.healthy = True
        for event, offset in reply.get("marks", {}).items():
            if event in ("prefill_start", "prefill_end"):  # the other process's clock
                self.listener.mark(rid, event, sent + offset)
        if "finished" in reply:
            if reply["tokens"] and reply["finished"] != "cancelled":
                self.listener.tokens([(rid, reply["tokens"][0], 0.0)])
            self.listener.finish(rid, reply["tokens"], reply["finished"],
                                 reply.get("cached_tokens", 0))
            return
        self.listener.mark(rid, "transfer_start", transfer_bytes=reply["nbytes"],
                           cached_tokens=reply["cached_tokens"])
        job.cached_tokens = reply["cached_tokens"]
        offers = [KVOffer.from_json(o) for o in reply["offers"]]
        target = self.decoders[job.target]
        try:  # here, not on the decode thread: a slow pull must not stall the decode batch
            failpoint("transfer.insert", rid)
            parts = [self.receiver.pull(o) for o in offers]
        except Exception as e:  # noqa: BLE001 - KVTransferError, or the sender vanished
            self.transfer_failures += 1
            self.listener.mark(rid, "transfer_failed")
            if self.on_failure == "recompute":  # prefill it on the decode instance
                target.post("job", PrefillJob(rid, job.prompt, job.params, job.stop_ids,
                                              target=job.target))
            else:
                self.listener.finish(rid, [], f"error: KV transfer failed: {e}")
            return
        finally:
            self.receiver.release(offers)
        h = Handoff(job, parts, int(reply["first_token"]), float(reply["first_logprob"]),
                    int(reply["num_blocks"]), source=0)
        while not self._closed.is_set():
            try:
                target.handoffs.put(h, timeout=0.5)
            except queue.Full:
                continue
            if target.wake is not None:
                target.wake.set()
            return

    def step(self) -> bool:
        return False  # the work happens in the prefill process

    @property
    def idle(self) -> bool:
        return True  # nothing to step here: the engine's thread for it may sleep long

    def drain(self) -> None:
        pass

    def gauges(self) -> dict:
        """The prefill process's own gauges as of the last health check."""
        with self._lock:
            inflight = self._inflight
        return {**self._gauges, "reachable": int(self.healthy),
                "calls_in_flight": inflight, "transfer_failures": self.transfer_failures}

    def close(self) -> None:
        self._closed.set()
        self._calls.shutdown(wait=False, cancel_futures=True)
        self.client.close()


class CrossProcessEngine(DisaggregatedEngine):
    """The decode process of a cross-process deployment, fronting the requests."""

    def __init__(self, deployment: Deployment, prefill_addresses: list[str],
                 secret: str | None = None, **kwargs):
        if not prefill_addresses:
            raise ValueError("--prefill: give at least one prefill process address")
        self.prefill_addresses = list(prefill_addresses)
        self.secret = secret or load_secret()
        super().__init__(deployment, **kwargs)

    @classmethod
    def build(cls, config: DeploymentConfig, prefill_addresses: list[str],
              progress: bool = False, **kwargs) -> CrossProcessEngine:
        return cls(Deployment.build(config, role="decode", progress=progress),
                   prefill_addresses, **kwargs)

    def healthy(self) -> bool:
        """Serving needs at least one reachable prefill process."""
        return any(w.healthy for w in self.prefillers)

    def _build_workers(self) -> None:
        cfg = self.config
        inst = self.deployment.pools["decode"][0]
        receiver = self.receiver = KVReceiver(inst, pull_timeout_s=cfg.transfer.pull_timeout_s,
                                              secret=self.secret)
        _warm("KV scatter", receiver.sink.warmup)
        # Handoffs arrive pulled already: the decode worker only scatters them in.
        worker = DecodeWorker("decode[0]", inst, pool_blocks(inst, False), {0: receiver.sink},
                              self, self.router.handoff_queue)
        self.decoders.append(worker)
        for i, address in enumerate(self.prefill_addresses):
            self.prefillers.append(RemotePrefill(address, self.decoders, self, receiver,
                                                 cfg.transfer.on_failure, name=f"prefill[{i}]",
                                                 secret=self.secret))

    def close(self) -> None:
        super().close()
        for w in self.prefillers:
            w.close()
        self.receiver.close()
