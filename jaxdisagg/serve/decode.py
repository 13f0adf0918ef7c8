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

ROW_FIELDS = ("seed_lo", "seed_hi", "temperature", "top_k", "top_p")  # fixed per request


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
        # The persistent batch: each slot's block table and sampling params, written
        # when a sequence comes, grows a block or goes, not rebuilt every step.
        b = inst.pool.max_slots
        self._tables = np.zeros((b, inst.max_pages), np.int32)
        self._table_len = [0] * b
        self._params = row_params([None] * b, 0, inst.config.vocab_size)

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
        self._set_row(slot, seq.params)
        return slot

    def _set_row(self, slot: int, params: SamplingParams | None) -> None:
        """The slot's sampling params in the persistent batch (None: an empty row)."""
        one = row_params([params], 0, self.inst.config.vocab_size)
        for k in ROW_FIELDS:
            getattr(self._params, k)[slot] = getattr(one, k)[0]
        self._tables[slot], self._table_len[slot] = 0, 0

    def _retire(self, slot: int) -> Sequence:
        seq = self.slots[slot]
        self.slots[slot] = None
        self._set_row(slot, None)
        self.blocks.release(seq.blocks)
        seq.blocks = []
        return seq

    def cancel(self, request_id: str) -> Sequence | None:
        for i, seq in enumerate(self.slots):
            if seq is not None and seq.request_id == request_id:
                return self._retire(i)
        return None

    def _running(self) -> list[tuple[int, Sequence, bool, int]]:
        """(slot, sequence, ahead, n) for each row the next step computes: `ahead` when
        the step in flight holds a token of it not read yet, `n` its tokens counting
        that one. A row whose token in flight is its last by max_tokens is left out."""
        flight, out = self._flight.seqs if self._flight else (), []
        for i, seq in enumerate(self.slots):
            if seq is not None:
                ahead = id(seq) in flight
                n = len(seq.tokens) + ahead
                if n < seq.params.max_tokens:
                    out.append((i, seq, ahead, n))
        return out

    def _growing(self, running: list) -> list[tuple[Sequence, int]]:
        """(sequence, blocks it lacks) for each running row that writes past its blocks
        in the next step: not every step, once a block's worth of tokens."""
        bs, out = self.blocks.block_size, []
        for _, seq, _, n in running:
            short = (len(seq.prompt) + n - 1) // bs + 1 - len(seq.blocks)
            if short > 0:
                out.append((seq, short))
        return out

    def _ensure_blocks(self, growing: list, preempted: list[Sequence], failed: list) -> None:
        """Gives every growing sequence a block for the position it writes this step;
        the newest sequence is preempted to make room."""
        for seq, short in sorted(growing, key=lambda g: g[0].admitted_order):
            while short > 0 and seq in self.slots:
                try:
                    seq.blocks += self.blocks.allocate(1)
                    short -= 1
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
        running = self._running()
        growing = self._growing(running)
        if (self._flight is not None
                and sum(short for _, short in growing) > self.blocks.num_available):
            # Growing would preempt: read the step in flight first, so that a preempted
            # sequence leaves with every token it was computed.
            return self.read_in_flight()
        preempted: list[Sequence] = []
        failed: list[tuple[Sequence, Exception]] = []
        if growing:
            self._ensure_blocks(growing, preempted, failed)
        launched = self._launch([r for r in running if self.slots[r[0]] is r[1]], failed)
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

    def _launch(self, running: list, failed: list) -> _InFlight | None:
        """Dispatches a step for `running` (rows preempted since it was taken are out)."""
        b = len(self.slots)
        tokens, positions, lens = (np.zeros(b, np.int32) for _ in range(3))
        steps = np.zeros(b, np.uint32)
        carried = np.zeros(b, bool)  # the row's input is the step in flight's token
        tables, known = self._tables, self._table_len
        rows = []
        for i, seq, ahead, n in running:
            try:
                failpoint("decode.row", seq.request_id)
                if len(seq.blocks) != known[i]:  # a block was added since the last step
                    tables[i, known[i]:len(seq.blocks)] = seq.blocks[known[i]:]
                    known[i] = len(seq.blocks)
            except Exception as e:  # noqa: BLE001 - this row fails, the batch goes on
                failed.append((self._retire(i), e))
                continue
            carried[i] = ahead
            tokens[i] = seq.tokens[-1]
            positions[i] = len(seq.prompt) + n - 1
            steps[i] = n
            rows.append((i, seq))
        if not rows:
            return None
        busy = [i for i, _ in rows]
        lens[busy] = positions[busy] + 1
        params = self._params
        # Copies: the arrays of a step in flight must not change under it.
        new, logprobs = self.inst.decode(
            tokens, positions, tables.copy(), lens,
            params._replace(steps=steps, **{
                k: getattr(params, k).copy() for k in ROW_FIELDS}),
            previous=self._flight.new if carried.any() else None, carried=carried)
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
