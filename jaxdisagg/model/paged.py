"""The two serving entry points over a paged KV cache.

`prefill_chunk` runs C tokens of one request; `decode_step` runs one token for
each of B slots. Both are pure functions of (graphdef, params state, KV pages,
inputs) with static shapes, so callers jit them once per bucket on any mesh and
donate the pages (`jit_serving_fns`).

Writes into the pages are scatters with `mode="drop"`: padded chunk positions and
empty decode slots are given an out-of-range row and so never touch any block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxdisagg.model.config import LlamaConfig
from jaxdisagg.model.llama import TIED_HEAD, Llama, Product, xla_product
from jaxdisagg.model.sampling import RowParams, sample_with_logprobs
from jaxdisagg.pallas import cpu
from jaxdisagg.pallas.attention import (
    AttentionSpec,
    decode_attention,
    prefill_attention,
    resolve_backend,
)

Backend = str | AttentionSpec  # an attention backend's name, or one with launch shapes


class KVPages(NamedTuple):
    """Per layer K and V pages, each [num_blocks, block_size, K, H]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


@dataclass(frozen=True)
class KVLayout:
    """Shape of one pool's paged cache; equal layouts can exchange pages."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @classmethod
    def for_model(cls, cfg: LlamaConfig, num_blocks: int, block_size: int,
                  dtype="float32") -> KVLayout:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"KVLayout: num_blocks ({num_blocks}) and block_size "
                             f"({block_size}) must be positive")
        return cls(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                   jnp.dtype(dtype).name)

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def allocate(self) -> KVPages:
        def pages():
            return tuple(jnp.zeros(self.page_shape, self.dtype) for _ in range(self.num_layers))

        return KVPages(pages(), pages())

    def nbytes(self) -> int:
        return 2 * self.num_layers * jnp.dtype(self.dtype).itemsize * math.prod(self.page_shape)


def _write(pages: jax.Array, rows: jax.Array, new: jax.Array) -> jax.Array:
    """Scatters new [R, K, H] into flat rows of pages [NB, bs, K, H]; rows out of range drop."""
    nb, bs = pages.shape[:2]
    if rows.shape[0] == 1:
        # XLA rewrites a one-row scatter into a dynamic-update-slice, which it then
        # cannot do in place when the pages are read in the same program: it copies
        # the whole pool (O(pool) per layer per step: 170 ms a decode step at 1281
        # blocks). Writing the same row twice keeps it a true in-place scatter.
        rows, new = jnp.concatenate([rows, rows]), jnp.concatenate([new, new])
    flat = pages.reshape(nb * bs, *pages.shape[2:])
    return flat.at[rows].set(new.astype(pages.dtype), mode="drop").reshape(pages.shape)


def _rows(block_tables: jax.Array, positions: jax.Array, valid: jax.Array,
          num_blocks: int, block_size: int) -> jax.Array:
    """Flat page rows for positions [...] through tables [..., P]; invalid -> out of range.

    A position past the table's last page is invalid too: it is dropped rather than
    clipped into (and corrupting) the last page.
    """
    page_idx = positions // block_size
    valid = valid & (page_idx < block_tables.shape[-1])
    pages = jnp.take_along_axis(block_tables, page_idx, axis=-1, mode="clip")
    rows = pages * block_size + positions % block_size
    return jnp.where(valid, rows, num_blocks * block_size)


def _split_kv(kv: KVPages) -> list[tuple[jax.Array, jax.Array]]:
    return list(zip(kv.k, kv.v, strict=True))


def _join_kv(caches) -> KVPages:
    return KVPages(tuple(c[0] for c in caches), tuple(c[1] for c in caches))


def _prefill_layers(model: Llama, x, caches, start, num_valid, block_table, backend, mesh):
    """The model's layers over x [1, C, D], one prefill chunk."""
    c = x.shape[1]
    nb, bs = caches[0][0].shape[:2]
    positions = start + jnp.arange(c, dtype=jnp.int32)
    rows = _rows(block_table, positions, jnp.arange(c) < num_valid, nb, bs)
    scale = model.config.head_dim ** -0.5

    def attend(q, k, v, cache):
        k_pages, v_pages = _write(cache[0], rows, k[0]), _write(cache[1], rows, v[0])
        out = prefill_attention(q[0], k_pages, v_pages, block_table, start, num_valid,
                                scale=scale, backend=backend, mesh=mesh)
        return out[None], (k_pages, v_pages)

    return model.run_layers(x, positions[None], caches, attend)


def _last_logits(model: Llama, x, num_valid):
    last = jax.lax.dynamic_index_in_dim(x[0], num_valid - 1, axis=0, keepdims=False)
    return model.logits(last)


