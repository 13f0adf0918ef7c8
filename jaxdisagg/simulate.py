"""`jaxdisagg simulate`: a discrete-event model of the serving system.

It replays the engines' own policies on simulated time, so a deployment can be
judged at rates, sizes and hardware this machine does not have:

* the router sends a request to the decode instance with the fewest requests in
  flight, and (disaggregated) to the prefill instance with the fewest queued
  tokens; prompts of at most `local_prefill_threshold` tokens are prefilled on the
  decode instance;
* a prefill instance runs FCFS chunked prefill, one chunk per iteration, padded to
  the smallest compiled bucket; a prompt's last chunk waits while its decode
  instance's handoff queue is full (backpressure);
* a decode (or colocated) instance iterates as `DecodeWorker` does: take
  handoffs while slots are free, admit (a cross-process pull runs on the decode
  thread), piggyback one local prefill chunk, run one decode step for the busy slots.
  The first token surfaces when the request is admitted; every later token at the
  end of a decode step.

What a call costs comes from a `Costs`: `RooflineCosts` (the roofline step times of
`jaxdisagg.roofline`, plus a fixed per-call overhead) for hardware we do not have,
or `FittedCosts` fitted to step times measured here (`simulate.calibrate`). The
output is `bench.Record`s, so a simulated run is summarized, swept and plotted
exactly like a measured one.

Host work is two constants of a `System`: time per decode-worker iteration and time
per token emitted (detokenizing and streaming run on other threads but share the
instance's cores, so they lengthen its steps).

Not modelled: preemption (pools are assumed to have the blocks), the prefix cache,
stop tokens (every request generates its drawn length), network jitter.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxdisagg import bench
from jaxdisagg import roofline as rl


def buckets(chunk_size: int, step: int = 16, fine_up_to: int = 64) -> tuple[int, ...]:
    """The prefill token buckets a pool compiles (`mesh.pool.chunk_buckets`, restated
    here so planning never imports JAX; a test holds the two equal)."""
    sizes = set(range(step, min(fine_up_to, chunk_size) + 1, step))
    size = fine_up_to * 2
    while size < chunk_size:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes | {chunk_size}))


@cache
def _buckets(chunk_size: int) -> tuple[int, ...]:
    return buckets(chunk_size)


def fit(n: int, sizes) -> int:
    return next((s for s in sizes if s >= n), sizes[-1])


# ---------------------------------------------------------------------- costs


class Costs(Protocol):
    def prefill_s(self, tokens: int, prefix: int) -> float:
        """One prefill call of `tokens` (as executed, padding included) over `prefix`."""

    def decode_s(self, active: int, kv_tokens: int, longest: int) -> float:
        """One decode step: `active` rows reading `kv_tokens` of KV in all, the longest
        row `longest` tokens."""


@dataclass(frozen=True)
class RooflineCosts:
    """Roofline step times (`roofline.served_point`) on `tp` devices, plus a fixed
    per-call overhead (launch, host work, sampling) and tensor parallelism's two
    all-reduces per layer over the fabric."""

    model: rl.Model
    hw: rl.Hardware
    tp: int = 1
    overhead_s: float = 0.0
    fabric: float = rl.FABRICS["nvlink"]
    hidden: int = 0  # for the all-reduce bytes (0: no tp communication counted)
    layers: int = 0
    allreduce_latency_s: float = 8e-6  # per all-reduce, the ring's fixed cost

    def _time(self, p: rl.Point, tokens: int) -> float:
        t = max(p.flops / (self.hw.flops * self.tp), p.bytes / (self.hw.bandwidth * self.tp))
        if self.tp > 1 and self.layers:
            moved = 2 * (self.tp - 1) / self.tp * tokens * self.hidden * self.model.bytes_per_param
            t += 2 * self.layers * (self.allreduce_latency_s + moved / self.fabric)
        return t + self.overhead_s

    def prefill_s(self, tokens: int, prefix: int) -> float:
        p = rl.served_point(self.model, "prefill", tokens, prefix + tokens, 1,
                            tokens * (prefix + (tokens + 1) / 2))
        return self._time(p, tokens)

    def decode_s(self, active: int, kv_tokens: int, longest: int) -> float:
        p = rl.served_point(self.model, "decode", active, kv_tokens, active, kv_tokens)
        return self._time(p, active)


@dataclass(frozen=True)
class FittedCosts:
    """Step times fitted to measurements of this project's own programs:

        prefill = p0 + p1 * executed tokens + p2 * attention pairs
        decode  = d0 + d1 * rows + d2 * width + d3 * rows * width

    A decode step runs the active rows padded to the smallest compiled batch size
    (`batches`); a full batch runs over the narrowest compiled table width (in tokens)
    that holds the longest row (`table_widths`), a smaller one over the full width.
    Every row reads its width of KV (a padding row re-reads block 0: cheap, not free),
    so width, not the rows' own contexts, is what attention costs. No `batches`
    (calibrations before 2026-12-02): every step ran all `max_slots` rows, and the fit
    took the active count for `rows`."""

    prefill: tuple[float, float, float]
    decode: tuple[float, float, float, float]
    widths: tuple[int, ...]  # compiled table widths, in tokens
    label: str = "fitted"
    batches: tuple[int, ...] = ()  # compiled decode batch sizes

    def prefill_s(self, tokens: int, prefix: int) -> float:
        p0, p1, p2 = self.prefill
        return p0 + p1 * tokens + p2 * tokens * (prefix + (tokens + 1) / 2)

    def decode_s(self, active: int, kv_tokens: int, longest: int) -> float:
        d0, d1, d2, d3 = self.decode
        rows, width = decode_program(active, longest, self.widths, self.batches)
        return d0 + d1 * rows + d2 * width + d3 * rows * width


def decode_program(active: int, longest: int, widths, batches) -> tuple[int, int]:
    """(rows, width in tokens) of the decode program that serves `active` rows whose
    longest holds `longest` tokens, as `mesh.pool.PoolInstance.decode` picks it."""
    if not batches:
        return active, fit(longest, widths)
    rows = fit(active, batches)
    return rows, fit(longest, widths) if rows == batches[-1] else widths[-1]


def fit_costs(prefill: list[tuple[int, int, float]], decode: list[tuple[int, int, float]],
              widths, label: str = "fitted", batches=()) -> FittedCosts:
    """Least squares (coefficients kept >= 0) on (tokens, prefix, s) and (active,
    width tokens, s) measurements; each decode point stands for the program it ran
    (`decode_program`)."""
    def solve(rows, ys):
        a, y = np.asarray(rows, float), np.asarray(ys, float)
        coef = np.linalg.lstsq(a, y, rcond=None)[0]
        while (coef < 0).any():  # drop a term that fits noise below zero, refit the rest
            keep = coef > 0
            coef = np.zeros_like(coef)
            coef[keep] = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        return tuple(float(c) for c in coef)

    p = solve([(1, t, t * (s + (t + 1) / 2)) for t, s, _ in prefill], [x[2] for x in prefill])
    widths, batches = tuple(sorted(widths)), tuple(sorted(batches))
    programs = [decode_program(a, w, widths, batches) for a, w, _ in decode]
    d = solve([(1, b, w, b * w) for b, w in programs], [x[2] for x in decode])
    return FittedCosts(p, d, widths, label, batches)


# ---------------------------------------------------------------------- the system


@dataclass(frozen=True)
class PoolSpec:
    """`costs` None: a pool that costs nothing (the other phase studied alone)."""

    instances: int
    costs: Costs | None
    chunk_size: int = 512
    max_slots: int = 0  # decode slots (0 for a prefill pool)
    tp: int = 1  # devices per instance, for per-device figures
    # Step-time multiplier while an instance of the other phase is working: on a CPU
    # the two pools' cores share the memory bus and last-level cache (calibrated
    # with `jaxdisagg simulate --busy`); 1 where they share nothing.
    contended: float = 1.0
    # Prompt tokens of KV a prefill instance can hold (its pool's blocks), 0: unbounded.
    # It binds with a pulled (cross-process) transfer, where prefilled requests keep
    # their KV on the prefill side until the decode side pulls it.
    kv_tokens: int = 0
    # The decode batching window (`decode_min_batch`, `decode_wait_s`), as the engine
    # holds it: a step waits, at most `wait_s`, while fewer rows are busy than
    # `min_batch` and than the requests routed to the instance.
    min_batch: int = 1
    wait_s: float = 0.0


@dataclass(frozen=True)
class Transfer:
    """KV handoff time: base + prompt tokens * bytes per token / bandwidth. `blocking`:
    the decode thread itself pulls it at admission (cross-process), rather than
    waiting only for what is still in flight. `latency_s` comes first and occupies
    nobody (messages between processes): the request cannot be admitted before it,
    and the decode instance goes on stepping meanwhile."""

    bytes_per_token: int
    bandwidth: float
    base_s: float = 0.0
    blocking: bool = False
    latency_s: float = 0.0
    # The sender serves a pull only while its prefill instance computes nothing: on a
    # CPU the prefill process's transfer server shares its pinned core with XLA's
    # threads. Measured (`benchmarks/pull_stall.py`): a request's KV waits out the
    # whole prefill of the next one and lands in the pause after that one's last
    # chunk (the host samples its first token), or when the instance idles.
    stalled_by_prefill: bool = False
    # The engine's answer to that stall (`transfer.pull_hold_s`): after a request's last
    # chunk the prefill instance waits for its pull, up to this long, before computing
    # more, so the pull is not stalled (the hold is taken to be long enough: measured
    # pulls of 26-108 ms against the default 0.25 s). With a hold, `stalled_by_prefill`
    # does not apply.
    pull_hold_s: float = 0.0

    def seconds(self, tokens: int) -> float:
        return self.base_s + tokens * self.bytes_per_token / self.bandwidth


@dataclass(frozen=True)
class System:
    mode: str  # disaggregated | colocated
    decode: PoolSpec  # the colocated pool, when colocated
    prefill: PoolSpec | None = None
    transfer: Transfer | None = None
    handoff_queue: int = 4
    local_prefill_threshold: int = 0
    iteration_s: float = 0.0  # host time per decode-worker iteration (scheduling)
    # Host time per token a decode instance emits (detokenizing, streaming it out): it
    # runs on other threads but takes the instance's cores, so each step carries it.
    token_s: float = 0.0
    # The front end's time before a request reaches the pools (RPCs, routing): it
    # delays the request and occupies no pool.
    admit_s: float = 0.0
    # Host CPU time per request on the decode instance's cores (its front end, handoff
    # and pull, where they run beside the decode loop, as `launch` pins the router with
    # the decode pool): each admission holds the decode loop that long.
    request_s: float = 0.0
    # Host CPU time per request on a prefill instance's cores beyond its chunks (its
    # RPCs, the KV's extraction and offer): after a request's last chunk the instance
    # is held that long before its next chunk; the request itself is not delayed.
    prefill_request_s: float = 0.0
    # How `request_s` shares the decode instance's cores with its loop. 0: it holds the
    # loop at each admission. Else the instance has that many cores; while its programs
    # run, the loop's threads take all of them (XLA's helpers spin between calls) and the
    # requests' host work runs as one more thread, the OS sharing the cores evenly: the
    # loop slows by (c + 1) / c while host work is owed, which gets c / (c + 1) of a core
    # (a whole core while the loop idles). A request joins the batch once its own host
    # work would be done.
    request_cores: float = 0.0


@dataclass(eq=False)
class _Req:
    rec: bench.Record
    prompt: int
    output: int
    pos: int = 0  # next prompt position to prefill
    first: float | None = None  # when its first token surfaced
    joined: int = 0  # its decode instance's step count when it joined the batch
    inst: _DecodeInst | None = None
    done: bool = False
    marks: dict[str, float] = field(default_factory=dict)
    decode: int = 0  # its decode instance
    transferred: bool = False
    transfer_ready: float = 0.0  # when its KV has landed (a non-blocking transfer)
    host_done: float | None = None  # when its host work beside the loop is done
    prefill: int = -1  # its prefill instance


class _Sim:
    def __init__(self, system: System):
        self.s = system
        self.now = 0.0
        self.events: list = []
        self._seq = itertools.count()
        d, p = system.decode, system.prefill
        self.dec = [_DecodeInst(self, j) for j in range(d.instances)]
        self.pre = ([_PrefillInst(self, i) for i in range(p.instances)]
                    if system.mode == "disaggregated" else [])
        self.load = [0] * len(self.dec)

    def at(self, t: float, fn) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn))

    def run(self, plan: list[tuple[float, int, int]], detail: bool) -> list[bench.Record]:
        reqs = [_Req(bench.Record(p, t), p, o) for t, p, o in plan]
        for r in reqs:
            self.at(r.rec.arrival + self.s.admit_s, lambda r=r: self.arrive(r))
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            fn()
        for r in reqs:
            self.finish(r, detail)
        return [r.rec for r in reqs]

    def arrive(self, r: _Req) -> None:
        j = min(range(len(self.dec)), key=lambda j: self.load[j])
        self.load[j] += 1
        r.decode = j
        r.marks["arrival"] = self.now
        if self.pre and r.prompt > self.s.local_prefill_threshold:
            i = min(range(len(self.pre)), key=lambda i: self.pre[i].queued_tokens())
            r.prefill = i
            self.pre[i].queue.append(r)
            self.pre[i].wake()
        else:
            self.dec[j].local.append(r)
            self.dec[j].wake()

    def finish(self, r: _Req, detail: bool) -> None:
        rec = r.rec
        if not r.done:
            rec.status = "failed: never finished"
            return
        rec.tokens, rec.ttft = r.output, r.first - rec.arrival
        rec.e2e = r.marks["finish"] - rec.arrival
        if detail:  # every inter-token gap (percentiles); attainment needs none of it
            rec.itl = np.diff(r.inst.tokens(r)).tolist()
            rec.stages = bench.stages(r.marks)


class _Inst:
    def __init__(self, sim: _Sim):
        self.sim, self.busy = sim, False

    def wake(self) -> None:
        if not self.busy:
            self.busy = True
            self.sim.at(self.sim.now, self._run)

    def _run(self) -> None:
        end = self.iterate(self.sim.now)
        if end is None:
            self.busy = False
        else:
            self.sim.at(end, self._run)

    def iterate(self, t: float) -> float | None:
        raise NotImplementedError


def _slowdown(pool: PoolSpec, others: list[_Inst]) -> float:
    """The pool's contention multiplier if any instance of the other phase is busy."""
    return pool.contended if pool.contended != 1.0 and any(o.busy for o in others) else 1.0


