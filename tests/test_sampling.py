"""Sampling: greedy, temperature, top-k, top-p, seeds, and parameter validation."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.model.sampling import row_keys, sample

V = 50


def draw(logits, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """n samples of one row, each with its own step key."""
    b = logits.shape[0]
    out = []
    for step in range(n):
        out.append(np.asarray(sample(
            jnp.asarray(logits), row_keys([seed] * b, step), jnp.full(b, temperature),
            jnp.full(b, top_k, jnp.int32), jnp.full(b, top_p))))
    return np.stack(out)  # [n, B]


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(size=(2, V)).astype(np.float32) * 2


def test_greedy_is_argmax(logits):
    got = draw(logits, 3, temperature=0.0)
    assert (got == logits.argmax(-1)).all()


def test_top_k_one_and_tiny_top_p_are_greedy(logits):
    assert (draw(logits, 20, top_k=1) == logits.argmax(-1)).all()
    assert (draw(logits, 20, top_p=1e-6) == logits.argmax(-1)).all()


def test_top_k_limits_support(logits):
    got = draw(logits, 200, top_k=5)
    for row in range(2):
        allowed = set(np.argsort(-logits[row])[:5].tolist())
        assert set(got[:, row].tolist()) <= allowed
        assert len(set(got[:, row].tolist())) > 1


def test_top_p_keeps_smallest_nucleus(logits):
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = order[: int(np.searchsorted(np.cumsum(probs[order]), 0.6) + 1)]
    got = draw(logits[:1], 300, top_p=0.6)[:, 0]
    assert set(got.tolist()) <= set(nucleus.tolist())


def test_temperature_one_follows_softmax():
    logits = np.log(np.array([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)], np.float32))
    got = draw(logits, 600)[:, 0]
    freq = np.bincount(got, minlength=3)[:3] / len(got)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.07)


def test_seed_reproducible_and_rows_independent(logits):
    a = draw(logits, 30, seed=7)
    b = draw(logits, 30, seed=7)
    c = draw(logits, 30, seed=8)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    # A row's draw depends on its own seed only, not on the batch around it.
    alone = draw(logits[1:], 30, seed=7)
    np.testing.assert_array_equal(a[:, 1], alone[:, 0])


def test_generator_sampling_reproducible(tiny_model):
    gen = ReferenceGenerator(tiny_model)
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11, max_tokens=8)
    prompts = [[256, 1, 2], [256, 9]]
    first = gen.generate(prompts, p, stop_token_ids=[])
    assert first == gen.generate(prompts, p, stop_token_ids=[])
    assert first[1] == gen.generate(prompts[1:], p, stop_token_ids=[])[0]


def test_generator_stops_and_limits(tiny_model):
    gen = ReferenceGenerator(tiny_model)
    prompts = [[256, 1, 2], [256, 9, 9, 9]]
    free = gen.generate(prompts, SamplingParams(max_tokens=6), stop_token_ids=[])
    stop = free[0][2]
    got = gen.generate(prompts, [SamplingParams(max_tokens=6), SamplingParams(max_tokens=2)],
                       stop_token_ids=[stop])
    assert got[0] == free[0][: free[0].index(stop) + 1]
    assert len(got[1]) <= 2 and got[1] == free[1][: len(got[1])]


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_k", -1), ("top_k", 1.5), ("top_p", 0.0), ("top_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3), ("seed", "x"),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("prompts,message", [
    ([], "prompts must not be empty"),
    ([[256], []], r"prompts\[1\] is empty"),
    ([[256, 384]], "outside the vocabulary"),
    ([[256, -1]], "outside the vocabulary"),
])
def test_generator_rejects_bad_prompts(tiny_model, prompts, message):
    with pytest.raises(ValueError, match=message):
        ReferenceGenerator(tiny_model).generate(prompts)


def test_generator_rejects_too_long(tiny_model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ReferenceGenerator(tiny_model).generate([[1] * 4000], SamplingParams(max_tokens=200))
