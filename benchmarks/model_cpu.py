"""Model step times on CPU against this machine's own ceilings, in one run.

A model (default: the `small` preset; `--model smollm2` for the real SmolLM2-135M,
`--dtype bfloat16` for bf16): a 512-token prefill chunk, and decode steps at B=1 and
B=8 with ~512 tokens of context per slot. Beside them, measured the same way in
the same process: the matmul rate (the prefill ceiling) and the weight-streaming
bandwidth of a large fp32 matrix-vector product (the decode ceiling). If
`transformers` is installed, HF on the same weights too.

    python benchmarks/model_cpu.py [--model small|smollm2|PATH] [--dtype float32|bfloat16]
                                   [--repeats 7] [--out benchmarks/results/model_cpu.json]

Prints a table and writes JSON. The machine is noisy: compare ratios within a run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import median_seconds, shuffled_cache, write_result
from flax import nnx

from jaxdisagg.model import jit_serving_fns
from jaxdisagg.model.weights import cast_model, load_model

CONTEXT = 512
BLOCK = 16


def ceilings(repeats: int) -> dict:
    """This machine's fp32 matmul rate and weight-streaming bandwidth, XLA and numpy."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 2048), np.float32)
    b = rng.standard_normal((2048, 2048), np.float32)
    w = rng.standard_normal((8192, 8192), np.float32)  # 256 MiB: far past every cache
    x = rng.standard_normal((8192,), np.float32)
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    dot = jax.jit(jnp.dot)
    ja, jb, jw, jx = map(jnp.asarray, (a, b, w, x))
    secs = lambda fn: median_seconds(fn, repeats)  # noqa: E731
    out = {
        "matmul_gflops_xla": flops / secs(lambda: dot(ja, jb).block_until_ready()) / 1e9,
        "matmul_gflops_numpy": flops / secs(lambda: a @ b) / 1e9,
        "stream_gbs_xla": w.nbytes / secs(lambda: dot(jw, jx).block_until_ready()) / 1e9,
        "stream_gbs_numpy": w.nbytes / secs(lambda: w @ x) / 1e9,
    }
    out["matmul_gflops"] = max(out["matmul_gflops_xla"], out["matmul_gflops_numpy"])
    out["stream_gbs"] = max(out["stream_gbs_xla"], out["stream_gbs_numpy"])
    return out


def model_costs(cfg, nbytes: int = 4) -> dict:
    """Bytes a decode step must stream and FLOPs a prefill chunk must do."""
    d, v = cfg.hidden_size, cfg.vocab_size
    layer_params = (cfg.num_params() - v * d * (1 if cfg.tie_word_embeddings else 2) - d)
    head_params = v * d
    t = CONTEXT
    attn_flops = cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * t * (t + 1) / 2
    return {
        # Every layer weight and the LM head; the embedding is read one row per token.
        "decode_weight_bytes": nbytes * (layer_params + head_params + d),
        "kv_bytes_per_token": cfg.kv_bytes_per_token(nbytes),
        # Layers for every token (causal attention counted once), LM head for the last.
        "prefill_flops": 2 * layer_params * t + attn_flops + 2 * head_params,
    }


def ours(model, repeats: int) -> dict:
    cfg = model.config
    graphdef, state = nnx.split(model)
    fns = jit_serving_fns(graphdef, backend="auto")  # as served
    kv, tables, prompt, rng = shuffled_cache(cfg, CONTEXT, BLOCK, 8)  # 8: decoded tokens

    def prefill(slot=0):
        logits, kv[0] = fns.prefill(state, kv[0], prompt, jnp.int32(0), jnp.int32(CONTEXT),
                                    jnp.asarray(tables[slot]))
        logits.block_until_ready()

    res = {"prefill_512_s": median_seconds(prefill, repeats)}
    for slot in range(8):  # fill every slot's cache with a real 512-token prefix
        prefill(slot)

    for b in (1, 8):
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, b), jnp.int32)
        pos = jnp.full((b,), CONTEXT, jnp.int32)
        lens = pos + 1
        tab = jnp.asarray(tables[:b])

        def step(tokens=tokens, pos=pos, tab=tab, lens=lens):
            logits, kv[0] = fns.decode(state, kv[0], tokens, pos, tab, lens)
            logits.block_until_ready()

        res[f"decode_b{b}_s"] = median_seconds(step, repeats * 3)
        res[f"decode_b{b}_ops"] = hlo_ops(fns.decode, state, kv[0], tokens, pos, tab, lens)
    res["prefill_512_ops"] = hlo_ops(fns.prefill, state, kv[0], prompt, jnp.int32(0),
                                     jnp.int32(CONTEXT), jnp.asarray(tables[0]))
    return res


