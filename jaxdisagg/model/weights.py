"""Weights: Hugging Face Llama checkpoints (safetensors) in, Orbax checkpoints in and out.

Loading is strict: every tensor in the files must map to a parameter, every
parameter must be filled, and shapes must match, or a `CheckpointError` names the
file and the tensor. A converted checkpoint directory holds `jaxdisagg.json`
(model config and dtype), `state/` (Orbax) and the tokenizer.json if there was one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxdisagg.model.config import LlamaConfig, RopeScaling, get_preset
from jaxdisagg.model.llama import Llama
from jaxdisagg.model.tokenizer import Tokenizer, load_tokenizer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
ORBAX_META = "jaxdisagg.json"
# /2: q/k/v and gate/up stored fused (see llama.py); /1 directories hold them apart.
ORBAX_FORMAT = "jaxdisagg-orbax/2"
# Buffers some older checkpoints carry that are not parameters.
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


# ---------------------------------------------------------------- HF config


def config_from_hf(hf: dict, source: str = "config.json") -> LlamaConfig:
    """Maps a transformers LlamaConfig dict (v4 or v5 layout) to ours."""
    archs = hf.get("architectures") or []
    if hf.get("model_type") != "llama" or not set(archs) <= set(SUPPORTED_ARCHITECTURES):
        raise CheckpointError(
            f"{source}: unsupported architecture (model_type={hf.get('model_type')!r}, "
            f"architectures={archs}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise CheckpointError(f"{source}: {flag}=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported "
                              "(Llama uses silu)")
    # transformers v5 moved rope_theta and rope_scaling into rope_parameters.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        def key(name, fallback=None):
            value = rope.get(name, fallback)
            if value is None:
                raise CheckpointError(f"{source}: llama3 rope scaling needs {name!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise CheckpointError(f"{source}: rope scaling {name!r} must be a positive "
                                      f"number, got {value!r}")
            return value

        # As transformers does: the original context defaults to max_position_embeddings.
        scaling = RopeScaling(float(key("factor")), float(key("low_freq_factor")),
                              float(key("high_freq_factor")),
                              int(key("original_max_position_embeddings",
                                      hf.get("max_position_embeddings"))))
    elif rope_type == "default":
        scaling = None
    else:
        raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported "
                              "(supported: default, llama3)")
    try:
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return LlamaConfig(
            name=hf.get("_name_or_path") or "hf-llama",
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_theta=float(theta), rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"))
    except KeyError as e:
        raise CheckpointError(f"{source}: missing required field {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


# ---------------------------------------------------------------- HF tensors

# HF name -> (our path, part, torch [out, in] layout -> ours, ours -> torch layout).
# `part` indexes the HF tensor's slice of a fused parameter (q/k/v in `qkv_proj`,
# gate/up in `gate_up_proj`); None: the tensor is the whole parameter.
_Transform = Callable[[np.ndarray, LlamaConfig], np.ndarray]
_Part = Callable[[LlamaConfig], tuple] | None
_Entry = tuple[tuple[str, ...], _Part, _Transform, Callable[[np.ndarray], np.ndarray]]
_same = (lambda w, c: w, lambda x: x)
_transpose = (lambda w, c: w.T, lambda x: x.T)


def _group(c: LlamaConfig) -> int:
    return c.num_heads // c.num_kv_heads


def _heads_in(shape: Callable[[LlamaConfig], tuple[int, ...]]):
    """q/k/v: [N*H, D] <-> [D, ..., H]."""
    return (lambda w, c: w.T.reshape(shape(c)), lambda x: x.reshape(x.shape[0], -1).T)


def _heads_out(shape: Callable[[LlamaConfig], tuple[int, ...]]):
    """o: [D, N*H] <-> [N, H, D]."""
    return (lambda w, c: w.T.reshape(shape(c)), lambda x: x.reshape(-1, x.shape[-1]).T)


_LAYER_MAP: dict[str, _Entry] = {
    "input_layernorm.weight": (("input_norm", "weight"), None, *_same),
    "post_attention_layernorm.weight": (("post_attn_norm", "weight"), None, *_same),
    # qkv_proj is [D, K, G+2, H]: query head k*G+g at [:, k, g], then k and v.
    "self_attn.q_proj.weight": (
        ("attn", "qkv_proj"), lambda c: np.s_[:, :, :_group(c)],
        *_heads_in(lambda c: (c.hidden_size, c.num_kv_heads, _group(c), c.head_dim))),
    "self_attn.k_proj.weight": (
        ("attn", "qkv_proj"), lambda c: np.s_[:, :, _group(c)],
        *_heads_in(lambda c: (c.hidden_size, c.num_kv_heads, c.head_dim))),
    "self_attn.v_proj.weight": (
        ("attn", "qkv_proj"), lambda c: np.s_[:, :, _group(c) + 1],
        *_heads_in(lambda c: (c.hidden_size, c.num_kv_heads, c.head_dim))),
    "self_attn.o_proj.weight": (("attn", "o_proj"), None, *_heads_out(
        lambda c: (c.num_heads, c.head_dim, c.hidden_size))),
    "mlp.gate_proj.weight": (("mlp", "gate_up_proj"), lambda c: np.s_[:, 0], *_transpose),
    "mlp.up_proj.weight": (("mlp", "gate_up_proj"), lambda c: np.s_[:, 1], *_transpose),
    "mlp.down_proj.weight": (("mlp", "down_proj"), None, *_transpose),
}
_TOP_MAP: dict[str, _Entry] = {
    "model.embed_tokens.weight": (("embed_tokens",), None, *_same),
    "model.norm.weight": (("norm", "weight"), None, *_same),
    "lm_head.weight": (("lm_head",), None, *_transpose),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _hf_to_path(name: str) -> _Entry | None:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        path, part, fwd, inv = _LAYER_MAP[m.group(2)]
        return ("layers", int(m.group(1)), *path), part, fwd, inv
    return None


def _hf_names(cfg: LlamaConfig) -> Iterator[tuple[str, _Entry]]:
    """Every HF tensor name this config's model has, with its entry."""
    for name, entry in _TOP_MAP.items():
        if not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            yield name, entry
    for i in range(cfg.num_layers):
        for suffix in _LAYER_MAP:
            yield f"model.layers.{i}.{suffix}", _hf_to_path(f"model.layers.{i}.{suffix}")


