"""The prefill scheduler: FCFS chunked prefill on one pool instance.

A job takes the longest cached prefix of its prompt from the pool's prefix cache
(those tokens are skipped, and counted), allocates blocks for the rest, and is
prefilled chunk by chunk, as many chunks per `step` as the token budget allows.
When the job has a transfer, its last chunk runs layer group by layer group and
each group's pages leave as soon as that group is dispatched. The first token is
sampled from the last chunk's logits.

The same scheduler runs on a prefill instance (KV handed to a decode instance) and
on a decode or colocated instance (no transfer: the blocks stay where they are).

A job whose own work raises (its chunk, its sampling) leaves the queue with its
blocks released and lands in `failed`; the step goes on with the next job and
keeps every handoff it already made, so one request's failure is that request's
alone and the block accounting stays exact.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxdisagg.mesh.deployment import block_table, chunk_at, prefill_last_chunk
from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.mesh.transfer import KVSendSide
from jaxdisagg.model.sampling import SamplingParams, sample_rows
from jaxdisagg.serve.faults import failpoint
from jaxdisagg.serve.kv_cache import BlockManager, OutOfBlocks


@dataclass(eq=False)
class PrefillJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    target: int = 0  # the decode instance that will take the request
    resume: bool = False  # recomputing a preempted request (its tokens already exist)
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    next_pos: int = -1  # next position to prefill; -1 until started
    started_at: float | None = None


@dataclass
class Handoff:
    """A prefilled request on its way to decode: KV tickets and the first token."""

    job: PrefillJob
    tickets: list  # transfer tickets (KV in flight, or offers); empty when local
    first_token: int
    first_logprob: float
    num_blocks: int  # pages the prompt's KV occupies
    source: int | None = None  # the prefill instance it came from; None: prefilled locally
    done_at: float = field(default_factory=time.perf_counter)

    @property
    def nbytes(self) -> int:
        return sum(getattr(t, "nbytes", 0) for t in self.tickets)


class PrefillScheduler:
    def __init__(self, inst: PoolInstance, blocks: BlockManager,
                 transfers: dict[int, KVSendSide] | None = None):
        self.inst, self.blocks = inst, blocks
        self.transfers = transfers or {}  # decode instance index -> transfer
        self.queue: deque[PrefillJob] = deque()
        self.failed: list[tuple[PrefillJob, Exception]] = []  # the caller reports and clears
        self.on_start: Callable[[PrefillJob], None] | None = None  # lifecycle hook
        self.tokens_real = 0  # prompt tokens prefilled
        self.tokens_executed = 0  # the same, with each chunk's padding to its bucket

    @property
    def capacity(self) -> int:
        return self.inst.max_pages * self.blocks.block_size

    def submit(self, job: PrefillJob) -> None:
        if not 0 < len(job.prompt) <= self.capacity:
            raise ValueError(f"prompt: {len(job.prompt)} tokens do not fit this pool "
                             f"(1..{self.capacity})")
        self.queue.append(job)

    def cancel(self, request_id: str) -> PrefillJob | None:
        for job in self.queue:
            if job.request_id == request_id:
                self.queue.remove(job)
                self.blocks.release(job.blocks)
                job.blocks = []
                return job
        return None

    def queued_tokens(self) -> int:
        return sum(len(j.prompt) - max(j.next_pos, 0) for j in self.queue)

    def _start(self, job: PrefillJob) -> bool:
        bs = self.blocks.block_size
        hit = self.blocks.match_prefix(job.prompt)
        try:
            fresh = self.blocks.allocate(-(-len(job.prompt) // bs) - len(hit))
        except OutOfBlocks:
            self.blocks.release(hit)
            return False  # FCFS: the head waits for blocks, nothing overtakes it
        job.blocks, job.cached_tokens = hit + fresh, len(hit) * bs
        job.next_pos = job.cached_tokens
        job.started_at = time.perf_counter()
        if self.on_start is not None:
            self.on_start(job)
        return True

    def step(self, budget: int | None = None,
             may_start: Callable[[PrefillJob], bool] = lambda job: True,
             may_finish: Callable[[PrefillJob], bool] = lambda job: True) -> list[Handoff]:
        """Prefills chunks of the queue's head jobs, up to `budget` tokens (default: one
        chunk); returns the handoffs of the jobs whose last chunk ran.

        `may_start` / `may_finish` let the caller hold the head back (no decode slot
        for it, or the decode side's handoff queue is full: backpressure).
        """
        budget = self.inst.pool.chunk_size if budget is None else budget
        out = []
        while self.queue and budget > 0:
            job = self.queue[0]
            try:
                if job.next_pos < 0 and not (may_start(job) and self._start(job)):
                    break
                size = min(budget, self.inst.pool.chunk_size)
                if job.next_pos + size < len(job.prompt):
                    # A piece that is not the prompt's last fills a bucket exactly, so only
                    # a prompt's last chunk is ever padded; a budget left smaller than
                    # the smallest bucket waits for the next step.
                    size = max((b for b in self.inst.chunk_buckets if b <= size), default=0)
                    if size == 0:
                        break
                last = job.next_pos + size >= len(job.prompt)
                if last and not may_finish(job):
                    break
                failpoint("prefill.chunk", job.request_id)
                table = block_table(self.inst, job.blocks)
                start = job.next_pos
                tokens, n = chunk_at(self.inst, job.prompt, start, size)
                self.tokens_real += n
                self.tokens_executed += len(tokens)
                job.next_pos += n
                budget -= n
                if not last:
                    self.inst.prefill(tokens, start, n, table)
                    continue
                logits, tickets = prefill_last_chunk(self.inst, tokens, start, n, table,
                                                     job.blocks, self.transfers.get(job.target))
                failpoint("prefill.sample", job.request_id)
                token, logprob = sample_rows(logits[None], [job.params], [0])
                handoff = Handoff(job, tickets, int(token[0]), float(logprob[0]),
                                  len(job.blocks))
            except Exception as e:  # noqa: BLE001 - this job fails, the queue goes on
                self._drop(job, e)
                continue
            self.queue.popleft()  # only now: a job is in the queue or in `out`, never lost
            out.append(handoff)
        return out

    def _drop(self, job: PrefillJob, error: Exception) -> None:
        if job in self.queue:
            self.queue.remove(job)
        self.blocks.release(job.blocks)
        job.blocks = []
        self.failed.append((job, error))

    def take_failed(self) -> list[tuple[PrefillJob, Exception]]:
        failed, self.failed = self.failed, []
        return failed

    def release(self, handoff: Handoff) -> None:
        """The pages have left: cache the prompt's full blocks and drop the job's references."""
        job = handoff.job
        self.blocks.register(job.prompt, job.blocks)
        self.blocks.release(job.blocks)
        job.blocks = []
