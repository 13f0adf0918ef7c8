"""One pool instance: its own mesh, its own sharded weights and KV pages, its programs.

The prefill and decode programs are jitted separately with explicit in/out
shardings on the instance's mesh and the KV pages donated. Every shape they will
see is fixed by the pool config (chunk size, slots, block-table width), so
`warmup` compiles them all before serving and the serving loop never compiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdisagg.mesh.config import PoolConfig
from jaxdisagg.mesh.sharding import (
    kv_replication,
    kv_sharding,
    make_mesh,
    replicate_kv_heads,
    replicated,
    state_shardings,
)
from jaxdisagg.model.llama import Llama
from jaxdisagg.model.paged import (
    KVLayout,
    KVPages,
    decode_sample_rows,
    decode_step,
    prefill_chunk_group,
    smallest_fit,
    table_widths,
)
from jaxdisagg.model.sampling import RowParams, row_params, sample_rows
from jaxdisagg.pallas.attention import AttentionSpec, resolve_backend


def chunk_buckets(chunk_size: int, step: int = 16, fine_up_to: int = 64) -> list[int]:
    """The token counts prefill programs are compiled for: multiples of `step` up to
    `fine_up_to` (short prompts pad by less than one step), then doubling up to
    chunk_size. A chunk runs in the smallest bucket that holds it, so a 20-token
    prompt costs a 32-token pass, not a chunk_size one."""
    sizes = set(range(step, min(fine_up_to, chunk_size) + 1, step))
    size = fine_up_to * 2
    while size < chunk_size:
        sizes.add(size)
        size *= 2
    return sorted(sizes | {chunk_size})


def step_rows(seq_lens: np.ndarray, sizes: list[int]) -> np.ndarray:
    """The slots a decode step runs: every busy one (seq_len > 0), padded with idle ones
    to the smallest compiled batch size (sorted `sizes`) that holds them."""
    busy = np.flatnonzero(seq_lens > 0)
    k = smallest_fit(max(1, len(busy)), sizes)
    idle = np.flatnonzero(seq_lens <= 0)[:k - len(busy)]
    return np.concatenate([busy, idle]).astype(np.int32)


def layer_groups(num_layers: int, group_size: int) -> list[range]:
    return [range(lo, min(lo + group_size, num_layers))
            for lo in range(0, num_layers, group_size)]


def _run_leaves(state: nnx.State, run_state: nnx.State, run: range) -> list[int]:
    """For each leaf of `run_state` (a model of len(run) layers), the index of the
    `state` leaf it stands for: its layer j is layer run.start + j, and the embedding,
    final norm and head are the full model's."""
    def key(path):
        return tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)

    index = {key(p): i for i, (p, _) in enumerate(jax.tree_util.tree_leaves_with_path(state))}
    out = []
    for path, _ in jax.tree_util.tree_leaves_with_path(run_state):
        k = key(path)
        if k[0] == "layers":
            k = (k[0], run.start + k[1], *k[2:])
        out.append(index[k])
    return out


def _over_leaves(fn, treedef, graphdef, **kw):
    """fn(graphdef, state, *args, **kw) as a function of the state's leaves."""
    def call(params, *args):
        return fn(graphdef, jax.tree.unflatten(treedef, params), *args, **kw)

    return call


