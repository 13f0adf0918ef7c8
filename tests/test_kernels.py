"""Pallas kernels against the jnp references, in interpret mode on CPU.

Random inputs drawn fresh per case from fixed seeds: GQA groups 1/2/4/8, head_dim 64
and 128, block sizes 8 and 16, chunks starting at 0 and mid-block, lengths that are
not multiples of the block size, shuffled (non-contiguous) block tables, batches
mixing empty and full slots. Output buffers start poisoned (NaN), so an element a
kernel forgets to write fails the comparison.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxdisagg.mesh.sharding import make_mesh
from jaxdisagg.pallas.attention import decode_attention, prefill_attention, resolve_backend
from jaxdisagg.pallas.blocks import DecodeBlocks, PrefillBlocks
from jaxdisagg.pallas.decode import paged_decode_attention
from jaxdisagg.pallas.prefill import paged_prefill_attention
from jaxdisagg.pallas.reference import decode_attention_ref, prefill_attention_ref

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
CASES = list(itertools.product([1, 2, 4, 8], [64, 128], [8, 16]))  # group, head_dim, block
CASES += [(3, 64, 16), (7, 64, 8)]  # groups that are not powers of two (SmolLM2: 3)
# Head dims that are not powers of two (run as the next one, masked), large blocks, a
# group of 16.
CASES += [(3, 80, 32), (6, 96, 64), (16, 64, 16), (2, 256, 8)]
NUM_BLOCKS, PAGES, KV_HEADS = 24, 6, 2


def pools(rng, bs, h, dtype, kv_heads=KV_HEADS):
    shape = (NUM_BLOCKS, bs, kv_heads, h)
    return (jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.asarray(rng.standard_normal(shape), dtype))


def check(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=0)


def decode_inputs(seed, g, h, bs, dtype, batch=4, kv_heads=KV_HEADS):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, kv_heads * g, h)), dtype)
    k, v = pools(rng, bs, h, dtype, kv_heads)
    tables = jnp.asarray(rng.permutation(NUM_BLOCKS)[:batch * PAGES].reshape(batch, PAGES))
    # an empty slot, a one-token slot, a full slot, and one ending mid-block
    lens = jnp.asarray([0, 1, bs * PAGES, 2 * bs + 3][:batch], jnp.int32)
    return q, k, v, tables.astype(jnp.int32), lens


def prefill_inputs(seed, g, h, bs, dtype, start, chunk=16, kv_heads=KV_HEADS):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((chunk, kv_heads * g, h)), dtype)
    k, v = pools(rng, bs, h, dtype, kv_heads)
    table = jnp.asarray(rng.permutation(NUM_BLOCKS)[:PAGES], jnp.int32)
    num_valid = min(chunk, PAGES * bs - start) - 3  # a partly padded chunk
    return q, k, v, table, jnp.int32(start), jnp.int32(num_valid)


@pytest.mark.parametrize("g,h,bs", CASES)
def test_decode_kernel_matches_reference(g, h, bs):
    q, k, v, tables, lens = decode_inputs(hash((g, h, bs)) % 1000, g, h, bs, jnp.float32)
    got = paged_decode_attention(q, k, v, tables, lens, scale=h ** -0.5, interpret=True,
                                 poison=True)
    check(got, decode_attention_ref(q, k, v, tables, lens, scale=h ** -0.5), jnp.float32)
    assert not np.asarray(got[0]).any()  # the empty slot is zeros, not NaN


@pytest.mark.parametrize("g,h,bs", CASES)
def test_prefill_kernel_matches_reference(g, h, bs):
    start = 0 if (g + bs) % 2 else bs + 3  # half the cases start mid-block over a prefix
    q, k, v, table, start, nv = prefill_inputs(hash((g, h, bs)) % 1000, g, h, bs, jnp.float32,
                                               start)
    got = paged_prefill_attention(q, k, v, table, start, nv, scale=h ** -0.5, interpret=True,
                                  poison=True)
    want = prefill_attention_ref(q, k, v, table, start, nv, scale=h ** -0.5)
    check(got[:int(nv)], want[:int(nv)], jnp.float32)
    assert not np.isnan(np.asarray(got)).any()  # padded rows are written too


@pytest.mark.parametrize("block_rows", [16, 32])
def test_prefill_unmasked_steps_and_row_order(block_rows):
    """Small tiles over a 37-token prefix: each row block runs 1-3 key steps without the
    mask before its diagonal steps, and the blocks run last first; every row still
    equals the reference."""
    q, k, v, table, start, nv = prefill_inputs(11, 2, 64, 16, jnp.float32, 37, chunk=32)
    got = paged_prefill_attention(q, k, v, table, start, nv, scale=0.125, interpret=True,
                                  poison=True, blocks=PrefillBlocks(block_rows=block_rows,
                                                                    keys_per_step=16))
    want = prefill_attention_ref(q, k, v, table, start, nv, scale=0.125)
    check(got[:int(nv)], want[:int(nv)], jnp.float32)


def test_prefill_blocks_of_padding_skip_their_work():
    """A 64-token chunk holding 5 real tokens: the row blocks made only of padding read
    no keys and write zeros (not NaN); the real rows still match the reference."""
    q, k, v, table, start, _ = prefill_inputs(7, 2, 64, 16, jnp.float32, 0, chunk=64)
    nv = jnp.int32(5)
    got = paged_prefill_attention(q, k, v, table, start, nv, scale=0.125, interpret=True,
                                  poison=True, blocks=PrefillBlocks(block_rows=64))
    want = prefill_attention_ref(q, k, v, table, start, nv, scale=0.125)
    check(got[:5], want[:5], jnp.float32)
    assert not np.asarray(got[32:]).any()  # rows 64.. of each KV head: tokens 32..63


@pytest.mark.parametrize("g,h,bs", [(4, 128, 16), (8, 64, 8)])
def test_bf16(g, h, bs):
    q, k, v, tables, lens = decode_inputs(7, g, h, bs, jnp.bfloat16)
    got = paged_decode_attention(q, k, v, tables, lens, scale=h ** -0.5, interpret=True)
    assert got.dtype == jnp.bfloat16
    check(got, decode_attention_ref(q, k, v, tables, lens, scale=h ** -0.5), jnp.bfloat16)
    q, k, v, table, start, nv = prefill_inputs(8, g, h, bs, jnp.bfloat16, bs + 5)
    got = paged_prefill_attention(q, k, v, table, start, nv, scale=h ** -0.5, interpret=True)
    assert got.dtype == jnp.bfloat16
    want = prefill_attention_ref(q, k, v, table, start, nv, scale=h ** -0.5)
    check(got[:int(nv)], want[:int(nv)], jnp.bfloat16)


@pytest.mark.parametrize("blocks", [DecodeBlocks(keys_per_step=16, num_splits=4),
                                    DecodeBlocks(keys_per_step=64, num_splits=1),
                                    DecodeBlocks(num_splits=5)])
def test_decode_launch_shapes_all_give_the_reference(blocks):
    """Splits that do not divide the pages, one split, more splits than steps: the
    combine step and the early exit of splits past a slot's length stay exact."""
    q, k, v, tables, lens = decode_inputs(11, 3, 64, 8, jnp.float32)
    got = paged_decode_attention(q, k, v, tables, lens, scale=0.125, interpret=True,
                                 poison=True, blocks=blocks)
    check(got, decode_attention_ref(q, k, v, tables, lens, scale=0.125), jnp.float32)


