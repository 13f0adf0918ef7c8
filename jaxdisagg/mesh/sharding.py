"""Logical-axis rules: how weights and KV pages are laid out over a pool's `tp` axis.

Each parameter names its dimensions with logical axes; one short rule table maps
logical axes to mesh axes. Attention heads and ffn columns shard over `tp`; the
KV pages shard over KV heads; everything else is replicated.

When `tp` exceeds the model's KV heads, the KV heads are replicated explicitly
(`replicate_kv_heads`): the pool runs a model whose k/v projections repeat each
head `tp / K` times, so every device owns whole KV heads. The math is unchanged
(each query head still reads its own original KV head); memory and transfer bytes
grow by that factor, and `KVLayout` accounts for it because it sees the
replicated head count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdisagg.model.llama import Llama

TP = "tp"

# logical axis -> mesh axis (None: replicated)
RULES: dict[str, str | None] = {
    "vocab": None,  # logits stay whole, so sampling needs no gather
    "embed": None,
    "heads": TP,
    "kv_heads": TP,
    "head_dim": None,
    "qkv_part": None,  # a KV head's G query heads, its k and its v: kept together
    "ffn": TP,
    "gate_up": None,
    "blocks": None,
    "block_pos": None,
}

# parameter name (last path element) -> logical axes of its dimensions
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed_tokens": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "qkv_proj": ("embed", "kv_heads", "qkv_part", "head_dim"),
    "o_proj": ("heads", "head_dim", "embed"),
    "gate_up_proj": ("embed", "gate_up", "ffn"),
    "down_proj": ("ffn", "embed"),
    "weight": ("embed",),  # RMSNorm scales
}
KV_PAGE_AXES = ("blocks", "block_pos", "kv_heads", "head_dim")


def spec_for(axes: tuple[str, ...]) -> PartitionSpec:
    return PartitionSpec(*(RULES[a] for a in axes))


def make_mesh(device_indices, devices=None) -> Mesh:
    """A 1-D `tp` mesh over the given device indices of this process."""
    devices = jax.devices() if devices is None else devices
    return Mesh(np.array([devices[i] for i in device_indices]), (TP,))


def kv_replication(num_kv_heads: int, tp: int) -> int:
    """How many copies of each KV head a pool of this `tp` keeps (1: none)."""
    return tp // num_kv_heads if tp > num_kv_heads else 1


def replicate_kv_heads(model: Llama, factor: int) -> Llama:
    """The same model with every KV head repeated `factor` times (consecutively).

    Expanded head e is a copy of original head e // factor, and query head n
    (group size now N / (K * factor)) maps to expanded head n // (N / (K * factor)),
    a copy of its original head n // (N / K): outputs are identical.
    """
    if factor == 1:
        return model
    cfg = model.config.replace(num_kv_heads=model.config.num_kv_heads * factor)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=model.dtype)))
    params = nnx.to_pure_dict(nnx.state(model))
    for layer in params["layers"].values():
        qkv = layer["attn"]["qkv_proj"]  # [D, K, G+2, H]
        d, k, c, h = qkv.shape
        g = (c - 2) // factor
        # Each KV head's query heads split into `factor` groups, each with its own
        # copy of the head's k and v: [D, K, factor, g+2, H].
        q = qkv[:, :, :c - 2].reshape(d, k, factor, g, h)
        kv = jnp.broadcast_to(qkv[:, :, None, c - 2:], (d, k, factor, 2, h))
        layer["attn"]["qkv_proj"] = jnp.concatenate([q, kv], axis=3).reshape(
            d, k * factor, g + 2, h)
    nnx.replace_by_pure_dict(abstract, params)
    return nnx.merge(graphdef, abstract)


def state_shardings(state: nnx.State, mesh: Mesh):
    """A NamedSharding for every parameter of the state, from PARAM_AXES."""

    def one(path, _):
        # The path ends in the variable's `.value`; the parameter's name is the last
        # string dict key before it.
        name = [k.key for k in path if isinstance(getattr(k, "key", None), str)][-1]
        return NamedSharding(mesh, spec_for(PARAM_AXES[name]))

    return jax.tree_util.tree_map_with_path(one, state)


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, spec_for(KV_PAGE_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
