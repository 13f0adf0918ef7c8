"""Paged decode attention in Pallas: flash-decoding split-K over pages, GQA native.

Grid (slot b, KV head k, split s). Each program reads the pages of split s of slot
b's block table, for KV head k only, once, and computes all G query heads of that
KV head against them: no KV head is read twice. Both products run on tensor cores
(`dot` of bf16 tiles, fp32 accumulation): the group is padded with zero rows to the
16-row minimum of a tensor-core tile (and to a power of two, which Triton's block
shapes must be). The padding costs no KV traffic, and decode is bandwidth-bound.
Each split writes an unnormalised partial (acc, max, sum); a jnp combine step
merges the splits. A split past a slot's length, and a slot of length 0, does no
work (zeros).

Launch shape (keys per step, splits, warps, stages): `blocks.DecodeBlocks`, chosen
by shape unless the deployment config sets it.

Letters: B slots, K KV heads, G query heads per KV head (Gp padded), H head_dim,
S splits, P pages per slot, bs block size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxdisagg.pallas.blocks import DecodeBlocks, decode_blocks
from jaxdisagg.pallas.tiles import NEG, layout_key, load_pages, padded_head_dim


def _kernel(tables_ref, lens_ref, q_ref, k_ref, v_ref, *refs, pages_per_split: int,
            pages_per_step: int, scale: float, head_dim: int):
    acc_ref, m_ref, l_ref = refs[-3:]  # (any aliased init buffers come first)
    b, s = pl.program_id(0), pl.program_id(2)
    num_blocks, bs, h = k_ref.shape
    g = q_ref.shape[0]
    step_keys = pages_per_step * bs
    q = q_ref[...]  # [Gp, Hp], the input dtype: bf16 tiles go to the tensor cores
    seq_len = lens_ref[b]
    first = s * pages_per_split
    pages_here = jnp.clip(pl.cdiv(seq_len, bs) - first, 0, pages_per_split)

    def body(i, carry):
        acc, m, denom = carry
        p0 = first + i * pages_per_step
        pages = jnp.clip(tables_ref[b, pl.ds(p0, pages_per_step)], 0, num_blocks - 1)
        k = load_pages(k_ref, pages, head_dim).reshape(step_keys, h)  # [BK, H]
        v = load_pages(v_ref, pages, head_dim).reshape(step_keys, h)
        logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * scale  # [Gp, BK]
        pos = p0 * bs + jax.lax.broadcasted_iota(jnp.int32, (g, step_keys), 1)
        logits = jnp.where(pos < seq_len, logits, NEG)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        p = jnp.exp(logits - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, denom * alpha + p.sum(axis=-1)

    init = (jnp.zeros((g, h), jnp.float32), jnp.full((g,), NEG, jnp.float32),
            jnp.zeros((g,), jnp.float32))
    acc, m, denom = jax.lax.fori_loop(0, pl.cdiv(pages_here, pages_per_step), body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = denom


def _launch(q, k_pages, block_tables, blocks: DecodeBlocks | None) -> DecodeBlocks:
    b, n, h = q.shape
    _, bs, kh, _ = k_pages.shape
    key, itemsize = layout_key(k_pages, n // kh)
    return decode_blocks(blocks, key=key, batch=b, kv_heads=kh, block_size=bs, head_dim=h,
                         pages=block_tables.shape[1], itemsize=itemsize)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "blocks", "poison"))
def paged_decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale: float,
                           interpret: bool = False, blocks: DecodeBlocks | None = None,
                           poison: bool = False):
    """q [B, N, H]; pages [NB, bs, K, H]; block_tables [B, P]; seq_lens [B] -> [B, N, H].

    Same contract as `reference.decode_attention_ref`: seq_lens counts the keys
    (the current token's K/V already written); length-0 slots give zeros.
    blocks: the launch shape; fields left None are chosen by shape (`blocks.py`).
    poison (tests): the kernel's output buffers start as NaN, so any element it
    fails to write shows up in the result of a non-empty slot.
    """
    b, n, h = q.shape
    nb, bs, kh, _ = k_pages.shape
    g = n // kh
    p = block_tables.shape[1]
    launch = _launch(q, k_pages, block_tables, blocks)
    pages_per_step, num_splits = launch.keys_per_step // bs, launch.num_splits
    per_split = pl.cdiv(pl.cdiv(p, num_splits), pages_per_step) * pages_per_step
    padded = per_split * num_splits
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - p)))
    # A tensor-core tile has >= 16 rows and Triton's a power-of-two side: SmolLM2's group
    # of 3 runs as 16 rows, 13 of them zeros whose results are dropped.
    gp, hp = max(16, pl.next_power_of_2(g)), padded_head_dim(h)
    qg = jnp.pad(q.reshape(b, kh, g, h), ((0, 0), (0, 0), (0, gp - g), (0, hp - h)))
    partial = jax.ShapeDtypeStruct((num_splits, b, kh, gp), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((num_splits, b, kh, gp, hp), jnp.float32), partial,
                 partial]
    inits = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape] if poison else []
    acc, m, denom = pl.pallas_call(
        functools.partial(_kernel, pages_per_split=per_split, pages_per_step=pages_per_step,
                          scale=scale, head_dim=h),
        grid=(b, kh, num_splits),
        in_specs=[
            pl.BlockSpec((b, padded), lambda i, j, s: (0, 0)),  # block tables
            pl.BlockSpec((b,), lambda i, j, s: (0,)),  # lengths
            pl.BlockSpec((None, None, gp, hp), lambda i, j, s: (i, j, 0, 0)),  # q
            pl.BlockSpec((nb, bs, None, hp), lambda i, j, s: (0, 0, j, 0)),  # K pages, head j
            pl.BlockSpec((nb, bs, None, hp), lambda i, j, s: (0, 0, j, 0)),  # V pages, head j
        ] + [pl.BlockSpec(memory_space=pl.ANY)] * len(inits),
        out_specs=[
            pl.BlockSpec((None, None, None, gp, hp), lambda i, j, s: (s, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, s: (s, i, j, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, s: (s, i, j, 0)),
        ],
        out_shape=out_shape,
        input_output_aliases={5 + i: i for i in range(len(inits))},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps,
                                             num_stages=launch.num_stages),
        name="paged_decode_attention",
    )(tables, seq_lens.astype(jnp.int32), qg, k_pages, v_pages, *inits)
    # Combine the splits: rescale each to the global max, then normalise once.
    m_all = m.max(axis=0)
    w = jnp.exp(m - m_all[None])  # [S, B, K, G]
    total = (denom * w).sum(axis=0)
    out = (acc * w[..., None]).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    out = jnp.where((seq_lens > 0)[:, None, None, None], out[:, :, :g, :h], 0.0)
    return out.reshape(b, n, h).astype(q.dtype)
