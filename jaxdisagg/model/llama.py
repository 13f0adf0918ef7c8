"""Llama in Flax NNX.

Dimension letters in einsum strings and shape comments:
  B batch   T tokens   D hidden   F ffn   V vocab
  N query heads   K KV heads   H head_dim   M = N*H
  G query heads per KV head (N = K*G)   C parts of a fused projection

q, k and v are one fused weight, and so are gate and up: one product instead of
three (or two) is fewer ops to dispatch, and at one token a step, where products
stream their weights from memory, a larger product streams faster. SmolLM2 on a
2-core CPU: q+k+v took 194-214 us a layer, the fused product 100; the B=1 step got
5-11% faster, B=8 and prefill did not measurably change (BENCHMARKS.md).
The fused q/k/v weight is laid out per KV head, [D, K, G+2, H] (that head's G
query heads, then its k, then its v), so sharding it over K gives every device
whole groups and the layout works for any tensor-parallel size.

Every layer keeps its own weight arrays (no stacked [L, ...] parameters): an
unrolled loop over stacked weights decoded ~4x slower on XLA:CPU (measured here).

The model does not own a KV cache. Each attention layer hands its rotated q, k, v
to an `attend` callback together with that layer's cache entry, and gets back the
attention output and the updated entry. The reference generator (contiguous
cache) and the serving entry points (paged cache) are two such callbacks over the
same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdisagg.model.config import LlamaConfig
from jaxdisagg.model.rope import apply_rope, inverse_frequencies, rope_angles

# attend(q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], cache_entry) -> (out [B,T,N,H], cache_entry)
Attend = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
# product(spec, x, w): the einsum `spec` of activations x and a weight w, which
# contracts x's last axis with w's first, or, for the tied LM head (`TIED_HEAD`), with
# its last. The serving entry points may pass a kernel for the decode step's few rows;
# the default is XLA's.
Product = Callable[[str, jax.Array, jax.Array], jax.Array]
TIED_HEAD = "...D,VD->...V"


def xla_product(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w)

INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jax.Array:
    return (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in fp32 whatever the compute dtype, then scale in the input dtype
        # (the order transformers uses, so bf16 rounding matches too).
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def pack_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [D, N, H], k and v [D, K, H] -> the fused weight [D, K, G+2, H]."""
    d, n, h = q.shape
    kv = k.shape[1]
    return jnp.concatenate([q.reshape(d, kv, n // kv, h), k[:, :, None], v[:, :, None]], axis=2)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # Drawn part by part in the order the unfused weights were, so a seed gives
        # the same model as before the fusion.
        q, kw, vw = (_normal(rngs, s, dtype) for s in ((d, n, h), (d, k, h), (d, k, h)))
        self.qkv_proj = nnx.Param(pack_qkv(q, kw, vw))  # [D, K, G+2, H]
        self.o_proj = nnx.Param(_normal(rngs, (n, h, d), dtype))  # [N, H, D]

    def __call__(self, x, cos, sin, cache, attend: Attend, product: Product = xla_product):
        qkv = product("BTD,DKCH->BTKCH", x, self.qkv_proj[...])
        b, t, kv, c, h = qkv.shape
        q = qkv[:, :, :, :c - 2].reshape(b, t, kv * (c - 2), h)  # [B, T, N, H]
        k, v = qkv[:, :, :, c - 2], qkv[:, :, :, c - 1]  # [B, T, K, H]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, cache = attend(q, k, v, cache)  # [B, T, N, H]
        b, t, n, h = out.shape
        o_proj = self.o_proj[...].reshape(n * h, -1)  # [N*H, D]: one plain matmul
        return product("BTM,MD->BTD", out.astype(x.dtype).reshape(b, t, n * h), o_proj), cache


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        gate, up = _normal(rngs, (d, f), dtype), _normal(rngs, (d, f), dtype)
        self.gate_up_proj = nnx.Param(jnp.stack([gate, up], axis=1))  # [D, 2, F]
        self.down_proj = nnx.Param(_normal(rngs, (f, d), dtype))  # [F, D]

    def __call__(self, x, product: Product = xla_product):
        gate_up = product("BTD,DCF->BTCF", x, self.gate_up_proj[...])
        gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
        return product("BTF,FD->BTD", jax.nn.silu(gate) * up, self.down_proj[...])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, cos, sin, cache, attend: Attend, product: Product = xla_product):
        attn_out, cache = self.attn(self.input_norm(x), cos, sin, cache, attend, product)
        x = x + attn_out
        return x + self.mlp(self.post_attn_norm(x), product), cache


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 seed: int = 0):
        rngs = rngs if rngs is not None else nnx.Rngs(params=seed)
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        nnx.Param(_normal(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)))

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> [B, T, D]."""
        return jnp.take(self.embed_tokens[...], tokens, axis=0)

    def run_layers(self, x, positions, caches: Sequence[Any], attend: Attend,
                   product: Product = xla_product):
        """Runs every layer over x [B, T, D] at positions [B, T].

        `caches` holds one entry per layer. Returns (x, updated caches).
        """
        cfg = self.config
        inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_angles(positions, inv_freq)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, cache = layer(x, cos, sin, cache, attend, product)
            new_caches.append(cache)
        return x, new_caches

    def logits(self, x: jax.Array, product: Product = xla_product) -> jax.Array:
        """Final norm and LM head: [..., D] -> fp32 [..., V]."""
        x = self.norm(x)
        if self.lm_head is None:
            out = product(TIED_HEAD, x, self.embed_tokens[...])
        else:  # XLA's: no kernel has been measured on an untied head
            out = jnp.einsum("...D,DV->...V", x, self.lm_head[...])
        return out.astype(jnp.float32)

    def __call__(self, tokens, positions, caches, attend: Attend):
        """Whole forward: tokens [B, T] -> (fp32 logits [B, T, V], updated caches)."""
        x, caches = self.run_layers(self.embed(tokens), positions, caches, attend)
        return self.logits(x), caches
