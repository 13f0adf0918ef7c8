"""The GPU check of the Pallas kernels: correctness, bandwidth, FLOP rate, and JAX's own kernels.

Run on a GPU machine with `bash benchmarks/gpu_check.sh` (needs only this tree and an
installed jax). On a 1-GPU H200 it is sized to finish in well under 8 minutes. It prints
one final table and writes JSON.

* ceilings measured in the same run: device copy bandwidth, bf16 matmul rate;
* correctness of both kernels against the jnp references in bf16;
* decode attention at Llama-3-8B shapes (32 q heads, 8 KV heads, head_dim 128) for
  B in {1, 32, 128} and context in {1k, 8k, 32k}: achieved GB/s of K/V read, against
  copy bandwidth, and JAX's own `paged_attention` and `decode_attention.gqa`;
* chunked-prefill attention, C=2048 over prefixes {0, 8k, 32k}: achieved TFLOP/s
  (causal FLOPs only) against the matmul rate.

`--smoke` runs the same code paths at toy shapes on CPU (interpret mode) so the script
itself is tested where no GPU is lent.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_seconds, write_result  # noqa: E402

from jaxdisagg.pallas.decode import paged_decode_attention  # noqa: E402
from jaxdisagg.pallas.prefill import paged_prefill_attention  # noqa: E402
from jaxdisagg.pallas.reference import decode_attention_ref, prefill_attention_ref  # noqa: E402

N_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = jnp.bfloat16


def timed(fn, *args, repeats=10):
    """Median seconds of a jitted call (after a compile-and-warm call)."""
    return median_seconds(lambda: jax.block_until_ready(fn(*args)), repeats)


def ceilings(smoke: bool) -> dict:
    n = 1 << (20 if smoke else 30)  # 2 GiB of bf16 on a GPU
    x = jnp.ones((n,), DTYPE)
    copy = jax.jit(lambda a: a * 2)
    copy_s = timed(copy, x)
    m = 256 if smoke else 8192
    a = jnp.ones((m, m), DTYPE)
    mm = jax.jit(lambda a, b: a @ b)
    mm_s = timed(mm, a, a)
    return {"copy_gbs": 2 * x.nbytes / copy_s / 1e9, "matmul_tflops": 2 * m ** 3 / mm_s / 1e12}


def paged_inputs(rng, batch, context, pages_per_seq=None):
    pages = pages_per_seq or -(-context // BLOCK)
    num_blocks = batch * pages + 1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k = jax.random.normal(jax.random.key(rng.integers(1 << 30)), shape, DTYPE)
    v = jax.random.normal(jax.random.key(rng.integers(1 << 30)), shape, DTYPE)
    tables = jnp.asarray(rng.permutation(num_blocks)[:batch * pages].reshape(batch, pages),
                         jnp.int32)
    return k, v, tables


def correctness(smoke: bool, interpret: bool) -> dict:
    rng = np.random.default_rng(0)
    batch, context = (3, 40) if smoke else (8, 2048)
    k, v, tables = paged_inputs(rng, batch, context)
    q = jnp.asarray(rng.standard_normal((batch, N_HEADS, HEAD_DIM)), DTYPE)
    lens = jnp.asarray(rng.integers(1, context + 1, batch), jnp.int32).at[0].set(0)
    scale = HEAD_DIM ** -0.5
    got = paged_decode_attention(q, k, v, tables, lens, scale=scale, interpret=interpret)
    want = decode_attention_ref(q, k, v, tables, lens, scale=scale)
    dec = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
    chunk, start = (16, 21) if smoke else (512, 1000)
    qp = jnp.asarray(rng.standard_normal((chunk, N_HEADS, HEAD_DIM)), DTYPE)
    kp, vp, table = paged_inputs(rng, 1, start + chunk)
    got = paged_prefill_attention(qp, kp, vp, table[0], start, chunk, scale=scale,
                                  interpret=interpret)
    want = prefill_attention_ref(qp, kp, vp, table[0], start, chunk, scale=scale)
    pre = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
    return {"decode_max_err": dec, "prefill_max_err": pre,
            "ok": dec <= 2e-2 and pre <= 2e-2 and not np.isnan([dec, pre]).any()}


def jax_paged(q, k, v, tables, lens, interpret):
    from jax.experimental.pallas.ops.gpu import paged_attention

    kt, vt = k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)  # their [K, NB, bs, H] layout
    jax.block_until_ready((kt, vt))
    splits = 2 if interpret else 16  # their defaults; toy shapes need fewer splits
    per_block = min(8, tables.shape[1] // splits)
    fn = jax.jit(lambda q, kt, vt, t, s: paged_attention.paged_attention(
        q, kt, vt, t, s, k_splits=splits, pages_per_compute_block=per_block,
        interpret=interpret))
    return timed(fn, q, kt, vt, tables, lens)


def jax_gqa(q, k, v, tables, lens, interpret):
    from jax.experimental.pallas.ops.gpu import decode_attention

    # Its contiguous [B, S, K, H] layout, built outside the timed call.
    kc = k[tables].reshape(tables.shape[0], -1, KV_HEADS, HEAD_DIM)
    vc = v[tables].reshape(tables.shape[0], -1, KV_HEADS, HEAD_DIM)
    jax.block_until_ready((kc, vc))
    splits = 2 if interpret else 16
    fn = jax.jit(lambda q, k, v, s: decode_attention.gqa(q, k, v, kv_seq_len=s, k_splits=splits,
                                                         interpret=interpret))
    return timed(fn, q, kc, vc, lens)


def decode_rows(smoke: bool, interpret: bool, ceil: dict) -> list[dict]:
    rng = np.random.default_rng(1)
    shapes = ([(1, 64), (2, 128)] if smoke else
              [(b, c) for b in (1, 32, 128) for c in (1024, 8192, 32768)])
    ours = jax.jit(lambda q, k, v, t, s: paged_decode_attention(
        q, k, v, t, s, scale=HEAD_DIM ** -0.5, interpret=interpret))
    impls = {"ours": lambda *a: timed(ours, *a, repeats=5),
             "jax_paged": lambda *a: jax_paged(*a, interpret),
             "jax_gqa": lambda *a: jax_gqa(*a, interpret)}
    rows = []
    for batch, context in shapes:
        k, v, tables = paged_inputs(rng, batch, context)
        q = jnp.asarray(rng.standard_normal((batch, N_HEADS, HEAD_DIM)), DTYPE)
        lens = jnp.full((batch,), context, jnp.int32)
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
        row = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
        for name, fn in impls.items():
            try:
                s = fn(q, k, v, tables, lens)
                row[f"{name}_s"] = s
                row[f"{name}_gbs"] = kv_bytes / s / 1e9
            except Exception as e:  # noqa: BLE001 - recorded, the table goes on
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        if "ours_gbs" in row:
            row["ours_fraction_of_copy"] = row["ours_gbs"] / ceil["copy_gbs"]
        rows.append(row)
    return rows


def prefill_rows(smoke: bool, interpret: bool, ceil: dict) -> list[dict]:
    rng = np.random.default_rng(2)
    chunk = 32 if smoke else 2048
    prefixes = (0, 32) if smoke else (0, 8192, 32768)
    fn = jax.jit(lambda q, k, v, t, s, n: paged_prefill_attention(
        q, k, v, t, s, n, scale=HEAD_DIM ** -0.5, interpret=interpret))
    rows = []
    for prefix in prefixes:
        k, v, tables = paged_inputs(rng, 1, prefix + chunk)
        q = jnp.asarray(rng.standard_normal((chunk, N_HEADS, HEAD_DIM)), DTYPE)
        s = timed(fn, q, k, v, tables[0], jnp.int32(prefix), jnp.int32(chunk), repeats=5)
        # QK and PV, each 2*H FLOPs per (query head, visible key): causal half of the chunk.
        flops = 4 * N_HEADS * HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
        rows.append({"chunk": chunk, "prefix": prefix, "s": s, "tflops": flops / s / 1e12,
                     "fraction_of_matmul": flops / s / 1e12 / ceil["matmul_tflops"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="toy shapes, interpret mode (CPU)")
    p.add_argument("--out", default="benchmarks/results/gpu_check.json")
    args = p.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    if not args.smoke and interpret:
        print("no GPU: run with --smoke to test the script on CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M"), "smoke": args.smoke}
    for name, step in (("ceilings", lambda: ceilings(args.smoke)),
                       ("correctness", lambda: correctness(args.smoke, interpret)),
                       ("decode", lambda: decode_rows(args.smoke, interpret, result["ceilings"])),
                       ("prefill", lambda: prefill_rows(args.smoke, interpret,
                                                        result["ceilings"]))):
        try:
            result[name] = step()
        except Exception:  # noqa: BLE001 - keep what was measured
            result[name] = {"error": traceback.format_exc(limit=3)}
        print(f"[{time.perf_counter() - t0:6.1f}s] {name} done", file=sys.stderr, flush=True)

    ceil, corr = result["ceilings"], result["correctness"]
    print(f"\n{result['device']}, jax {result['jax']}: copy {ceil.get('copy_gbs', 0):.0f} GB/s, "
          f"bf16 matmul {ceil.get('matmul_tflops', 0):.0f} TFLOP/s")
    print(f"correctness (bf16, max abs err vs jnp reference): {corr}")
    print(f"{'decode B':>9}{'context':>9}{'ours GB/s':>11}{'% copy':>8}{'jax paged':>11}"
          f"{'jax gqa':>9}")
    def fmt(row, key):
        return f"{row[key]:.0f}" if key in row else "err"

    for r in result["decode"] if isinstance(result["decode"], list) else []:
        frac = f"{r['ours_fraction_of_copy']:.0%}" if "ours_fraction_of_copy" in r else "-"
        print(f"{r['batch']:>9}{r['context']:>9}{fmt(r, 'ours_gbs'):>11}{frac:>8}"
              f"{fmt(r, 'jax_paged_gbs'):>11}{fmt(r, 'jax_gqa_gbs'):>9}")
    print(f"{'prefill C':>9}{'prefix':>9}{'TFLOP/s':>11}{'% matmul':>10}")
    for r in result["prefill"] if isinstance(result["prefill"], list) else []:
        print(f"{r['chunk']:>9}{r['prefix']:>9}{r['tflops']:>11.1f}"
              f"{r['fraction_of_matmul']:>10.0%}")
    print("targets: decode >= 85% of copy bandwidth; prefill >= 60% of matmul rate; "
          "faster than JAX's kernels on GQA shapes")
    write_result(args.out, result)
    print(f"done in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
