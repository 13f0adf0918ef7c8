"""Chunked-prefill flash attention over a paged KV cache, in Pallas, GQA native.

The queries of one chunk are regrouped per KV head with each KV head's G query
heads folded into the rows: row r of KV head k is token r // G, query head
k*G + r % G. Grid (KV head k, row block i): a program loads its [BR, H] query rows
once and streams that KV head's keys and values page by page, straight from the
paged cache through the block table, with an online softmax in fp32. One load of a
KV tile serves all G heads of the group (no duplicated KV reads, no group padding),
and the rows are a multiple of 16, so both matmuls run on tensor cores.

Key s is visible to row r when s <= start + r // G (causal, the cached prefix
included) and s < start + num_valid. The loop stops at the last page any row of
the block can see, so a chunk at the start of a long table never reads the rest;
the steps before the block's diagonal run without the mask. (Together with base-2
logits and the longest row blocks first: 1.28-1.54x the single masked loop on an
H200, BENCHMARKS.md.)

Launch shape (row block, keys per step, warps, stages): `blocks.PrefillBlocks`,
chosen by shape unless the deployment config sets it.

Letters: T chunk tokens, R = T*G rows, BR rows per block, BK keys per step,
K KV heads, G group, H head_dim, bs block size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxdisagg.pallas.blocks import PrefillBlocks, prefill_blocks
from jaxdisagg.pallas.tiles import LOG2E, NEG, layout_key, load_pages, padded_head_dim


def _kernel(table_ref, bounds_ref, q_ref, k_ref, v_ref, *refs, group: int,
            pages_per_step: int, scale: float, head_dim: int):
    o_ref = refs[-1]  # (an aliased init buffer, if any, comes first)
    i = _row_block(pl.program_id(1), pl.num_programs(1))
    num_blocks, bs, h = k_ref.shape
    rows = q_ref.shape[0]
    step_keys = pages_per_step * bs
    start, num_valid = bounds_ref[0], bounds_ref[1]
    kv_len = start + num_valid
    # Logits in base 2: exp2 is one instruction, exp a range reduction plus it.
    q, qk_scale = q_ref[...], scale * LOG2E  # [BR, H]
    q_pos = start + (i * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, step_keys), 0)
                     ) // group
    first_q = start + (i * rows) // group  # the block's earliest position
    # The last key any row of this block may see, and so the pages to stream.
    last_key = jnp.minimum(start + ((i + 1) * rows - 1) // group, kv_len - 1)
    # A block made only of padding tokens (past num_valid) reads nothing and writes zeros.
    steps = jnp.where((i * rows) // group < num_valid, pl.cdiv(last_key + 1, step_keys), 0)
    # Keys up to first_q are visible to every row (and < kv_len when the block has a
    # real row): those steps skip the mask, whose iota, compares and select per logit
    # add to the softmax's elementwise work. Only the diagonal steps mask.
    full_steps = jnp.minimum((first_q + 1) // step_keys, steps)

    def body(j, carry, masked: bool):
        acc, m, denom = carry
        pages = jnp.clip(table_ref[pl.ds(j * pages_per_step, pages_per_step)], 0,
                         num_blocks - 1)
        k = load_pages(k_ref, pages, head_dim).reshape(step_keys, h)
        v = load_pages(v_ref, pages, head_dim).reshape(step_keys, h)
        logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * qk_scale
        if masked:
            k_pos = j * step_keys + jax.lax.broadcasted_iota(jnp.int32, (rows, step_keys), 1)
            logits = jnp.where((k_pos <= q_pos) & (k_pos < kv_len), logits, NEG)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        p = jnp.exp2(logits - m_new[:, None])
        alpha = jnp.exp2(m - m_new)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, denom * alpha + p.sum(axis=-1)

    init = (jnp.zeros((rows, h), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    carry = jax.lax.fori_loop(0, full_steps, functools.partial(body, masked=False), init)
    acc, _, denom = jax.lax.fori_loop(full_steps, steps, functools.partial(body, masked=True),
                                      carry)
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)


def _row_block(program: int, num_programs: int) -> int:
    """Row blocks run last first: under the causal mask the last rows see the most keys,
    and starting the longest programs first keeps the final wave from running one alone."""
    return num_programs - 1 - program


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "blocks", "poison"))
def paged_prefill_attention(q, k_pages, v_pages, block_table, start, num_valid, *,
                            scale: float, interpret: bool = False,
                            blocks: PrefillBlocks | None = None, poison: bool = False):
    """q [T, N, H] at positions start..; pages [NB, bs, K, H]; block_table [P] -> [T, N, H].

    Same contract as `reference.prefill_attention_ref` (the chunk's K/V already
    written to the pages; rows past num_valid are padding). blocks: the launch shape;
    fields left None are chosen by shape (`blocks.py`). poison (tests): the
    output buffer starts as NaN, so any element the kernel fails to write shows.
    """
    t, n, h = q.shape
    nb, bs, kh, _ = k_pages.shape
    g = n // kh
    p = block_table.shape[0]
    rows = t * g
    key, itemsize = layout_key(k_pages, g)
    launch = prefill_blocks(blocks, key=key, rows=rows, block_size=bs, head_dim=h, pages=p,
                            itemsize=itemsize)
    block_rows, pages_per_step = launch.block_rows, launch.keys_per_step // bs
    padded_rows = pl.cdiv(rows, block_rows) * block_rows
    padded_pages = pl.cdiv(p, pages_per_step) * pages_per_step
    table = jnp.pad(block_table.astype(jnp.int32), (0, padded_pages - p))
    # [T, K*G, H] -> [K, T*G, H]: row r of KV head k is token r // G, head k*G + r % G.
    qr = q.reshape(t, kh, g, h).transpose(1, 0, 2, 3).reshape(kh, rows, h)
    hp = padded_head_dim(h)
    qr = jnp.pad(qr, ((0, 0), (0, padded_rows - rows), (0, hp - h)))
    bounds = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(num_valid, jnp.int32)])
    out_shape = jax.ShapeDtypeStruct((kh, padded_rows, hp), q.dtype)
    inits = [jnp.full(out_shape.shape, jnp.nan, q.dtype)] if poison else []
    nblk = padded_rows // block_rows
    out = pl.pallas_call(
        functools.partial(_kernel, group=g, pages_per_step=pages_per_step, scale=scale,
                          head_dim=h),
        grid=(kh, nblk),
        in_specs=[
            pl.BlockSpec((padded_pages,), lambda k, i: (0,)),  # block table
            pl.BlockSpec((2,), lambda k, i: (0,)),  # start, num_valid
            pl.BlockSpec((None, block_rows, hp),
                         lambda k, i: (k, _row_block(i, nblk), 0)),  # query rows
            pl.BlockSpec((nb, bs, None, hp), lambda k, i: (0, 0, k, 0)),  # K pages, head k
            pl.BlockSpec((nb, bs, None, hp), lambda k, i: (0, 0, k, 0)),  # V pages, head k
        ] + [pl.BlockSpec(memory_space=pl.ANY)] * len(inits),
        out_specs=pl.BlockSpec((None, block_rows, hp),
                               lambda k, i: (k, _row_block(i, nblk), 0)),
        out_shape=out_shape,
        input_output_aliases={5: 0} if poison else {},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps,
                                             num_stages=launch.num_stages),
        name="paged_prefill_attention",
    )(table, bounds, qr, k_pages, v_pages, *inits)
    out = out[:, :rows, :h].reshape(kh, t, g, h).transpose(1, 0, 2, 3)
    return out.reshape(t, n, h)
