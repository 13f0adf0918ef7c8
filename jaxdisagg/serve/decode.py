"""The decode scheduler: continuous batching over a pool instance's fixed slots.

A sequence arrives with its prompt's KV already in the pool (prefilled there, or
transferred in) and its first token. Each `step` feeds every active slot's last
token through one decode program call, samples each slot's next token with its
own parameters and seed, and retires sequences that hit a stop token or their
max_tokens. A sequence that crosses into a new block gets one; when the pool has
none left, the newest sequence is preempted (its blocks freed) and handed back to
be recomputed later, so nothing crashes and no request is dropped. A sequence
that could only make room by preempting itself, with nothing else to free, fails
with a clear reason instead of being recomputed forever.

A row whose own host work raises (building its inputs, taking its token) is
retired with its blocks released and reported in `failed`; the other rows of the
batch go on.

With `overlap`, a step is dispatched before the previous one's tokens are read:
each row's input token is the previous step's sampled token, still on the device,
so the host builds inputs, emits tokens and checks stops while the device runs the
next step (the overlap scheduling of vLLM and SGLang). `step` then returns the
previous step's tokens. A row whose token in flight turns out to be a stop token
has had one step too many computed: its output is dropped, and the KV it wrote
lies past its end, in a block it owned (device programs run in order, so whoever
gets that block next writes after it). Greedy and seeded tokens are the same
either way: a row's inputs, position and sampling step do not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.model.sampling import SamplingParams, row_params
from jaxdisagg.serve.faults import failpoint
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
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # blocks freed
    launched: bool = False  # a step was dispatched (with overlap: still in flight)
    read: bool = False  # a dispatched step's tokens were read (some rows may be gone)


@dataclass
class _InFlight:
    """A dispatched step: its device outputs and the rows it computed."""

    new: jax.Array
    logprobs: jax.Array
    rows: list[tuple[int, Sequence]]
    seqs: set[int]  # id() of each row's sequence, for membership


class DecodeScheduler:
    def __init__(self, inst: PoolInstance, blocks: BlockManager, overlap: bool = False):
        if blocks.block_size != inst.layout.block_size:
            raise ValueError("block manager and pool disagree on the block size")
        self.inst, self.blocks = inst, blocks
        self.slots: list[Sequence | None] = [None] * inst.pool.max_slots
        self.overlap = overlap
        self._order = 0
        self._flight: _InFlight | None = None

    @property
    def active(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    @property
    def in_flight(self) -> bool:
        """A dispatched step's tokens are still to be read (overlap only)."""
        return self._flight is not None

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
        if seq.finish_check():
            raise ValueError(f"{seq.request_id}: already finished ({seq.finish_check()}); "
                             "only a sequence with tokens left to generate enters decode")
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

    def _ahead(self, seq: Sequence) -> int:
        """Tokens of seq computed by the step in flight and not read yet (0 or 1)."""
        return int(self._flight is not None and id(seq) in self._flight.seqs)

    def _runs(self, seq: Sequence) -> bool:
        """Whether the next step computes a token for seq: not when the token in
        flight is already its last by max_tokens."""
        return len(seq.tokens) + self._ahead(seq) < seq.params.max_tokens

    def _blocks_short(self) -> int:
        bs = self.blocks.block_size
        return sum(max(0, (s.last_position + self._ahead(s)) // bs + 1 - len(s.blocks))
                   for s in self.active if self._runs(s))

    def _ensure_blocks(self, preempted: list[Sequence], failed: list) -> None:
        """Gives every active sequence a block for the position it writes this step."""
        bs = self.blocks.block_size
        for seq in sorted(self.active, key=lambda s: s.admitted_order):
            while (seq in self.slots and self._runs(seq)
                   and (seq.last_position + self._ahead(seq)) // bs >= len(seq.blocks)):
                try:
                    seq.blocks += self.blocks.allocate(1)
                except OutOfBlocks:
                    victim = max(self.active, key=lambda s: s.admitted_order)
                    retired = self._retire(self.slots.index(victim))
                    if victim is seq and self.blocks.num_used == 0:
                        # Alone in a pool it cannot fit: recomputing it would only
                        # come back here. Fail it instead of looping forever.
                        failed.append((retired, OutOfBlocks(
                            f"the pool's {self.blocks.num_blocks} KV blocks cannot hold "
                            f"{seq.last_position + 1} tokens")))
                    else:
                        preempted.append(retired)

    def step(self) -> StepResult:
        """Dispatches one decode step for every active row and returns the tokens of
        the step it reads: this one, or with `overlap` the one dispatched before."""
        if self._flight is not None and self._blocks_short() > self.blocks.num_available:
            # Growing would preempt: read the step in flight first, so that a preempted
            # sequence leaves with every token it was computed.
            return self.read_in_flight()
        preempted: list[Sequence] = []
        failed: list[tuple[Sequence, Exception]] = []
        self._ensure_blocks(preempted, failed)
        launched = self._launch(failed)
        if self.overlap:
            previous, self._flight = self._take_flight(), launched
            result = self._read(previous)
        else:
            result = self._read(launched)
        result.preempted[:0], result.failed[:0] = preempted, failed
        result.launched = launched is not None
        return result

    def read_in_flight(self) -> StepResult:
        """Reads the step in flight, if any, and dispatches none (a held step)."""
        return self._read(self._take_flight())

    def _take_flight(self) -> _InFlight | None:
        flight, self._flight = self._flight, None
        return flight

    def _launch(self, failed: list) -> _InFlight | None:
        b, p = len(self.slots), self.inst.max_pages
        tokens, positions, lens = (np.zeros(b, np.int32) for _ in range(3))
        carried = np.zeros(b, bool)  # the row's input is the step in flight's token
        tables = np.zeros((b, p), np.int32)
        params, steps = [None] * b, [0] * b
        rows = []
        for i, seq in enumerate(self.slots):
            if seq is None or not self._runs(seq):
                continue
            try:
                failpoint("decode.row", seq.request_id)
                tables[i, :len(seq.blocks)] = seq.blocks
            except Exception as e:  # noqa: BLE001 - this row fails, the batch goes on
                tables[i] = 0
                failed.append((self._retire(i), e))
                continue
            ahead = self._ahead(seq)
            carried[i] = ahead > 0
            tokens[i], positions[i] = seq.tokens[-1], seq.last_position + ahead
            lens[i] = positions[i] + 1
            params[i], steps[i] = seq.params, len(seq.tokens) + ahead
            rows.append((i, seq))
        if not rows:
            return None
        new, logprobs = self.inst.decode(tokens, positions, tables, lens,
                                         row_params(params, steps, self.inst.config.vocab_size),
                                         previous=self._flight.new if carried.any() else None,
                                         carried=carried)
        return _InFlight(new, logprobs, rows, {id(seq) for _, seq in rows})

    def _read(self, flight: _InFlight | None) -> StepResult:
        """Reads a dispatched step's tokens (waiting for the device) and retires the
        rows that finished. Rows retired since it was dispatched are skipped."""
        if flight is None:
            return StepResult([], [], [], [])
        new, logprobs = np.asarray(flight.new), np.asarray(flight.logprobs)
        out, finished, failed = [], [], []
        for i, seq in flight.rows:
            if self.slots[i] is not seq:  # cancelled, failed or finished meanwhile
                continue
            try:
                failpoint("decode.token", seq.request_id)
                token = int(new[i])
            except Exception as e:  # noqa: BLE001
                failed.append((self._retire(i), e))
                continue
            seq.tokens.append(token)
            seq.logprobs.append(float(logprobs[i]))
            out.append((seq.request_id, token, float(logprobs[i])))
            seq.finish_reason = seq.finish_check()
            if seq.finish_reason:
                finished.append(self._retire(i))
        return StepResult(out, finished, [], failed, read=True)
