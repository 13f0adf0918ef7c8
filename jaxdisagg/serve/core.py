"""The disaggregated engine's core loop, single-threaded: prefill -> transfer -> decode.

`DisaggregatedCore.step()` advances every stage once: one prefill chunk on the
prefill instance, the admission of prefilled requests into free decode slots (their
KV landed in fresh decode blocks), and one decode step. Requests can be added and
cancelled between steps at any stage. The threaded engine, the router over several
instances and the public API build on this (issue 5 continues there).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from jaxdisagg.mesh.deployment import Deployment
from jaxdisagg.model.sampling import SamplingParams
from jaxdisagg.serve.decode import DecodeScheduler, Sequence
from jaxdisagg.serve.kv_cache import BlockManager, OutOfBlocks
from jaxdisagg.serve.prefill import Handoff, PrefillJob, PrefillScheduler


@dataclass
class Finished:
    request_id: str
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    cached_tokens: int = 0


class DisaggregatedCore:
    def __init__(self, dep: Deployment, *, prefix_cache: bool = True):
        if dep.config.mode != "disaggregated" or not dep.transfers:
            raise ValueError("DisaggregatedCore needs an in-process disaggregated deployment")
        pre, dec = dep.pools["prefill"][0], dep.pools["decode"][0]
        self.transfer = dep.transfers[(0, 0)]
        self.prefill_blocks = BlockManager(pre.layout.num_blocks, pre.layout.block_size,
                                           prefix_cache=prefix_cache)
        self.decode_blocks = BlockManager(dec.layout.num_blocks, dec.layout.block_size,
                                          prefix_cache=False)
        self.prefill = PrefillScheduler(pre, self.prefill_blocks, self.transfer)
        self.decode = DecodeScheduler(dec, self.decode_blocks)
        self.handoffs: deque[Handoff] = deque()  # prefilled, KV in flight, waiting for a slot
        self.finished: dict[str, Finished] = {}
        self._cached: dict[str, int] = {}
        self._resume: dict[str, Sequence] = {}  # preempted, being recomputed
        self._emitted: list[tuple[str, int]] = []

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    stop_ids=()) -> None:
        self.prefill.submit(PrefillJob(request_id, list(prompt), params, frozenset(stop_ids)))

    def cancel(self, request_id: str) -> bool:
        """Frees the request's blocks on both pools, wherever it is."""
        if self.prefill.cancel(request_id) is not None:
            seq = self._resume.pop(request_id, None)
            return self.finish(request_id, seq.tokens if seq else [], "cancelled")
        for h in self.handoffs:
            if h.job.request_id == request_id:
                self.handoffs.remove(h)
                self.prefill.release(h)
                seq = self._resume.pop(request_id, None)
                return self.finish(request_id, seq.tokens if seq else [], "cancelled")
        seq = self.decode.cancel(request_id)
        if seq is not None:
            return self.finish(request_id, seq.tokens, "cancelled")
        return False

    def finish(self, request_id, tokens, reason) -> bool:
        """Records a request as finished (its blocks already released)."""
        self.finished[request_id] = Finished(request_id, list(tokens), reason,
                                             self._cached.pop(request_id, 0))
        return True

    def _admit(self) -> None:
        while self.handoffs and self.decode.free_slots():
            h = self.handoffs[0]
            try:
                blocks = self.decode_blocks.allocate(h.num_blocks)
            except OutOfBlocks:
                return  # wait for decode blocks; the KV stays staged on the decode devices
            self.handoffs.popleft()
            self.transfer.insert(h.tickets, blocks)
            self.prefill.release(h)
            job = h.job
            seq = self._resume.pop(job.request_id, None)
            if seq is not None:  # recomputed after preemption: keep what it generated
                seq.blocks = blocks
                self.decode.admit(seq)
                continue
            self._cached[job.request_id] = job.cached_tokens
            self._emitted.append((job.request_id, h.first_token))
            seq = Sequence(job.request_id, job.prompt, job.params, job.stop_ids, blocks=blocks,
                           tokens=[h.first_token])
            if seq.finish_check():  # its first token already ends it
                self.decode_blocks.release(blocks)
                self.finish(seq.request_id, seq.tokens, seq.finish_check())
            else:
                self.decode.admit(seq)

    def step(self) -> list[tuple[str, int]]:
        """Advances every stage once; returns the tokens produced, (request id, token)."""
        self._emitted: list[tuple[str, int]] = []
        handoff = self.prefill.step()
        if handoff is not None:
            self.handoffs.append(handoff)
        self._admit()
        result = self.decode.step()
        self._emitted += result.tokens
        for seq in result.finished:
            self.finish(seq.request_id, seq.tokens, seq.finish_reason)
        for seq in result.preempted:  # recompute: prefill prompt + generated, then decode on
            self.prefill.submit(PrefillJob(seq.request_id, seq.prompt + seq.tokens[:-1],
                                           seq.params, seq.stop_ids))
            self._resume[seq.request_id] = seq
        return self._emitted

    @property
    def idle(self) -> bool:
        return not (self.prefill.queue or self.handoffs or self.decode.active)