class PoolInstance:
    """A model replica on `tp` devices with its paged KV cache.

    `self.kv` always holds the current pages: every program call donates them and
    stores the result back, so only the thread that owns the instance may call it.
    """

    def __init__(self, name: str, model: Llama, device_indices: Sequence[int],
                 pool: PoolConfig, *, backend: str = "auto", layer_group_size: int | None = None,
                 devices=None):
        self.name = name
        self.pool = pool
        self.mesh = make_mesh(device_indices, devices)
        self.kv_replication = kv_replication(model.config.num_kv_heads, pool.tp)
        model = replicate_kv_heads(model, self.kv_replication)
        self.config = model.config
        self.dtype = model.dtype
        self.backend = resolve_backend(backend)
        # What the programs get: the backend and the launch shapes this pool's config set.
        attention = AttentionSpec(self.backend, pool.decode_kernel, pool.prefill_kernel)
        graphdef, state = nnx.split(model)
        # The programs take the parameters as a flat tuple of arrays, not the nnx.State:
        # jit flattens a State through its Variables in Python at every call, ~1 ms of a
        # SmolLM2 decode call's 2.4-2.8 ms of host time (measured); a tuple is flattened
        # in C++.
        treedef = jax.tree.structure(state)
        state_sh = state_shardings(state, self.mesh)
        self.params = tuple(jax.tree.leaves(jax.device_put(state, state_sh)))
        self._state_sharding = tuple(jax.tree.leaves(state_sh))
        self.layout = KVLayout.for_model(self.config, pool.num_blocks, pool.block_size,
                                         dtype=self.dtype)
        self.page_sharding = kv_sharding(self.mesh)
        self.kv = self._allocate()

        rep = replicated(self.mesh)
        kv_sh = self._kv_shardings(self.config.num_layers)
        step = _over_leaves(decode_sample_rows, treedef, graphdef, backend=attention,
                            mesh=self.mesh)

        # Overlap scheduling's input tokens are picked inside the step: row i takes the
        # previous step's token (still on the device) where `carried[i]`, else the host's.
        # The host arrays go in as arguments (no `device_put` before the call: 0.13-0.47
        # ms each, measured) and there is no separate feed program to dispatch.
        def fed(params, kv, previous, host, carried, *args):
            return step(params, kv, jnp.where(carried, previous, host), *args)

        self._no_previous = jax.device_put(np.zeros(pool.max_slots, np.int32), rep)
        self._decode = jax.jit(
            fed, in_shardings=(self._state_sharding, kv_sh) + (rep,) * 8,
            out_shardings=(rep, rep, kv_sh), donate_argnums=(1,))
        self._decode_logits = jax.jit(
            _over_leaves(decode_step, treedef, graphdef, backend=attention, mesh=self.mesh),
            in_shardings=(self._state_sharding, kv_sh, rep, rep, rep, rep),
            out_shardings=(rep, kv_sh), donate_argnums=(1,))  # compiled on first use
        self.table_widths = table_widths(self.max_pages)
        self.batch_sizes = table_widths(pool.max_slots)  # rows a decode step runs
        self.chunk_buckets = chunk_buckets(pool.chunk_size)
        # Prefill runs layer group by layer group (one group when not streaming), each
        # group a model of its own layers: equal groups share one program and the
        # pool never compiles a whole-model prefill it does not run.
        self.groups = layer_groups(self.config.num_layers,
                                   layer_group_size or self.config.num_layers)
        runs, programs, self._group_fns, self._group_params = {}, {}, [], []
        for g in self.groups:
            first, last = g.start == 0, g.stop == self.config.num_layers
            if len(g) not in runs:  # the abstract model of a run depends on its length only
                run_cfg = self.config.replace(num_layers=len(g))
                runs[len(g)] = nnx.split(nnx.eval_shape(
                    lambda cfg=run_cfg: Llama(cfg, dtype=self.dtype)))
            run_graphdef, run_state = runs[len(g)]
            leaves = _run_leaves(state, run_state, g)
            if (len(g), first, last) not in programs:
                programs[len(g), first, last] = jax.jit(
                    _over_leaves(prefill_chunk_group, jax.tree.structure(run_state),
                                 run_graphdef, first=first, last=last, backend=attention,
                                 mesh=self.mesh),
                    in_shardings=(tuple(self._state_sharding[i] for i in leaves),
                                  self._kv_shardings(len(g)), rep, rep, rep, rep),
                    out_shardings=(rep, self._kv_shardings(len(g))), donate_argnums=(1,))
            self._group_fns.append(programs[len(g), first, last])
            self._group_params.append(tuple(self.params[i] for i in leaves))

    def _kv_shardings(self, num_layers: int) -> KVPages:
        return KVPages((self.page_sharding,) * num_layers, (self.page_sharding,) * num_layers)

    def _allocate(self) -> KVPages:
        return jax.jit(self.layout.allocate,
                       out_shardings=self._kv_shardings(self.config.num_layers))()

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    @property
    def max_pages(self) -> int:
        return self.pool.max_pages_per_request

    # ---------------------------------------------------------------- programs

    def prefill(self, tokens: np.ndarray, start: int, num_valid: int,
                block_table: np.ndarray) -> jax.Array:
        """One chunk (tokens padded to a chunk bucket) -> fp32 logits [V] of its last real
        token."""
        out = tokens
        for i in range(len(self.groups)):
            out = self.prefill_group(i, out, start, num_valid, block_table)
        return out

    def prefill_group(self, index: int, inputs, start: int, num_valid: int,
                      block_table: np.ndarray):
        """Layer group `index` of a chunk: hidden states out, or logits after the last group."""
        g = self.groups[index]
        group_kv = KVPages(self.kv.k[g.start:g.stop], self.kv.v[g.start:g.stop])
        out, group_kv = self._group_fns[index](self._group_params[index], group_kv, inputs,
                                               np.int32(start), np.int32(num_valid),
                                               block_table)
        self.kv = KVPages(self.kv.k[:g.start] + group_kv.k + self.kv.k[g.stop:],
                          self.kv.v[:g.start] + group_kv.v + self.kv.v[g.stop:])
        return out

    def decode(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
               seq_lens: np.ndarray, rows: RowParams, *, previous: jax.Array | None = None,
               carried: np.ndarray | None = None) -> tuple[jax.Array, jax.Array]:
        """One step for max_slots slots, sampled on device -> (tokens [B], logprobs [B]).

        Input tokens come from the host (`tokens`), except rows where `carried` is set,
        which take `previous[i]`: the token of the step still in flight, on the device
        (overlap scheduling reads a step after dispatching the next).

        Only the busy slots (seq_lens > 0) run, padded to the smallest compiled batch
        size that holds them (`step_rows`); idle slots get 0. A full batch's block
        tables are cut to the narrowest compiled width that holds the longest sequence,
        so attention reads what the batch holds, not max_pages. A smaller batch runs at
        the full width: its few rows' attention is a small part of its step, and a
        program per (batch size, width) would multiply the programs warm-up compiles
        (SmolLM2 on 2 CPU cores: 7 s each)."""
        if previous is None:  # no row carried; always a device array: one trace
            previous, carried = self._no_previous, np.zeros(self.pool.max_slots, bool)
        index = step_rows(seq_lens, self.batch_sizes)
        pages = -(-int(seq_lens.max(initial=1)) // self.layout.block_size)
        width = smallest_fit(pages, self.step_widths(len(index)))
        new, logprobs, self.kv = self._decode(
            self.params, self.kv, previous, np.asarray(tokens, np.int32), carried, positions,
            block_tables[:, :width], seq_lens, rows, index)
        return new, logprobs

    def step_widths(self, busy: int) -> list[int]:
        """The table widths a step with `busy` busy slots is compiled for: every width
        for a full batch, the full width only for a smaller one (`decode`)."""
        full = smallest_fit(max(1, busy), self.batch_sizes) == self.batch_sizes[-1]
        return self.table_widths if full else [self.max_pages]

    def decode_logits(self, tokens: np.ndarray, positions: np.ndarray,
                      block_tables: np.ndarray, seq_lens: np.ndarray) -> jax.Array:
        """The same step returning fp32 logits [B, V] (tests and tools; not served)."""
        logits, self.kv = self._decode_logits(self.params, self.kv, tokens, positions,
                                              block_tables, seq_lens)
        return logits

    # ---------------------------------------------------------------- host cache

    def read_block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """One block of every layer, copied to host memory: K and V [L, bs, K, H]."""
        if not hasattr(self, "_read_block"):
            self._read_block = jax.jit(
                lambda kv, b: (jnp.stack([p[b] for p in kv.k]), jnp.stack([p[b] for p in kv.v])),
                in_shardings=(self._kv_shardings(self.config.num_layers), None))
        k, v = self._read_block(self.kv, np.int32(block))
        return np.asarray(k), np.asarray(v)

    def write_block(self, data: tuple[np.ndarray, np.ndarray], block: int) -> None:
        """Puts a block read by `read_block` back at `block` (pages donated)."""
        if not hasattr(self, "_write_block"):
            sh = self._kv_shardings(self.config.num_layers)

            def write(kv, k, v, b):
                return KVPages(tuple(p.at[b].set(k[i]) for i, p in enumerate(kv.k)),
                               tuple(p.at[b].set(v[i]) for i, p in enumerate(kv.v)))

            self._write_block = jax.jit(write, in_shardings=(sh, None, None, None),
                                        out_shardings=sh, donate_argnums=(0,))
        self.kv = self._write_block(self.kv, data[0], data[1], np.int32(block))

    # ---------------------------------------------------------------- warm-up

    def warmup(self, prefill: bool = True, decode: bool = True) -> None:
        """Compiles every program this instance serves with (on throwaway pages)."""
        p, b = self.max_pages, self.pool.max_slots
        table = np.full(p, self.layout.num_blocks - 1, np.int32)
        for c in self.chunk_buckets if prefill else ():  # one program set per chunk bucket
            logits = self.prefill(np.zeros(c, np.int32), 0, 1, table)
            sample_rows(logits[None], [None], [0])
        if decode:
            zeros = np.zeros(b, np.int32)
            rows = row_params([None] * b, 0, self.config.vocab_size)
            tables = np.tile(table, (b, 1))
            for k in self.batch_sizes:  # one program per batch size and its widths
                for width in self.step_widths(k):
                    lens = np.where(np.arange(b) < k, width * self.layout.block_size, 0)
                    lens = lens.astype(np.int32)
                    # A carried step (overlap scheduling) is the same program.
                    jax.block_until_ready(self.decode(zeros, zeros, tables, lens, rows)[0])
        if self.pool.host_cache_blocks:
            self.write_block(self.read_block(0), 0)
        self.kv = self._allocate()  # warm-up wrote into the last block: start clean
