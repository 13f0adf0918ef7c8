"""End to end on one GPU: step times against their floors, greedy tokens against the
CPU reference, and a two-process disaggregated deployment sharing the one GPU.

    python benchmarks/gpu_e2e.py steps|tokens|disagg [--smoke] [--out-dir DIR]

* `steps`: SmolLM2-135M's and Llama-3-8B's shapes (random weights) in bf16 through the
  served programs (Pallas kernels): a 512-token prefill chunk against the FLOP floor
  (FLOPs / measured bf16 matmul rate) and decode steps at B=1 and B=32 over 1024
  tokens of context against the bandwidth floor (weight + KV bytes / measured copy
  bandwidth), each through a pool instance as served, calls back to back.
* `tokens`: SmolLM2's shapes in fp32 (full-precision products): greedy tokens of the
  colocated engine on the GPU against the reference generator on the CPU, the same
  seed's weights.
* `disagg`: `jaxdisagg launch` of a cross-process config with both pools on GPU 0
  (each process with its own memory fraction, KV over `jax.experimental.transfer`),
  the same greedy requests through the gRPC client, tokens against `tokens`' reference.

Each part prints its rows as it goes and writes `gpu_e2e_<part>.json`. `--smoke` runs
the same paths at toy shapes on CPU (`steps` with interpret-mode kernels, the engines
with the CPU kernel), so a test keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import write_result  # noqa: E402

PROMPT_LENS, NEW_TOKENS = (5, 37, 100, 300), 24
SERVED = "auto"  # the engines' attention: the Pallas kernels on a GPU, the CPU kernel in --smoke


def _say(*parts) -> None:
    print(*parts, flush=True)


def steps(smoke: bool) -> dict:
    from gpu_check import ceilings

    ceil = ceilings(smoke)
    _say(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} "
         "TFLOP/s")
    backend = "pallas_interpret" if smoke else "pallas"
    context, batches, chunk = (32, (1, 2), 32) if smoke else (1024, (1, 32), 512)
    out = {"ceilings": ceil, "models": {}}
    for name in ("tiny",) if smoke else ("smollm2-135m", "llama3-8b"):
        out["models"][name] = _model_steps(name, backend, context, batches, chunk, ceil, smoke)
    return out


def _model_steps(name, backend, context, batches, chunk, ceil, smoke) -> dict:
    """A model's programs as a pool serves them (flat parameters, sampling on the
    device), timed as the serving loop runs them: calls back to back, so the host's
    dispatch of one overlaps the device's work on the previous."""
    from gpu_check import timed
    from model_cpu import model_costs

    from jaxdisagg.mesh.config import PoolConfig
    from jaxdisagg.mesh.pool import PoolInstance
    from jaxdisagg.model.sampling import row_params
    from jaxdisagg.model.weights import load_model

    model, _ = load_model(name, jnp.bfloat16)
    cfg = model.config
    cost = model_costs(cfg, 2)
    pages = context // 16 + 1
    rng = np.random.default_rng(0)
    row = {"params": cfg.num_params(), "prefill_tokens": chunk, "context": context}
    for b in batches:
        pool = PoolConfig(devices=[0], num_blocks=b * pages + 1, block_size=16,
                          chunk_size=chunk, max_slots=b, max_pages_per_request=pages)
        inst = PoolInstance(name, model, [0], pool, backend=backend)
        tables = rng.permutation(b * pages)[:b * pages].reshape(b, pages).astype(np.int32)
        if b == batches[0]:
            prompt = rng.integers(0, cfg.vocab_size, chunk).astype(np.int32)
            s = timed(inst.prefill, prompt, 0, chunk, tables[0])
            # model_costs counts a 512-token chunk's FLOPs (the chunk in real runs).
            flops = cost["prefill_flops"] * (chunk / 512 if smoke else 1)
            row |= {"prefill_s": s, "prefill_tflops": flops / s / 1e12,
                    "prefill_floor_s": flops / (ceil["matmul_tflops"] * 1e12)}
            _say(f"{name} prefill {chunk}: {s * 1e3:.2f} ms = {row['prefill_tflops']:.0f} "
                 f"TFLOP/s, floor {row['prefill_floor_s'] * 1e3:.2f} ms "
                 f"({row['prefill_floor_s'] / s:.0%} of the FLOP floor)")
        tokens = rng.integers(0, cfg.vocab_size, b).astype(np.int32)
        pos = np.full(b, context, np.int32)
        rows = row_params([None] * b, 0, cfg.vocab_size)
        s = timed(inst.decode, tokens, pos, tables, pos + 1, rows, calls=5 if smoke else 20)
        nbytes = cost["decode_weight_bytes"] + b * (context + 1) * cost["kv_bytes_per_token"]
        floor = nbytes / (ceil["copy_gbs"] * 1e9)
        row |= {f"decode_b{b}_s": s, f"decode_b{b}_floor_s": floor,
                f"decode_b{b}_gbs": nbytes / s / 1e9}
        _say(f"{name} decode B={b} ctx {context}: {s * 1e3:.3f} ms, floor "
             f"{floor * 1e3:.3f} ms ({floor / s:.0%} of the bandwidth floor)")
        del inst
    return row


def _prompts(vocab: int, smoke: bool) -> list[list[int]]:
    rng = np.random.default_rng(3)
    lens = (3, 9, 20) if smoke else PROMPT_LENS
    return [rng.integers(3, vocab, n).tolist() for n in lens]


def _model_name(smoke: bool) -> str:
    return "tiny" if smoke else "smollm2-135m"


