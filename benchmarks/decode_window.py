"""The decode batching window's wait against throughput and inter-token gaps.

    python benchmarks/decode_window.py [--waits 0,0.05,0.1,0.2,0.5] [--rounds 3]

peers.py's serving workload (SmolLM2 fp32, 16 prompts of 256 tokens, 64 new tokens
each, all submitted at once, new prompts every round) through the in-process
disaggregated engine once per `decode_wait_s` (with `decode_min_batch` 16; wait 0 is
the window off), beside the colocated engine and llama.cpp batched (all-fp32, one KV
stream per sequence). The systems alternate within a round and the order rotates.

The window trades each stream's gaps for throughput: while prefill is feeding decode
its rows, a held decode step leaves both cores to prefill. The question is the
shortest wait that buys the throughput, so the table gives the TBT p50 and p99 beside
tokens/s and the ratio to llama.cpp batched (paired within a round). Writes
benchmarks/results/decode_window.json.
"""

import os

# Exactly the host devices it uses: XLA:CPU sizes its thread pool to max(cores, devices).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import spread, write_result  # noqa: E402
from peers import (  # noqa: E402
    SERVE_NEW,
    SERVE_PROMPT,
    SERVE_REQUESTS,
    LlamaCpp,
    LlamaCppBatched,
    fmt,
    ggufs,
    serve_ours,
    serving_configs,
)

from jaxdisagg.model import SamplingParams  # noqa: E402
from jaxdisagg.serve.engine import Engine  # noqa: E402


def configs(waits):
    base = serving_configs()
    disagg = base["disaggregated"]
    out = {}
    for w in waits:
        decode = dataclasses.replace(disagg.decode, decode_wait_s=w,
                                     decode_min_batch=SERVE_REQUESTS if w > 0 else 1)
        out[f"disaggregated, wait {w:g} s"] = dataclasses.replace(disagg, decode=decode)
    out["colocated"] = base["colocated"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--waits", default="0,0.05,0.1,0.2,0.5",
                   help="decode_wait_s values, comma-separated (0: the window off)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/decode_window.json")
    args = p.parse_args(argv)
    waits = [float(w) for w in args.waits.split(",")]

    _, f32 = ggufs()
    batched = LlamaCppBatched(LlamaCpp(f32, fp32=True))
    engines = {name: Engine.from_config(cfg) for name, cfg in configs(waits).items()}
    rng = np.random.default_rng(2)
    warm, *round_prompts = ([rng.integers(3, 49152, SERVE_PROMPT).tolist()
                             for _ in range(SERVE_REQUESTS)] for _ in range(args.rounds + 1))
    for e in engines.values():
        e.generate([warm[0]], SamplingParams(max_tokens=2))  # first calls, excluded

    names = ["llama.cpp batched", *engines]
    rounds = []
    for r, prompts in enumerate(round_prompts):
        row = {}
        for name in names[r % len(names):] + names[:r % len(names)]:  # the order rotates
            if name == "llama.cpp batched":
                row[name] = {"serve": batched.serve(prompts), "tbt": None}
            else:
                served, gaps = serve_ours(engines[name], prompts)
                row[name] = {"serve": served, "tbt": gaps}
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for e in engines.values():
        e.close()
    batched.close()

    total = SERVE_REQUESTS * SERVE_NEW
    print(f"\nSmolLM2 fp32, {SERVE_REQUESTS} x {SERVE_PROMPT}-token prompts x {SERVE_NEW} new "
          f"tokens, {args.rounds} rounds, median [range]; ratio = ours / llama.cpp batched "
          "throughput within a round (> 1: ours faster)\n")
    print(f"{'system':<28}{'tok/s':>20}{'ratio':>20}{'TBT p50 ms':>20}{'TBT p99 ms':>22}"
          f"{'same tokens':>13}")
    table = {}
    for name in names:
        walls = [rd[name]["serve"][0] for rd in rounds]
        ref = [rd["llama.cpp batched"]["serve"] for rd in rounds]
        entry = {"tokens_per_s": spread([total / w for w in walls])}
        line = f"{name:<28}{fmt(entry['tokens_per_s']):>20}"
        if name != "llama.cpp batched":
            entry["ratio"] = spread([lw / w for w, (lw, _) in zip(walls, ref, strict=True)])
            entry["same_tokens"] = statistics.fmean(
                float(a == b) for rd, (_, lt) in zip(rounds, ref, strict=True)
                for a, b in zip(rd[name]["serve"][1], lt, strict=True))
            entry["tbt_ms"] = {f"p{q}": spread([1e3 * float(np.percentile(rd[name]["tbt"], q))
                                                for rd in rounds]) for q in (50, 99)}
            line += (f"{fmt(entry['ratio']):>20}{fmt(entry['tbt_ms']['p50']):>20}"
                     f"{fmt(entry['tbt_ms']['p99']):>22}{entry['same_tokens']:>13.2f}")
        table[name] = entry
        print(line)
    write_result(args.out, {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.node(),
        "cores": os.cpu_count(), "args": vars(args), "systems": table,
        "rounds_s": [{n: rd[n]["serve"][0] for n in rd} for rd in rounds]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