def hf_tensor(params: dict, cfg: LlamaConfig, name: str) -> np.ndarray:
    """The HF tensor `name` in its HF layout, from our pure-dict parameters."""
    path, part, _, to_hf = _hf_to_path(name)
    value = np.asarray(_get_path(params, path))
    return to_hf(value if part is None else value[part(cfg)])


def _safetensors_files(ckpt: Path) -> dict[str, Path]:
    """tensor name -> file, from the index if there is one, else from every file's header."""
    from safetensors import safe_open

    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (ckpt / f).exists()})
        if missing:
            raise CheckpointError(f"{index}: lists shard files that are missing: {missing}")
        return {name: ckpt / f for name, f in weight_map.items()}
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt}: no *.safetensors files (and no "
                              "model.safetensors.index.json)")
    where: dict[str, Path] = {}
    for f in files:
        with _open_safetensors(f, safe_open) as handle:
            for name in handle.keys():
                if name in where:
                    raise CheckpointError(f"{f}: tensor {name!r} is also in {where[name]}")
                where[name] = f
    return where


def _open_safetensors(path: Path, safe_open):
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None


def _iter_hf_tensors(where: dict[str, Path]) -> Iterator[tuple[str, Path, np.ndarray]]:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, f in where.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with _open_safetensors(f, safe_open) as handle:
            available = set(handle.keys())
            for name in names:
                if name not in available:
                    raise CheckpointError(f"{f}: tensor {name!r} listed in the index is "
                                          "not in this file")
                yield name, f, handle.get_tensor(name)


def _set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _get_path(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def load_hf_checkpoint(ckpt_dir: str | Path, dtype=jnp.float32,
                       progress: bool = False) -> Llama:
    """Builds a Llama from a HF directory (config.json + safetensors, index optional)."""
    ckpt = Path(ckpt_dir)
    cfg_file = ckpt / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file}: not found (is {ckpt} a Hugging Face checkpoint?)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from None
    cfg = config_from_hf(hf, str(cfg_file))
    where = _safetensors_files(ckpt)
    return build_model(cfg, dtype, _iter_hf_tensors(where), total=len(where),
                       progress=progress, source=ckpt, config_name=cfg_file.name)