def hlo_ops(fn, *args) -> dict:
    """Executable ops of the compiled program (what XLA:CPU dispatches one by one):
    fusions, dots and the rest, bitcasts and parameters not counted."""
    import collections
    import re

    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    ops = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"= \S+ ([\w-]+)\(", line)
        if m and m.group(1) not in ("parameter", "bitcast", "constant", "tuple",
                                    "get-tuple-element"):
            ops[m.group(1)] += 1
    return {"total": sum(ops.values()), **dict(ops.most_common(4))}


def hf(model, repeats: int) -> dict | None:
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError:
        return None
    from jaxdisagg.model.weights import save_hf_checkpoint

    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(model, d)
        hf_model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompt = torch.tensor(rng.integers(0, model.config.vocab_size, (1, CONTEXT)))
    new = 32
    with torch.no_grad():
        prefill = median_seconds(lambda: hf_model(prompt, use_cache=False), repeats)

        def gen(b):
            batch = prompt.repeat(b, 1)
            kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)  # no early stop
            full = median_seconds(lambda: hf_model.generate(batch, max_new_tokens=new, **kw), 2)
            first = median_seconds(lambda: hf_model.generate(batch, max_new_tokens=1, **kw), 2)
            return (full - first) / (new - 1)  # per decode step, prefill excluded

        return {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "prefill_512_s": prefill, "decode_b1_s": gen(1), "decode_b8_s": gen(8)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/model_cpu.json")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--model", default="small", help="preset, smollm2, or a checkpoint")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args(argv)

    model, _ = load_model(args.model, jnp.float32)
    cfg = model.config
    fp32 = model  # transformers runs fp32 on CPU either way
    model = cast_model(model, args.dtype)
    ceil = ceilings(args.repeats)
    cost = model_costs(cfg, jnp.dtype(args.dtype).itemsize)
    mine = ours(model, args.repeats)
    theirs = None if args.no_hf else hf(fp32, args.repeats)

    prefill_gflops = cost["prefill_flops"] / mine["prefill_512_s"] / 1e9
    rows = [
        ("matmul rate (fp32, max of XLA/numpy)", f"{ceil['matmul_gflops']:.0f} GFLOP/s", ""),
        ("weight streaming (fp32 matvec)", f"{ceil['stream_gbs']:.1f} GB/s", ""),
        ("prefill 512 tokens", f"{mine['prefill_512_s'] * 1e3:.1f} ms",
         f"{prefill_gflops:.0f} GFLOP/s = {prefill_gflops / ceil['matmul_gflops']:.0%} "
         "of matmul rate (target >= 55%)"),
    ]
    result = {"ceilings": ceil, "costs": cost, "ours": mine, "hf": theirs}
    for b in (1, 8):
        s = mine[f"decode_b{b}_s"]
        gbs = cost["decode_weight_bytes"] / s / 1e9
        result[f"decode_b{b}_weight_gbs"] = gbs
        total = cost["decode_weight_bytes"] + b * (CONTEXT + 1) * cost["kv_bytes_per_token"]
        result[f"decode_b{b}_total_gbs"] = total / s / 1e9
        ops = mine[f"decode_b{b}_ops"]
        rows.append((f"decode step B={b}, context {CONTEXT}", f"{s * 1e3:.2f} ms",
                     f"weights at {gbs:.1f} GB/s = {gbs / ceil['stream_gbs']:.0%} of streaming"
                     + (" (target >= 80%)" if b == 1 else "")
                     + f"; weights+KV at {total / s / 1e9:.1f} GB/s; {ops['total']} XLA ops "
                     f"({ops.get('fusion', 0)} fusions, {ops.get('dot', 0)} dots)"))
    ratio = mine["decode_b8_s"] / mine["decode_b1_s"]
    rows.append(("decode B=8 / B=1", f"{ratio:.2f}x", "target <= 1.5x"))
    result["decode_b8_over_b1"] = ratio
    result["prefill_fraction_of_matmul"] = prefill_gflops / ceil["matmul_gflops"]
    result["decode_b1_fraction_of_stream"] = result["decode_b1_weight_gbs"] / ceil["stream_gbs"]
    if theirs:
        for key, label in (("prefill_512_s", "prefill 512"), ("decode_b1_s", "decode B=1"),
                           ("decode_b8_s", "decode B=8")):
            rows.append((f"HF transformers {label}", f"{theirs[key] * 1e3:.2f} ms",
                         f"ours is {theirs[key] / mine[key]:.2f}x faster"))
    result["model"], result["dtype"] = cfg.name, args.dtype
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                         "python": sys.version.split()[0], "jax": jax.__version__,
                         "date": time.strftime("%Y-%m-%d %H:%M")}

    width = max(len(r[0]) for r in rows)
    print(f"{cfg.name} ({args.dtype}, {cfg.num_params() / 1e6:.1f}M params), "
          f"jax {jax.__version__}, "
          f"{os.cpu_count()} CPUs, median of {args.repeats}+ runs")
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>14}  {note}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
