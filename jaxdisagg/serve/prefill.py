"""The prefill scheduler: FCFS chunked prefill on one pool instance, KV handed onward.

A job takes the longest cached prefix of its prompt from the pool's prefix cache
(those tokens are skipped, and counted), allocates blocks for the rest, and is
prefilled one chunk per `step`. Its last chunk runs layer group by layer group, and
each group's pages leave through the transfer as soon as that group is dispatched.
The first token is sampled from the last chunk's logits. The job's full blocks are
then registered in the prefix cache and its references dropped; the blocks stay
cached (and reusable) until the pool needs them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import jax.numpy as jnp

from jaxdisagg.mesh.deployment import block_table, chunk_at, prefill_last_chunk
from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.mesh.transfer import KVSendSide
from jaxdisagg.model.sampling import SamplingParams, row_keys, sample
from jaxdisagg.serve.kv_cache import BlockManager, OutOfBlocks


@dataclass(eq=False)
class PrefillJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    next_pos: int = -1  # next position to prefill; -1 until started


@dataclass
class Handoff:
    """A prefilled request on its way to decode: KV tickets and the first token."""

    job: PrefillJob
    tickets: list  # transfer tickets (in flight KV, or offers); empty when colocated
    first_token: int
    num_blocks: int  # pages the prompt's KV occupies


class PrefillScheduler:
    def __init__(self, inst: PoolInstance, blocks: BlockManager,
                 transfer: KVSendSide | None = None):
        self.inst, self.blocks, self.transfer = inst, blocks, transfer
        self.queue: deque[PrefillJob] = deque()

    def submit(self, job: PrefillJob) -> None:
        cap = self.inst.max_pages * self.blocks.block_size
        if not 0 < len(job.prompt) <= cap:
            raise ValueError(f"{job.request_id}: prompt of {len(job.prompt)} tokens does not "
                             f"fit this pool (1..{cap})")
        self.queue.append(job)

    def cancel(self, request_id: str) -> PrefillJob | None:
        for job in self.queue:
            if job.request_id == request_id:
                self.queue.remove(job)
                self.blocks.release(job.blocks)
                job.blocks = []
                return job
        return None

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
        return True

    def step(self) -> Handoff | None:
        """Prefills one chunk of the head job; returns its handoff after the last chunk."""
        if not self.queue:
            return None
        job = self.queue[0]
        if job.next_pos < 0 and not self._start(job):
            return None
        table = block_table(self.inst, job.blocks)
        start = job.next_pos
        tokens, n = chunk_at(self.inst, job.prompt, start)
        job.next_pos += n
        if job.next_pos < len(job.prompt):
            self.inst.prefill(tokens, start, n, table)
            return None
        logits, tickets = prefill_last_chunk(self.inst, tokens, start, n, table, job.blocks,
                                             self.transfer)
        p_ = job.params
        first = sample(logits[None], row_keys([p_.seed], 0), jnp.array([p_.temperature]),
                       jnp.array([p_.top_k]), jnp.array([p_.top_p]))
        self.queue.popleft()
        return Handoff(job, tickets, int(first[0]), len(job.blocks))

    def release(self, handoff: Handoff) -> None:
        """After the handoff: cache the prompt's full blocks and drop the job's references."""
        job = handoff.job
        self.blocks.register(job.prompt, job.blocks)
        self.blocks.release(job.blocks)
        job.blocks = []
