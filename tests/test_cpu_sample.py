"""The CPU greedy kernel (`pallas/cpu_sample.cc`): each row's first argmax and
log-normaliser against numpy in float64 on random shapes (vocabularies under one vector,
ragged tails, ties, -inf entries), jnp.argmax's answer on NaN and inf rows, the decode
step's choice of it, and sampled steps with and without it agreeing on tokens and
logprobs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdisagg.mesh.sharding import make_mesh
from jaxdisagg.model import get_preset, paged
from jaxdisagg.model.llama import Llama
from jaxdisagg.model.sampling import SamplingParams, row_params, sample_with_logprobs
from jaxdisagg.pallas import cpu

TARGET = "jaxdisagg_argmax_log_norm_f32"
kernel = jax.jit(cpu.argmax_log_norm_cpu)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 32), v=st.integers(1, 3000), ties=st.integers(0, 3),
       neg_inf=st.integers(0, 5), seed=st.integers(0, 2**31 - 1))
def test_matches_numpy_on_random_rows(b, v, ties, neg_inf, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((b, v)) * rng.uniform(0.1, 20)).astype(np.float32)
    for r in range(b):  # copies of the row's maximum elsewhere: the first must win
        x[r, rng.integers(0, v, ties)] = x[r].max()
        x[r, rng.integers(0, v, neg_inf)] = -np.inf
    best, norm = map(np.asarray, kernel(x))
    assert best.dtype == np.int32 and (best == x.argmax(-1)).all()
    x64 = x.astype(np.float64)
    finite = np.isfinite(x64.max(-1))
    want = np.log(np.exp(x64[finite] - x64[finite].max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(norm[finite], want, rtol=1e-5, atol=1e-5)
    assert np.isnan(norm[~finite]).all()


def test_nan_and_inf_rows_answer_as_jnp():
    x = np.zeros((5, 40), np.float32)
    x[0, [7, 30]] = np.nan  # the first NaN, in the vector part
    x[1, [3, 33, 38]] = [np.inf, np.inf, np.nan]  # NaN beats +inf, in the tail
    x[2, [3, 30]] = np.inf  # the first +inf
    x[3] = -np.inf  # nothing finite: index 0
    x[4, 39] = 1.0  # the maximum in the ragged tail
    best, norm = map(np.asarray, kernel(x))
    assert best.tolist() == np.asarray(jnp.argmax(x, -1)).tolist() == [7, 38, 3, 0, 39]
    assert np.isnan(norm[:4]).all()  # log_softmax is NaN everywhere in such rows
    np.testing.assert_allclose(norm[4], np.log(39 * np.exp(-1.0) + 1.0), rtol=1e-6)


def test_refuses_what_it_does_not_take():
    assert not cpu.argmax_log_norm_fits(jnp.ones((2, 8), jnp.bfloat16))
    assert not cpu.argmax_log_norm_fits(jnp.ones(8))
    assert not cpu.argmax_log_norm_fits(jnp.ones((2, 0)))
    with pytest.raises(TypeError, match="fp32 logits"):
        cpu.argmax_log_norm_cpu(jnp.ones((2, 8), jnp.bfloat16))


def _model(b):
    cfg = dataclasses.replace(get_preset("tiny"), tie_word_embeddings=True)
    graphdef, state = nnx.split(Llama(cfg, seed=2))
    rng = np.random.default_rng(b)
    nb, bs, pages = 4 * b + 1, 4, 4
    kv = paged.KVPages(*(tuple(jnp.asarray(rng.standard_normal(
        (nb, bs, cfg.num_kv_heads, cfg.head_dim)), jnp.float32) for _ in range(cfg.num_layers))
        for _ in range(2)))
    tables = jnp.asarray(rng.permutation(nb)[:b * pages].reshape(b, pages), jnp.int32)
    lens = jnp.asarray(rng.integers(1, bs * pages + 1, b), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, b), jnp.int32)
    return cfg, graphdef, (state, kv, tokens, lens - 1, tables, lens)


def _rows(b, vocab, greedy_only):
    params = [SamplingParams() if greedy_only or i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(b)]
    return row_params(params, list(range(b)), vocab)


def test_the_decode_step_takes_it_where_it_fits():
    def lowered(backend, mesh):
        cfg, graphdef, args = _model(2)
        fn = jax.jit(lambda *a: paged.decode_sample_step(graphdef, *a, backend=backend,
                                                         mesh=mesh))
        return fn.lower(*args, _rows(2, cfg.vocab_size, True)).as_text()

    assert TARGET in lowered("cpu", make_mesh([0])) and TARGET in lowered("auto", None)
    assert TARGET not in lowered("reference", None)  # the reference backend is all jnp
    assert TARGET not in lowered("cpu", make_mesh([0, 1]))  # sharded: XLA partitions


@pytest.mark.parametrize("b", [1, 5, 8])
@pytest.mark.parametrize("greedy_only", [True, False])
def test_sampled_steps_with_and_without_it_agree(b, greedy_only, monkeypatch):
    cfg, graphdef, args = _model(b)
    rows = _rows(b, cfg.vocab_size, greedy_only)

    def step():
        fn = jax.jit(lambda *a: paged.decode_sample_step(graphdef, *a, backend="cpu"))
        return tuple(map(np.asarray, fn(*args, rows)[:2]))

    tokens, logprobs = step()
    monkeypatch.setattr(paged, "step_greedy", lambda backend, mesh, logits: None)
    want_tokens, want_logprobs = step()
    assert tokens.tolist() == want_tokens.tolist()
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)


def test_logprobs_equal_log_softmax_on_wide_logits():
    """At SmolLM2's vocabulary and logit range, greedy and sampled rows alike."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((6, 49152)) * 8, jnp.float32)
    rows = row_params([SamplingParams(), SamplingParams(temperature=1.0, seed=4)] * 3,
                      [0] * 6, 49152)
    fn = jax.jit(sample_with_logprobs, static_argnums=2)
    tokens, logprobs = fn(logits, rows, cpu.argmax_log_norm_cpu)
    want_tokens, want_logprobs = fn(logits, rows, None)
    assert np.asarray(tokens).tolist() == np.asarray(want_tokens).tolist()
    np.testing.assert_allclose(logprobs, want_logprobs, atol=2e-5)
