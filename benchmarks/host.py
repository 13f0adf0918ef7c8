"""What this host is, as a roofline: its processor, fp32 matmul rate and memory streaming.

    python benchmarks/host.py [--repeats 7] [--out benchmarks/results/host.json]

The development machine has changed processor four times in a week, and every CPU
figure in BENCHMARKS.md is only comparable with figures from the same host. Run this
first on a new one: it prints the processor (model name, family, caches, whether it has
AVX-512 and AMX), numpy's fp32 2048^3 matmul in GFLOP/s (the compute ceiling prefill
approaches), the rate at which one and two threads sum 538 MB of fp32 (SmolLM2's
weights) and at which OpenBLAS multiplies them by a vector (the ceiling a decode step
approaches). OPENBLAS_CORETYPE, where the environment sets it, holds for both.
Medians and ranges of `--repeats`. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time

import numpy as np
from common import write_result

WEIGHT_BYTES = 538_000_000  # SmolLM2-135M's fp32 weights, as a decode step streams them


def cpu_facts() -> dict:
    """The processor as /proc/cpuinfo and sysfs name it (Linux)."""
    facts = {"machine": platform.machine(), "cores": os.cpu_count()}
    try:
        info = open("/proc/cpuinfo").read().split("\n\n")[0]
    except OSError:
        return facts
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    facts.update({"model_name": fields.get("model name"), "vendor": fields.get("vendor_id"),
                  "family": fields.get("cpu family"), "model": fields.get("model"),
                  "avx512": "avx512f" in flags, "amx": "amx_tile" in flags})
    caches = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    for idx in sorted(os.listdir(base)) if os.path.isdir(base) else ():
        try:
            level = open(f"{base}/{idx}/level").read().strip()
            kind = open(f"{base}/{idx}/type").read().strip()
            size = open(f"{base}/{idx}/size").read().strip()
        except OSError:
            continue
        caches[f"L{level}{'' if kind == 'Unified' else kind[0].lower()}"] = size
    facts["caches"] = caches
    return facts


def timed(fn, repeats: int) -> list[float]:
    fn()  # first touch and warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def matmul_gflops(repeats: int) -> list[float]:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((2048, 2048), np.float32) for _ in range(2))
    return [2 * 2048 ** 3 / s / 1e9 for s in timed(lambda: a @ b, repeats)]


def sum_gbs(threads: int, repeats: int) -> list[float]:
    """`threads` threads each summing its share of 538 MB (numpy releases the GIL)."""
    x = np.ones(WEIGHT_BYTES // 4, np.float32)
    parts = np.array_split(x, threads)

    def run():
        ts = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return [WEIGHT_BYTES / s / 1e9 for s in timed(run, repeats)]


def matvec_gbs(repeats: int) -> list[float]:
    """OpenBLAS's fp32 matrix-vector product over 538 MB on all its threads: a decode
    step's weight streaming as a tuned library does it (a plain sum here is slower)."""
    w = np.ones((WEIGHT_BYTES // 4 // 576, 576), np.float32)
    v = np.ones(576, np.float32)
    return [WEIGHT_BYTES / s / 1e9 for s in timed(lambda: w @ v, repeats)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/host.json")
    args = p.parse_args(argv)
    facts = cpu_facts()
    rows = {"fp32 matmul 2048^3, GFLOP/s": matmul_gflops(args.repeats),
            "sum 538 MB, 1 thread, GB/s": sum_gbs(1, args.repeats)}
    if (facts["cores"] or 1) > 1:
        rows["sum 538 MB, 2 threads, GB/s"] = sum_gbs(2, args.repeats)
    rows["matrix-vector 538 MB, OpenBLAS, GB/s"] = matvec_gbs(args.repeats)
    print(f"{facts.get('model_name')} (family {facts.get('family')}, model "
          f"{facts.get('model')}), {facts['cores']} cores, AVX-512 {facts.get('avx512')}, "
          f"AMX {facts.get('amx')}, caches {facts.get('caches')}")
    print(f"\n| measure | median | range (of {args.repeats}) |\n|---|---|---|")
    for name, vals in rows.items():
        print(f"| {name} | {statistics.median(vals):.1f} | {min(vals):.1f}-{max(vals):.1f} |")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d %H:%M"), "host": facts,
                            "results": {k: {"median": statistics.median(v), "runs": v}
                                        for k, v in rows.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
