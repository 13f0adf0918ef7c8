"""Paged decode attention in Pallas: flash-decoding split-K over pages, GQA native.

Grid (slot b, KV head k, split s). Each program reads the pages of split s of slot
b's block table, for KV head k only, once, and computes all G query heads of that
KV head against them: no KV head is read twice. (A group that is not a power of two
is padded to one with zero rows, which Triton's block shapes require.) The
logits of G rows are computed with broadcast products rather than a tensor-core dot
(decode is bandwidth-bound and G may be 1..8, below the 16-row minimum of a dot).
Each split writes an unnormalised partial (acc, max, sum); a jnp combine step
merges the splits. Slots with length 0 give zeros.

Letters: B slots, K KV heads, G query heads per KV head, H head_dim, S splits,
P pages per slot, bs block size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(tables_ref, lens_ref, q_ref, k_ref, v_ref, *refs, pages_per_split: int,
            pages_per_step: int, scale: float):
    acc_ref, m_ref, l_ref = refs[-3:]  # (any aliased init buffers come first)
    b, s = pl.program_id(0), pl.program_id(2)
    num_blocks, bs, h = k_ref.shape
    g = q_ref.shape[0]
    step_keys = pages_per_step * bs
    q = q_ref[...].astype(jnp.float32) * scale  # [G, H]
    seq_len = lens_ref[b]
    first = s * pages_per_split
    pages_here = jnp.clip(pl.cdiv(seq_len, bs) - first, 0, pages_per_split)

    def body(i, carry):
        acc, m, denom = carry
        p0 = first + i * pages_per_step
        pages = jnp.clip(tables_ref[b, pl.ds(p0, pages_per_step)], 0, num_blocks - 1)
        k = k_ref[pages].reshape(step_keys, h).astype(jnp.float32)  # [BK, H]
        v = v_ref[pages].reshape(step_keys, h).astype(jnp.float32)
        logits = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1)  # [G, BK]
        pos = p0 * bs + jax.lax.broadcasted_iota(jnp.int32, (g, step_keys), 1)
        logits = jnp.where(pos < seq_len, logits, _NEG)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        p = jnp.exp(logits - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return acc, m_new, denom * alpha + p.sum(axis=-1)

    init = (jnp.zeros((g, h), jnp.float32), jnp.full((g,), _NEG, jnp.float32),
            jnp.zeros((g,), jnp.float32))
    acc, m, denom = jax.lax.fori_loop(0, pl.cdiv(pages_here, pages_per_step), body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = denom


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_splits",
                                             "pages_per_step", "num_warps", "poison"))
def paged_decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale: float,
                           interpret: bool = False, num_splits: int | None = None,
                           pages_per_step: int | None = None, num_warps: int = 4,
                           poison: bool = False):
    """q [B, N, H]; pages [NB, bs, K, H]; block_tables [B, P]; seq_lens [B] -> [B, N, H].

    Same contract as `reference.decode_attention_ref`: seq_lens counts the keys
    (the current token's K/V already written); length-0 slots give zeros.
    poison (tests): the kernel's output buffers start as NaN, so any element it
    fails to write shows up in the result of a non-empty slot.
    """
    b, n, h = q.shape
    nb, bs, kh, _ = k_pages.shape
    g = n // kh
    p = block_tables.shape[1]
    if pages_per_step is None:  # >= 16 keys a step, never more pages than a slot has
        pages_per_step = min(max(1, 16 // bs), pl.next_power_of_2(p))
    if num_splits is None:  # enough programs to fill a GPU at small batch
        num_splits = max(1, min(p // pages_per_step, 8))
    per_split = pl.cdiv(pl.cdiv(p, num_splits), pages_per_step) * pages_per_step
    padded = per_split * num_splits
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - p)))
    # Triton blocks must have power-of-two sides: a group of 3 (SmolLM2's 9/3 heads) runs
    # as 4 rows, the extra one zeros whose result is dropped. Decode is bandwidth-bound,
    # so the padded row costs no extra KV read.
    gp = pl.next_power_of_2(g)
    qg = jnp.pad(q.reshape(b, kh, g, h), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    partial = jax.ShapeDtypeStruct((num_splits, b, kh, gp), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((num_splits, b, kh, gp, h), jnp.float32), partial,
                 partial]
    inits = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape] if poison else []
    acc, m, denom = pl.pallas_call(
        functools.partial(_kernel, pages_per_split=per_split, pages_per_step=pages_per_step,
                          scale=scale),
        grid=(b, kh, num_splits),
        in_specs=[
            pl.BlockSpec((b, padded), lambda i, j, s: (0, 0)),  # block tables
            pl.BlockSpec((b,), lambda i, j, s: (0,)),  # lengths
            pl.BlockSpec((None, None, gp, h), lambda i, j, s: (i, j, 0, 0)),  # q
            pl.BlockSpec((nb, bs, None, h), lambda i, j, s: (0, 0, j, 0)),  # K pages, head j
            pl.BlockSpec((nb, bs, None, h), lambda i, j, s: (0, 0, j, 0)),  # V pages, head j
        ] + [pl.BlockSpec(memory_space=pl.ANY)] * len(inits),
        out_specs=[
            pl.BlockSpec((None, None, None, gp, h), lambda i, j, s: (s, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, s: (s, i, j, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, s: (s, i, j, 0)),
        ],
        out_shape=out_shape,
        input_output_aliases={5 + i: i for i in range(len(inits))},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        name="paged_decode_attention",
    )(tables, seq_lens.astype(jnp.int32), qg, k_pages, v_pages, *inits)
    # Combine the splits: rescale each to the global max, then normalise once.
    m_all = m.max(axis=0)
    w = jnp.exp(m - m_all[None])  # [S, B, K, G]
    total = (denom * w).sum(axis=0)
    out = (acc * w[..., None]).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    out = jnp.where((seq_lens > 0)[:, None, None, None], out[:, :, :g], 0.0)
    return out.reshape(b, n, h).astype(q.dtype)
