"""The CPU small-batch product kernel (`pallas/cpu_dense.cc`) against numpy in float64
on random shapes (ragged contraction lengths, 1-8 rows, threads' row ranges of every
size), the decode step's choice of it (cpu backend, one device, what it takes), and
whole decode steps with and without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdisagg.mesh.sharding import make_mesh
from jaxdisagg.model import decode_step, get_preset, paged
from jaxdisagg.model.llama import Llama, xla_product
from jaxdisagg.pallas import cpu

TARGET = "jaxdisagg_small_product_f32"


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 8), d=st.integers(1, 700), n16=st.integers(1, 40),
       seed=st.integers(0, 2**31 - 1))
def test_matches_numpy_on_random_shapes(m, d, n16, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)).astype(np.float32)
    w = rng.standard_normal((d, 16 * n16)).astype(np.float32)
    got = np.asarray(jax.jit(cpu.small_product_cpu)(x, w))
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(d), rtol=1e-5)


def test_refuses_what_it_does_not_take():
    x, w = jnp.ones((9, 64)), jnp.ones((64, 32))
    assert not cpu.small_product_fits(x, w)  # 9 rows
    assert not cpu.small_product_fits(x[:2], jnp.ones((64, 24)))  # N not a multiple of 16
    assert not cpu.small_product_fits(x[:2].astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="fp32"):
        cpu.small_product_cpu(x, w)


def _uses_kernel(backend, mesh, b, dtype=jnp.float32) -> bool:
    model = Llama(get_preset("tiny"), dtype=dtype)
    graphdef, state = nnx.split(model)
    cfg = model.config
    pages = jnp.zeros((9, 4, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    kv = paged.KVPages((pages,) * cfg.num_layers, (pages,) * cfg.num_layers)
    args = (state, kv, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32),
            jnp.zeros((b, 2), jnp.int32), jnp.ones(b, jnp.int32))
    fn = jax.jit(lambda *a: decode_step(graphdef, *a, backend=backend, mesh=mesh))
    return TARGET in fn.lower(*args).as_text()


def test_the_decode_step_takes_it_where_it_fits():
    one = make_mesh([0])
    assert _uses_kernel("cpu", one, 1) and _uses_kernel("auto", None, 8)
    assert not _uses_kernel("cpu", one, 9)  # more rows than the kernel takes: XLA's
    assert not _uses_kernel("reference", one, 1)  # the reference backend is all jnp
    assert not _uses_kernel("cpu", make_mesh([0, 1]), 1)  # sharded: XLA partitions
    assert not _uses_kernel("cpu", one, 1, jnp.bfloat16)  # bf16 weights: XLA's


@pytest.mark.parametrize("b", [1, 3, 8])
def test_decode_steps_with_and_without_it_agree(b, monkeypatch):
    cfg = get_preset("tiny")
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
