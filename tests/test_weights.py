"""Checkpoint loading: round trips, sharded files, dtypes, and every bad-checkpoint error."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_util import make_hf_model, write_tokenizer_json
from safetensors.numpy import load_file, save_file

from jaxdisagg.model import Llama, ReferenceGenerator, get_preset
from jaxdisagg.model.weights import (
    CheckpointError,
    load_hf_checkpoint,
    load_model,
    load_orbax,
    save_hf_checkpoint,
    save_orbax,
)


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model))


def assert_same_params(a, b):
    leaves_a, tree_a = jax.tree_util.tree_flatten(params_of(a))
    leaves_b, tree_b = jax.tree_util.tree_flatten(params_of(b))
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path, _ = make_hf_model(tmp_path_factory.mktemp("hf"), heads=4, kv_heads=2)
    write_tokenizer_json(path)
    return path


@pytest.fixture
def broken(hf_dir, tmp_path):
    """A fresh copy of the good checkpoint to damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_dir, dst)
    return dst


@pytest.mark.parametrize("preset", ["tiny", "llama3.2-1b"])
def test_safetensors_round_trip(tmp_path, preset):
    cfg = get_preset(preset)
    if preset != "tiny":  # same structure, shapes small enough for CPU
        cfg = cfg.replace(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16)
    model = Llama(cfg, seed=1)
    back = load_hf_checkpoint(save_hf_checkpoint(model, tmp_path / "hf"))
    assert back.config.replace(name=cfg.name) == cfg
    assert_same_params(model, back)


def test_orbax_round_trip_and_convert_equivalence(hf_dir, tmp_path):
    model = load_hf_checkpoint(hf_dir)
    out = save_orbax(model, tmp_path / "orbax", tokenizer=load_model(str(hf_dir))[1])
    back = load_orbax(out)
    assert back.config == model.config
    assert_same_params(model, back)
    restored, tok = load_model(str(out))
    assert tok is not None and tok.encode("w1 w2") == [1, 4, 5]
    prompt = [[1, 5, 9, 12]]
    np.testing.assert_array_equal(ReferenceGenerator(model).prompt_logits(prompt),
                                  ReferenceGenerator(restored).prompt_logits(prompt))
    with pytest.raises(FileExistsError, match="already exists"):
        save_orbax(model, out)


def test_orbax_restore_in_other_dtype(tmp_path):
    model = Llama(get_preset("tiny"), seed=2)
    out = save_orbax(model, tmp_path / "o")
    bf = load_orbax(out, jnp.bfloat16)
    assert bf.dtype == jnp.bfloat16
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params_of(bf)))


def test_orbax_directory_of_another_format_is_refused_by_name(tmp_path):
    out = save_orbax(Llama(get_preset("tiny"), seed=2), tmp_path / "o")
    meta = json.loads((out / "jaxdisagg.json").read_text())
    (out / "jaxdisagg.json").write_text(json.dumps({**meta, "format": "jaxdisagg-orbax/1"}))
    with pytest.raises(CheckpointError, match=r"format 'jaxdisagg-orbax/1'.*convert the source"):
        load_orbax(out)


def test_sharded_checkpoint_with_index(tmp_path):
    path, _ = make_hf_model(tmp_path, heads=4, kv_heads=2, shard_size="60KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 1
    single, _ = make_hf_model(tmp_path / "single", heads=4, kv_heads=2)
    assert_same_params(load_hf_checkpoint(path), load_hf_checkpoint(single))
    # Without the index the loader reads every file's header instead.
    (path / "model.safetensors.index.json").unlink()
    assert_same_params(load_hf_checkpoint(path), load_hf_checkpoint(single))


def test_bf16_load(hf_dir):
    model = load_hf_checkpoint(hf_dir, jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params_of(model)))
    logits = ReferenceGenerator(model).prompt_logits([[1, 2, 3]])
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


def test_tied_checkpoint_with_identical_head_is_accepted(tmp_path):
    path, _ = make_hf_model(tmp_path, heads=4, kv_heads=2, tie=True)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, path / "model.safetensors")
    assert load_hf_checkpoint(path).lm_head is None


def _edit_tensors(ckpt, fn):
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def _edit_config(ckpt, **changes):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _add_lm_head_to_tied(ckpt):
    _edit_config(ckpt, tie_word_embeddings=True)
    _edit_tensors(ckpt, lambda t: t.update(
        {"lm_head.weight": t["lm_head.weight"] + 1}))


YARN = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
BAD = {
    "no config.json": (lambda d: (d / "config.json").unlink(), r"config\.json: not found"),
    "config not json": (lambda d: (d / "config.json").write_text("{oops"), "invalid JSON"),
    "other architecture": (lambda d: _edit_config(d, model_type="mistral",
                                                  architectures=["MistralForCausalLM"]),
                           "unsupported architecture"),
    "attention bias": (lambda d: _edit_config(d, attention_bias=True), "attention_bias"),
    "unknown rope type": (lambda d: _edit_config(d, rope_parameters=YARN, rope_scaling=YARN),
                          "rope type 'yarn'"),
    "missing field": (lambda d: _drop_key(d, "vocab_size"),
                      "missing required field 'vocab_size'"),
    "no safetensors": (lambda d: (d / "model.safetensors").unlink(), r"no \*\.safetensors"),
    "garbage file": (lambda d: (d / "model.safetensors").write_bytes(b"\x00garbage" * 10),
                     "cannot read safetensors"),
    "missing tensor": (lambda d: _edit_tensors(d, lambda t: t.pop(
        "model.layers.1.mlp.up_proj.weight")), r"missing tensors .*layers\.1\.mlp\.up_proj"),
    "unexpected tensor": (lambda d: _edit_tensors(d, lambda t: t.update(
        {"model.layers.0.self_attn.q_norm.weight": np.ones(4, np.float32)})),
        r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.q_norm"),
    "extra layer": (lambda d: _edit_config(d, num_hidden_layers=1),
                    r"unexpected tensor 'model\.layers\.1\..*config has 1 layers"),
    "shape mismatch": (lambda d: _edit_config(d, intermediate_size=100),
                       r"model\.safetensors: tensor 'model\.layers\.0\.mlp\..*has shape"),
    "tied but different head": (_add_lm_head_to_tied, "tie_word_embeddings=true but it differs"),
    "index lists missing shard": (
        lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})),
        "shard files that are missing"),
}


def _drop_key(ckpt, key):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg[key]
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_raises_clear_error(broken, case):
    damage, message = BAD[case]
    damage(broken)
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(broken)


def test_load_model_spec_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset 'nope'.*tiny"):
        load_model("nope")
    with pytest.raises(CheckpointError, match="no such checkpoint file or directory"):
        load_model(str(tmp_path / "missing") + "/")
    with pytest.raises(CheckpointError, match="no such checkpoint file or directory"):
        load_model("model.gguf")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="a directory .* or a .gguf file"):
        load_model(str(f))
    with pytest.raises(CheckpointError, match="jaxdisagg.json: cannot read"):
        load_orbax(tmp_path)