def test_launch_shapes_come_from_the_config_then_the_table_then_the_shape(monkeypatch):
    from jaxdisagg.pallas import blocks as blk

    key = blk.table_key("NVIDIA H200", "bfloat16", 4, 128, 16)
    monkeypatch.setattr(blk, "_tuned", lambda: {"decode": {key: {"keys_per_step": 32,
                                                                 "num_warps": 8}}})
    shape = dict(key=key, batch=1, kv_heads=8, block_size=16, head_dim=128, pages=512)
    tuned = blk.decode_blocks(None, **shape)
    assert (tuned.keys_per_step, tuned.num_warps, tuned.num_stages) == (32, 8, 2)
    assert tuned.num_splits == blk.MAX_SPLITS == 32  # batch 1, 8 KV heads: the most allowed
    assert blk.decode_blocks(None, **(shape | {"batch": 32})).num_splits == 16  # 4096 programs
    assert blk.decode_blocks(DecodeBlocks(num_warps=2), **shape).num_warps == 2
    other = blk.decode_blocks(None, **(shape | {"key": "cpu|float32|g4|h128|bs16",
                                                 "batch": 64, "pages": 3}))
    assert (other.keys_per_step, other.num_splits) == (64, 1)  # 3 pages: one 4-page step
    with pytest.raises(ValueError, match="keys_per_step: must be a positive power of two"):
        DecodeBlocks(keys_per_step=24)
    # Pipeline stages are a count, not a tile side (the H200 sweep tries 3).
    assert DecodeBlocks(num_stages=3).num_stages == PrefillBlocks(num_stages=3).num_stages == 3
    with pytest.raises(ValueError, match="num_stages: must be positive, got 0"):
        PrefillBlocks(num_stages=0)
    # fp32 tiles hold twice the bytes: smaller defaults, or ptxas runs out of registers
    pre = dict(key="cpu|x", rows=4096, block_size=16, head_dim=128, pages=64)
    assert blk.prefill_blocks(None, **pre) == PrefillBlocks(128, 64, 4, 2)
    assert blk.prefill_blocks(None, **pre, itemsize=4) == PrefillBlocks(64, 16, 8, 2)
    assert blk.prefill_blocks(None, **(pre | {"rows": 20})).block_rows == 32  # short chunk


