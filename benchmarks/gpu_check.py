"""The GPU check of the Pallas kernels: correctness, launch-shape sweep, speed beside JAX's own.

Run on a GPU machine with `bash benchmarks/gpu_check.sh` (needs only this tree and an
installed jax with GPU support). Parts, each printed as it runs and saved to the JSON
as soon as it ends (`--resume` skips parts already saved, so a cut-short run goes on):

* `ceilings`: device copy bandwidth and bf16 matmul rate, measured here;
* `correctness`: both kernels in bf16 against the jnp references on every real model
  head layout (SmolLM2-135M, Llama-3.2-1B, Llama-2-7B, Llama-3-8B / Mistral-7B,
  Qwen2-1.5B, Qwen2.5-7B), per device at tp 1 and at the largest tp each allows;
* `sweep`: a few launch shapes per kernel on the main layouts; the fastest per layout
  goes into `jaxdisagg/pallas/tuned_blocks.json` (the kernels read it by device kind);
* `decode`: achieved GB/s of K/V read at Llama-3-8B's layout, B in {1, 32, 128} x
  context in {1k, 8k, 32k}, and at SmolLM2's and Qwen2.5-7B's, against the copy
  bandwidth and JAX's own `paged_attention` and `decode_attention.gqa`;
* `prefill`: a 2048-token chunk over prefixes {0, 8k, 32k}: TFLOP/s (causal FLOPs)
  against the matmul rate; at prefix 0 beside cuDNN (`jax.nn.dot_product_attention`)
  and JAX's Pallas flash attention;
* `splits`: the decode kernel with the split count forced, at batch 1 to 128 (last:
  the evidence behind the split heuristic, the first part a short run gives up).

`--smoke` runs the same code paths at toy shapes on CPU (interpret mode) so the script
itself is tested where no GPU is lent.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
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
from common import write_result  # noqa: E402

from jaxdisagg.pallas import blocks as blk  # noqa: E402
from jaxdisagg.pallas.decode import paged_decode_attention  # noqa: E402
from jaxdisagg.pallas.prefill import paged_prefill_attention  # noqa: E402
from jaxdisagg.pallas.reference import decode_attention_ref, prefill_attention_ref  # noqa: E402

BLOCK = 16
DTYPE = jnp.bfloat16
# Model -> (query heads, KV heads, head_dim, largest tp its KV heads allow).
MODELS = {"SmolLM2-135M": (9, 3, 64, 3), "Llama-3.2-1B": (32, 8, 64, 8),
          "Llama-2-7B": (32, 32, 128, 8), "Llama-3-8B": (32, 8, 128, 8),
          "Mistral-7B": (32, 8, 128, 8), "Qwen2-1.5B": (12, 2, 128, 2),
          "Qwen2.5-7B": (28, 4, 128, 4)}


def layouts() -> list[tuple[str, int, int, int]]:
    """(label, query heads, KV heads, head_dim) per device, at tp 1 and the largest tp."""
    out = []
    for name, (n, k, h, tp) in MODELS.items():
        out += [(f"{name} tp1", n, k, h), (f"{name} tp{tp}", n // tp, k // tp, h)]
    return out


def timed(fn, *args, repeats: int = 5, calls: int = 10) -> float:
    """Median seconds of one call: `calls` back-to-back calls per trial, so the launch of
    one overlaps the previous (as in a served step), after a compile-and-warm call."""
    jax.block_until_ready(fn(*args))
    trials = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        trials.append((time.perf_counter() - t0) / calls)
    return float(np.median(trials))


def ceilings(smoke: bool) -> dict:
    n = 1 << (20 if smoke else 30)  # 2 GiB of bf16 on a GPU
    x = jnp.ones((n,), DTYPE)
    copy_s = timed(jax.jit(lambda a: a * 2), x)
    m = 256 if smoke else 8192
    a = jax.random.normal(jax.random.key(0), (m, m), DTYPE)
    mm_s = timed(jax.jit(lambda a, b: a @ b), a, a)
    return {"copy_gbs": 2 * x.nbytes / copy_s / 1e9, "matmul_tflops": 2 * m ** 3 / mm_s / 1e12}


def paged_inputs(rng, batch, context, kv_heads, head_dim, dtype=DTYPE):
    pages = -(-context // BLOCK)
    num_blocks = batch * pages + 1
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    k = jax.random.normal(jax.random.key(rng.integers(1 << 30)), shape, dtype)
    v = jax.random.normal(jax.random.key(rng.integers(1 << 30)), shape, dtype)
    tables = jnp.asarray(rng.permutation(num_blocks)[:batch * pages].reshape(batch, pages),
                         jnp.int32)
    return k, v, tables


def _err(got, want) -> float:
    return float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())


def correctness(smoke: bool, interpret: bool) -> dict:
    rng = np.random.default_rng(0)
    batch, context, chunk, start = (3, 40, 16, 21) if smoke else (8, 2048, 256, 700)
    rows = []
    for label, n, kh, h in layouts()[:2] if smoke else layouts():
        k, v, tables = paged_inputs(rng, batch, context, kh, h)
        q = jnp.asarray(rng.standard_normal((batch, n, h)), DTYPE)
        lens = jnp.asarray(rng.integers(1, context + 1, batch), jnp.int32).at[0].set(0)
        scale = h ** -0.5
        got = paged_decode_attention(q, k, v, tables, lens, scale=scale, interpret=interpret)
        dec = _err(got, decode_attention_ref(q, k, v, tables, lens, scale=scale))
        qp = jnp.asarray(rng.standard_normal((chunk, n, h)), DTYPE)
        valid = chunk - 5  # a partly padded chunk, starting mid-block over a prefix
        args = (qp, k, v, tables[-1], jnp.int32(start), jnp.int32(valid))
        got = paged_prefill_attention(*args, scale=scale, interpret=interpret)
        pre = _err(got[:valid], prefill_attention_ref(*args, scale=scale)[:valid])
        rows.append({"layout": label, "decode_max_err": dec, "prefill_max_err": pre})
        print(f"  {label:<20} decode err {dec:.2e}  prefill err {pre:.2e}", flush=True)
    ok = all(r["decode_max_err"] <= 2e-2 and r["prefill_max_err"] <= 2e-2 for r in rows)
    return {"rows": rows, "ok": ok}


# The layouts swept (query heads, KV heads, head_dim): Llama-3-8B, SmolLM2, Llama-3.2-1B.
SWEEP_LAYOUTS = [(32, 8, 128), (9, 3, 64), (32, 8, 64)]


def _decode_candidates(smoke: bool):
    keys, warps, stages = ((16, 32), (4,), (2,)) if smoke else ((128, 256), (4, 8), (2, 3))
    return [blk.DecodeBlocks(keys_per_step=k, num_warps=w, num_stages=st)
            for k in keys for w in warps for st in stages]


def _prefill_candidates(smoke: bool):
    rows, keys, warps, stages = (((16, 32), (16,), (4,), (2,)) if smoke else
                                 ((64, 128), (64, 128), (4, 8), (2, 3)))
    return [blk.PrefillBlocks(block_rows=r, keys_per_step=k, num_warps=w, num_stages=st)
            for r in rows for k in keys for w in warps for st in stages]


def _best(kernel, key, candidates, call, rows) -> dict | None:
    """Times each candidate; appends the timings to rows; the fastest one's fields."""
    best = None
    for cand in candidates:
        try:
            s = timed(call, cand, repeats=3)
        except Exception as e:  # noqa: BLE001 - a shape the backend rejects
            print(f"  {kernel} {key} {cand}: {type(e).__name__}", flush=True)
            continue
        rows.append({"kernel": kernel, "key": key, **dataclasses.asdict(cand), "s": s})
        if best is None or s < best[1]:
            best = (cand, s)
    if best is None:
        return None
    chosen = {f: v for f, v in dataclasses.asdict(best[0]).items()
              if v is not None and f != "num_splits"}  # splits follow the batch, not a table
    print(f"  {kernel} {key}: best {chosen} at {best[1] * 1e6:.0f} us", flush=True)
    return chosen


