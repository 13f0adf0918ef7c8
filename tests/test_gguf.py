"""GGUF files written with the `gguf` package, in every type it can quantize, load back
exactly as the dequantized tensors say; bad files are refused naming the key."""

import numpy as np
import pytest
from flax import nnx

from jaxdisagg.model.config import LlamaConfig
from jaxdisagg.model.gguf import GGUFError, load_gguf
from jaxdisagg.model.weights import load_model

CFG = LlamaConfig(name="gguf-test", vocab_size=96, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=256, rope_theta=50000.0,
                  rms_norm_eps=float(np.float32(1e-5)),  # GGUF stores float32
                  tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def permute(w, heads):
    """llama.cpp's converter: rotated halves -> adjacent pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def hf_tensors(cfg, seed=0):
    """Random weights in the Hugging Face [out, in] layout, by GGUF name."""
    rng = np.random.default_rng(seed)
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    out = {"token_embd.weight": w(cfg.vocab_size, d), "output_norm.weight": 1 + w(d),
           "output.weight": w(cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        out |= {f"blk.{i}.attn_norm.weight": 1 + w(d), f"blk.{i}.ffn_norm.weight": 1 + w(d),
                f"blk.{i}.attn_q.weight": w(cfg.num_heads * h, d),
                f"blk.{i}.attn_k.weight": w(cfg.num_kv_heads * h, d),
                f"blk.{i}.attn_v.weight": w(cfg.num_kv_heads * h, d),
                f"blk.{i}.attn_output.weight": w(d, cfg.num_heads * h),
                f"blk.{i}.ffn_gate.weight": w(f, d), f"blk.{i}.ffn_up.weight": w(f, d),
                f"blk.{i}.ffn_down.weight": w(d, f)}
    return out


def write_gguf(path, cfg, tensors, qtype="F32", arch="llama", skip=()):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": cfg.num_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_heads,
            "attention.head_count_kv": cfg.num_kv_heads}
    for key, value in keys.items():
        if key not in skip:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    expected = {}
    t = gguf.GGMLQuantizationType[qtype]
    for name, w in tensors.items():
        stored = w
        if name.endswith("attn_q.weight"):
            stored = permute(w, cfg.num_heads)
        elif name.endswith("attn_k.weight"):
            stored = permute(w, cfg.num_kv_heads)
        kind = t if w.ndim == 2 else gguf.GGMLQuantizationType.F32  # norms stay F32
        data = gguf.quants.quantize(stored, kind)
        writer.add_tensor(name, data, raw_dtype=kind)
        # What the file holds, back in the HF layout (row permutations commute with
        # per-row quantization blocks).
        expected[name] = gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind) \
            .reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("qtype", TYPES)
def test_round_trip_in_every_type(tmp_path, qtype):
    from jaxdisagg.model.gguf import hf_name
    from jaxdisagg.model.weights import hf_tensor

    tensors = hf_tensors(CFG)
    expected = write_gguf(tmp_path / "m.gguf", CFG, tensors, qtype)
    model, _ = load_gguf(tmp_path / "m.gguf")
    assert model.config.replace(name="gguf-test", bos_token_id=1, eos_token_ids=(2,)) == CFG
    params = nnx.to_pure_dict(nnx.state(model))
    for name, want in expected.items():
        got = hf_tensor(params, model.config, hf_name(name))
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=name)
    if qtype != "F32":  # quantization did change the weights, and we kept its values
        assert not np.array_equal(expected["blk.0.attn_q.weight"],
                                  tensors["blk.0.attn_q.weight"])


def test_load_model_takes_a_gguf_path_and_ties_a_missing_head(tmp_path):
    tensors = hf_tensors(CFG)
    del tensors["output.weight"]
    write_gguf(tmp_path / "tied.gguf", CFG, tensors)
    model, tok = load_model(str(tmp_path / "tied.gguf"))
    assert model.config.tie_word_embeddings and tok is None  # no tokenizer metadata


@pytest.mark.parametrize("change,message", [
    ({"arch": "gpt2"}, "architecture 'gpt2' is not supported (supported: llama)"),
    ({"skip": ("attention.head_count",)}, "metadata key 'llama.attention.head_count' is "
                                          "missing"),
    ({"skip": ("feed_forward_length",)}, "'llama.feed_forward_length' is missing"),
])
def test_bad_files_name_the_key(tmp_path, change, message):
    write_gguf(tmp_path / "bad.gguf", CFG, hf_tensors(CFG), **change)
    with pytest.raises(GGUFError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_gguf(tmp_path / "bad.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not gguf at all")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        load_gguf(tmp_path / "x.gguf")
