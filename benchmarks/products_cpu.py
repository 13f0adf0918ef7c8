"""The decode step with the CPU small-batch product kernel against XLA's products.

The same model's decode step (`decode_step`, backend `auto`, as served) compiled twice
in one process: once with the layer products through `pallas/cpu_dense.cc` (what the
`cpu` backend does at 1-16 slots), once through XLA's einsum. Rounds alternate the two
programs; each round's time is a median of `--repeats` steps. Context ~512 tokens a
slot over shuffled block tables, as `model_cpu.py`.

    python benchmarks/products_cpu.py [--model smollm2|PRESET|PATH] [--batches 1 2 4 8]
                                      [--rounds 8] [--repeats 7]
                                      [--baseline xla|layers|head]
                                      [--out benchmarks/results/products_cpu.json]

`--baseline layers` compares against the layers' kernel with XLA's LM head instead,
which isolates the tied-head kernel; `--baseline head` against the head's kernel with
XLA's layer products, which isolates the layers' kernel.

Prints kernel / XLA step-time ratios (median and range over rounds) and whether the
two programs' greedy tokens agree; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import shuffled_cache, write_result
from flax import nnx

from jaxdisagg.model import jit_serving_fns, paged
from jaxdisagg.model.llama import TIED_HEAD, xla_product
from jaxdisagg.model.weights import load_model

CONTEXT, BLOCK = 512, 16


def compiled_pair(graphdef):
    """Two jitted decode steps; which products each uses is fixed when it is traced."""
    def jit():
        return jax.jit(functools.partial(paged.decode_step, graphdef, backend="auto"),
                       donate_argnums=(1,))
    return {"kernel": jit(), "xla": jit()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--baseline", choices=("xla", "layers", "head"), default="xla")
    p.add_argument("--out", default="benchmarks/results/products_cpu.json")
    args = p.parse_args()

    model, _ = load_model(args.model, jnp.float32)
    cfg = model.config
    graphdef, state = nnx.split(model)
    prefill = jit_serving_fns(graphdef, backend="auto").prefill
    kv, tables, prompt, rng = shuffled_cache(cfg, CONTEXT, BLOCK, 8, max(8, *args.batches))
    for slot in range(len(tables)):  # every slot's cache holds a real 512-token prefix
        _, kv[0] = prefill(state, kv[0], prompt, jnp.int32(0), jnp.int32(CONTEXT),
                           jnp.asarray(tables[slot]))
    chosen = paged.step_product

    def layers_only(backend, mesh):
        kernel = chosen(backend, mesh)
        return lambda spec, x, w: (xla_product if spec == TIED_HEAD else kernel)(spec, x, w)

    def head_only(backend, mesh):
        kernel = chosen(backend, mesh)
        return lambda spec, x, w: (kernel if spec == TIED_HEAD else xla_product)(spec, x, w)

    baseline = {"layers": layers_only, "head": head_only}.get(args.baseline,
                                                             lambda *_: xla_product)
    # what the baseline is called in the table ("xla" in the JSON)
    label = {"layers": "XLA head", "head": "XLA layers"}.get(args.baseline, "XLA")
    fns = compiled_pair(graphdef)
    rows = []
    for b in args.batches:
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, b), jnp.int32)
        pos = jnp.full((b,), CONTEXT, jnp.int32)
        step_args = (tokens, pos, jnp.asarray(tables[:b]), pos + 1)
        logits = {}
        for name, fn in fns.items():  # traced for this shape under its choice of products
            paged.step_product = chosen if name == "kernel" else baseline
            try:
                out, kv[0] = fn(state, kv[0], *step_args)
            finally:
                paged.step_product = chosen
            logits[name] = np.asarray(out)
        times = {name: [] for name in fns}
        for r in range(args.rounds):
            for name in (("kernel", "xla") if r % 2 == 0 else ("xla", "kernel")):
                ts = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    out, kv[0] = fns[name](state, kv[0], *step_args)
                    out.block_until_ready()
                    ts.append(time.perf_counter() - t0)
                times[name].append(float(np.median(ts)))
        ratio = np.array(times["kernel"]) / np.array(times["xla"])
        row = {"batch": b, "kernel_s": times["kernel"], "xla_s": times["xla"],
               "ratio_median": float(np.median(ratio)), "ratio_min": float(ratio.min()),
               "ratio_max": float(ratio.max()),
               "same_greedy": bool((logits["kernel"].argmax(-1)
                                    == logits["xla"].argmax(-1)).all()),
               "max_abs_logit_diff": float(np.abs(logits["kernel"] - logits["xla"]).max())}
        rows.append(row)
        print(f"B={b}: {label} {np.median(times['xla']) * 1e3:6.1f} ms, kernel "
              f"{np.median(times['kernel']) * 1e3:6.1f} ms; kernel/{label} "
              f"{row['ratio_median']:.2f} [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}] "
              f"over {args.rounds} rounds; same greedy {row['same_greedy']}, max |dlogit| "
              f"{row['max_abs_logit_diff']:.1e}", flush=True)
    write_result(args.out, {
        "benchmark": "products_cpu", "model": args.model, "context": CONTEXT,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
        "machine": platform.processor() or platform.machine(), "cpus": jax.device_count(),
        "rounds": args.rounds, "repeats": args.repeats, "baseline": args.baseline,
        "rows": rows})


if __name__ == "__main__":
    main()
