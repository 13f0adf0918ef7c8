"""When does the decode side get a prefilled request's KV, while the prefill process
computes the next requests? (`jaxdisagg launch`, cross-process pulls.)

    python benchmarks/pull_stall.py [--config configs/cpu-smollm2-2proc.yaml]
        [--prompt 500] [--requests 3] [--gap 0.3] [--rounds 2] [--tag NAME]

Sends `--requests` prompts of `--prompt` tokens, `--gap` s apart, so each one queues
behind the one before, and prints every request's marks from the server's own
timeline: its prefill's end, the router's receipt of its offer, the decode side's
start of its insert (the pull done). A pull that waits for
the prefill compute to pause shows as an insert right after the *next* request's
prefill end, however early the offer arrived. Each round uses fresh prompts (the
prefix cache would otherwise serve them). Marks are the router's, each shifted by its
request's sending time on the client (so within a few ms of one clock). The simulator
models what this measures (`Transfer.stalled_by_prefill`, and `Transfer.pull_hold_s`
for the engine's answer). Writes results/pull_stall_<date>[_<tag>].json, so a run
before a change and one after it are kept side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import disagg_vs_colocated as dv  # noqa: E402

from jaxdisagg import bench  # noqa: E402

MARKS = ("arrival", "prefill_start", "prefill_end", "transfer_start", "pull_start",
         "decode_insert")


def burst(target, prompts, gap: float, tokens: int = 2) -> list[dict]:
    """Each request's marks in ms from the first one's sending. A timeline counts from
    its own request's arrival, so it is shifted by the client's sending time."""
    recs = [bench.Record(len(p), 0.0) for p in prompts]
    sent, threads = [], []
    t0 = time.perf_counter()
    for p, rec in zip(prompts, recs, strict=True):
        sent.append(time.perf_counter() - t0)
        threads.append(threading.Thread(target=target.run_one, args=(p, tokens, rec)))
        threads[-1].start()
        time.sleep(gap)
    for t in threads:
        t.join()
    return [{k: (s + r.timeline[k] - r.timeline.get("arrival", 0.0)) * 1e3
             for k in MARKS if k in r.timeline} for s, r in zip(sent, recs, strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/cpu-smollm2-2proc.yaml")
    p.add_argument("--prompt", type=int, default=500)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--gap", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tag", default="", help="appended to the result file's name")
    args = p.parse_args()
    proc, address = dv.start("launch", "--config", str(dv.ROOT / args.config), "--port", "0")
    rounds = []
    try:
        target = bench.ServerTarget(address)
        rng = np.random.default_rng(0)

        def prompts(n):
            return [rng.integers(3, 250, args.prompt).tolist() for _ in range(n)]

        burst(target, prompts(1), 0.0)  # first pull: connections, compiles
        for k in range(args.rounds):
            rows = burst(target, prompts(args.requests), args.gap)
            rounds.append(rows)
            print(f"round {k}: ms from the first request's sending")
            print("  req  " + "  ".join(f"{m:>14}" for m in MARKS) + "  offer->insert")
            for i, row in enumerate(rows):
                wait = row.get("pull_start", np.nan) - row.get("transfer_start", np.nan)
                print(f"  {i:3d}  " + "  ".join(f"{row.get(m, np.nan):14.0f}" for m in MARKS)
                      + f"  {wait:13.0f}")
        target.client.close()
    finally:
        dv.stop(proc)
    tag = f"_{args.tag}" if args.tag else ""
    out = dv.RESULTS / f"pull_stall_{time.strftime('%Y-%m-%d')}{tag}.json"
    out.write_text(json.dumps({"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M"),
                               "rounds": rounds}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