def _chunk(pool: PoolSpec, r: _Req) -> tuple[int, int, bool]:
    """(real tokens, executed tokens, last?) of the request's next chunk."""
    size = min(pool.chunk_size, r.prompt - r.pos)
    last = r.pos + size >= r.prompt
    return size, fit(size, _buckets(pool.chunk_size)), last


class _PrefillInst(_Inst):
    """With a pulled (blocking, cross-process) transfer the prefill process answers
    each request as soon as its KV is staged, so a full decode side does not stop it:
    prefilled requests wait on the decode side, their KV held here until pulled, and
    only this instance's KV capacity (`kv_tokens`) stops it. Otherwise (in-process)
    the last chunk waits for room in the decode instance's handoff queue."""

    def __init__(self, sim: _Sim, index: int):
        super().__init__(sim)
        self.pool = sim.s.prefill
        self.queue: deque[_Req] = deque()
        self.pulled = sim.s.transfer is not None and sim.s.transfer.blocking
        self.held = 0  # prompt tokens of KV held: being prefilled or staged for a pull
        self.unserved: list[_Req] = []  # staged KV waiting for a pause in the compute

    def release(self, tokens: int) -> None:
        """The decode side pulled a request's KV: its blocks are free again."""
        self.held -= tokens
        self.wake()

    def queued_tokens(self) -> int:
        return sum(r.prompt - r.pos for r in self.queue)

    def _serve(self, t: float) -> None:
        """A pause in the compute: the pulls that waited for one go (after their latency)."""
        for r in self.unserved:
            r.transfer_ready = t + self.sim.s.transfer.latency_s
            self.sim.at(r.transfer_ready, self.sim.dec[r.decode].wake)
        self.unserved.clear()

    def iterate(self, t: float) -> float | None:
        if not self.queue:
            self._serve(t)
            return None
        r = self.queue[0]
        n, executed, last = _chunk(self.pool, r)
        dec = self.sim.dec[r.decode]
        if self.pulled:
            if r.pos == 0:  # its KV blocks are taken when its prefill starts
                full = self.held + r.prompt > self.pool.kv_tokens
                if self.pool.kv_tokens and self.held and full:
                    self._serve(t)  # idle too: what it holds can be pulled
                    return None  # woken by `release`
                self.held += r.prompt
        elif last and not dec.room():
            dec.blocked.add(self)  # woken when the decode side takes a handoff
            return None
        r.marks.setdefault("prefill_start", t)
        cost = self.pool.costs.prefill_s(executed, r.pos) if self.pool.costs else 0.0
        end = t + cost * _slowdown(self.pool, self.sim.dec)
        r.pos += n
        if last:
            self.queue.popleft()
            r.marks["prefill_end"] = end
            r.transferred = True
            tr = self.sim.s.transfer
            held = 0.0
            if tr.blocking and tr.pull_hold_s > 0:
                r.transfer_ready = end + tr.latency_s
                held = min(tr.pull_hold_s, tr.latency_s + tr.seconds(r.prompt))
            elif tr.blocking and tr.stalled_by_prefill:
                self._serve(end)  # the pulls already waiting, in the pause after this chunk
                r.transfer_ready = math.inf  # set by a later `_serve`
                self.unserved.append(r)
            else:
                r.transfer_ready = end + tr.latency_s + (0.0 if tr.blocking
                                                         else tr.seconds(r.prompt))
            dec.in_flight += 1
            self.sim.at(end, lambda: dec.receive(r))
            return end + held + self.sim.s.prefill_request_s
        return end