def reference_tokens(smoke: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, greedy new tokens) of the reference generator on the CPU, fp32."""
    from jaxdisagg.model import ReferenceGenerator, SamplingParams
    from jaxdisagg.model.weights import load_model

    with jax.default_device(jax.devices("cpu")[0]):
        model, _ = load_model(_model_name(smoke), jnp.float32)
        prompts = _prompts(model.config.vocab_size, smoke)
        want = ReferenceGenerator(model).generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    return prompts, want


def _compare(got: list[list[int]], want: list[list[int]]) -> dict:
    same = [g == w for g, w in zip(got, want, strict=True)]
    first = [next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
             for g, w in zip(got, want, strict=True)]
    return {"requests_equal": sum(same), "requests": len(same), "first_divergence": first}


def tokens(smoke: bool) -> dict:
    from jaxdisagg.mesh.config import DeploymentConfig, ModelSpec, PoolConfig
    from jaxdisagg.model import SamplingParams
    from jaxdisagg.serve.engine import Engine

    jax.config.update("jax_default_matmul_precision", "highest")
    prompts, want = reference_tokens(smoke)
    cfg = DeploymentConfig(
        mode="colocated", model=ModelSpec(_model_name(smoke), "float32", SERVED),
        colocated=PoolConfig(devices=[0], num_blocks=128, block_size=16,
                             chunk_size=16 if smoke else 64, max_slots=4,
                             max_pages_per_request=8 if smoke else 32))
    # The same seed draws the same weights on the device (up to rounding in the normal
    # sampler; the logits then differ at ~1e-6, the margins of greedy choices are larger).
    engine = Engine.from_config(cfg)
    try:
        t0 = time.perf_counter()
        got = [r.token_ids for r in engine.generate(prompts,
                                                    SamplingParams(max_tokens=NEW_TOKENS))]
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    out = {"prompts": prompts, "reference": want, "colocated": got, "wall_s": wall,
           **_compare(got, want)}
    _say(f"colocated engine on {jax.devices()[0].device_kind} vs CPU reference (fp32): "
         f"{out['requests_equal']}/{out['requests']} requests token-equal, first divergence "
         f"{out['first_divergence']}")
    return out


def disagg(smoke: bool, out_dir: Path) -> dict:
    from jaxdisagg.cli import die_with_parent
    from jaxdisagg.serve.client import Client

    ref = out_dir / "gpu_e2e_tokens.json"
    if ref.exists():
        saved = json.loads(ref.read_text())
        prompts, want = saved["prompts"], saved["reference"]
    else:
        prompts, want = reference_tokens(smoke)
    config = f"""\
mode: disaggregated
model: {{name: {_model_name(smoke)}, dtype: float32, attention_backend: {SERVED}}}
prefill: {{devices: [0], chunk_size: {16 if smoke else 64}, num_blocks: 128, block_size: 16}}
decode: {{devices: [0], max_slots: 4, num_blocks: 128, block_size: 16,
          max_pages_per_request: {8 if smoke else 32}}}
transfer: {{kind: cross_process, layer_streaming: false}}
"""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           # full-precision fp32 products in both pool processes, as in `tokens`
           "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "one-gpu-2proc.yaml"
        path.write_text(config)
        t0 = time.perf_counter()
        # INFO: each pool logs its warm-up programs as they compile (a slow start shows
        # as progress); the launcher dies with this script, its pools with it.
        proc = subprocess.Popen([sys.executable, "-m", "jaxdisagg.cli", "--log-level", "INFO",
                                 "launch", "--config", str(path), "--port", "0"],
                                stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                                preexec_fn=die_with_parent)
        try:
            line = proc.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"launch did not start: {line!r} (exit {proc.wait()})")
            ready_s = time.perf_counter() - t0
            _say(f"two processes on one device ready in {ready_s:.0f} s: {line.strip()}")
            with Client(line.split()[1]) as client:
                results = [client.generate(p, max_tokens=NEW_TOKENS, temperature=0.0,
                                           timeout=300) for p in prompts]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    got = [r["token_ids"] for r in results]
    out = {"ready_s": ready_s, "disaggregated": got,
           "ttft_s": [r["timings"].ttft_s for r in results],
           "e2e_s": [r["timings"].e2e_s for r in results],
           "transfer_bytes": [r["timings"].transfer_bytes for r in results],
           # the server's own stages (seconds from arrival): where a slow TTFT went
           "timeline": [dict(r["timings"].timeline) for r in results],
           **_compare(got, want)}
    _say(f"two-process disaggregated vs CPU reference (fp32): {out['requests_equal']}/"
         f"{out['requests']} requests token-equal, first divergence {out['first_divergence']}; "
         f"TTFT {[round(t * 1e3) for t in out['ttft_s']]} ms, KV moved "
         f"{[b // 1024 for b in out['transfer_bytes']]} KiB")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("steps", "tokens", "disagg"))
    p.add_argument("--smoke", action="store_true", help="toy shapes on CPU (interpret mode)")
    p.add_argument("--out-dir", default="benchmarks/results")
    args = p.parse_args(argv)
    if not args.smoke and jax.default_backend() != "gpu":
        print("no GPU: run with --smoke to test the script on CPU", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    t0 = time.perf_counter()
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M"), "smoke": args.smoke}
    if args.part == "steps":
        result |= steps(args.smoke)
    elif args.part == "tokens":
        result |= tokens(args.smoke)
    else:
        result |= disagg(args.smoke, out_dir)
    write_result(str(out_dir / f"gpu_e2e_{args.part}.json"), result)
    _say(f"{args.part} done in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
