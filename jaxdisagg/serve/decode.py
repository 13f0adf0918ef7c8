"""The decode scheduler: continuous batching over a pool instance's fixed slots.

A sequence arrives with its prompt's KV already in the pool (prefilled there, or
transferred in) and its first token. Each `step` feeds every active slot's last
token through one decode program call, samples each slot's next token with its
own parameters and seed, and retires sequences that hit a stop token or their
max_tokens. A sequence that crosses into a new block gets one; when the pool has
none left, the newest sequence is preempted (its blocks freed) and handed back to
be recomputed later, so nothing crashes and no request is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.model.sampling import SamplingParams, sample_rows
from jaxdisagg.serve.kv_cache import BlockManager, OutOfBlocks


@dataclass(eq=False)  # identity: two requests are never "equal"
class Sequence:
    """A request on the decode side."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    blocks: list[int] = field(default_factory=list)  # pages holding prompt + generated KV
    tokens: list[int] = field(default_factory=list)  # generated so far, first token included
    logprobs: list[float] = field(default_factory=list)  # one per generated token
    finish_reason: str | None = None  # "stop" | "length"
    admitted_order: int = 0

    @property
    def last_position(self) -> int:
        """Position of the newest token (the one the next step feeds in)."""
        return len(self.prompt) + len(self.tokens) - 1

    def finish_check(self) -> str | None:
        if self.tokens and self.tokens[-1] in self.stop_ids:
            return "stop"
        if len(self.tokens) >= self.params.max_tokens:
            return "length"
        return None


@dataclass
class StepResult:
    tokens: list[tuple[str, int, float]]  # (request id, new token, logprob) per active slot
    finished: list[Sequence]
    preempted: list[Sequence]  # blocks freed; recompute prompt + tokens to resume


class DecodeScheduler:
    def __init__(self, inst: PoolInstance, blocks: BlockManager):
        if blocks.block_size != inst.layout.block_size:
            raise ValueError("block manager and pool disagree on the block size")
        self.inst, self.blocks = inst, blocks
        self.slots: list[Sequence | None] = [None] * inst.pool.max_slots
        self._order = 0

    @property
    def active(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in self.active if s.request_id == request_id), None)

    def free_slots(self) -> int:
        return self.slots.count(None)

    def admit(self, seq: Sequence) -> int:
        """Puts a prefilled sequence (blocks and first token set) into a free slot."""
        if None not in self.slots:
            raise RuntimeError("no free decode slot: check free_slots() before admitting")
        if not seq.tokens:
            raise ValueError(f"{seq.request_id}: a sequence enters decode with its first token")
        needed = -(-(seq.last_position + 1) // self.blocks.block_size)
        if len(seq.blocks) < needed - 1:
            raise ValueError(f"{seq.request_id}: {len(seq.blocks)} blocks cannot hold its "
                             "prompt")
        slot = self.slots.index(None)
        self._order += 1
        seq.admitted_order = self._order
        self.slots[slot] = seq
        return slot

    def _retire(self, slot: int) -> Sequence:
        seq = self.slots[slot]
        self.slots[slot] = None
        self.blocks.release(seq.blocks)
        seq.blocks = []
        return seq

    def cancel(self, request_id: str) -> Sequence | None:
        for i, seq in enumerate(self.slots):
            if seq is not None and seq.request_id == request_id:
                return self._retire(i)
        return None

    def _ensure_blocks(self, preempted: list[Sequence]) -> None:
        """Gives every active sequence a block for the position it writes this step."""
        bs = self.blocks.block_size
        for seq in sorted(self.active, key=lambda s: s.admitted_order):
            while seq in self.slots and seq.last_position // bs >= len(seq.blocks):
                try:
                    seq.blocks += self.blocks.allocate(1)
                except OutOfBlocks:
                    victim = max(self.active, key=lambda s: s.admitted_order)
                    preempted.append(self._retire(self.slots.index(victim)))

    def step(self) -> StepResult:
        preempted: list[Sequence] = []
        self._ensure_blocks(preempted)
        active = [(i, s) for i, s in enumerate(self.slots) if s is not None]
        if not active:
            return StepResult([], [], preempted)
        b, p = len(self.slots), self.inst.max_pages
        tokens, positions, lens = (np.zeros(b, np.int32) for _ in range(3))
        tables = np.zeros((b, p), np.int32)
        params, steps = [None] * b, [0] * b
        for i, seq in active:
            tokens[i], positions[i] = seq.tokens[-1], seq.last_position
            lens[i] = seq.last_position + 1
            tables[i, :len(seq.blocks)] = seq.blocks
            params[i], steps[i] = seq.params, len(seq.tokens)
        logits = self.inst.decode(tokens, positions, tables, lens)
        new, logprobs = sample_rows(logits, params, steps)
        out, finished = [], []
        for i, seq in active:
            token = int(new[i])
            seq.tokens.append(token)
            seq.logprobs.append(float(logprobs[i]))
            out.append((seq.request_id, token, float(logprobs[i])))
            seq.finish_reason = seq.finish_check()
            if seq.finish_reason:
                finished.append(self._retire(i))
        return StepResult(out, finished, preempted)
