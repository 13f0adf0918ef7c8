"""Step times of a deployment's own pools, measured, and the simulator's costs fitted
to them (`jaxdisagg simulate --calibrate`).

Each pool of the config is built as serving builds it (its devices, tp, chunk
buckets, table widths) and its programs are timed as the schedulers call them:

* prefill: one chunk at every compiled bucket, over no prefix and over a long one,
  with the first token sampled as the last chunk's is;
* decode: a step with 1, half and all slots active, the full batch at every compiled
  table width and the smaller ones at the full width (the programs that serve them),
  tokens copied to the host as the decode worker does: one step late under overlap
  scheduling (the default), so the host's dispatch of the next step hides under the
  device's work, as it does when served.

`simulate.fit_costs` turns the medians into a `FittedCosts` per pool. Pools that
run in their own pinned processes (`jaxdisagg launch`) should be measured the same
way: `--cores` pins this process before JAX starts.

Two pools on neighbouring cores still share the memory bus and the last-level
cache, so each runs slower while the other works. `busy` keeps one pool's programs
running so that the other can be calibrated under that load
(`jaxdisagg simulate --busy POOL`); the ratio of the two calibrations is the
simulator's `PoolSpec.contended`.
"""

from __future__ import annotations

import numpy as np

from jaxdisagg import simulate as sim
from jaxdisagg.roofline import median_seconds


def _tables(inst) -> tuple[np.ndarray, np.ndarray]:
    """One request's block table [P], and every slot's [slots, P] as the decode worker
    lays them out: sequences that grew together hold interleaved pages."""
    pages, slots, blocks = inst.max_pages, inst.pool.max_slots, inst.pool.num_blocks
    one = np.arange(pages, dtype=np.int32) % blocks
    full = (np.arange(slots * pages, dtype=np.int32) % blocks).reshape(pages, slots).T
    return one, full


