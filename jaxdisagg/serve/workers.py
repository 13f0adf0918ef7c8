"""Pool workers: the single-threaded step logic of one prefill or decode instance.

Each worker owns one pool instance (its programs, pages and block accounting), so
only the worker's own thread ever touches them. Workers talk through queues:

    router --job--> PrefillWorker --Handoff (bounded queue)--> DecodeWorker --> tokens
    router --job (short prompt, or colocated)----------------> DecodeWorker

* `PrefillWorker.step` prefills up to a token budget of its FCFS queue. A finished
  job's KV is already moving to its decode instance when the handoff is queued; the
  prefill blocks go back to the prefix cache at once (the staged copy is separate).
  The first token is sampled here but surfaces when the request enters a decode
  slot (the article's TTFT: prefill + transfer + first decode iteration).
  When the target's handoff queue is full the last chunk waits: backpressure.
* `DecodeWorker.step` admits what is ready (locally prefilled, or transferred:
  blocks allocated, KV inserted) into free slots, piggybacks one local prefill
  chunk (short prompts, recomputation after preemption, or every prompt when
  colocated), and runs one decode step for the busy slots.

Workers report through a `Listener` (the engine): tokens as they are sampled,
lifecycle marks, and every request's end exactly once. A cancel reaches every
worker that may hold the request; whoever holds it frees its blocks and reports.
A request caught between workers (in a handoff queue) is dropped by the decode
worker when it arrives, because the listener says it was cancelled.

Failure containment: whatever one request's own work raises (its chunk, its
sampling, its transfer, its admission, its row of the batch) fails that request
alone, with exactly its blocks released; the step goes on for the others. Only
what no request owns (a whole program call) falls back to the engine, which fails
the requests the worker holds.

Readers on other threads (metrics, Info, health checks, the router's load
figures) never touch a worker's structures: after every step the worker publishes
an immutable snapshot of its gauges (`gauges()` returns the latest).
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from types import MappingProxyType
from typing import Protocol

import jax

from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.serve.decode import DecodeScheduler, Sequence
from jaxdisagg.serve.faults import failpoint
from jaxdisagg.serve.kv_cache import BlockManager, OutOfBlocks
from jaxdisagg.serve.prefill import Handoff, PrefillJob, PrefillScheduler

log = logging.getLogger(__name__)


class Listener(Protocol):
    """What workers report to; every method is called from worker threads."""

    def tokens(self, items: list[tuple[str, int, float]]) -> None:
        """New tokens, (request id, token, logprob) each: a whole decode step's at once,
        so the consumer takes one hand-off a step, not one a row."""

    def mark(self, request_id: str, event: str, at: float | None = None, **info) -> None: ...

    def finish(self, request_id: str, tokens: list[int], reason: str,
               cached_tokens: int = 0) -> None: ...

    def is_cancelled(self, request_id: str) -> bool: ...


def _error(e: Exception) -> str:
    return f"error: {type(e).__name__}: {e}"


def _first_token_ends(job: PrefillJob, token: int) -> str | None:
    if token in job.stop_ids:
        return "stop"
    return "length" if job.params.max_tokens <= 1 else None


class _Worker:
    healthy = True  # an in-process worker is as alive as the process

    def __init__(self, name: str, listener: Listener):
        self.name, self.listener = name, listener
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("job", PrefillJob) | ("cancel", id)
        self.wake = None  # set by the engine: a threading.Event to poke on new work
        self._snapshot = MappingProxyType({})

    def publish(self) -> None:
        """Takes a fresh snapshot of the gauges (the worker's own thread only)."""
        self._snapshot = MappingProxyType(self._gauges())

    def gauges(self) -> dict:
        """The gauges as of this worker's last step (a copy): safe from any thread."""
        return dict(self._snapshot)

    def _fail_job(self, job: PrefillJob, error: Exception, tokens=()) -> None:
        log.warning("%s: failed in %s: %s", job.request_id, self.name, error)
        self.listener.finish(job.request_id, list(tokens), _error(error), job.cached_tokens)

    def _started(self, job: PrefillJob) -> None:
        if not job.resume:
            self.listener.mark(job.request_id, "prefill_start", job.started_at,
                               cached_tokens=job.cached_tokens)

    def post(self, kind: str, item) -> None:
        self.inbox.put((kind, item))
        if self.wake is not None:
            self.wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "job":
                self._accept(item)
            elif kind == "cancel":
                self._cancel(item)

    @property
    def capacity(self) -> int:
        """Longest request (prompt + generated) this worker's instance can hold: its
        block table's reach, and never more than the whole pool."""
        return min(self.inst.max_pages, self.blocks.num_blocks) * self.blocks.block_size

    def _prefill_tokens(self) -> dict:
        return {"prefill_tokens": self.scheduler.tokens_real,
                "prefill_tokens_executed": self.scheduler.tokens_executed}

    def prefix_hit(self, prompt) -> int:
        return self.blocks.peek_prefix(prompt)

    def step(self) -> bool:
        """One round of this worker's work; False when there was nothing to do."""
        try:
            return self._step()
        finally:
            self.publish()

    def drain(self) -> None:
        """Handles what is posted without running any program (used at shutdown)."""
        self._drain_inbox()
        self.publish()

    def _accept(self, job: PrefillJob) -> None:
        try:
            self.scheduler.submit(job)
        except ValueError as e:  # the request fails alone; the worker goes on
            self.listener.finish(job.request_id, [], f"error: {e}")

    def _cancel(self, request_id: str) -> None:
        job = self.scheduler.cancel(request_id)
        if job is not None:
            self.listener.finish(request_id, [], "cancelled")


class PrefillWorker(_Worker):
    def __init__(self, index: int, inst: PoolInstance, blocks: BlockManager, transfers: dict,
                 decoders: list[DecodeWorker], listener: Listener):
        super().__init__(f"prefill[{index}]", listener)
        self.index, self.inst, self.blocks, self.decoders = index, inst, blocks, decoders
        self.scheduler = PrefillScheduler(inst, blocks, transfers)
        self.scheduler.on_start = self._started
        self._outgoing: deque[Handoff] = deque()  # a full target queue: retried next step
        self.bytes_sent = 0
        self.transfers_done = 0
        self.publish()

    def _room(self, job: PrefillJob, finishing: list[PrefillJob]) -> bool:
        """Backpressure: a job's last chunk runs only if its handoff fits the queue."""
        target = self.decoders[job.target]
        waiting = sum(h.job.target == job.target for h in self._outgoing)
        waiting += sum(j.target == job.target for j in finishing)
        if target.handoffs.maxsize - target.handoffs.qsize() - waiting <= 0:
            return False
        finishing.append(job)
        return True

    def _step(self) -> bool:
        """One scheduling round; False when there was nothing to do."""
        self._drain_inbox()
        self._send()
        if not self.scheduler.queue:
            return False
        head = self.scheduler.queue[0]
        before = head.next_pos
        finishing: list[PrefillJob] = []
        handoffs = self.scheduler.step(may_finish=lambda job: self._room(job, finishing))
        failed = self.scheduler.take_failed()
        for job, e in failed:
            self._fail_job(job, e)
        for h in handoffs:
            try:
                self._hand_off(h)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                if h.job.blocks:
                    self.scheduler.release(h)
                if h in self._outgoing:
                    self._outgoing.remove(h)
                self._fail_job(h.job, e, [h.first_token])
        self._send()
        return bool(handoffs) or bool(failed) or head.next_pos != before

    def _hand_off(self, h: Handoff) -> None:
        job = h.job
        failpoint("prefill.handoff", job.request_id)
        self.scheduler.release(h)  # the pages are staged for the transfer already
        self.listener.mark(job.request_id, "prefill_end", h.done_at)
        if h.tickets:  # (a cross-process offer has no dispatch time: now, then)
            self.listener.mark(job.request_id, "transfer_start",
                               getattr(h.tickets[0], "dispatched_at", None),
                               transfer_bytes=h.nbytes)
        reason = _first_token_ends(job, h.first_token)
        if reason:  # done at its first token: it never needs the decode pool
            self.listener.tokens([(job.request_id, h.first_token, h.first_logprob)])
        if reason or self.listener.is_cancelled(job.request_id):
            self.listener.finish(job.request_id, [h.first_token],
                                 reason or "cancelled", job.cached_tokens)
            return  # the staged KV is simply dropped
        failpoint("transfer.send", job.request_id)
        self.bytes_sent += h.nbytes
        self.transfers_done += 1
        h.source = self.index
        self._outgoing.append(h)

    def _send(self) -> None:
        """Queues finished handoffs at their decode instances (another prefill instance
        may have filled a queue since `_room` looked: those wait for the next step)."""
        for _ in range(len(self._outgoing)):
            h = self._outgoing.popleft()
            target = self.decoders[h.job.target]
            try:
                target.handoffs.put_nowait(h)
            except queue.Full:
                self._outgoing.append(h)
                continue
            if target.wake is not None:
                target.wake.set()

    def _cancel(self, request_id: str) -> None:
        for h in self._outgoing:
            if h.job.request_id == request_id:
                self._outgoing.remove(h)
                self.listener.finish(request_id, [h.first_token], "cancelled",
                                     h.job.cached_tokens)
                return
        super()._cancel(request_id)

    @property
    def idle(self) -> bool:
        return not (self.scheduler.queue or self._outgoing)

    def _gauges(self) -> dict:
        return {"queued_requests": len(self.scheduler.queue),
                "queued_tokens": self.scheduler.queued_tokens(), **self._prefill_tokens(),
                **self.blocks.gauges(),
                "transfer_bytes": self.bytes_sent, "transfers": self.transfers_done}


class DecodeWorker(_Worker):
    """A decode instance (disaggregated) or a whole colocated instance."""

    def __init__(self, name: str, inst: PoolInstance, blocks: BlockManager, transfers: dict,
                 listener: Listener, handoff_queue: int = 4):
        super().__init__(name, listener)
        self.inst, self.blocks = inst, blocks
        self.transfers = transfers  # prefill instance index -> transfer (insert side)
        self.scheduler = PrefillScheduler(inst, blocks)  # local prefill, piggybacked
        self.scheduler.on_start = self._started
        self.decode = DecodeScheduler(inst, blocks, overlap=inst.pool.overlap_steps)
        self.handoffs: queue.Queue[Handoff] = queue.Queue(maxsize=handoff_queue)
        self.ready: deque[Handoff] = deque()  # prefilled, waiting for a slot (and blocks)
        self._resume: dict[str, Sequence] = {}  # preempted, being recomputed locally
        self.bytes_received = 0
        self.transfer_failures = 0
        self.on_transfer_failure = "fail"  # or "recompute": prefill it on this instance
        # Requests routed to this instance and not finished, as the router counts them
        # (set by the engine; None: unknown, so the batching window never holds).
        self.routed: Callable[[], int] | None = None
        self._held_since: float | None = None  # when the step now held was first due
        self.held_s = 0.0  # time steps spent held, all told
        self.publish()

    # ---------------------------------------------------------------- cancel

    def _cancel(self, request_id: str) -> None:
        seq = self._resume.pop(request_id, None)
        job = self.scheduler.cancel(request_id)
        if job is not None:
            self.listener.finish(request_id, seq.tokens if seq else [], "cancelled")
            return
        for h in self.ready:
            if h.job.request_id == request_id:
                self.ready.remove(h)
                self.blocks.release(h.job.blocks)  # local: its blocks; transferred: none yet
                self.listener.finish(request_id, seq.tokens if seq else [h.first_token],
                                     "cancelled", h.job.cached_tokens)
                return
        seq = self.decode.cancel(request_id)
        if seq is not None:
            self.listener.finish(request_id, seq.tokens, "cancelled")

    def drain(self) -> None:
        super().drain()
        while True:  # at shutdown every queued handoff belongs to a cancelled request
            try:
                h = self.handoffs.get_nowait()
            except queue.Empty:
                break
            if self.listener.is_cancelled(h.job.request_id):
                self.listener.finish(h.job.request_id, [h.first_token], "cancelled",
                                     h.job.cached_tokens)
            else:
                self.ready.append(h)
        self.publish()

    # ---------------------------------------------------------------- admission

    def _may_start(self, job: PrefillJob) -> bool:
        """Local prefill starts only for a request that will find a slot."""
        return job.resume or self.decode.free_slots() > len(self.ready)

    def _pull_handoffs(self) -> None:
        """Takes transferred requests off the queue while there are slots for them."""
        while self.decode.free_slots() > len(self.ready):
            try:
                h = self.handoffs.get_nowait()
            except queue.Empty:
                return
            rid = h.job.request_id
            if self.listener.is_cancelled(rid):
                self.listener.finish(rid, [h.first_token], "cancelled", h.job.cached_tokens)
                continue
            self.ready.append(h)

    def _admit(self) -> None:
        while self.ready and self.decode.free_slots():
            h = self.ready[0]
            job = h.job
            if h.source is not None:  # transferred: blocks here, then land the pages
                try:
                    job.blocks = self.blocks.allocate(h.num_blocks)
                except OutOfBlocks:
                    return  # the KV stays staged on our devices until blocks free up
                try:
                    failpoint("transfer.insert", job.request_id)
                    self.listener.mark(job.request_id, "pull_start")
                    # In-process tickets are arrays already moving; cross-process ones
                    # are offers that `insert` pulls (under its watchdog).
                    jax.block_until_ready([t.pages for t in h.tickets if hasattr(t, "pages")])
                    self.transfers[h.source].insert(h.tickets, job.blocks)
                except Exception as e:  # noqa: BLE001 - this request fails, not the pool
                    self.ready.popleft()
                    self.blocks.release(job.blocks)
                    job.blocks = []
                    self._transfer_failed(h, e)
                    continue
                self.listener.mark(job.request_id, "transfer_end")
                self.bytes_received += h.nbytes
            self.ready.popleft()
            try:
                failpoint("decode.admit", job.request_id)
                if h.source is None:  # prefilled here: cache its prompt blocks
                    self.blocks.register(job.prompt, job.blocks)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self.blocks.release(job.blocks)
                job.blocks = []
                seq = self._resume.pop(job.request_id, None)
                self._fail_job(job, e, seq.tokens if seq else [h.first_token])
                continue
            seq = self._resume.pop(job.request_id, None)
            fresh = seq is None
            if fresh:
                seq = Sequence(job.request_id, job.prompt, job.params, job.stop_ids,
                               tokens=[h.first_token], logprobs=[h.first_logprob])
            seq.blocks = job.blocks  # the sequence holds the job's references now
            job.blocks = []
            self.decode.admit(seq)
            self.listener.mark(seq.request_id, "decode_insert")
            if fresh:  # the first token surfaces with the request in the decode batch,
                # so TTFT = prefill + transfer + wait for a slot, and TBT is pure decode
                self.listener.tokens([(seq.request_id, h.first_token, h.first_logprob)])

    def _transfer_failed(self, h: Handoff, error: Exception) -> None:
        """The KV never arrived: fail the request, or prefill it here (`recompute`)."""
        job, seq = h.job, self._resume.pop(h.job.request_id, None)
        self.transfer_failures += 1
        self.listener.mark(job.request_id, "transfer_failed")
        if self.on_transfer_failure == "recompute" and seq is None:
            self.scheduler.submit(PrefillJob(job.request_id, job.prompt, job.params,
                                             job.stop_ids, target=job.target))
            return
        log.warning("%s: KV transfer failed: %s", job.request_id, error)
        self.listener.finish(job.request_id, seq.tokens if seq else [],
                             f"error: KV transfer failed: {error}", job.cached_tokens)

    def _local_prefill(self) -> bool:
        if not self.scheduler.queue:
            return False
        head = self.scheduler.queue[0]
        before = head.next_pos
        handoffs = self.scheduler.step(may_start=self._may_start)
        for job, e in self.scheduler.take_failed():
            seq = self._resume.pop(job.request_id, None)
            self._fail_job(job, e, seq.tokens if seq else [])
        for h in handoffs:
            job = h.job
            if not job.resume:
                self.listener.mark(job.request_id, "prefill_end", h.done_at)
                reason = _first_token_ends(job, h.first_token)
                if reason:
                    self.listener.tokens([(job.request_id, h.first_token, h.first_logprob)])
                    self.blocks.register(job.prompt, job.blocks)
                    self.blocks.release(job.blocks)
                    self.listener.finish(job.request_id, [h.first_token], reason,
                                         job.cached_tokens)
                    continue
            if job.resume:
                self.ready.appendleft(h)
            else:
                self.ready.append(h)
        return head.next_pos != before or head not in self.scheduler.queue

    # ---------------------------------------------------------------- the step

    def _hold(self) -> bool:
        """Whether to hold the decode step due now for more rows (the batching window).

        Held only while fewer rows are busy than `decode_min_batch` and than the requests
        the router has sent here, and for at most `decode_wait_s` a step: the rows the
        window waits for are on their way, so the tail of a load never waits.
        """
        pool = self.inst.pool
        if pool.decode_wait_s <= 0 or self.routed is None:
            return False
        active, now = len(self.decode.active), time.monotonic()
        if active and active < min(pool.decode_min_batch, self.routed()):
            if self._held_since is None:
                self._held_since = now
            if now - self._held_since < pool.decode_wait_s:
                return True
        if self._held_since is not None:  # a hold ends: the rows came, or the wait is over
            self.held_s += now - self._held_since
            self._held_since = None
        return False

    def _step(self) -> bool:
        """One iteration: admit, one local prefill chunk, one decode step."""
        self._drain_inbox()
        self._pull_handoffs()
        self._admit()
        did = self._local_prefill()
        self._admit()
        result = self.decode.read_in_flight() if self._hold() else self.decode.step()
        if result.tokens:
            self.listener.tokens(result.tokens)
        for seq in result.finished:
            self.listener.finish(seq.request_id, seq.tokens, seq.finish_reason)
        for seq, e in result.failed:
            log.warning("%s: failed in %s: %s", seq.request_id, self.name, e)
            self.listener.finish(seq.request_id, seq.tokens, _error(e))
        for seq in result.preempted:  # recompute prompt + generated here, then decode on
            self._resume[seq.request_id] = seq
            self.listener.mark(seq.request_id, "preempted")
            job = PrefillJob(seq.request_id, seq.prompt + seq.tokens[:-1], seq.params,
                             seq.stop_ids, resume=True)
            q = self.scheduler.queue  # first in line, behind a job already mid-prefill
            q.insert(1 if q and q[0].next_pos >= 0 else 0, job)
        return (did or result.launched or result.read or bool(result.preempted)
                or bool(result.failed))

    @property
    def idle(self) -> bool:
        return not (self.scheduler.queue or self.ready or self.decode.active
                    or self.decode.in_flight or not self.handoffs.empty() or self._resume)

    def _gauges(self) -> dict:
        return {"slots_used": len(self.decode.active), "slots_total": len(self.decode.slots),
                "local_prefill_queued": len(self.scheduler.queue), **self._prefill_tokens(),
                "handoffs_waiting": self.handoffs.qsize() + len(self.ready),
                **self.blocks.gauges(), "transfer_bytes_received": self.bytes_received,
                "transfer_failures": self.transfer_failures, "decode_held_s": self.held_s}