def prefill_chunk(graphdef: nnx.GraphDef, state: nnx.State, kv: KVPages, tokens: jax.Array,
                  start: jax.Array, num_valid: jax.Array, block_table: jax.Array, *,
                  backend: Backend = "reference", mesh: Mesh | None = None
                  ) -> tuple[jax.Array, KVPages]:
    """One prefill chunk of one request.

    tokens [C] (the first num_valid real, the rest padding) at positions
    start .. start+C; block_table [P] the request's pages, covering positions up to
    start + num_valid. Writes the chunk's K/V, attends to prefix + chunk, and
    returns (fp32 logits [V] of the last real token, updated pages).
    num_valid must be >= 1 (the caller's scheduler never sends an empty chunk).
    `mesh`: the pool's mesh when running sharded (the kernels then use shard_map).
    """
    return prefill_chunk_group(graphdef, state, kv, tokens, start, num_valid, block_table,
                               first=True, last=True, backend=backend, mesh=mesh)


def prefill_chunk_group(graphdef: nnx.GraphDef, state: nnx.State, kv_group: KVPages,
                        inputs: jax.Array, start: jax.Array, num_valid: jax.Array,
                        block_table: jax.Array, *, first: bool, last: bool,
                        backend: Backend = "reference", mesh: Mesh | None = None):
    """A run of consecutive layers of a prefill chunk, for layer-wise KV streaming.

    (graphdef, state) is a model holding only the run's layers, with the full model's
    embedding and head: every run of the same length then traces to the same program,
    so a pool compiles one program per (length, first, last), not one per run.
    inputs are the chunk's tokens [C] when `first`, else the hidden states [1, C, D]
    the previous run returned. Returns (hidden states, or the last real token's logits
    when `last`; the run's updated pages). Running every run in order equals
    `prefill_chunk`.
    """
    model: Llama = nnx.merge(graphdef, state)
    x = model.embed(inputs[None]) if first else inputs
    x, caches = _prefill_layers(model, x, _split_kv(kv_group), start,
                                num_valid, block_table, backend, mesh)
    return (_last_logits(model, x, num_valid) if last else x), _join_kv(caches)


def _cpu_kernels(backend: Backend, mesh: Mesh | None) -> bool:
    """Whether the decode step uses `pallas/cpu.py`'s kernels beyond attention: on the
    `cpu` backend and one device (they have no partitioning rule, so a sharded pool
    keeps XLA's ops)."""
    name = backend.backend if isinstance(backend, AttentionSpec) else backend
    return resolve_backend(name) == "cpu" and (mesh is None or mesh.size == 1)


