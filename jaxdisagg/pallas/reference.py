"""Plain-jnp paged attention: the CPU default and the oracle for the kernels.

Dimension letters: T query tokens, S key positions, B slots, K KV heads,
G query heads per KV head (GQA group), H head_dim, P pages per request.
Pages are [num_blocks, block_size, K, H]; a block table row lists a request's
pages in position order, so position s lives in page table[s // bs] at s % bs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = jnp.finfo(jnp.float32).min  # finite, so a fully masked row gives no NaN


def gather_pages(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """pages [NB, bs, K, H], table [..., P] -> keys in position order [..., P*bs, K, H]."""
    got = pages[block_table]  # [..., P, bs, K, H]
    return got.reshape(*block_table.shape[:-1], -1, *pages.shape[2:])


def prefill_attention_ref(q, k_pages, v_pages, block_table, start, num_valid, *, scale):
    """Causal attention of one chunk over its request's paged KV.

    q [T, N, H] at positions start .. start+T (the first num_valid real, the rest
    padding); the chunk's own K/V are already written to the pages. Query i sees
    keys s <= start + i and s < start + num_valid. Returns [T, N, H] in q's dtype.
    """
    t, n, h = q.shape
    kh = k_pages.shape[2]
    k = gather_pages(k_pages, block_table)  # [S, K, H]
    v = gather_pages(v_pages, block_table)
    qg = q.reshape(t, kh, n // kh, h)  # [T, K, G, H]
    logits = jnp.einsum("TKGH,SKH->KGTS", qg, k, preferred_element_type=jnp.float32) * scale
    q_pos = start + jnp.arange(t)
    k_pos = jnp.arange(k.shape[0])
    mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < start + num_valid)  # [T, S]
    probs = jax.nn.softmax(jnp.where(mask, logits, _MASKED), axis=-1)
    out = jnp.einsum("KGTS,SKH->TKGH", probs, v.astype(jnp.float32))
    return out.reshape(t, n, h).astype(q.dtype)


def decode_attention_ref(q, k_pages, v_pages, block_tables, seq_lens, *, scale):
    """One query per slot over that slot's pages.

    q [B, N, H]; block_tables [B, P]; seq_lens [B] counts the keys to attend
    (the current token's K/V already written). Slots with seq_len 0 give zeros.
    """
    b, n, h = q.shape
    kh = k_pages.shape[2]
    k = gather_pages(k_pages, block_tables)  # [B, S, K, H]
    v = gather_pages(v_pages, block_tables)
    qg = q.reshape(b, kh, n // kh, h)  # [B, K, G, H]
    logits = jnp.einsum("BKGH,BSKH->BKGS", qg, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.arange(k.shape[1])[None, :] < seq_lens[:, None]  # [B, S]
    probs = jax.nn.softmax(jnp.where(mask[:, None, None, :], logits, _MASKED), axis=-1)
    out = jnp.einsum("BKGS,BSKH->BKGH", probs, v.astype(jnp.float32)).reshape(b, n, h)
    return jnp.where((seq_lens > 0)[:, None, None], out, 0).astype(q.dtype)
