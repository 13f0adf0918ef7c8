"""Rotary position embedding, rotate-half convention (as Hugging Face Llama).

Frequencies are computed in fp32 the way `transformers` does, so positions in
the thousands give the same angles to the last bit that matters for parity.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdisagg.model.config import RopeScaling


@functools.cache
def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """[head_dim // 2] fp32 inverse frequencies, with Llama-3 scaling if given."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    # Llama-3: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between them interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin, each [*positions.shape, head_dim // 2], in fp32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    both = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    # Left alone, XLA:CPU fuses the trig into every layer's rope (optimization barriers
    # are expanded away before fusion there) and evaluates it per output element: a
    # B x N x H cos and sin per layer instead of B x H/2 once, 1 ms of an 8-slot
    # SmolLM2 step. A product is never fused into its consumers, so passing the angles
    # through an identity (exact at HIGHEST precision) computes them once a call.
    eye = jnp.eye(both.shape[-1], dtype=jnp.float32)
    both = jnp.matmul(both, eye, precision=jax.lax.Precision.HIGHEST)
    half = inv_freq.shape[-1]
    return both[..., :half], both[..., half:]


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x: [B, T, N, H]; cos/sin: [B, T, H/2]. Rotate-half pairs (i, i + H/2)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