class _DecodeInst(_Inst):
    """Tokens are not stored per request: the instance keeps its decode steps' end
    times, and a request knows the step it joined at, so a step costs O(log n)
    whatever the batch."""

    def __init__(self, sim: _Sim, index: int):
        super().__init__(sim)
        self.index = index
        self.pool = sim.s.decode
        self.local: deque[_Req] = deque()  # prefilled here (colocated, short prompts)
        self.handoffs: deque[_Req] = deque()  # transferred, bounded by handoff_queue
        self.in_flight = 0  # handed off by a prefill step that has not ended yet
        self.ready: deque[_Req] = deque()
        self.blocked: set[_PrefillInst] = set()
        self.steps: list[float] = []  # end time of every decode step
        self.active = 0
        self.kv = 0  # KV tokens the active rows hold
        self.ends: list = []  # (step index of a row's last token, seq, request)
        self.lengths: list = []  # (-(prompt - join step), seq, request): the longest row
        self._seq = itertools.count()
        self.held_since: float | None = None  # when the step now held was first due
        self.debt = 0.0  # host CPU of admitted requests not yet done (`request_cores`)
        self.debt_t = 0.0  # the time up to which `debt` is accounted

    def _program(self, t: float, d0: float) -> float:
        """The end of a program that starts at t and takes d0 alone, beside the host work
        still owed (`System.request_cores`)."""
        c = self.sim.s.request_cores
        if c <= 0:
            return t + d0
        if t > self.debt_t:  # while the loop idled the host work had a core
            self.debt = max(0.0, self.debt - (t - self.debt_t))
        slow, rate = (c + 1) / c, c / (c + 1)
        clear = self.debt / rate  # when the host work owed is done, at the shared rate
        if clear >= d0 * slow:
            self.debt -= d0 * slow * rate
            end = t + d0 * slow
        else:
            self.debt = 0.0
            end = t + clear + (d0 - clear / slow)
        self.debt_t = end
        return end

    def _host_work(self, r: _Req, t: float) -> bool:
        """Whether r still waits for its own host work, run beside the loop
        (`System.request_cores`; it begins once r is at the head, its KV arrived)."""
        s = self.sim.s
        if s.request_cores <= 0 or s.request_s <= 0:
            return False
        if r.host_done is None:
            self._program(t, 0.0)  # what is owed, drained to t
            self.debt += s.request_s
            r.host_done = t + s.request_s
        if r.host_done > t:
            self.sim.at(r.host_done, self.wake)
            return True
        return False

    def room(self) -> bool:
        return len(self.handoffs) + self.in_flight < self.sim.s.handoff_queue

    def receive(self, r: _Req) -> None:
        self.in_flight -= 1
        self.handoffs.append(r)
        self.wake()

    def _admit(self, t: float) -> float:
        tr = self.sim.s.transfer
        while self.ready and self.active < self.pool.max_slots:
            r = self.ready[0]
            if r.transferred and tr.blocking and r.transfer_ready > t:
                # still in its latency: step on, come back
                if r.transfer_ready < math.inf:  # (else its prefill instance wakes us)
                    self.sim.at(r.transfer_ready, self.wake)
                break
            if self._host_work(r, t):
                break
            if r.transferred and tr.blocking:
                t += tr.seconds(r.prompt)
                self.sim.pre[r.prefill].release(r.prompt)
            elif r.transferred:
                t = max(t, r.transfer_ready)
            self.ready.popleft()
            if self.sim.s.request_cores <= 0:
                t += self.sim.s.request_s
            r.marks["decode_insert"] = t
            r.first = t  # the first token surfaces on admission
            r.joined = len(self.steps)
            r.inst = self
            if r.output <= 1 or self.pool.costs is None:  # a free decode: all at once
                self._retire(r, t)
                continue
            self.active += 1
            self.kv += r.prompt + 1
            n = next(self._seq)
            heapq.heappush(self.ends, (r.joined + r.output - 2, n, r))
            heapq.heappush(self.lengths, (-(r.prompt - r.joined), n, r))
        return t

    def _retire(self, r: _Req, t: float) -> None:
        r.marks["finish"] = t
        r.done = True
        self.sim.load[self.index] -= 1

    def iterate(self, t: float) -> float | None:
        did = took = False
        while self.handoffs and self.pool.max_slots - self.active > len(self.ready):
            self.ready.append(self.handoffs.popleft())
            took = True
        if took:
            for p in list(self.blocked):
                self.blocked.discard(p)
                p.wake()
        waiting = len(self.ready)
        t = self._admit(t)
        did = len(self.ready) < waiting
        if self.local and (self.local[0].pos > 0 or
                           self.pool.max_slots - self.active > len(self.ready)):
            r = self.local[0]
            did = True
            n, executed, last = _chunk(self.pool, r)
            r.marks.setdefault("prefill_start", t)
            t = self._program(t, self.pool.costs.prefill_s(executed, r.pos))
            r.pos += n
            if last:
                self.local.popleft()
                r.marks["prefill_end"] = t
                self.ready.append(r)
            t = self._admit(t)
        if self.active and self._hold(t):
            return t + self.sim.s.iteration_s if did else None
        if self.active:
            did = True
            while self.lengths[0][2].done:
                heapq.heappop(self.lengths)
            longest = -self.lengths[0][0] + len(self.steps) + 1
            t = self._program(t, self.pool.costs.decode_s(self.active, self.kv, longest)
                          * _slowdown(self.pool, self.sim.pre) + self.sim.s.token_s * self.active)
            self.steps.append(t)
            self.kv += self.active
            k = len(self.steps) - 1
            while self.ends and self.ends[0][0] == k:
                r = heapq.heappop(self.ends)[2]
                self.active -= 1
                self.kv -= r.prompt + r.output
                self._retire(r, t)
        return t + self.sim.s.iteration_s if did else None

    def _hold(self, t: float) -> bool:
        """The engine's batching window (`DecodeWorker._hold`): while held, the instance
        idles (so it contends with nobody) until a row arrives or the wait is over."""
        pool = self.pool
        if pool.wait_s <= 0 or self.active >= min(pool.min_batch, self.sim.load[self.index]):
            self.held_since = None
            return False
        if self.held_since is None:
            self.held_since = t
        if t - self.held_since >= pool.wait_s:
            self.held_since = None
            return False
        self.sim.at(self.held_since + pool.wait_s, self.wake)
        return True

    def tokens(self, r: _Req) -> np.ndarray:
        if self.pool.costs is None:
            return np.full(r.output, r.first)
        return np.concatenate([[r.first], self.steps[r.joined:r.joined + r.output - 1]])


