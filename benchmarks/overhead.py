"""Host overhead of the decode loop: the engine's time per step against the bare program.

    python benchmarks/overhead.py [--slots 32 --new 1024 --preset tiny --rounds 3]

The `tiny` preset's decode step takes a few milliseconds, as a GPU's does, so what the
engine adds around it (building inputs, admitting, emitting tokens, detokenizing,
stop strings, metrics) shows. One colocated instance on one CPU device serves
`--slots` requests of 16-token prompts, each generating exactly `--new` tokens, all
at once. The engine's step time is the median time between a request's tokens
(every slot gets one token per step); the bare step is the same jitted program
called in a loop with the same batch, block-table width and context, its tokens
copied to the host as the engine does. Both are taken in an early window (tokens
64-192) and a late one (the last 128 tokens), to show whether any per-token cost
grows with the output. Rounds alternate engine and bare runs; the table gives the
median and range of the ratio. The engine runs twice a round, with decode overlap
scheduling (the default) and without it, for the A/B. Writes
benchmarks/results/overhead.json.
"""

import os

# Exactly the host devices it uses: XLA:CPU sizes its thread pool to max(cores, devices).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import write_result  # noqa: E402

from jaxdisagg.mesh.config import DeploymentConfig, ModelSpec, PoolConfig  # noqa: E402
from jaxdisagg.model import SamplingParams  # noqa: E402
from jaxdisagg.model.sampling import row_params  # noqa: E402
from jaxdisagg.serve.engine import Engine  # noqa: E402

PROMPT, BS = 16, 16


def config(model: str, slots: int, new: int) -> DeploymentConfig:
    pages = -(-(PROMPT + new + 1) // BS)
    pool = PoolConfig(devices=[0], tp=1, block_size=BS, num_blocks=slots * pages + 8,
                      max_slots=slots, chunk_size=256, max_pages_per_request=pages)
    return DeploymentConfig(mode="colocated", model=ModelSpec(model, "float32"), colocated=pool)


def windows(new: int) -> dict[str, tuple[int, int]]:
    return {"early": (64, min(192, new // 2)), "late": (new - 128, new)}


def thread_cpu_s(prefix: str = "jaxdisagg-") -> float:
    """CPU seconds used so far by the engine's own threads (its workers and output
    thread; XLA's compute threads excluded): the host work, immune to wall-clock noise."""
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident))
               for t in threading.enumerate() if t.name.startswith(prefix))


def engine_round(engine: Engine, prompts, new: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=new)
    cpu = thread_cpu_s()
    ids = [engine.submit(p, params, stop_token_ids=[]) for p in prompts]
    results = [engine.result(rid) for rid in ids]
    assert all(len(r.token_ids) == new for r in results)
    out = {name: statistics.median(t for r in results for t in r.tbt_s[lo:hi])
           for name, (lo, hi) in windows(new).items()}
    out["host_cpu"] = (thread_cpu_s() - cpu) / new  # per step: one token for every row
    return out


def bare_round(inst, slots: int, new: int, steps: int = 64) -> dict[str, float]:
    """The same program, batch and context as the engine's window, in a tight loop."""
    pages = inst.max_pages
    # The engine's layout: sequences that grow together take blocks in turn, so slot
    # i's pages are i, i + slots, i + 2 * slots, ... (a gather with the same locality).
    tables = np.arange(slots * pages, dtype=np.int32).reshape(pages, slots).T.copy()
    rows = row_params([SamplingParams()] * slots, 1, inst.config.vocab_size)
    out, cpu = {}, time.thread_time()
    for name, (lo, hi) in windows(new).items():
        tokens = np.ones(slots, np.int32)
        times = []
        for i in range(steps):  # walk the window's contexts, as the engine did
            pos = np.full(slots, PROMPT + lo + i * (hi - lo) // steps, np.int32)
            t = time.perf_counter()
            new_tokens, logprobs = inst.decode(tokens, pos, tables, pos + 1, rows)
            np.asarray(new_tokens), np.asarray(logprobs)
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
    out["host_cpu"] = (time.thread_time() - cpu) / (steps * len(windows(new)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", "--preset", dest="model", default="tiny")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/overhead.json")
    args = p.parse_args(argv)

    engine = Engine.from_config(config(args.model, args.slots, args.new))
    inst = engine.decoders[0].inst
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, min(250, engine.vocab_size), PROMPT).tolist()
               for _ in range(args.slots)]
    worker = engine.decoders[0]
    rounds = []
    with engine:
        engine.generate([prompts[0]], SamplingParams(max_tokens=4))  # first calls, excluded
        for r in range(args.rounds):  # the three runs in a rotated order
            out = {}
            for kind in ("overlap", "sync", "bare")[r % 3:] + ("overlap", "sync", "bare")[:r % 3]:
                if kind == "bare":  # the engine's thread is idle: the loop uses its instance
                    out[kind] = bare_round(inst, args.slots, args.new)
                else:  # switched between runs, with no step in flight
                    worker.decode.overlap = kind == "overlap"
                    out[kind] = engine_round(engine, prompts, args.new)
            rounds.append({"engine_s": out["overlap"], "sync_s": out["sync"],
                           "bare_s": out["bare"],
                           "ratio": {k: out["overlap"][k] / out["bare"][k] for k in out["bare"]},
                           "sync_ratio": {k: out["sync"][k] / out["bare"][k]
                                          for k in out["bare"]}})
    cpu = {k: statistics.median(r[k]["host_cpu"] * 1e3 for r in rounds)
           for k in ("engine_s", "bare_s")}

    print(f"\n{args.model} fp32, {args.slots} slots x {args.new} new tokens, "
          f"{args.rounds} rounds ({platform.machine()}, {os.cpu_count()} cores)\n")
    print(f"{'window':<8}{'engine step ms':>16}{'bare step ms':>14}{'engine / bare':>24}"
          f"{'without overlap / bare':>30}")
    summary = {}
    for name in windows(args.new):
        eng = [r["engine_s"][name] * 1e3 for r in rounds]
        bare = [r["bare_s"][name] * 1e3 for r in rounds]
        ratio = [r["ratio"][name] for r in rounds]
        sync = [r["sync_ratio"][name] for r in rounds]
        summary[name] = {"engine_ms": statistics.median(eng), "bare_ms": statistics.median(bare),
                         "ratio_median": statistics.median(ratio),
                         "ratio_range": [min(ratio), max(ratio)],
                         "sync_ratio_median": statistics.median(sync),
                         "sync_ratio_range": [min(sync), max(sync)]}
        print(f"{name:<8}{statistics.median(eng):>16.2f}{statistics.median(bare):>14.2f}"
              f"{statistics.median(ratio):>12.3f}x [{min(ratio):.3f}-{max(ratio):.3f}]"
              f"{statistics.median(sync):>16.3f}x [{min(sync):.3f}-{max(sync):.3f}]")
    print("\nmedian [range] over rounds; target: engine / bare <= 1.10 in both windows")
    print(f"host CPU per step (median of rounds): engine's threads {cpu['engine_s']:.3f} ms "
          f"(decode worker, dispatch included, and output), bare loop's {cpu['bare_s']:.3f} "
          "ms (dispatch and reading tokens)")
    summary["host_cpu_ms"] = {"engine": cpu["engine_s"], "bare": cpu["bare_s"]}
    write_result(args.out, {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.node(),
                            "cores": os.cpu_count(), "args": vars(args), "rounds": rounds,
                            "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