@pytest.mark.parametrize("tp", [2, 4])
def test_kernels_under_shard_map(tp):
    """KV heads sharded over tp devices: each device runs the kernel on its own heads."""
    kv_heads, g, h, bs = 4, 2, 64, 8
    mesh = make_mesh(range(tp))
    heads = NamedSharding(mesh, PartitionSpec(None, "tp", None))
    pages = NamedSharding(mesh, PartitionSpec(None, None, "tp", None))
    q, k, v, tables, lens = decode_inputs(3, g, h, bs, jnp.float32, kv_heads=kv_heads)
    args = (jax.device_put(q, heads), jax.device_put(k, pages), jax.device_put(v, pages))
    run = jax.jit(lambda q, k, v, t, s: decode_attention(
        q, k, v, t, s, scale=h ** -0.5, backend="pallas_interpret", mesh=mesh))
    got = run(*args, tables, lens)
    assert got.sharding.is_equivalent_to(heads, 3)
    check(got, decode_attention_ref(q, k, v, tables, lens, scale=h ** -0.5), jnp.float32)

    q, k, v, table, start, nv = prefill_inputs(4, g, h, bs, jnp.float32, 5, kv_heads=kv_heads)
    args = (jax.device_put(q, heads), jax.device_put(k, pages), jax.device_put(v, pages))
    run = jax.jit(lambda q, k, v, t, s, n: prefill_attention(
        q, k, v, t, s, n, scale=h ** -0.5, backend="pallas_interpret", mesh=mesh))
    got = run(*args, table, start, nv)
    want = prefill_attention_ref(q, k, v, table, start, nv, scale=h ** -0.5)
    check(got[:int(nv)], want[:int(nv)], jnp.float32)


def test_backend_names():
    assert resolve_backend("auto") == ("pallas" if jax.default_backend() == "gpu"
                                       else "cpu")  # the fallback: test_cpu_kernel.py
    with pytest.raises(ValueError, match="unknown attention backend 'triton'.*pallas_interpret"):
        resolve_backend("triton")


# (query heads, KV heads, head_dim) per device as real models shard, at tp 1 and at the
# largest tp their heads allow: SmolLM2-135M (tp 3), Llama-3.2-1B, Llama-2-7B (MHA),
# Llama-3-8B and Mistral-7B (same layout), Qwen2-1.5B (group 6), Qwen2.5-7B (group 7).
REAL_SHAPES = [(9, 3, 64), (3, 1, 64), (32, 8, 64), (4, 1, 64), (32, 32, 128), (4, 4, 128),
               (32, 8, 128), (4, 1, 128), (12, 2, 128), (6, 1, 128), (28, 4, 128),
               (7, 1, 128)]


# Every group 1-8 and 16, head dims 64/80/96/128/256 and block sizes 8/16/32/64, each
# of them several times: (query heads, KV heads, head_dim, block size).
SYNTHETIC_SHAPES = [(1, 1, 80, 8), (2, 1, 96, 32), (3, 1, 256, 64), (4, 2, 80, 64),
                    (5, 1, 64, 32), (6, 1, 96, 8), (7, 1, 128, 64), (8, 1, 256, 16),
                    (16, 1, 128, 32), (32, 2, 96, 16)]
LOWERING = ([(n, k, h, 16) for n, k, h in REAL_SHAPES]
            + [(n * kv, kv, h, bs) for n, kv, h, bs in SYNTHETIC_SHAPES])


