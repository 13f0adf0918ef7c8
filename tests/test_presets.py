"""Presets carry the published shapes; parameter counts are checked independently."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdisagg.model import PRESETS, Llama, LlamaConfig, get_preset

# Published parameter counts (model cards / HF safetensors metadata).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_counts(name):
    cfg = get_preset(name)
    assert cfg.num_params() == PUBLISHED[name]
    # The model built from the preset has exactly those parameters (shapes only).
    abstract = nnx.eval_shape(lambda: Llama(cfg))
    leaves = jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param))
    assert sum(int(np.prod(x.shape)) for x in leaves) == PUBLISHED[name]


def test_small_preset_shape():
    cfg = get_preset("small")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (
        512, 8, 8, 2, 1408, 32000, False)


def test_tiny_is_gqa_with_byte_vocab():
    cfg = get_preset("tiny")
    assert cfg.num_kv_heads == 2 and cfg.group_size > 1 and cfg.vocab_size >= 259


def test_kv_bytes_per_token_llama2_7b():
    # The founding article's figure: 512 KiB per token in fp16.
    assert get_preset("llama2-7b").kv_bytes_per_token(2) == 512 * 1024


def test_random_init_is_seeded():
    a = nnx.state(Llama(PRESETS["tiny"], seed=5))
    b = nnx.state(Llama(PRESETS["tiny"], seed=5))
    c = nnx.state(Llama(PRESETS["tiny"], seed=6))
    eq = lambda x, y: all(np.array_equal(u, v) for u, v in zip(  # noqa: E731
        jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y), strict=True))
    assert eq(a, b) and not eq(a, c)


@pytest.mark.parametrize("bad,message", [
    (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(head_dim=7), "even"),
    (dict(hidden_size=0), "hidden_size must be a positive int"),
])
def test_config_validation(bad, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**vars(PRESETS["tiny"]), **bad})
