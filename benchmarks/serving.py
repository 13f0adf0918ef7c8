"""Serving throughput and latency: both engines, and HF transformers' continuous batching.

    python benchmarks/serving.py [--requests 32 --prompt 512 --new 64 --model small]

Every request arrives at once (after one warm-up request per engine, excluded). Each
engine runs on two CPU devices: disaggregated = prefill tp1 on device 0 + decode tp1
(32 slots) on device 1; colocated = two tp1 instances (16 slots each) on devices 0 and 1.
HF `generate_batch` (transformers' continuous batching) runs the same prompts on the
same weights, written as an HF checkpoint, in the same process. Every request generates
exactly `--new` tokens (no stop tokens), so token counts are equal. Prints a table and
writes benchmarks/results/serving.json.
"""

import os

# Exactly the host devices it uses: XLA:CPU sizes its thread pool to max(cores, devices).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import write_result  # noqa: E402

from jaxdisagg.mesh.config import (  # noqa: E402
    DeploymentConfig,
    ModelSpec,
    PoolConfig,
    TransferConfig,
)
from jaxdisagg.model import SamplingParams  # noqa: E402
from jaxdisagg.serve.engine import Engine  # noqa: E402


def configs(preset: str, prompt: int, new: int, requests: int) -> dict[str, DeploymentConfig]:
    bs = 16
    pages = -(-(prompt + new) // bs)
    blocks = requests * pages + 64
    model = ModelSpec(preset, "float32")
    pool = PoolConfig(tp=1, block_size=bs, num_blocks=blocks, chunk_size=256,
                      max_pages_per_request=pages)
    return {
        "disaggregated": DeploymentConfig(
            mode="disaggregated", model=model,
            prefill=dataclasses.replace(pool, devices=[0], max_slots=1),
            decode=dataclasses.replace(pool, devices=[1], max_slots=requests),
            transfer=TransferConfig(layer_streaming=True, layer_group_size=2)),
        "colocated": DeploymentConfig(
            mode="colocated", model=model,
            colocated=dataclasses.replace(pool, devices=[0, 1], instances=2,
                                          max_slots=requests // 2)),
    }


def work_flops(preset: str, prompt: int, new: int, requests: int) -> float:
    """The FLOPs the workload needs at the least: every layer for every prompt and
    generated token (causal attention once), the LM head for every generated token."""
    from jaxdisagg.model import get_preset

    cfg = get_preset(preset)
    d, v = cfg.hidden_size, cfg.vocab_size
    layer = cfg.num_params() - v * d * (1 if cfg.tie_word_embeddings else 2) - d
    total = prompt + new
    attn = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * total * (total + 1) / 2
    return requests * (2 * layer * total + attn + 2 * v * d * new)


def percentiles(values, prefix) -> dict:
    values = sorted(values)
    out = {}
    for q in (50, 90, 99):
        out[f"{prefix}_p{q}_ms"] = (1e3 * values[min(len(values) - 1, int(q / 100 * len(values)))]
                                    if values else None)
    return out


def run_engine(cfg: DeploymentConfig, prompts, new: int) -> tuple[dict, list[list[int]]]:
    t0 = time.perf_counter()
    engine = Engine.from_config(cfg, progress=True)
    build_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=new)
    with engine:
        # First calls, excluded; a prompt of its own, so no measured one is cached.
        engine.generate([prompts[0][::-1]], SamplingParams(max_tokens=2))
        t0 = time.perf_counter()
        ids = [engine.submit(p, params, stop_token_ids=[]) for p in prompts]
        results = [engine.result(rid) for rid in ids]
        wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    row = {"build_s": build_s, "wall_s": wall, "generated_tokens": tokens,
           "tokens_per_s": tokens / wall,
           **percentiles([r.ttft_s for r in results], "ttft"),
           **percentiles([t for r in results for t in r.tbt_s], "tbt"),
           **percentiles([r.e2e_s for r in results], "e2e"),
           "transfer_bytes": sum(r.transfer_bytes for r in results)}
    return row, [r.token_ids for r in results]


def run_hf(preset: str, prompts, new: int) -> tuple[dict | None, list[list[int]] | None]:
    try:
        import torch
        import transformers
        from transformers import GenerationConfig, LlamaForCausalLM
    except ImportError:
        return None, None
    from jaxdisagg.model.weights import load_model, save_hf_checkpoint

    model, _ = load_model(preset, "float32", seed=0)  # the same weights as the engines'
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(model, d)
        hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    hf.generate_batch([prompts[0][::-1]], generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0))
    t0 = time.perf_counter()
    out = hf.generate_batch(prompts, generation_config=gen, record_timestamps=True)
    wall = time.perf_counter() - t0
    outs = sorted(out.values(), key=lambda o: int(str(o.request_id).split("_")[-1]))
    tokens = sum(len(o.generated_tokens) for o in outs)
    ttft, tbt = [], []
    for o in outs:
        if o.timestamps:
            ttft.append(o.timestamps[0] - o.created_time)
            tbt += list(np.diff(o.timestamps))
    row = {"transformers": transformers.__version__, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "wall_s": wall, "generated_tokens": tokens,
           "tokens_per_s": tokens / wall, **percentiles(ttft, "ttft"),
           **percentiles(tbt, "tbt")}
    return row, [list(o.generated_tokens) for o in outs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", "--preset", dest="preset", default="small",
                   help="a preset, smollm2, a .gguf file or a checkpoint directory")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--out", default="benchmarks/results/serving.json")
    args = p.parse_args(argv)

    cfgs = configs(args.preset, args.prompt, args.new, args.requests)
    vocab = 256 if args.preset == "tiny" else 32000  # ids every model here knows
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt).tolist() for _ in range(args.requests)]
    rows, tokens = {}, {}
    for name, cfg in cfgs.items():
        rows[name], tokens[name] = run_engine(cfg, prompts, args.new)
        print(f"{name}: {rows[name]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    if not args.no_hf:
        hf_row, hf_tokens = run_hf(args.preset, prompts, args.new)
        if hf_row is not None:
            rows["hf_generate_batch"], tokens["hf_generate_batch"] = hf_row, hf_tokens

    from model_cpu import ceilings

    rate = ceilings(3)["matmul_gflops"] * 1e9
    floor_s = work_flops(args.preset, args.prompt, args.new, args.requests) / rate
    ceiling_tps = args.requests * args.new / floor_s
    base = tokens["disaggregated"]
    agreement = {name: statistics.fmean(
        float(a == b) for a, b in zip(base, toks, strict=True)) for name, toks in tokens.items()}
    hf_tps = rows.get("hf_generate_batch", {}).get("tokens_per_s")
    print(f"\n{args.requests} requests x {args.prompt}-token prompts x {args.new} new tokens, "
          f"preset {args.preset} fp32, all arriving at once ({platform.machine()}, "
          f"{os.cpu_count()} cores)\n")
    cols = ["tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p99_ms",
            "wall_s"]
    print(f"{'':<20}" + "".join(f"{c:>14}" for c in cols) + f"{'vs HF':>8}{'same tokens':>13}")
    for name, row in rows.items():
        vs = f"{row['tokens_per_s'] / hf_tps:.1f}x" if hf_tps else "-"
        print(f"{name:<20}" + "".join(
            f"{row.get(c):>14.1f}" if row.get(c) is not None else f"{'-':>14}" for c in cols)
            + f"{vs:>8}{agreement[name]:>13.2f}")
    print("\n'same tokens': fraction of requests whose tokens equal the disaggregated "
          "engine's (greedy fp32).")
    print(f"Compute ceiling: the workload needs at least {floor_s:.1f} s at this machine's "
          f"measured matmul rate ({rate / 1e9:.0f} GFLOP/s), i.e. at most "
          f"{ceiling_tps:.1f} generated tok/s"
          + (f" = {ceiling_tps / hf_tps:.1f}x HF's measured throughput." if hf_tps else "."))
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
                            "cores": os.cpu_count(), "args": vars(args), "results": rows,
                            "token_agreement_with_disaggregated": agreement,
                            "matmul_gflops": rate / 1e9, "compute_floor_s": floor_s,
                            "ceiling_tokens_per_s": ceiling_tps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