def build_model(cfg: LlamaConfig, dtype, tensors: Iterator[tuple[str, object, np.ndarray]],
                total: int | None = None, progress: bool = False, source: object = "",
                config_name: str = "config.json") -> Llama:
    """A Llama from (HF tensor name, file, array in HF layout) triples, strictly: every
    tensor must map to a parameter, every parameter must be filled, and each shape is
    checked in the file's own layout before any reshape."""
    dtype = jnp.dtype(dtype)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=dtype)))
    expected = nnx.to_pure_dict(abstract)
    wanted = dict(_hf_names(cfg))
    seen: set[str] = set()
    values = jax.tree_util.tree_map(lambda _: None, expected)
    tied_head = None
    # disable=None: tqdm draws only on a terminal, so logs get no carriage-return frames
    for name, f, tensor in tqdm(tensors, total=total, disable=None if progress else True,
                                desc="loading tensors", unit="tensor"):
        if _IGNORED.match(name):
            continue
        mapped = _hf_to_path(name)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            tied_head = (f, tensor)  # allowed only if it equals the embedding (checked below)
            continue
        if mapped is None:
            raise CheckpointError(f"{f}: unexpected tensor {name!r} (no Llama parameter "
                                  "has this name)")
        if name not in wanted:
            raise CheckpointError(f"{f}: unexpected tensor {name!r} (the config has "
                                  f"{cfg.num_layers} layers)")
        path, part, transform, to_hf = mapped
        target = _get_path(expected, path)
        index = () if part is None else part(cfg)
        # Checked in the file's own layout, before any reshape: a transposed k_proj
        # has the right element count and would otherwise load as garbage.
        hf_shape = jax.eval_shape(lambda x, f=to_hf, i=index: f(x[i]),
                                  jax.ShapeDtypeStruct(target.shape, np.float32)).shape
        if tuple(tensor.shape) != tuple(hf_shape):
            raise CheckpointError(
                f"{f}: tensor {name!r} has shape {list(tensor.shape)}, expected "
                f"{list(hf_shape)} (the Hugging Face layout for {config_name})")
        if _get_path(values, path) is None:
            _set_path(values, path, np.empty(target.shape, dtype))
        _get_path(values, path)[index] = np.asarray(transform(tensor, cfg)).astype(dtype)
        seen.add(name)
    missing = [n for n in wanted if n not in seen]
    if missing:
        raise CheckpointError(f"{source}: missing tensors {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}")
    if tied_head is not None:
        f, tensor = tied_head
        if not np.array_equal(tensor.astype(dtype), values["embed_tokens"]):
            raise CheckpointError(f"{f}: unexpected tensor 'lm_head.weight': the config says "
                                  "tie_word_embeddings=true but it differs from the embedding")
    nnx.replace_by_pure_dict(abstract, jax.tree_util.tree_map(jnp.asarray, values))
    return nnx.merge(graphdef, abstract)


def config_to_hf(cfg: LlamaConfig, dtype) -> dict:
    """Our config as a transformers config.json (v4 keys, which v5 also reads)."""
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id,
        "torch_dtype": jnp.dtype(dtype).name,
    }
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return hf


