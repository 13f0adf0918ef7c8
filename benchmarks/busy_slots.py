"""Inter-token gap by the number of busy decode slots, through the engine.

    python benchmarks/busy_slots.py [--model smollm2] [--slots 8] [--busy 1 2 4 8]
                                    [--rounds 3] [--out benchmarks/results/busy_slots.json]

One colocated instance on one CPU device (`--slots` decode slots, fp32) serves `n`
requests of 256-token prompts at once, each generating 48 tokens, for every `n` of
`--busy`; the rounds alternate the `n`s. A request's gaps after its 8th token are
taken (the batch's prompts are prefilled by then), and the median over the batch is
the round's figure. A decode step runs only the busy slots, padded to a compiled batch
size (`max_slots` and its halves), so the gap grows with `n`; before 2026-12-02 every
step ran all slots, and one busy slot paid the full batch's step. Prints the median
and range over rounds of each `n`'s gap and of its ratio to the full batch's, and
writes JSON.
"""

import os

# Exactly the host device it uses: XLA:CPU sizes its thread pool to max(cores, devices).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402

import numpy as np  # noqa: E402
from common import spread, write_result  # noqa: E402

from jaxdisagg.mesh.config import DeploymentConfig, ModelSpec, PoolConfig  # noqa: E402
from jaxdisagg.model import SamplingParams  # noqa: E402
from jaxdisagg.serve.engine import Engine  # noqa: E402

PROMPT, NEW, SKIP, BS = 256, 48, 8, 16


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--busy", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/busy_slots.json")
    args = p.parse_args(argv)

    pages = -(-(PROMPT + NEW) // BS) + 1
    pool = PoolConfig(devices=[0], tp=1, block_size=BS, num_blocks=args.slots * pages + 8,
                      max_slots=args.slots, chunk_size=PROMPT, max_pages_per_request=pages)
    engine = Engine.from_config(DeploymentConfig(
        mode="colocated", model=ModelSpec(args.model, "float32"), colocated=pool))
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    gaps: dict[int, list[float]] = {n: [] for n in args.busy}
    try:
        engine.generate([rng.integers(3, vocab, PROMPT).tolist()], SamplingParams(max_tokens=2))
        for r in range(args.rounds):
            order = args.busy if r % 2 == 0 else args.busy[::-1]
            for n in order:  # fresh prompts every time: no prefix-cache hits
                prompts = [rng.integers(3, vocab, PROMPT).tolist() for _ in range(n)]
                ids = [engine.submit(q, SamplingParams(max_tokens=NEW), stop_token_ids=[])
                       for q in prompts]
                results = [engine.result(i) for i in ids]
                gaps[n].append(statistics.median(t for res in results for t in res.tbt_s[SKIP:]))
    finally:
        engine.close()
    full = max(args.busy)
    rows = {n: {"gap_s": spread(gaps[n]),
                "vs_full": spread([a / b for a, b in zip(gaps[n], gaps[full], strict=True)])}
            for n in args.busy}
    print(f"\n{args.model} fp32, {args.slots} slots, {args.rounds} rounds, median [range]\n")
    print(f"{'busy':>5}{'gap ms':>26}{f'/ {full} busy':>24}")
    for n, row in rows.items():
        g, v = row["gap_s"], row["vs_full"]
        print(f"{n:>5}{g['median'] * 1e3:>12.1f} [{g['min'] * 1e3:.1f}-{g['max'] * 1e3:.1f}]"
              f"{v['median']:>12.2f} [{v['min']:.2f}-{v['max']:.2f}]")
    write_result(args.out, {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "args": vars(args), "busy": {str(n): row for n, row in rows.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