def sweep(smoke: bool, interpret: bool, table_path: Path) -> dict:
    """Times a few launch shapes per layout; the fastest per layout goes into the table."""
    rng = np.random.default_rng(4)
    batch, context, chunk, prefix = (2, 64, 32, 32) if smoke else (32, 8192, 2048, 8192)
    kind = jax.devices()[0].device_kind
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    rows = []
    for n, kh, h in SWEEP_LAYOUTS[:1] if smoke else SWEEP_LAYOUTS:
        key = blk.table_key(kind, jnp.dtype(DTYPE).name, n // kh, h, BLOCK)
        k, v, tables = paged_inputs(rng, batch, max(context, prefix + chunk), kh, h)
        q = jnp.asarray(rng.standard_normal((batch, n, h)), DTYPE)
        lens = jnp.full((batch,), context, jnp.int32)
        qp = jnp.asarray(rng.standard_normal((chunk, n, h)), DTYPE)
        start, valid = jnp.int32(prefix), jnp.int32(chunk)
        found = {
            "decode": _best("decode", key, _decode_candidates(smoke), functools.partial(
                _decode_call, q, k, v, tables, lens, h ** -0.5, interpret), rows),
            "prefill": _best("prefill", key, _prefill_candidates(smoke), functools.partial(
                _prefill_call, qp, k, v, tables[0], start, valid, h ** -0.5, interpret), rows)}
        for kernel, chosen in found.items():
            if chosen:
                table.setdefault(kernel, {})[key] = chosen
    if not smoke:  # the table the kernels read on this device kind from now on
        table_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        blk._tuned.cache_clear()
    return {"rows": rows, "table": table}


def _decode_call(q, k, v, tables, lens, scale, interpret, blocks):
    return paged_decode_attention(q, k, v, tables, lens, scale=scale, interpret=interpret,
                                  blocks=blocks)


def _prefill_call(q, k, v, table, start, valid, scale, interpret, blocks):
    return paged_prefill_attention(q, k, v, table, start, valid, scale=scale,
                                   interpret=interpret, blocks=blocks)


def splits(smoke: bool, interpret: bool, ceil: dict) -> list[dict]:
    """The decode kernel at Llama-3-8B's layout with the split count forced: how many
    programs it takes to reach the bandwidth (the shape heuristic's TARGET_PROGRAMS)."""
    rng = np.random.default_rng(5)
    n, kh, h = 32, 8, 128
    shapes = [(1, 64), (2, 64)] if smoke else [(1, 8192), (1, 32768), (32, 8192), (32, 32768),
                                               (128, 8192)]
    counts = (1, 2) if smoke else (2, 4, 8, 16, 32, 64)
    rows = []
    for batch, context in shapes:
        k, v, tables = paged_inputs(rng, batch, context, kh, h)
        q = jnp.asarray(rng.standard_normal((batch, n, h)), DTYPE)
        lens = jnp.full((batch,), context, jnp.int32)
        kv_bytes = 2 * batch * context * kh * h * 2
        for count in (None, *counts):
            b = blk.DecodeBlocks(num_splits=count)
            s = timed(_decode_call, q, k, v, tables, lens, h ** -0.5, interpret, b)
            rows.append({"batch": batch, "context": context, "num_splits": count or "auto",
                         "gbs": kv_bytes / s / 1e9})
        print(f"  B={batch} ctx {context}: " + ", ".join(
            f"{r['num_splits']}: {r['gbs']:.0f}" for r in rows[-len(counts) - 1:]) + " GB/s",
              flush=True)
        del k, v, tables
    return rows


def jax_paged(q, k, v, tables, lens, interpret):
    from jax.experimental.pallas.ops.gpu import paged_attention

    kt, vt = k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)  # their [K, NB, bs, H] layout
    jax.block_until_ready((kt, vt))
    splits = 2 if interpret else 16  # their defaults; toy shapes need fewer splits
    per_block = max(1, min(8, tables.shape[1] // splits))
    fn = jax.jit(lambda q, kt, vt, t, s: paged_attention.paged_attention(
        q, kt, vt, t, s, k_splits=splits, pages_per_compute_block=per_block,
        interpret=interpret))
    return timed(fn, q, kt, vt, tables, lens)


def jax_gqa(q, k, v, tables, lens, interpret):
    from jax.experimental.pallas.ops.gpu import decode_attention

    # Its contiguous [B, S, K, H] layout, built outside the timed call.
    b, kh, h = tables.shape[0], k.shape[2], k.shape[3]
    kc, vc = k[tables].reshape(b, -1, kh, h), v[tables].reshape(b, -1, kh, h)
    jax.block_until_ready((kc, vc))
    splits = 2 if interpret else 16
    fn = jax.jit(lambda q, k, v, s: decode_attention.gqa(q, k, v, kv_seq_len=s, k_splits=splits,
                                                         interpret=interpret))
    return timed(fn, q, kc, vc, lens)


def decode_rows(smoke: bool, interpret: bool, ceil: dict) -> list[dict]:
    rng = np.random.default_rng(1)
    llama3, smol, qwen = (32, 8, 128), (9, 3, 64), (28, 4, 128)
    shapes = ([(llama3, 1, 64), (smol, 2, 128)] if smoke else
              [(llama3, b, c) for b in (1, 32, 128) for c in (1024, 8192, 32768)]
              + [(smol, 32, 4096), (qwen, 32, 8192)])
    rows = []
    for (n, kh, h), batch, context in shapes:
        ours = jax.jit(lambda q, k, v, t, s, h=h: paged_decode_attention(
            q, k, v, t, s, scale=h ** -0.5, interpret=interpret))
        impls = {"ours": lambda *a, ours=ours: timed(ours, *a),
                 "jax_paged": lambda *a: jax_paged(*a, interpret),
                 "jax_gqa": lambda *a: jax_gqa(*a, interpret)}
        k, v, tables = paged_inputs(rng, batch, context, kh, h)
        q = jnp.asarray(rng.standard_normal((batch, n, h)), DTYPE)
        lens = jnp.full((batch,), context, jnp.int32)
        kv_bytes = 2 * batch * context * kh * h * 2
        row = {"layout": f"{n}q{kh}kv{h}", "batch": batch, "context": context,
               "kv_bytes": kv_bytes}
        for name, fn in impls.items():
            try:
                s = fn(q, k, v, tables, lens)
                row[f"{name}_s"] = s
                row[f"{name}_gbs"] = kv_bytes / s / 1e9
            except Exception as e:  # noqa: BLE001 - recorded, the table goes on
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        if "ours_gbs" in row:
            row["ours_fraction_of_copy"] = row["ours_gbs"] / ceil["copy_gbs"]
        print("  " + _decode_line(row), flush=True)
        rows.append(row)
        del k, v, tables
    return rows


def _fmt(row, key, spec=".0f"):
    return format(row[key], spec) if key in row else "err"


def _decode_line(r) -> str:
    frac = f"{r['ours_fraction_of_copy']:.0%}" if "ours_fraction_of_copy" in r else "-"
    return (f"{r['layout']:>11}{r['batch']:>6}{r['context']:>8}{_fmt(r, 'ours_gbs'):>10}"
            f"{frac:>8}{_fmt(r, 'jax_paged_gbs'):>11}{_fmt(r, 'jax_gqa_gbs'):>9}")


def _reference_prefill(q, k, v, interpret, smoke):
    """cuDNN's and JAX's Pallas flash attention on the contiguous causal case."""
    from jax.experimental.pallas.ops.gpu import attention

    out = {}
    qb, kb, vb = q[None], k[None], v[None]  # [1, T, N, H]; K/V heads repeated to N
    if not interpret:
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"))
        try:
            out["cudnn_s"] = timed(fn, qb, kb, vb)
        except Exception as e:  # noqa: BLE001
            out["cudnn_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    block = attention.BlockSizes(block_q=16, block_k=16) if smoke else None
    kw = {"block_sizes": block} if block else {}
    fn = jax.jit(lambda q, k, v: attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5,
                                               causal=True, interpret=interpret, **kw))
    try:
        out["jax_flash_s"] = timed(fn, qb, kb, vb)
    except Exception as e:  # noqa: BLE001
        out["jax_flash_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def prefill_rows(smoke: bool, interpret: bool, ceil: dict) -> list[dict]:
    rng = np.random.default_rng(2)
    n, kh, h = 32, 8, 128
    chunk = 32 if smoke else 2048
    prefixes = (0, 32) if smoke else (0, 8192, 32768)
    fn = jax.jit(lambda q, k, v, t, s, c: paged_prefill_attention(
        q, k, v, t, s, c, scale=h ** -0.5, interpret=interpret))
    rows = []
    for prefix in prefixes:
        k, v, tables = paged_inputs(rng, 1, prefix + chunk, kh, h)
        q = jnp.asarray(rng.standard_normal((chunk, n, h)), DTYPE)
        s = timed(fn, q, k, v, tables[0], jnp.int32(prefix), jnp.int32(chunk))
        # QK and PV, each 2*H FLOPs per (query head, visible key): causal half of the chunk.
        flops = 4 * n * h * chunk * (prefix + (chunk + 1) / 2)
        row = {"chunk": chunk, "prefix": prefix, "s": s, "tflops": flops / s / 1e12,
               "fraction_of_matmul": flops / s / 1e12 / ceil["matmul_tflops"]}
        if prefix == 0:  # the contiguous causal case other kernels serve
            kc = jnp.repeat(k[tables[0]].reshape(-1, kh, h)[:chunk], n // kh, axis=1)
            vc = jnp.repeat(v[tables[0]].reshape(-1, kh, h)[:chunk], n // kh, axis=1)
            for name, t in _reference_prefill(q, kc, vc, interpret, smoke).items():
                row[name] = t
                if name.endswith("_s"):
                    row[name[:-2] + "_tflops"] = flops / t / 1e12
        print(f"  C={chunk} prefix {prefix}: {row['tflops']:.1f} TFLOP/s "
              f"({row['fraction_of_matmul']:.0%} of matmul)"
              + (f", cuDNN {_fmt(row, 'cudnn_tflops', '.1f')}, JAX flash "
                 f"{_fmt(row, 'jax_flash_tflops', '.1f')}" if prefix == 0 else ""), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="toy shapes, interpret mode (CPU)")
    p.add_argument("--out", default="benchmarks/results/gpu_check.json")
    p.add_argument("--resume", action="store_true", help="skip parts --out already holds")
    p.add_argument("--table", default=str(blk.TUNED_PATH),
                   help="the tuned launch-shape table the sweep updates")
    args = p.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    if not args.smoke and interpret:
        print("no GPU: run with --smoke to test the script on CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = Path(args.out)
    result = json.loads(out.read_text()) if args.resume and out.exists() else {}
    result |= {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M"), "smoke": args.smoke}
    parts = (("ceilings", lambda: ceilings(args.smoke)),
             ("correctness", lambda: correctness(args.smoke, interpret)),
             ("sweep", lambda: sweep(args.smoke, interpret, Path(args.table))),
             ("decode", lambda: decode_rows(args.smoke, interpret, result["ceilings"])),
             ("prefill", lambda: prefill_rows(args.smoke, interpret, result["ceilings"])),
             ("splits", lambda: splits(args.smoke, interpret, result["ceilings"])))
    print(f"{result['device']}, jax {result['jax']}", flush=True)
    print(f"{'layout':>11}{'B':>6}{'context':>8}{'ours GB/s':>10}{'% copy':>8}"
          f"{'jax paged':>11}{'jax gqa':>9}  (decode rows, as they come)", flush=True)
    for name, step in parts:
        if name in result and "error" not in result[name]:
            print(f"[{time.perf_counter() - t0:6.1f}s] {name}: kept from {out}", flush=True)
            continue
        print(f"[{time.perf_counter() - t0:6.1f}s] {name} ...", flush=True)
        try:
            result[name] = step()
        except Exception:  # noqa: BLE001 - keep what was measured
            result[name] = {"error": traceback.format_exc(limit=3)}
            print(result[name]["error"], flush=True)
        if name == "ceilings" and "copy_gbs" in result[name]:
            c = result[name]
            print(f"  copy {c['copy_gbs']:.0f} GB/s, bf16 matmul {c['matmul_tflops']:.0f} "
                  "TFLOP/s", flush=True)
        write_result(args.out, result)
    print("targets: decode >= 85% of copy bandwidth; prefill >= 60% of matmul rate; "
          "at or ahead of JAX's kernels on GQA shapes")
    print(f"done in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