def save_hf_checkpoint(model: Llama, out_dir: str | Path) -> Path:
    """Writes config.json + model.safetensors that `transformers` and `load_hf_checkpoint` read."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = nnx.to_pure_dict(nnx.state(model))
    tensors = {name: np.ascontiguousarray(hf_tensor(params, model.config, name))
               for name, _ in _hf_names(model.config)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_to_hf(model.config, model.dtype),
                                                indent=2))
    return out


# ---------------------------------------------------------------- Orbax


def save_orbax(model: Llama, out_dir: str | Path, tokenizer=None,
               progress: bool = False) -> Path:
    """Writes an Orbax checkpoint directory that `load_model` restores."""
    import orbax.checkpoint as ocp

    out = Path(out_dir).resolve()
    if (out / "state").exists():
        raise FileExistsError(f"{out / 'state'} already exists; choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=3, disable=None if progress else True,  # None: only on a terminal
                 desc="writing orbax checkpoint", unit="step")
    meta = {"format": ORBAX_FORMAT, "dtype": model.dtype.name,
            "config": dataclasses.asdict(model.config)}
    (out / ORBAX_META).write_text(json.dumps(meta, indent=2))
    steps.update()
    if tokenizer is not None and hasattr(tokenizer, "to_files"):  # not the byte tokenizer
        tokenizer.to_files(out)
    steps.update()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "state", nnx.state(model))
    checkpointer.wait_until_finished()
    steps.update()
    steps.close()
    return out


def _config_from_meta(meta: dict, source: str) -> LlamaConfig:
    fields = dict(meta["config"])
    if fields.get("rope_scaling"):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
    try:
        return LlamaConfig(**fields)
    except TypeError as e:
        raise CheckpointError(f"{source}: config does not match this version ({e})") from None


def load_orbax(ckpt_dir: str | Path, dtype=None) -> Llama:
    """Restores a `save_orbax` directory (in its saved dtype unless one is given)."""
    import orbax.checkpoint as ocp

    ckpt = Path(ckpt_dir).resolve()
    meta_file = ckpt / ORBAX_META
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_file}: cannot read ({e})") from None
    if meta.get("format") != ORBAX_FORMAT:
        raise CheckpointError(
            f"{meta_file}: format {meta.get('format')!r}, this version reads {ORBAX_FORMAT!r} "
            "(its weights are laid out differently); convert the source checkpoint again")
    cfg = _config_from_meta(meta, str(meta_file))
    saved = jnp.dtype(meta["dtype"])
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=saved)))
    if not (ckpt / "state").exists():
        raise CheckpointError(f"{ckpt / 'state'}: not found")
    try:
        state = ocp.StandardCheckpointer().restore(ckpt / "state", abstract)
    except Exception as e:  # orbax raises assorted types for structure mismatches
        raise CheckpointError(f"{ckpt / 'state'}: cannot restore ({e})") from None
    model = nnx.merge(graphdef, state)
    return model if dtype is None else cast_model(model, dtype)


def cast_model(model: Llama, dtype) -> Llama:
    dtype = jnp.dtype(dtype)
    if dtype == model.dtype:
        return model
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(model.config, dtype=dtype)))
    values = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype),
                                    nnx.to_pure_dict(nnx.state(model)))
    nnx.replace_by_pure_dict(abstract, values)
    return nnx.merge(graphdef, abstract)


# ---------------------------------------------------------------- one entry point


def load_model(spec: str, dtype=jnp.float32, seed: int = 0,
               progress: bool = False) -> tuple[Llama, Tokenizer | None]:
    """A preset name (random weights, byte tokenizer), a catalog name (`smollm2`:
    fetched on first use, see `fetch.py`), a GGUF file, or a HF or Orbax checkpoint
    directory.

    The tokenizer (with the checkpoint's chat template) is None for a checkpoint
    without one.
    """
    from jaxdisagg.model.fetch import CATALOG, fetch

    path = Path(spec)
    if not path.exists() and spec in CATALOG:
        path = fetch(spec)
    if not path.exists():
        if "/" in spec or spec.startswith(".") or spec.endswith(".gguf"):
            raise CheckpointError(f"{spec}: no such checkpoint file or directory")
        cfg = get_preset(spec)
        return Llama(cfg, dtype=dtype, seed=seed), load_tokenizer(None, cfg)
    if path.is_file() and path.suffix == ".gguf":
        from jaxdisagg.model.gguf import load_gguf
        from jaxdisagg.model.tokenizer import HFTokenizer

        model, spec_tok = load_gguf(path, jnp.dtype(dtype), progress=progress)
        tok = None if spec_tok is None else HFTokenizer.from_gguf(spec_tok, model.config)
        return model, tok
    if not path.is_dir():
        raise CheckpointError(f"{spec}: a checkpoint is a directory (Hugging Face or Orbax) "
                              "or a .gguf file")
    if (path / ORBAX_META).exists():
        model = load_orbax(path, dtype)
    else:
        model = load_hf_checkpoint(path, dtype, progress=progress)
    return model, load_tokenizer(path, model.config)
