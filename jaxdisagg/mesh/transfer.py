"""Moving a request's KV pages from a prefill instance to a decode instance.

Two halves, so each runs on the thread that owns its pool:

* `extract` (prefill side): gathers the request's pages of some layers on the
  prefill mesh and starts copying them to the decode devices. Nothing blocks:
  the copy waits on the prefill program the way any dispatched op does.
* `insert` (decode side): scatters what arrived into the decode pool (donated).

The copy goes shard by shard: each destination shard is assembled on its own
device from single-device pieces of the source shards, then the pieces become
one array with `make_array_from_single_device_arrays`. A plain `device_put` to a
sharding with another shard count would go through host memory synchronously
and stall on the producer (JAX_NOTES), killing layer-wise overlap.

Resharding handles any pair of `tp` degrees, including KV heads replicated on one
side (tp > KV heads) and not on the other: every destination head is fetched
from one source copy of the same original head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.mesh.sharding import TP
from jaxdisagg.model.paged import KVPages

HEAD_AXIS = 4  # of the staged array [2 (K/V), layers, pages, block_size, K, H]


def page_bucket(n: int, max_pages: int) -> int:
    """Pages are moved in power-of-two buckets so a handful of programs cover all sizes."""
    if not 0 < n <= max_pages:
        raise ValueError(f"a request must have 1..{max_pages} pages, got {n}")
    return min(1 << (n - 1).bit_length(), max_pages)


@dataclass
class InFlightKV:
    """Pages of some layers of one request, on (or on their way to) the decode devices."""

    layers: range
    pages: jax.Array  # [2, len(layers), bucket, block_size, K_dst, H] on the decode mesh
    num_pages: int  # real pages (the rest of the bucket is padding)
    nbytes: int  # real bytes moved (padding and replicated heads not counted twice)
    dispatched_at: float = field(default_factory=time.perf_counter)


@dataclass
class TransferStats:
    bytes_moved: int
    transfer_s: float  # first extract dispatched -> KV in the decode pool
    exposed_s: float | None = None  # end of prefill compute -> KV in the decode pool


def _heads(index, num_heads: int) -> range:
    """The KV heads a shard index covers (a replicated axis has slice(None))."""
    return range(*index[HEAD_AXIS].indices(num_heads))


def _head_plan(src_shards, src_heads: int, dst_index_map, dst_heads: int, r_src: int,
               r_dst: int):
    """For each destination device: [(source shard, head start, head stop)] to concatenate.

    Heads are expanded KV heads; expanded head e of a side with replication r is a
    copy of original head e // r. Source pieces are taken from the first copy.
    """
    where = {}  # original head -> (source shard number, local head index)
    for j, shard in enumerate(src_shards):
        for local, e in enumerate(_heads(shard.index, src_heads)):
            where.setdefault(e // r_src, (j, local))
    plan = {}
    for device, index in dst_index_map.items():
        runs: list[list[int]] = []
        for e in _heads(index, dst_heads):
            j, local = where[e // r_dst]
            if runs and runs[-1][0] == j and runs[-1][2] == local:
                runs[-1][2] += 1
            else:
                runs.append([j, local, local + 1])
        plan[device] = [tuple(r) for r in runs]
    return plan


class InProcessTransfer:
    """KV from one prefill instance to one decode instance in the same process."""

    def __init__(self, src: PoolInstance, dst: PoolInstance):
        if src.layout.block_size != dst.layout.block_size:
            raise ValueError(f"block sizes differ: prefill {src.layout.block_size}, "
                             f"decode {dst.layout.block_size}")
        if src.config.replace(num_kv_heads=1) != dst.config.replace(num_kv_heads=1):
            raise ValueError("prefill and decode instances serve different models")
        self.src, self.dst = src, dst
        self.num_kv_heads = src.config.num_kv_heads // src.kv_replication
        self._stage_sharding = NamedSharding(src.mesh, PartitionSpec(*[None] * HEAD_AXIS, TP))
        self._arrive_sharding = NamedSharding(dst.mesh, PartitionSpec(*[None] * HEAD_AXIS, TP))
        self._gather = {}
        self._scatter = {}
        self._plans = {}

    # ------------------------------------------------------------ programs

    def _gather_fn(self, layers: range, bucket: int):
        key = (layers.start, layers.stop, bucket)
        if key not in self._gather:
            def gather(k_pages, v_pages, ids):
                take = lambda p: jnp.take(p, ids, axis=0, mode="clip")  # noqa: E731
                return jnp.stack([jnp.stack([take(p) for p in k_pages]),
                                  jnp.stack([take(p) for p in v_pages])])

            kv_sh = (self.src.page_sharding,) * len(layers)
            self._gather[key] = jax.jit(
                gather, in_shardings=(kv_sh, kv_sh, None), out_shardings=self._stage_sharding)
        return self._gather[key]

    def _scatter_fn(self, layers: range, bucket: int):
        key = (layers.start, layers.stop, bucket)
        if key not in self._scatter:
            def scatter(k_pages, v_pages, staged, ids):
                put = lambda p, new: p.at[ids].set(new, mode="drop")  # noqa: E731
                return (tuple(put(p, staged[0, i]) for i, p in enumerate(k_pages)),
                        tuple(put(p, staged[1, i]) for i, p in enumerate(v_pages)))

            kv_sh = (self.dst.page_sharding,) * len(layers)
            self._scatter[key] = jax.jit(
                scatter, in_shardings=(kv_sh, kv_sh, self._arrive_sharding, None),
                out_shardings=(kv_sh, kv_sh), donate_argnums=(0, 1))
        return self._scatter[key]

    # ------------------------------------------------------------ the copy

    def _move(self, staged: jax.Array) -> jax.Array:
        """Shard-by-shard copy of the staged pages onto the decode mesh (asynchronous)."""
        shape = list(staged.shape)
        shape[HEAD_AXIS] = self.dst.config.num_kv_heads
        shape = tuple(shape)
        src_heads = staged.shape[HEAD_AXIS]
        src_shards = sorted(staged.addressable_shards,
                            key=lambda s: _heads(s.index, src_heads).start)
        plan_key = shape
        if plan_key not in self._plans:
            index_map = self._arrive_sharding.addressable_devices_indices_map(shape)
            self._plans[plan_key] = _head_plan(src_shards, src_heads, index_map,
                                               shape[HEAD_AXIS], self.src.kv_replication,
                                               self.dst.kv_replication)
        pieces = []
        for device, runs in self._plans[plan_key].items():
            parts = []
            for j, a, b in runs:
                data = src_shards[j].data
                if (a, b) != (0, data.shape[HEAD_AXIS]):
                    data = jax.lax.slice_in_dim(data, a, b, axis=HEAD_AXIS)
                parts.append(jax.device_put(data, device))
            pieces.append(parts[0] if len(parts) == 1 else
                          jnp.concatenate(parts, axis=HEAD_AXIS))
        return jax.make_array_from_single_device_arrays(shape, self._arrive_sharding, pieces)

    # ------------------------------------------------------------ the interface

    def extract(self, layers: range, src_blocks) -> InFlightKV:
        """Starts moving pages `src_blocks` of `layers` from the prefill pool. Never blocks."""
        n = len(src_blocks)
        bucket = page_bucket(n, self.src.max_pages)
        ids = np.zeros(bucket, np.int32)
        ids[:n] = src_blocks
        kv = self.src.kv
        staged = self._gather_fn(layers, bucket)(kv.k[layers.start:layers.stop],
                                                 kv.v[layers.start:layers.stop], ids)
        layout = self.src.layout
        per_page = layout.block_size * self.num_kv_heads * layout.head_dim * np.dtype(
            layout.dtype).itemsize
        return InFlightKV(layers, self._move(staged), n, 2 * len(layers) * n * per_page)

    def insert(self, parts: list[InFlightKV], dst_blocks) -> None:
        """Scatters arrived pages into the decode pool at `dst_blocks` (pool donated)."""
        kv = self.dst.kv
        k, v = list(kv.k), list(kv.v)
        for part in parts:
            if part.num_pages != len(dst_blocks):
                raise ValueError(f"{part.num_pages} pages arrived for {len(dst_blocks)} "
                                 "destination blocks")
            bucket = part.pages.shape[2]
            ids = np.full(bucket, self.dst.layout.num_blocks, np.int32)  # padding drops
            ids[:len(dst_blocks)] = dst_blocks
            lo, hi = part.layers.start, part.layers.stop
            new_k, new_v = self._scatter_fn(part.layers, bucket)(tuple(k[lo:hi]),
                                                                 tuple(v[lo:hi]), part.pages, ids)
            k[lo:hi], v[lo:hi] = new_k, new_v
        self.dst.kv = KVPages(tuple(k), tuple(v))

    def warmup(self) -> None:
        """Compiles the gather, copy and scatter programs for every bucket and layer group."""
        buckets = sorted({page_bucket(n, self.src.max_pages)
                          for n in range(1, self.src.max_pages + 1)})
        groups = {(g.start, g.stop) for g in self.src.groups} | {(0, self.src.config.num_layers)}
        for lo, hi in sorted(groups):
            for bucket in buckets:
                blocks = list(range(bucket))
                part = self.extract(range(lo, hi), blocks)
                self.insert([part], blocks)
        jax.block_until_ready(self.dst.kv)
        self.dst.kv = self.dst._allocate()

