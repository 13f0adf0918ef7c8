"""Where peers.py's serving workload spends its time, per pool: both engines in one process.

    python benchmarks/serving_timeline.py [--rounds 2]
                                          [--out benchmarks/results/serving_timeline.json]

The serving workload of `peers.py` (16 prompts of 256 tokens, 64 new tokens each, all
at once, SmolLM2 fp32, the same two deployments on 2 CPU devices) with every prefill
group call and decode step timed: how long the prefill pool is busy, how many decode
steps run and at how many busy slots, and how long a decode step takes while a prefill
is running. Each call is waited for, which takes away the decode loop's overlap of one
step's dispatch with the last one's run: walls come out a little longer than peers.py's.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import write_result  # noqa: E402
from peers import SERVE_NEW, SERVE_PROMPT, SERVE_REQUESTS, serve_ours, serving_configs  # noqa: E402

from jaxdisagg.mesh.pool import PoolInstance  # noqa: E402
from jaxdisagg.model import SamplingParams  # noqa: E402
from jaxdisagg.serve.engine import Engine  # noqa: E402

CALLS: list[tuple[str, float, float, int]] = []  # (kind, start, end, busy slots)


def timed(kind: str, method):
    def run(self, *args):
        t = time.perf_counter()
        out = jax.block_until_ready(method(self, *args))
        busy = int((np.asarray(args[3]) > 0).sum()) if kind == "decode" else 0
        CALLS.append((kind, t, time.perf_counter(), busy))
        return out
    return run


def summary(wall: float) -> dict:
    pre = [c for c in CALLS if c[0] == "prefill"]
    dec = [c for c in CALLS if c[0] == "decode"]
    prefill_end = max(c[2] for c in pre) - min(c[1] for c in CALLS)
    during = [c[2] - c[1] for c in dec if c[1] < max(c[2] for c in pre)]
    by_busy = collections.defaultdict(list)
    for c in dec:
        by_busy[c[3]].append(c[2] - c[1])
    return {"wall_s": wall, "prefill_busy_s": sum(c[2] - c[1] for c in pre),
            "prefill_calls": len(pre), "prefill_done_at_s": prefill_end,
            "decode_steps": len(dec), "decode_busy_s": sum(c[2] - c[1] for c in dec),
            "decode_steps_during_prefill": len(during),
            "decode_step_during_prefill_ms": 1e3 * float(np.median(during)) if during else None,
            "decode_by_busy_slots": {b: {"steps": len(v), "median_ms": 1e3 * float(np.median(v))}
                                     for b, v in sorted(by_busy.items())}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/serving_timeline.json")
    args = p.parse_args()
    PoolInstance.prefill_group = timed("prefill", PoolInstance.prefill_group)
    PoolInstance.decode = timed("decode", PoolInstance.decode)
    engines = {name: Engine.from_config(cfg) for name, cfg in serving_configs().items()}
    rng = np.random.default_rng(1)
    for e in engines.values():
        e.generate([rng.integers(3, 49152, SERVE_PROMPT).tolist()], SamplingParams(max_tokens=2))
    rows = {name: [] for name in engines}
    for r in range(args.rounds):  # fresh prompts each round; the order alternates
        prompts = [rng.integers(3, 49152, SERVE_PROMPT).tolist() for _ in range(SERVE_REQUESTS)]
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            CALLS.clear()
            wall, _ = serve_ours(engines[name], prompts)
            rows[name].append(s := summary(wall))
            print(f"{name:<14} wall {wall:5.2f} s  prefill busy {s['prefill_busy_s']:5.2f} s "
                  f"(done at {s['prefill_done_at_s']:5.2f})  decode steps {s['decode_steps']:4d}"
                  f" busy {s['decode_busy_s']:5.2f} s, {s['decode_steps_during_prefill']} during"
                  f" prefill at {s['decode_step_during_prefill_ms'] or 0:.1f} ms", flush=True)
            print("    steps by busy slots (count, median ms): " + ", ".join(
                f"{b}: {v['steps']}, {v['median_ms']:.1f}"
                for b, v in s["decode_by_busy_slots"].items()), flush=True)
    for e in engines.values():
        e.close()
    write_result(args.out, {
        "benchmark": "serving_timeline", "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.node(), "requests": SERVE_REQUESTS, "prompt": SERVE_PROMPT,
        "new": SERVE_NEW, "rounds": rows})


if __name__ == "__main__":
    main()