def simulate(system: System, plan: list[tuple[float, int, int]], detail: bool = True
             ) -> list[bench.Record]:
    """Runs (arrival s, prompt tokens, output tokens) requests through the system.
    Without `detail` the records carry TTFT, TPOT and E2E but no inter-token gaps."""
    return _Sim(system).run(plan, detail)


def attainment(records: list[bench.Record], slo: bench.SLO) -> float:
    return sum(slo.met(r) for r in records) / len(records)


@lru_cache(maxsize=64)
def _lengths(workload: bench.Workload) -> tuple[tuple[float, int, int], ...]:
    plan = workload.build(vocab=8)  # the same draws `bench` makes; token ids unused
    return tuple((t, len(p), o) for t, p, o in plan[workload.warmup:])


def plan_of(workload: bench.Workload) -> list[tuple[float, int, int]]:
    """The measured requests `bench.run` would send for this workload (same seed, same
    arrivals and lengths), as (arrival, prompt tokens, output tokens)."""
    return list(_lengths(workload))


def run(system: System, workload: bench.Workload, slo: bench.SLO) -> dict:
    """`bench.summarize` of the simulated run."""
    return bench.summarize(simulate(system, plan_of(workload)), slo)


def max_rate(system: System, workload: bench.Workload, slo: bench.SLO, target: float = 0.9,
             guess: float = 1.0, tol: float = 0.02) -> float:
    """The highest request rate whose SLO attainment stays >= target: a bracket
    grown by doubling (or halving) from `guess`, then bisection on a log scale
    (attainment falls with rate). 0 when even 1/1000 of the guess misses the SLO.
    A guess near the answer saves the slow trials: a low rate simulates one
    request at a time, each for its whole output."""
    from dataclasses import replace

    def ok(rate):
        plan = plan_of(replace(workload, rate=rate))
        return attainment(simulate(system, plan, detail=False), slo) >= target

    lo = hi = guess
    if ok(guess):
        while ok(hi * 2):
            hi *= 2
            if hi > 1e6:
                return hi
        lo, hi = hi, hi * 2
    else:
        while not ok(lo / 2):
            lo /= 2
            if lo < guess / 1000:
                return 0.0
        lo, hi = lo / 2, lo
    while hi / lo > 1 + tol:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def capacity(system: System, prompt: float, output: float) -> float:
    """A rough requests/s the system can sustain (each pool busy all the time, decode
    batches full): `max_rate`'s starting guess, never a result."""
    d, p = system.decode, system.prefill or system.decode
    rates = []
    if p.costs is not None:
        chunks = -(-prompt // p.chunk_size)
        per = sum(p.costs.prefill_s(min(p.chunk_size, prompt - k * p.chunk_size),
                                    k * p.chunk_size) for k in range(int(chunks)))
        rates.append(p.instances / per)
    if d.costs is not None and d.max_slots:
        ctx = int(prompt + output / 2)
        step = d.costs.decode_s(d.max_slots, d.max_slots * ctx, ctx)
        rates.append(d.instances * d.max_slots / (output * step))
    if system.mode == "colocated" and len(rates) == 2:
        return 1 / sum(1 / r for r in rates)  # one instance does both
    return min(rates) if rates else 1.0


# ---------------------------------------------------------------------- from a config


def system_from_config(cfg, costs: dict[str, Costs], transfer: Transfer | None = None,
                       iteration_s: float = 0.0, token_s: float = 0.0, admit_s: float = 0.0,
                       contended: dict[str, float] | None = None,
                       request_s: float = 0.0, prefill_request_s: float = 0.0,
                       request_cores: float = 0.0) -> System:
    """The System a DeploymentConfig serves: its pools' instances, chunk sizes, slots
    and tp, its router's handoff queue and local-prefill threshold. `costs` (and
    optionally `contended`) per pool name; `transfer` defaults to the fabric table
    (loopback for cross_process, nvlink otherwise), blocking when the decode side
    pulls (cross_process)."""
    pools = cfg.pools()
    contended = contended or {}

    def spec(name):
        p = pools[name]
        slots = 0 if name == "prefill" else p.max_slots
        kv = p.num_blocks * p.block_size if name == "prefill" else 0
        return PoolSpec(p.instances, costs[name], p.chunk_size, slots, p.tp,
                        contended.get(name, 1.0), kv, p.decode_min_batch, p.decode_wait_s)

    if cfg.mode == "colocated":
        return System("colocated", spec("colocated"), iteration_s=iteration_s,
                      handoff_queue=cfg.router.handoff_queue, token_s=token_s,
                      admit_s=admit_s, request_s=request_s, request_cores=request_cores)
    if transfer is None:
        raise ValueError("a disaggregated system needs its KV transfer's cost")
    return System("disaggregated", spec("decode"), spec("prefill"), transfer,
                  cfg.router.handoff_queue, cfg.router.local_prefill_threshold, iteration_s,
                  token_s, admit_s, request_s, prefill_request_s, request_cores)


# ---------------------------------------------------------------------- calibration files


def save_calibration(path: str | Path, pools: dict[str, tuple], extra: dict) -> None:
    """Writes `calibrate.calibrate`'s {pool: (FittedCosts, points)} and `extra` as JSON."""
    Path(path).write_text(json.dumps(
        {"pools": {k: {**asdict(c), "points": pts} for k, (c, pts) in pools.items()},
         **extra}, indent=1))


def load_calibration(path: str | Path) -> tuple[dict[str, FittedCosts], dict]:
    """({pool: FittedCosts}, the file's other entries)."""
    data = json.loads(Path(path).read_text())
    pools = {k: FittedCosts(tuple(v["prefill"]), tuple(v["decode"]), tuple(v["widths"]),
                            v.get("label", k), tuple(v.get("batches", ())))
             for k, v in data.pop("pools").items()}
    return pools, data