def step_product(backend: Backend, mesh: Mesh | None) -> Product:
    """The decode step's products: on the `cpu` backend and one device, the small-batch
    kernels of `pallas/cpu_dense.cc` (BENCHMARKS.md): the layers' at 1-16 slots
    (SmolLM2's step at 2-8 slots in 0.63-0.80x the time, at 12-16 0.81-0.87x with the
    head kernel in both), a tied LM head's at 1-32
    (SmolLM2's head alone in 0.45-0.50x XLA's time at 2-8 rows, 0.8x at 1 and 32);
    XLA's einsum otherwise, and wherever `_cpu_kernels` says no."""
    if not _cpu_kernels(backend, mesh):
        return xla_product

    def product(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
        if spec == TIED_HEAD:
            x2 = x.reshape(-1, x.shape[-1])
            if not cpu.tied_head_fits(x2, w):
                return jnp.einsum(spec, x, w)
            return cpu.tied_head_cpu(x2, w).reshape(*x.shape[:-1], w.shape[0])
        d = x.shape[-1]
        x2, w2 = x.reshape(-1, d), w.reshape(d, -1)  # the einsums contract x[-1] with w[0]
        if not cpu.small_product_fits(x2, w2):
            return jnp.einsum(spec, x, w)
        return cpu.small_product_cpu(x2, w2).reshape(*x.shape[:-1], *w.shape[1:])

    return product


def decode_step(graphdef: nnx.GraphDef, state: nnx.State, kv: KVPages, tokens: jax.Array,
                positions: jax.Array, block_tables: jax.Array, seq_lens: jax.Array, *,
                backend: Backend = "reference", mesh: Mesh | None = None
                ) -> tuple[jax.Array, KVPages]:
    """One decode step for B slots.

    tokens, positions, seq_lens [B]; block_tables [B, P]. An active slot has
    seq_len = position + 1 (its new token included); seq_len 0 marks an empty slot,
    which writes nothing. Returns (fp32 logits [B, V], updated pages).
    """
    model: Llama = nnx.merge(graphdef, state)
    nb, bs = kv.k[0].shape[:2]
    rows = _rows(block_tables, positions[:, None], (seq_lens > 0)[:, None], nb, bs)[:, 0]
    scale = model.config.head_dim ** -0.5

    def attend(q, k, v, cache):
        k_pages, v_pages = _write(cache[0], rows, k[:, 0]), _write(cache[1], rows, v[:, 0])
        out = decode_attention(q[:, 0], k_pages, v_pages, block_tables, seq_lens,
                               scale=scale, backend=backend, mesh=mesh)
        return out[:, None], (k_pages, v_pages)

    product = step_product(backend, mesh)
    x, caches = model.run_layers(model.embed(tokens[:, None]), positions[:, None],
                                 _split_kv(kv), attend, product)
    return model.logits(x[:, 0], product), _join_kv(caches)


def decode_sample_step(graphdef: nnx.GraphDef, state: nnx.State, kv: KVPages,
                       tokens: jax.Array, positions: jax.Array, block_tables: jax.Array,
                       seq_lens: jax.Array, rows: RowParams, *, backend: Backend = "reference",
                       mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, KVPages]:
    """`decode_step` with each row's next token sampled in the same program:
    returns (tokens [B] int32, logprobs [B] fp32, updated pages). Only 2B numbers
    leave the device per step, and the host dispatches one program, not three."""
    logits, kv = decode_step(graphdef, state, kv, tokens, positions, block_tables, seq_lens,
                             backend=backend, mesh=mesh)
    new, logprobs = sample_with_logprobs(logits, rows, step_greedy(backend, mesh, logits))
    return new, logprobs, kv


def step_greedy(backend: Backend, mesh: Mesh | None, logits: jax.Array):
    """The sampler's argmax and log-normaliser: `pallas/cpu_sample.cc`'s kernel where
    `_cpu_kernels` says yes (XLA:CPU's argmax and log_softmax took ~2 ms of SmolLM2's
    34 ms 8-slot step; BENCHMARKS.md), None (jnp's) otherwise."""
    if not _cpu_kernels(backend, mesh) or not cpu.argmax_log_norm_fits(logits):
        return None
    return cpu.argmax_log_norm_cpu


def decode_sample_rows(graphdef: nnx.GraphDef, state: nnx.State, kv: KVPages,
                       tokens: jax.Array, positions: jax.Array, block_tables: jax.Array,
                       seq_lens: jax.Array, rows: RowParams, index: jax.Array, *,
                       backend: Backend = "reference",
                       mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, KVPages]:
    """`decode_sample_step` on rows `index` [K] of a B-slot batch: those K rows are
    gathered, stepped, and their tokens and logprobs put back at their slots ([B], the
    other slots 0). A batch with few slots busy then runs a K-row step, not a B-row
    one: on CPU the 1-row SmolLM2 step takes about half the 8-row one. Each row's
    result does not depend on which others share the step (per-row sampling keys)."""
    def take(a):
        return a[index]

    new, logprobs, kv = decode_sample_step(
        graphdef, state, kv, take(tokens), take(positions), take(block_tables),
        take(seq_lens), RowParams(*map(take, rows)), backend=backend, mesh=mesh)
    b = tokens.shape[0]
    return (jnp.zeros(b, new.dtype).at[index].set(new),
            jnp.zeros(b, logprobs.dtype).at[index].set(logprobs), kv)


def table_widths(max_pages: int, count: int = 4) -> list[int]:
    """The block-table widths decode programs are compiled for: max_pages, then
    halves of it (at most `count`). Attention reads every page a table lists, so
    a batch of short sequences runs the narrowest width that holds its longest. The
    same halving gives the decode batch sizes from max_slots."""
    return sorted({max(1, max_pages >> k) for k in range(count)})



def smallest_fit(n: int, sizes: list[int]) -> int:
    """The smallest compiled size (sorted `sizes`) that holds n: a table width, a chunk
    bucket."""
    return next(s for s in sizes if s >= n)


class ServingFns(NamedTuple):
    """Jitted entry points with the KV pages donated (updated in place)."""

    prefill: Callable
    decode: Callable


def jit_serving_fns(graphdef: nnx.GraphDef, backend: Backend = "reference") -> ServingFns:
    """jax.jit over the split state (merge inside): ~2.7x less dispatch than nnx.jit."""
    prefill = jax.jit(functools.partial(prefill_chunk, graphdef, backend=backend),
                      donate_argnums=(1,))
    decode = jax.jit(functools.partial(decode_step, graphdef, backend=backend),
                     donate_argnums=(1,))
    return ServingFns(prefill, decode)
