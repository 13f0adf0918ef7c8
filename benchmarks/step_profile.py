"""Where one served decode step's time goes on CPU, op by op, from XLA's own trace.

    python benchmarks/step_profile.py [--model smollm2] [--steps 5]
                                      [--out benchmarks/results/step_profile.json]

The decode step as served (`jit_serving_fns`, backend `auto`) at B=1 and B=8 over
512 tokens of context a slot, pages shuffled across the pool, run `--steps` times
under `jax.profiler`. The trace's complete events are grouped by kind: XLA:CPU's dot
thunks (`dot`, or `ynn_fusion` where it hands a dot to YNNPACK), our custom calls
(`ffi_call`: the CPU decode attention), the other fusions, and the host side of the
call (`PjitFunction`, argument parsing). Per-call figures come from the calls' order in the step
(each layer's fused q/k/v, attention, o, fused gate/up and down, then the LM head), where
the trace has exactly those.
Thunks may run concurrently, so kinds can sum to more than the step.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import shuffled_cache, write_result
from flax import nnx

from jaxdisagg.model import jit_serving_fns
from jaxdisagg.model.weights import load_model

CONTEXT, BLOCK = 512, 16
KINDS = ("dot", "ynn_fusion", "ffi_call", "fusion", "PjitFunction", "ParseArguments")
# A layer's calls in step order: at 1-16 slots on the `cpu` backend the products are
# custom calls too (`pallas/cpu_dense.cc`), else XLA's dots; attention is a custom call.
LAYER = ("qkv", "attention", "o", "gate_up", "down")


def trace_events(run, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                run()
        (path,) = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
        data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def kind_of(name: str) -> str | None:
    base = re.sub(r"[.\d]+$", "", name)
    if base in ("dot", "ynn_fusion", "ffi_call"):
        return base
    if base.startswith("PjitFunction") or base == "ParseArguments":
        return base.split("(")[0]
    if base.endswith("fusion") or base.startswith("wrapped_"):
        return "fusion"
    return None


def profile(fns, state, kv, tables, rng, vocab: int, b: int, steps: int,
            layers: int) -> dict:
    tokens = jnp.asarray(rng.integers(0, vocab, b), jnp.int32)
    pos = jnp.full((b,), CONTEXT, jnp.int32)
    tab = jnp.asarray(tables[:b])

    def run():
        logits, kv[0] = fns.decode(state, kv[0], tokens, pos, tab, pos + 1)
        logits.block_until_ready()

    for _ in range(3):
        run()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    wall = (time.perf_counter() - t0) / steps
    events = sorted(trace_events(run, steps), key=lambda e: e["ts"])
    per_kind = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if (k := kind_of(e["name"])) is not None:
            per_kind[k][0] += 1
            per_kind[k][1] += e.get("dur", 0) * 1e-6
    out = {"b": b, "step_s": wall,
           "kinds": {k: {"per_step": n / steps, "s_per_step": s / steps}
                     for k, (n, s) in per_kind.items()}}
    calls = [e for e in events if kind_of(e["name"]) in ("dot", "ynn_fusion", "ffi_call")]
    custom = [e for e in calls if kind_of(e["name"]) == "ffi_call"]
    per_layer = len(LAYER) * layers
    # A layer's five calls, then the LM head, either among all products or among the
    # custom calls alone (where XLA hands small fusions to YNNPACK as well).
    for group in (calls, custom):
        head = len(group) == (per_layer + 1) * steps
        if head or len(group) == per_layer * steps:
            shaped = np.array([e["dur"] for e in group]).reshape(steps, -1) * 1e-6
            out["calls_s"] = {name: float(np.median(shaped[:, j:per_layer:len(LAYER)]))
                              for j, name in enumerate(LAYER)}
            if head:
                out["calls_s"]["lm_head"] = float(np.median(shaped[:, -1]))
            break
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="preset, smollm2, or a checkpoint")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/step_profile.json")
    args = p.parse_args(argv)

    model, _ = load_model(args.model, jnp.float32)
    cfg = model.config
    graphdef, state = nnx.split(model)
    fns = jit_serving_fns(graphdef, backend="auto")
    kv, tables, prompt, rng = shuffled_cache(cfg, CONTEXT, BLOCK, 8)
    for slot in range(8):  # every slot holds a real 512-token prefix
        _, kv[0] = fns.prefill(state, kv[0], prompt, jnp.int32(0), jnp.int32(CONTEXT),
                               jnp.asarray(tables[slot]))
    result = {"model": args.model, "date": time.strftime("%Y-%m-%d %H:%M"),
              "steps": args.steps, "profiles": []}
    for b in (1, 8):
        prof = profile(fns, state, kv, tables, rng, cfg.vocab_size, b, args.steps,
                       cfg.num_layers)
        result["profiles"].append(prof)
        print(f"\ndecode step B={b}: {prof['step_s'] * 1e3:.1f} ms (untraced)")
        print("| kind | per step | ms per step | us each |\n|---|---|---|---|")
        for k in KINDS:
            if k in prof["kinds"]:
                v = prof["kinds"][k]
                print(f"| {k} | {v['per_step']:.0f} | {v['s_per_step'] * 1e3:.2f} | "
                      f"{v['s_per_step'] / v['per_step'] * 1e6:.0f} |")
        if "calls_s" in prof:
            print("per call, median us: " + ", ".join(
                f"{n} {s * 1e6:.0f}" for n, s in prof["calls_s"].items()))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
