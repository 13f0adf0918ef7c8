"""Where a CPU decode step's attention time goes, op by op, on SmolLM2's shapes.

    python benchmarks/attention_cpu.py [--repeats 50] [--rounds 3] [--no-step]
                                       [--out benchmarks/results/attention_cpu.json]

One layer's decode attention (9 query heads over 3 KV heads of 64, 16-token pages,
~528 keys a slot) at B=1 and B=8: the CPU kernel the `cpu` backend serves with
(`pallas/cpu_decode.cc`, one custom call), the jnp reference
(`pallas/reference.py: decode_attention_ref`, a dozen XLA ops), the reference's parts
timed alone as separate programs (the page gather, the QK^T product and the PV
product), and a copy of the same bytes (what the data alone would cost). It shows
whether attention is bound by bytes or by per-op costs. The kernel is also timed out of
cache, over ~600 MB of distinct layers' pools in one program, as a served step reads
its pages. All alternate over `--rounds`; each cell is the median of the rounds' medians.

Then the whole served decode step of the real SmolLM2 (fp32, 512 tokens of context a
slot) with each backend, alternating the two programs within every round, so the
step-level gain is a ratio measured in one run (`--no-step` skips it).
Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import median_seconds, shuffled_cache, write_result

from jaxdisagg.pallas.cpu import paged_decode_attention_cpu
from jaxdisagg.pallas.reference import decode_attention_ref, gather_pages

K, G, H, BS, PAGES = 3, 3, 64, 16, 33  # SmolLM2-135M: 9 heads over 3 KV heads


COLD = "cpu kernel, out of cache"
COLD_BYTES = 600_000_000


def cold_layers(q, pools, tables, lens, *, scale):
    """The kernel once per pool in turn, each layer's query depending on the last
    layer's output as in a model; the per-layer time is the program's / len(pools)."""
    x = q
    for k, v in pools:
        x = q + 1e-6 * paged_decode_attention_cpu(x, k, v, tables, lens, scale=scale)
    return x


def case(b: int, repeats: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    nb = b * PAGES + 1
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((nb, BS, K, H), np.float32))
                        for _ in range(2))
    tables = jnp.asarray(rng.permutation(nb)[:b * PAGES].reshape(b, PAGES).astype(np.int32))
    lens = jnp.full((b,), PAGES * BS, jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, K * G, H), np.float32))
    keys = gather_pages(k_pages, tables)  # [B, S, K, H]
    probs = jnp.asarray(rng.random((b, keys.shape[1], K, G), np.float32))
    qg = q.reshape(b, K, G, H)
    progs = {
        "cpu kernel (as served)": (jax.jit(lambda q, k, v, t, n: paged_decode_attention_cpu(
            q, k, v, t, n, scale=H ** -0.5)), (q, k_pages, v_pages, tables, lens)),
        "jnp reference": (jax.jit(lambda q, k, v, t, n: decode_attention_ref(
            q, k, v, t, n, scale=H ** -0.5)), (q, k_pages, v_pages, tables, lens)),
        "gather K": (jax.jit(gather_pages), (k_pages, tables)),
        "QK^T": (jax.jit(lambda q, k: jnp.einsum("BKGH,BSKH->BSKG", q, k)), (qg, keys)),
        "PV": (jax.jit(lambda p, v: jnp.einsum("BSKG,BSKH->BKGH", p, v)), (probs, keys)),
        "copy K+V bytes": (jax.jit(lambda k, v: (k + 1.0, v + 1.0)), (keys, keys)),
    }
    out = {"kv_bytes": 2 * keys.size * 4}
    # One program over many layers' pools, ~600 MB of K/V in all: a served step's pages
    # come from memory (its weights pass through the caches between two layers), where
    # one layer's pool called again and again stays in cache.
    layers = int(np.clip(COLD_BYTES // (2 * k_pages.nbytes), 30, 400))
    pools = [tuple(jnp.asarray(rng.standard_normal(k_pages.shape, np.float32))
                   for _ in range(2)) for _ in range(layers)]
    progs[COLD] = (jax.jit(functools.partial(cold_layers, scale=H ** -0.5)),
                   (q, pools, tables, lens))
    times = {name: [] for name in progs}
    for fn, args in progs.values():
        jax.block_until_ready(fn(*args))
    for _ in range(rounds):
        for name, (fn, args) in progs.items():
            times[name].append(median_seconds(
                lambda fn=fn, args=args: jax.block_until_ready(fn(*args)), repeats))
    times[COLD] = [t / layers for t in times[COLD]]
    out["cold_layers"] = layers
    out.update({name: float(np.median(t)) for name, t in times.items()})
    out["ranges"] = {name: [min(t), max(t)] for name, t in times.items()}
    macs = 2 * b * keys.shape[1] * K * G * H  # QK^T and PV
    out["macs"] = macs
    return out


def whole_step(repeats: int, rounds: int) -> dict:
    """SmolLM2's decode step, B=1 and B=8, served with the `cpu` and `reference`
    backends over the same pages, alternating; medians of each round's median."""
    from flax import nnx

    from jaxdisagg.model import jit_serving_fns
    from jaxdisagg.model.weights import load_model

    model, _ = load_model("smollm2")
    graphdef, state = nnx.split(model)
    fns = {b: jit_serving_fns(graphdef, backend=b) for b in ("cpu", "reference")}
    context = 512
    kv, tables, prompt, rng = shuffled_cache(model.config, context, BS, 1)
    for slot in range(8):  # every slot holds a real 512-token context
        _, kv[0] = fns["reference"].prefill(state, kv[0], prompt, jnp.int32(0),
                                            jnp.int32(context), jnp.asarray(tables[slot]))
    out = {}
    for b in (1, 8):
        tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, b), jnp.int32)
        pos = jnp.full((b,), context, jnp.int32)
        tab = jnp.asarray(tables[:b])

        def step(f, tokens=tokens, pos=pos, tab=tab):
            logits, kv[0] = f.decode(state, kv[0], tokens, pos, tab, pos + 1)
            return logits.block_until_ready()

        same = bool((np.asarray(step(fns["cpu"])).argmax(-1)
                     == np.asarray(step(fns["reference"])).argmax(-1)).all())
        times = {name: [] for name in fns}
        for r in range(rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                times[name].append(median_seconds(lambda f=fns[name]: step(f), repeats))
        ratios = [c / r for c, r in zip(times["cpu"], times["reference"], strict=True)]
        out[str(b)] = {"cpu_s": times["cpu"], "reference_s": times["reference"],
                       "ratios": ratios, "same_argmax": same}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-step", action="store_true", help="skip the whole-step comparison")
    p.add_argument("--out", default="benchmarks/results/attention_cpu.json")
    args = p.parse_args(argv)
    res = {b: case(b, args.repeats, args.rounds) for b in (1, 8)}
    print(f"\nSmolLM2 decode attention, one layer, {PAGES * BS} keys a slot "
          f"({platform.machine()}, {os.cpu_count()} cores)\n")
    names = [n for n in res[1] if n not in ("kv_bytes", "macs", "ranges")]
    print(f"{'':<24}" + "".join(f"{f'B={b} us':>12}" for b in res))
    for n in names:
        print(f"{n:<24}" + "".join(f"{res[b][n] * 1e6:>12.0f}" for b in res))
    for b, r in res.items():
        for name in ("cpu kernel (as served)", COLD, "jnp reference"):
            t, (lo, hi) = r[name], r["ranges"][name]
            print(f"B={b} {name}: {r['kv_bytes'] / 1e6:.1f} MB of K/V and "
                  f"{r['macs'] / 1e6:.1f} M multiply-adds in {t * 1e6:.0f} us "
                  f"[{lo * 1e6:.0f}-{hi * 1e6:.0f}] = {r['kv_bytes'] / t / 1e9:.1f} GB/s, "
                  f"{2 * r['macs'] / t / 1e9:.1f} GFLOP/s; x30 layers = {30 * t * 1e3:.1f} ms")
        ratio = r["jnp reference"] / r["cpu kernel (as served)"]
        print(f"B={b}: the kernel is {ratio:.1f}x faster than the reference")
    step = {} if args.no_step else whole_step(15, 2 * args.rounds)
    if step:
        print("\nSmolLM2 decode step, fp32, 512 tokens of context, ms: median [range] of "
              f"{2 * args.rounds} alternated rounds")
        for b, r in step.items():
            med = {k: float(np.median(r[k])) * 1e3 for k in ("cpu_s", "reference_s")}
            print(f"B={b}: cpu {med['cpu_s']:.1f} [{min(r['cpu_s']) * 1e3:.1f}-"
                  f"{max(r['cpu_s']) * 1e3:.1f}], reference {med['reference_s']:.1f} "
                  f"[{min(r['reference_s']) * 1e3:.1f}-{max(r['reference_s']) * 1e3:.1f}], "
                  f"cpu / reference {np.median(r['ratios']):.2f} [{min(r['ratios']):.2f}-"
                  f"{max(r['ratios']):.2f}], same argmax: {r['same_argmax']}")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.node(),
                            "cores": os.cpu_count(), "jax": jax.__version__,
                            "results": {str(b): r for b, r in res.items()},
                            "whole_step": step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
