"""The CPU decode attention kernel (`pallas/cpu.py`, a C++ XLA custom call) against
the jnp reference: random shapes and ragged lengths drawn by hypothesis, real model
head layouts, empty and over-long slots, out-of-range table entries, thread splits,
tp-sharded pools, and the build and fallback paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

from jaxdisagg.mesh.sharding import make_mesh
from jaxdisagg.pallas import cpu
from jaxdisagg.pallas.attention import decode_attention, resolve_backend
from jaxdisagg.pallas.reference import decode_attention_ref


def test_the_kernel_builds_here():
    # Not a skip condition: the suite's machines have a C++ compiler, and every CPU
    # engine test runs this kernel, so a failed build must fail loudly.
    assert cpu.available(), cpu.unavailable_reason()


def inputs(rng, b, k, g, h, bs, pages, lens, num_blocks=None):
    num_blocks = num_blocks or b * pages + 3
    q = jnp.asarray(rng.standard_normal((b, k * g, h)), jnp.float32)
    kp, vp = (jnp.asarray(rng.standard_normal((num_blocks, bs, k, h)), jnp.float32)
              for _ in range(2))
    tables = np.stack([rng.permutation(num_blocks)[:pages] for _ in range(b)])
    return q, kp, vp, jnp.asarray(tables, jnp.int32), jnp.asarray(lens, jnp.int32)


def run_both(q, kp, vp, tables, lens):
    scale = q.shape[-1] ** -0.5
    got = jax.jit(lambda *a: cpu.paged_decode_attention_cpu(*a, scale=scale))(
        q, kp, vp, tables, lens)
    want = decode_attention_ref(q, kp, vp, tables, lens, scale=scale)
    return np.asarray(got), np.asarray(want)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), b=st.integers(1, 9), k=st.integers(1, 4),
       g=st.sampled_from([1, 2, 3, 4, 6, 7, 8, 16]), h=st.sampled_from([16, 32, 64, 80, 128]),
       bs=st.sampled_from([1, 8, 16, 32]), pages=st.integers(1, 6))
def test_matches_reference_on_random_ragged_inputs(data, b, k, g, h, bs, pages):
    lens = data.draw(st.lists(st.integers(0, pages * bs), min_size=b, max_size=b))
    seed = data.draw(st.integers(0, 2 ** 16))
    got, want = run_both(*inputs(np.random.default_rng(seed), b, k, g, h, bs, pages, lens))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


# (query heads, KV heads, head_dim): SmolLM2-135M, Llama-3.2-1B, Llama-2-7B (MHA),
# Llama-3-8B, Qwen2-1.5B, Qwen2.5-7B.
REAL = [(9, 3, 64), (32, 8, 64), (32, 32, 128), (32, 8, 128), (12, 2, 128), (28, 4, 128)]


@pytest.mark.parametrize("n,k,h", REAL, ids=[f"{n}q{k}kv{h}" for n, k, h in REAL])
def test_matches_reference_on_real_head_layouts(n, k, h):
    rng = np.random.default_rng(n * k)
    lens = [0, 1, 16 * 5 + 7, 16 * 8]
    got, want = run_both(*inputs(rng, 4, k, n // k, h, 16, 8, lens))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert not got[0].any()  # an empty slot gives zeros


def test_long_slots_and_out_of_range_entries_follow_the_reference():
    """A length past the table's pages attends to every listed page (the reference's
    mask); table entries past a slot's length are never read, and ones outside the
    pool inside it are read as jnp indexing reads them (negative from the end, then
    clamped)."""
    rng = np.random.default_rng(1)
    q, kp, vp, tables, _ = inputs(rng, 3, 2, 2, 32, 8, 4, [0, 0, 0], num_blocks=10)
    tables = tables.at[0, 3].set(10_000).at[1, 2].set(-5).at[2, 3].set(99)
    lens = jnp.asarray([4 * 8 + 20, 3 * 8, 3 * 8 - 1], jnp.int32)  # 2: entry 3 unused
    got, want = run_both(q, kp, vp, tables, lens)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_extreme_scores_stay_finite():
    """Large logits spread over pages and splits: the online softmax's rescaling and
    the merge of the splits must not overflow or lose the winning key."""
    rng = np.random.default_rng(2)
    q, kp, vp, tables, lens = inputs(rng, 1, 1, 4, 64, 8, 12, [12 * 8])
    q = q * 40.0
    got, want = run_both(q, kp, vp, tables, lens)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_slots_longer_than_a_chunk_of_scores():
    """The kernel scores a slot's keys a chunk at a time (8,192 scores: 16 pages of 16
    keys for 32 query heads) and merges the chunks by their maxima: slots of up to 40
    pages, pages whose logits differ in scale (each chunk may raise the maximum and
    rescale what came before), ragged ends inside and at chunk boundaries."""
    rng = np.random.default_rng(5)
    lens = [40 * 16, 33 * 16 + 5, 32 * 16, 16 * 16 + 1, 17 * 16, 1, 0, 39 * 16 + 15]
    q, kp, vp, tables, lens = inputs(rng, 8, 8, 4, 64, 16, 40, lens)
    spread = jnp.asarray(1.0 + 3.0 * rng.random(kp.shape[0]), jnp.float32)
    got, want = run_both(q * 3.0, kp * spread[:, None, None, None], vp, tables, lens)
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)


def test_dispatch_uses_the_kernel_and_falls_back_where_it_cannot():
    q, kp, vp, tables, lens = inputs(np.random.default_rng(3), 2, 2, 2, 32, 8, 3, [5, 17])

    def targets(fn, *args):
        return "jaxdisagg_paged_decode" in jax.jit(fn).lower(*args).as_text()

    def attend(q, kp, vp):
        return decode_attention(q, kp, vp, tables, lens, scale=0.1, backend="cpu")

    assert targets(attend, q, kp, vp)
    assert not targets(attend, q, kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16))
    assert not targets(attend, q[..., :24], kp[..., :24], vp[..., :24])  # head_dim 24
    got = attend(q, kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16))  # the reference
    assert got.shape == q.shape


def test_auto_picks_the_kernel_on_cpu_and_the_reference_without_a_compiler(monkeypatch):
    assert resolve_backend("auto") == "cpu"
    monkeypatch.setattr(cpu, "_load", lambda: "no C++ compiler (g++ or clang++; or set CXX)")
    assert resolve_backend("auto") == "reference"
    with pytest.raises(ValueError, match="'cpu' is unavailable: no C\\+\\+ compiler"):
        resolve_backend("cpu")


def test_builds_once_into_the_cache_and_reports_a_broken_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDISAGG_CACHE", str(tmp_path))
    built = cpu._build()
    assert built.parent == tmp_path and built.stat().st_size > 0
    mtime = built.stat().st_mtime_ns
    assert cpu._build() == built and built.stat().st_mtime_ns == mtime  # reused
    monkeypatch.setenv("JAXDISAGG_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="compiling the CPU kernels"):
        cpu._build()
    assert not list((tmp_path / "other").glob("*.so*"))  # no half-written library left


@pytest.mark.parametrize("tp", [2])
def test_under_shard_map_each_device_runs_its_own_heads(tp):
    mesh = make_mesh(list(range(tp)))
    q, kp, vp, tables, lens = inputs(np.random.default_rng(4), 3, 2 * tp, 3, 64, 16, 4,
                                     [0, 40, 64])
    heads = NamedSharding(mesh, PartitionSpec(None, "tp", None))
    pages = NamedSharding(mesh, PartitionSpec(None, None, "tp", None))
    run = jax.jit(lambda q, k, v: decode_attention(q, k, v, tables, lens, scale=0.125,
                                                   backend="cpu", mesh=mesh))
    got = run(jax.device_put(q, heads), jax.device_put(kp, pages), jax.device_put(vp, pages))
    want = decode_attention_ref(q, kp, vp, tables, lens, scale=0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
