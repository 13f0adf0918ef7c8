"""GGUF checkpoints (llama.cpp's format), read with the `gguf` package.

A GGUF file holds the whole checkpoint: the model's shape as metadata
(`llama.block_count`, `llama.attention.head_count`, ...), the tokenizer
(`tokenizer.ggml.*`), the chat template, and the tensors, often quantized. We
dequantize every tensor to float32 with `gguf.quants` (F32, F16, BF16, Q8_0,
Q4_0/1, Q5_0/1, the K-quants and the rest the package knows), turn llama.cpp's
names and layouts back into Hugging Face's, and hand the result to the same
strict builder the safetensors loader uses.

llama.cpp's converter permutes the rows of q_proj and k_proj (its RoPE pairs
adjacent elements, Hugging Face's rotates halves); `_unpermute` undoes that.
A missing `output.weight` means tied embeddings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdisagg.model.config import LlamaConfig

SUPPORTED = ("llama",)

_TOP = {"token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


class GGUFError(ValueError):
    """A GGUF file we cannot serve; the message names the file and the key or tensor."""


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """What the file says about its tokenizer (`tokenizer.ggml.*`)."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises assorted types on bad files
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _value(reader, key: str, path: Path, default=None, required: bool = False):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise GGUFError(f"{path}: metadata key {key!r} is missing")
        return default
    return field.contents()


def _positive_int(reader, key, path, default=None) -> int:
    value = _value(reader, key, path, default, required=default is None)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise GGUFError(f"{path}: metadata key {key!r} must be a positive integer, "
                        f"got {value!r}")
    return int(value)


def config_from_gguf(reader, path: Path) -> LlamaConfig:
    arch = _value(reader, "general.architecture", path, required=True)
    if arch not in SUPPORTED:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED)})")
    scaling = _value(reader, f"{arch}.rope.scaling.type", path)
    if scaling not in (None, "none"):
        raise GGUFError(f"{path}: metadata key '{arch}.rope.scaling.type' = {scaling!r} is "
                        "not supported (plain RoPE only for GGUF files)")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' (llama3 RoPE frequency factors) "
                        "is not supported for GGUF files yet; convert the Hugging Face "
                        "checkpoint instead")
    heads = _positive_int(reader, f"{arch}.attention.head_count", path)
    hidden = _positive_int(reader, f"{arch}.embedding_length", path)
    tokens = _value(reader, "tokenizer.ggml.tokens", path)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab_default = len(tokens) if tokens else (int(embd.shape[1]) if embd is not None else None)
    eos = _value(reader, "tokenizer.ggml.eos_token_id", path)
    eot = _value(reader, "tokenizer.ggml.eot_token_id", path)
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    bos = _value(reader, "tokenizer.ggml.bos_token_id", path)
    pad = _value(reader, "tokenizer.ggml.padding_token_id", path)
    name = _value(reader, "general.name", path, default=path.stem)
    try:
        return LlamaConfig(
            name=str(name), vocab_size=_positive_int(reader, f"{arch}.vocab_size", path,
                                                     vocab_default),
            hidden_size=hidden,
            intermediate_size=_positive_int(reader, f"{arch}.feed_forward_length", path),
            num_layers=_positive_int(reader, f"{arch}.block_count", path),
            num_heads=heads,
            num_kv_heads=_positive_int(reader, f"{arch}.attention.head_count_kv", path, heads),
            head_dim=_positive_int(reader, f"{arch}.rope.dimension_count", path,
                                   hidden // heads),
            max_position_embeddings=_positive_int(reader, f"{arch}.context_length", path),
            rope_theta=float(_value(reader, f"{arch}.rope.freq_base", path, 10000.0)),
            rms_norm_eps=float(_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", path,
                                      required=True)),
            tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
            pad_token_id=None if pad is None else int(pad))
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (adjacent pairs back to rotated halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str) -> str | None:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.weight"
    return None


def iter_tensors(reader, path: Path, cfg: LlamaConfig
                 ) -> Iterator[tuple[str, str, np.ndarray]]:
    """(HF name, where, float32 array in the HF [out, in] layout) for every tensor."""
    from gguf import quants

    for t in reader.tensors:
        name = hf_name(t.name)
        where = f"{path}: tensor {t.name!r}"
        if name is None:
            raise GGUFError(f"{where} has no Llama parameter")
        try:
            w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError:
            raise GGUFError(f"{where}: type {t.tensor_type.name} cannot be dequantized by "
                            "the gguf package") from None
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGML lists dims inner first
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg.num_kv_heads)
        yield name, where, w


def load_gguf(path: str | Path, dtype=np.float32, progress: bool = False):
    """(Llama, GGUFTokenizerSpec) from a GGUF file."""
    from jaxdisagg.model.weights import build_model

    path = Path(path)
    reader = _reader(path)
    cfg = config_from_gguf(reader, path)
    model = build_model(cfg, dtype, iter_tensors(reader, path, cfg), total=len(reader.tensors),
                        progress=progress, source=path, config_name=f"{path.name}'s metadata")
    return model, tokenizer_spec(reader, path)


def tokenizer_spec(reader, path: Path) -> GGUFTokenizerSpec | None:
    model = _value(reader, "tokenizer.ggml.model", path)
    if model is None:
        return None

    def opt_int(key):
        v = _value(reader, key, path)
        return None if v is None else int(v)

    scores = _value(reader, "tokenizer.ggml.scores", path)
    return GGUFTokenizerSpec(
        model=str(model), tokens=list(_value(reader, "tokenizer.ggml.tokens", path, [])),
        token_types=[int(t) for t in _value(reader, "tokenizer.ggml.token_type", path, [])],
        merges=list(_value(reader, "tokenizer.ggml.merges", path, [])),
        scores=None if scores is None else [float(s) for s in scores],
        bos_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_id=opt_int("tokenizer.ggml.eos_token_id"),
        unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
        pad_id=opt_int("tokenizer.ggml.padding_token_id"),
        add_bos=bool(_value(reader, "tokenizer.ggml.add_bos_token", path, True)),
        add_eos=bool(_value(reader, "tokenizer.ggml.add_eos_token", path, False)),
        add_space_prefix=bool(_value(reader, "tokenizer.ggml.add_space_prefix", path, False)),
        chat_template=_value(reader, "tokenizer.chat_template", path))


def write_f32_gguf(src: str | Path, dst: str | Path) -> Path:
    """A copy of GGUF `src` with every tensor dequantized to float32, names and
    metadata kept: the same weights our loader computes with, for a peer (llama.cpp)
    that should compute on exactly them."""
    import gguf
    from gguf import quants

    src, dst = Path(src), Path(dst)
    reader = _reader(src)
    arch = _value(reader, "general.architecture", src, required=True)
    writer = gguf.GGUFWriter(str(dst), arch)
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture",
            "general.file_type"}
    for key, field in reader.fields.items():
        if key in skip:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        writer.add_tensor(t.name, w.reshape(tuple(int(d) for d in reversed(t.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
