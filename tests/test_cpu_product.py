"""The CPU small-batch product kernels (`pallas/cpu_dense.cc`) against numpy in float64
on random shapes (the layers': ragged contraction lengths, 1-16 rows (past 8 in groups
over column tiles, ragged ones too), threads' row ranges of every size; the tied head's:
1-32 rows, vocabularies of any size), the decode step's choice of them (cpu backend, one
device, what they take), and whole decode steps with and without them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxdisagg.mesh.sharding import make_mesh
from jaxdisagg.model import decode_step, get_preset, paged
from jaxdisagg.model.llama import Llama, xla_product
from jaxdisagg.pallas import cpu

TARGET, HEAD = "jaxdisagg_small_product_f32", "jaxdisagg_tied_head_f32"


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 16), d=st.integers(1, 700), n16=st.integers(1, 40),
       seed=st.integers(0, 2**31 - 1))
@example(m=4, d=77, n16=5, seed=1)  # the 4-row variant (its own code on AVX2)
@example(m=12, d=300, n16=17, seed=2)  # 8 rows, then that variant as the last group
def test_matches_numpy_on_random_shapes(m, d, n16, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)).astype(np.float32)
    w = rng.standard_normal((d, 16 * n16)).astype(np.float32)
    got = np.asarray(jax.jit(cpu.small_product_cpu)(x, w))
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(d), rtol=1e-5)


def test_refuses_what_it_does_not_take():
    x, w = jnp.ones((17, 64)), jnp.ones((64, 32))
    assert not cpu.small_product_fits(x, w)  # 17 rows
    assert not cpu.small_product_fits(x[:2], jnp.ones((64, 24)))  # N not a multiple of 16
    assert not cpu.small_product_fits(x[:2].astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="fp32"):
        cpu.small_product_cpu(x, w)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 32), d16=st.integers(1, 45), v=st.integers(1, 3000),
       seed=st.integers(0, 2**31 - 1))
def test_the_head_matches_numpy_on_random_shapes(m, d16, v, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, 16 * d16)).astype(np.float32)
    e = rng.standard_normal((v, 16 * d16)).astype(np.float32)
    got = np.asarray(jax.jit(cpu.tied_head_cpu)(x, e))
    want = x.astype(np.float64) @ e.astype(np.float64).T
    np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(16 * d16), rtol=1e-5)


def test_the_head_refuses_what_it_does_not_take():
    x, e = jnp.ones((33, 64)), jnp.ones((100, 64))
    assert not cpu.tied_head_fits(x, e)  # 33 rows
    assert not cpu.tied_head_fits(jnp.ones((2, 24)), jnp.ones((100, 24)))  # D % 16
    assert not cpu.tied_head_fits(x[:2].astype(jnp.bfloat16), e.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="fp32"):
        cpu.tied_head_cpu(x, e)


def _lowered(backend, mesh, b, dtype=jnp.float32, tied=True) -> str:
    cfg = dataclasses.replace(get_preset("tiny"), tie_word_embeddings=tied)
    model = Llama(cfg, dtype=dtype)
    graphdef, state = nnx.split(model)
    cfg = model.config
    pages = jnp.zeros((9, 4, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    kv = paged.KVPages((pages,) * cfg.num_layers, (pages,) * cfg.num_layers)
    args = (state, kv, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32),
            jnp.zeros((b, 2), jnp.int32), jnp.ones(b, jnp.int32))
    fn = jax.jit(lambda *a: decode_step(graphdef, *a, backend=backend, mesh=mesh))
    return fn.lower(*args).as_text()


def _uses_kernel(backend, mesh, b, dtype=jnp.float32) -> bool:
    return TARGET in _lowered(backend, mesh, b, dtype)


def test_the_decode_step_takes_it_where_it_fits():
    one = make_mesh([0])
    assert _uses_kernel("cpu", one, 1) and _uses_kernel("auto", None, 16)
    assert not _uses_kernel("cpu", one, 17)  # more rows than the kernel takes: XLA's
    assert not _uses_kernel("reference", one, 1)  # the reference backend is all jnp
    assert not _uses_kernel("cpu", make_mesh([0, 1]), 1)  # sharded: XLA partitions
    assert not _uses_kernel("cpu", one, 1, jnp.bfloat16)  # bf16 weights: XLA's


def test_the_decode_step_takes_the_head_kernel_where_it_fits():
    one = make_mesh([0])
    assert HEAD in _lowered("cpu", one, 1) and HEAD in _lowered("auto", None, 32)
    assert HEAD not in _lowered("cpu", one, 33)
    assert HEAD not in _lowered("cpu", one, 8, tied=False)  # a [D, V] head: layers' kernel
    assert HEAD not in _lowered("reference", one, 8)
    assert HEAD not in _lowered("cpu", make_mesh([0, 1]), 8)
    assert HEAD not in _lowered("cpu", one, 8, jnp.bfloat16)


@pytest.mark.parametrize("b", [1, 3, 8, 12])
@pytest.mark.parametrize("tied", [False, True])
def test_decode_steps_with_and_without_it_agree(b, tied, monkeypatch):
    cfg = dataclasses.replace(get_preset("tiny"), tie_word_embeddings=tied)
    graphdef, state = nnx.split(Llama(cfg, seed=1))
    rng = np.random.default_rng(b)
    nb, bs, pages = 4 * b + 1, 4, 4
    kv = paged.KVPages(*(tuple(jnp.asarray(rng.standard_normal(
        (nb, bs, cfg.num_kv_heads, cfg.head_dim)), jnp.float32) for _ in range(cfg.num_layers))
        for _ in range(2)))
    tables = jnp.asarray(rng.permutation(nb)[:b * pages].reshape(b, pages), jnp.int32)
    lens = jnp.asarray(rng.integers(1, bs * pages + 1, b), jnp.int32)
    args = (state, kv, jnp.asarray(rng.integers(0, cfg.vocab_size, b), jnp.int32), lens - 1,
            tables, lens)

    def step():
        return jax.jit(lambda *a: decode_step(graphdef, *a, backend="cpu"))(*args)[0]

    with_kernel = np.asarray(step())
    monkeypatch.setattr(paged, "step_product", lambda backend, mesh: xla_product)
    without = np.asarray(step())
    np.testing.assert_allclose(with_kernel, without, atol=1e-4, rtol=1e-4)
    assert (with_kernel.argmax(-1) == without.argmax(-1)).all()


@pytest.mark.parametrize("spin_us", [0, 200])
def test_calls_from_two_devices_at_once_agree(spin_us):
    """The kernels' helper threads serve one call at a time; a call that finds them
    busy runs on XLA's pool. Two devices' programs call at once, parked or spinning."""
    import threading

    rng = np.random.default_rng(spin_us)
    x = rng.standard_normal((4, 576)).astype(np.float32)
    ws = [rng.standard_normal((576, 960)).astype(np.float32),
          rng.standard_normal((960, 576)).astype(np.float32)]
    e = rng.standard_normal((2000, 576)).astype(np.float32)
    want = (x.astype(np.float64) @ ws[0] @ ws[1]) @ e.T.astype(np.float64)

    def chain(x, w0, w1, e):
        return cpu.tied_head_cpu(cpu.small_product_cpu(cpu.small_product_cpu(x, w0), w1), e)

    fn = jax.jit(chain)
    cpu.set_helper_spin_us(spin_us)
    got, errors = {}, []

    def run(device):
        try:
            args = jax.device_put((x, *ws, e), device)
            got[device.id] = [np.asarray(fn(*args)) for _ in range(30)]
        except Exception as exc:  # surfaced below, not swallowed by the thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=run, args=(d,)) for d in jax.devices()[:2]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a call hung"
    finally:
        cpu.set_helper_spin_us(200)
    assert not errors, errors
    for outs in got.values():
        for out in outs:
            np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-2 * np.abs(want).max())