def cpu_share(fn, seconds: float = 0.5) -> float:
    """CPU seconds this process spends per wall second while fn() runs back to back
    (all its threads: XLA's intra-op pool makes it more than 1 on several cores)."""
    import time

    fn()
    wall0, cpu0, calls = time.perf_counter(), time.process_time(), 0
    while calls < 3 or time.perf_counter() - wall0 < seconds:
        fn()
        calls += 1
    return (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def _read(out) -> None:
    """A decode step's tokens and logprobs to the host, as the decode worker reads them."""
    np.asarray(out[0]), np.asarray(out[1])


def overlapped_seconds(call, repeats: int = 5, steps: int = 4) -> float:
    """Median seconds per decode step when each step is read one step late, as the
    overlapped decode loop reads them (call() dispatches a step and returns its
    outputs): runs of `steps` calls, after one warm-up run."""
    def run():
        prev = call()
        for _ in range(steps - 1):
            out = call()
            _read(prev)
            prev = out
        _read(prev)

    return median_seconds(run, repeats) / steps


def measure_pool(inst, repeats: int = 5) -> tuple[list, list, dict]:
    """(tokens, prefix, s) prefill points, (active, width tokens, s) decode points, and
    the CPU share of a lone request's programs (its smallest chunk, a one-row step):
    what a request's model work costs in CPU time beside its wall time."""
    from jaxdisagg.model.sampling import SamplingParams, row_params, sample_rows

    bs = inst.layout.block_size
    reach = inst.max_pages * bs
    table, full = _tables(inst)
    prefill, shares = [], {}
    for bucket in inst.chunk_buckets:
        for prefix in sorted({0, max(0, min(reach - bucket, reach // 2) // bs * bs)}):
            tokens = np.ones(bucket, np.int32)

            def chunk(tokens=tokens, prefix=prefix, bucket=bucket):
                logits = inst.prefill(tokens, prefix, bucket, table)
                sample_rows(logits[None], [SamplingParams()], [0])

            prefill.append((bucket, prefix, median_seconds(chunk, repeats)))
            if bucket == inst.chunk_buckets[0] and prefix == 0:
                shares["prefill"] = cpu_share(chunk)
    slots = inst.pool.max_slots
    decode = []
    if inst.name != "prefill":  # a prefill pool never decodes
        # An empty row's table is all zeros, as the worker's (it reads block 0).
        for active in sorted({1, max(1, slots // 2), slots}):
            params = [SamplingParams()] * active + [None] * (slots - active)
            rows = row_params(params, 1, inst.config.vocab_size)
            tables = np.zeros_like(full)
            tables[:active] = full[:active]
            for width in inst.step_widths(active):  # the programs that serve `active`
                lens = np.zeros(slots, np.int32)
                lens[:active] = width * bs - 1
                pos = np.maximum(lens - 1, 0)

                def call(pos=pos, lens=lens, rows=rows, tables=tables):
                    return inst.decode(np.ones(slots, np.int32), pos, tables, lens, rows)

                def step(call=call):
                    _read(call())

                # With overlap scheduling (the default) step N+1 is dispatched before
                # step N's tokens are read, so the host's dispatch hides under the
                # device's work: timed that way, or the fit charges every step for it.
                s = (overlapped_seconds(call, repeats) if inst.pool.overlap_steps
                     else median_seconds(step, repeats))
                decode.append((active, width * bs, s))
                if active == 1:
                    shares["decode"] = cpu_share(step)
    return prefill, decode, shares


def busy(config, pool: str, limit_s: float = 1800.0, ready=None) -> None:
    """Runs `pool`'s heaviest program in a loop until killed (or `limit_s`, so that a
    forgotten load never outlives its calibration): prefill chunks of the largest
    bucket over a half-full table, or decode steps with every slot active at the
    widest table. `ready()` is called once it is compiled and looping."""
    import time

    from jaxdisagg.mesh.config import load_config
    from jaxdisagg.mesh.deployment import Deployment
    from jaxdisagg.model.sampling import SamplingParams, row_params

    cfg = load_config(config) if isinstance(config, str) else config
    role = pool if cfg.mode == "disaggregated" else None
    inst = Deployment.build(cfg, role=role).pools[pool][0]
    bs, slots = inst.layout.block_size, inst.pool.max_slots
    table, tables = _tables(inst)
    if pool == "prefill":
        bucket = inst.chunk_buckets[-1]
        prefix = max(0, (inst.max_pages * bs - bucket) // 2 // bs * bs)
        tokens = np.ones(bucket, np.int32)

        def step():
            np.asarray(inst.prefill(tokens, prefix, bucket, table))
    else:
        lens = np.full(slots, inst.table_widths[-1] * bs - 1, np.int32)
        rows = row_params([SamplingParams()] * slots, 1, inst.config.vocab_size)

        def step():
            np.asarray(inst.decode(np.ones(slots, np.int32), lens - 1, tables, lens, rows)[0])
    step()
    if ready is not None:
        ready()
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        step()


def contention(alone: list, loaded: list) -> float:
    """Median ratio of matching measured points (same shape) under load and alone:
    the step-time multiplier while the neighbour works (1 when it costs nothing)."""
    ratios = [b[-1] / a[-1] for a, b in zip(alone, loaded, strict=True)
              if a[:-1] == b[:-1] and a[-1] > 0]
    return max(1.0, float(np.median(ratios))) if ratios else 1.0


def calibrate(config, pools=None, repeats: int = 5) -> dict[str, tuple]:
    """{pool: (FittedCosts, measured points)} for each pool (of `pools`, default all)
    of a deployment config."""
    from jaxdisagg.mesh.config import devices_needed, ensure_cpu_devices, load_config
    from jaxdisagg.mesh.deployment import Deployment

    cfg = load_config(config) if isinstance(config, str) else config
    # Pool by pool, in one process: JAX must start with the devices of all of them.
    ensure_cpu_devices(max(devices_needed(cfg, role) for role in cfg.pools()))
    out = {}
    for name in pools or list(cfg.pools()):
        role = name if cfg.mode == "disaggregated" else None
        inst = Deployment.build(cfg, role=role).pools[name][0]
        prefill, decode, shares = measure_pool(inst, repeats)
        widths = [w * inst.layout.block_size for w in inst.table_widths]
        costs = sim.fit_costs(prefill, decode or [(1, widths[0], 0.0)], widths, name,
                              inst.batch_sizes)
        out[name] = (costs, {"prefill": prefill, "decode": decode, "cpu_share": shares})
    return out