@pytest.mark.parametrize("n,k,h,bs", LOWERING,
                         ids=[f"{n}q{k}kv{h}bs{bs}" for n, k, h, bs in LOWERING])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_kernels_lower_for_cuda_through_triton(n, k, h, bs, dtype):
    """Cross-platform lowering runs Pallas' Triton lowering without a GPU: an op the
    backend cannot lower, or a tile it rejects (every block side a power of two), fails
    here. Pools of 321 blocks: the page count need not be a power of two either."""
    sds = jax.ShapeDtypeStruct
    page = sds((321, bs, k, h), dtype)
    decode = jax.jit(lambda *a: paged_decode_attention(*a, scale=0.088))
    prefill = jax.jit(lambda *a: paged_prefill_attention(*a, scale=0.088))
    for fn, args in (
            (decode, (sds((32, n, h), dtype), page, page, sds((32, 40), jnp.int32),
                      sds((32,), jnp.int32))),
            (prefill, (sds((128, n, h), dtype), page, page, sds((40,), jnp.int32),
                       sds((), jnp.int32), sds((), jnp.int32)))):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu" in text  # the Triton kernel call


@pytest.mark.parametrize("tp", [1, 2])
def test_model_with_pallas_interpret_matches_reference(tiny_model, tp, monkeypatch):
    """The whole model on a pool with the kernels (under shard_map for tp=2): the same
    logits as the reference generator at every step, so the same greedy tokens. At tp=1
    the pool's config sets the kernels' launch shapes (3 splits, 16-key steps, 16-row
    prefill blocks): they reach the kernels and change nothing but the schedule."""
    from kv_util import make_pool

    from jaxdisagg.mesh.deployment import prefill_request
    from jaxdisagg.model import ReferenceGenerator, SamplingParams
    from jaxdisagg.pallas import decode as decode_module
    from jaxdisagg.pallas import prefill as prefill_module

    shapes = {} if tp > 1 else {
        "decode_kernel": DecodeBlocks(keys_per_step=16, num_splits=3),
        "prefill_kernel": PrefillBlocks(block_rows=16, keys_per_step=16)}
    seen = []  # the launch shapes each kernel was traced with
    for module, name in ((decode_module, "decode_blocks"), (prefill_module, "prefill_blocks")):
        chosen = getattr(module, name)
        monkeypatch.setattr(module, name, lambda o, *a, chosen=chosen, **k: (
            seen.append(o), chosen(o, *a, **k))[1])
    inst = make_pool(tiny_model, list(range(tp)), tp, backend="pallas_interpret", **shapes)
    prompt = np.random.default_rng(5).integers(0, 256, 29).tolist()
    steps, ref_logits = 4, []
    want = list(ReferenceGenerator(tiny_model).stream(
        [prompt], SamplingParams(max_tokens=steps), stop_token_ids=[], logits_out=ref_logits))
    blocks = [9, 2, 17, 5]
    logits, _, _ = prefill_request(inst, prompt, blocks)
    np.testing.assert_allclose(np.asarray(logits), ref_logits[0][0], atol=1e-5, rtol=0)
    tables = np.zeros((inst.pool.max_slots, inst.max_pages), np.int32)
    tables[0, :len(blocks)] = blocks
    for step in range(1, steps):
        pos = len(prompt) + step - 1
        tokens, positions, lens = (np.zeros(inst.pool.max_slots, np.int32) for _ in range(3))
        tokens[0], positions[0], lens[0] = want[step - 1][0], pos, pos + 1
        logits = np.asarray(inst.decode_logits(tokens, positions, tables, lens))
        np.testing.assert_allclose(logits[0], ref_logits[step][0], atol=1e-5, rtol=0)
        assert int(logits[0].argmax()) == want[step][0]
    if shapes:
        assert set(shapes.values()) <= set(seen)


def test_gpu_check_script_runs_in_smoke_mode(tmp_path):
    """benchmarks/gpu_check.sh runs for real only where a GPU is lent; its --smoke mode
    runs every path on CPU (our kernels and JAX's in interpret mode, the sweep, the step
    times, the engine's tokens against the reference, two pool processes started by
    `jaxdisagg launch`), so none of it can rot."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh"), "all", "--smoke"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["correctness"]["ok"]
    for row in result["decode"]:
        assert {"ours_gbs", "jax_paged_gbs", "jax_gqa_gbs"} <= set(row), row
    assert all("tflops" in row for row in result["prefill"])
    assert result["sweep"]["table"]["decode"] and result["splits"]
    steps = json.loads((tmp_path / "gpu_e2e_steps.json").read_text())
    assert {"prefill_s", "decode_b1_s", "decode_b2_s"} <= set(steps["models"]["tiny"])
    for part in ("tokens", "disagg"):
        got = json.loads((tmp_path / f"gpu_e2e_{part}.json").read_text())
        assert got["requests_equal"] == got["requests"] == 3, got
    # the server's own stages of each request, where a slow first token would show
    assert all({"prefill_end", "pull_start", "first_token"} <= set(t) for t in got["timeline"])
