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
and stall on the producer (seen with jax 0.10), killing layer-wise overlap.

Resharding handles any pair of `tp` degrees, including KV heads replicated on one
side (tp > KV heads) and not on the other: every destination head is fetched
from one source copy of the same original head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

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


def page_runs(n: int, max_pages: int) -> list[tuple[int, int]]:
    """(offset, count) runs covering pages 0..n, each count a bucket: 37 -> 32 + 4 + 1.

    A request's pages move as one transfer per run, so the bytes on the wire are the
    real bytes (no bucket padding) and the compiled programs are still one per bucket.
    """
    page_bucket(n, max_pages)  # checks the range
    buckets = all_buckets(max_pages)
    runs, offset = [], 0
    while offset < n:
        size = max(b for b in buckets if b <= n - offset)
        runs.append((offset, size))
        offset += size
    return runs


@dataclass
class InFlightKV:
    """Pages of some layers of one request, on (or on their way to) the decode devices."""

    layers: range
    pages: jax.Array  # [2, len(layers), bucket, block_size, K_dst, H] on the decode mesh
    num_pages: int  # real pages (the rest of the bucket is padding)
    nbytes: int  # real bytes moved (padding and replicated heads not counted twice)
    dispatched_at: float = field(default_factory=time.perf_counter)
    offset: int = 0  # where these pages start in the request's block list


@dataclass
class TransferStats:
    bytes_moved: int
    transfer_s: float  # first extract dispatched -> KV in the decode pool
    exposed_s: float | None = None  # end of prefill compute -> KV in the decode pool


def _heads(index, num_heads: int) -> range:
    """The KV heads a shard index covers (a replicated axis has slice(None))."""
    return range(*index[HEAD_AXIS].indices(num_heads))


@dataclass(frozen=True)
class Piece:
    """A single-device slab of staged pages and the original KV head of each of its heads."""

    data: jax.Array  # [2, layers, bucket, block_size, len(heads), H] on one device
    heads: tuple[int, ...]


class KVSource:
    """Prefill side: gathers a request's pages of some layers into one staged array."""

    def __init__(self, inst: PoolInstance):
        self.inst = inst
        self.num_kv_heads = inst.config.num_kv_heads // inst.kv_replication
        self._sharding = NamedSharding(inst.mesh, PartitionSpec(*[None] * HEAD_AXIS, TP))
        self._gather = {}

    def _gather_fn(self, layers: range, bucket: int):
        # Keyed by the layer count, not the range: equal groups share one program.
        key = (len(layers), bucket)
        if key not in self._gather:
            def gather(k_pages, v_pages, ids):
                take = lambda p: jnp.take(p, ids, axis=0, mode="clip")  # noqa: E731
                return jnp.stack([jnp.stack([take(p) for p in k_pages]),
                                  jnp.stack([take(p) for p in v_pages])])

            kv_sh = (self.inst.page_sharding,) * len(layers)
            self._gather[key] = jax.jit(gather, in_shardings=(kv_sh, kv_sh, None),
                                        out_shardings=self._sharding)
        return self._gather[key]

    def stage(self, layers: range, src_blocks) -> tuple[jax.Array, int]:
        """Dispatches the gather; returns (staged [2, L, bucket, bs, K, H], real bytes)."""
        n = len(src_blocks)
        bucket = page_bucket(n, self.inst.max_pages)
        ids = np.zeros(bucket, np.int32)
        ids[:n] = src_blocks
        kv = self.inst.kv
        staged = self._gather_fn(layers, bucket)(kv.k[layers.start:layers.stop],
                                                 kv.v[layers.start:layers.stop], ids)
        layout = self.inst.layout
        per_page = (layout.block_size * self.num_kv_heads * layout.head_dim
                    * np.dtype(layout.dtype).itemsize)
        return staged, 2 * len(layers) * n * per_page

    def warmup(self) -> None:
        """Compiles the gather for every layer group size and page bucket (it only reads
        the pool), so that no request pays a compile."""
        for layers in moved_layer_groups(self.inst):
            for bucket in all_buckets(self.inst.max_pages):
                jax.block_until_ready(self.stage(layers, list(range(bucket)))[0])

    def pieces(self, staged: jax.Array) -> list[Piece]:
        """One piece per shard, labelled with original heads (first copies only)."""
        r = self.inst.kv_replication
        total = staged.shape[HEAD_AXIS]
        out, seen = [], set()
        for shard in sorted(staged.addressable_shards,
                            key=lambda sh: _heads(sh.index, total).start):
            heads = tuple(e // r for e in _heads(shard.index, total))
            if heads[0] not in seen:  # a replicated copy of heads already offered
                seen.update(heads)
                out.append(Piece(shard.data, heads))
        return out


class KVSink:
    """Decode side: assembles pieces into the pool's sharding and scatters them in."""

    def __init__(self, inst: PoolInstance):
        self.inst = inst
        self._sharding = NamedSharding(inst.mesh, PartitionSpec(*[None] * HEAD_AXIS, TP))
        self._scatter = {}
        self._plans = {}

    def _plan(self, pieces: list[Piece], shape: tuple[int, ...]):
        """For each of our devices: [(piece, local start, local stop)] to concatenate."""
        key = (tuple(p.heads for p in pieces), shape)
        if key not in self._plans:
            where = {}
            for j, piece in enumerate(pieces):
                for local, head in enumerate(piece.heads):
                    where.setdefault(head, (j, local))
            r = self.inst.kv_replication
            plan = {}
            for device, index in self._sharding.addressable_devices_indices_map(shape).items():
                runs: list[list[int]] = []
                for e in _heads(index, shape[HEAD_AXIS]):
                    if e // r not in where:
                        raise ValueError(f"no piece carries KV head {e // r}")
                    j, local = where[e // r]
                    if runs and runs[-1][0] == j and runs[-1][2] == local:
                        runs[-1][2] += 1
                    else:
                        runs.append([j, local, local + 1])
                plan[device] = [tuple(run) for run in runs]
            self._plans[key] = plan
        return self._plans[key]

    def assemble(self, pieces: list[Piece]) -> jax.Array:
        """Shard-by-shard: each of our shards built on its device from pieces (async)."""
        shape = list(pieces[0].data.shape)
        shape[HEAD_AXIS] = self.inst.config.num_kv_heads
        shape = tuple(shape)
        shards = []
        for device, runs in self._plan(pieces, shape).items():
            parts = []
            for j, a, b in runs:
                data = pieces[j].data
                if (a, b) != (0, data.shape[HEAD_AXIS]):
                    data = jax.lax.slice_in_dim(data, a, b, axis=HEAD_AXIS)
                parts.append(jax.device_put(data, device))
            shards.append(parts[0] if len(parts) == 1 else
                          jnp.concatenate(parts, axis=HEAD_AXIS))
        return jax.make_array_from_single_device_arrays(shape, self._sharding, shards)

    def _scatter_fn(self, layers: range, bucket: int):
        key = (len(layers), bucket)  # as the gather: one program per group size
        if key not in self._scatter:
            def scatter(k_pages, v_pages, staged, ids):
                put = lambda p, new: p.at[ids].set(new, mode="drop")  # noqa: E731
                return (tuple(put(p, staged[0, i]) for i, p in enumerate(k_pages)),
                        tuple(put(p, staged[1, i]) for i, p in enumerate(v_pages)))

            kv_sh = (self.inst.page_sharding,) * len(layers)
            self._scatter[key] = jax.jit(
                scatter, in_shardings=(kv_sh, kv_sh, self._sharding, None),
                out_shardings=(kv_sh, kv_sh), donate_argnums=(0, 1))
        return self._scatter[key]

    def warmup(self) -> None:
        """Compiles the scatter for every layer group size and page bucket by landing
        zero-page parts: every index is out of range, so nothing is written. (Pieces
        from a sender of the same tp need no program to assemble; another tp's
        concatenations compile on first use.)"""
        layout, heads = self.inst.layout, self.inst.config.num_kv_heads
        for layers in moved_layer_groups(self.inst):
            for bucket in all_buckets(self.inst.max_pages):
                shape = (2, len(layers), bucket, layout.block_size, heads, layout.head_dim)
                pages = jax.device_put(jnp.zeros(shape, layout.dtype), self._sharding)
                self.insert([InFlightKV(layers, pages, 0, 0)], [])
        jax.block_until_ready(self.inst.kv)

    def insert(self, parts: list[InFlightKV], dst_blocks) -> None:
        """Scatters arrived pages into the pool at `dst_blocks` (pool donated).

        Every layer the parts carry must arrive whole: its runs cover exactly the
        destination blocks, once."""
        covered: dict[tuple[int, int], list[int]] = {}
        for part in parts:
            covered.setdefault((part.layers.start, part.layers.stop), []).append(part)
        for (lo, hi), group in covered.items():
            pages = sorted((p.offset, p.num_pages) for p in group)
            offsets = [o for o, _ in pages]
            ends = [o + c for o, c in pages]
            if offsets != [0, *ends[:-1]] or ends[-1] != len(dst_blocks):
                raise ValueError(f"layers {lo}..{hi}: pages {pages} (offset, count) arrived "
                                 f"for {len(dst_blocks)} destination blocks")
        kv = self.inst.kv
        k, v = list(kv.k), list(kv.v)
        for part in parts:
            bucket = part.pages.shape[2]
            ids = np.full(bucket, self.inst.layout.num_blocks, np.int32)  # padding drops
            ids[:part.num_pages] = dst_blocks[part.offset:part.offset + part.num_pages]
            lo, hi = part.layers.start, part.layers.stop
            k[lo:hi], v[lo:hi] = self._scatter_fn(part.layers, bucket)(
                tuple(k[lo:hi]), tuple(v[lo:hi]), part.pages, ids)
        self.inst.kv = KVPages(tuple(k), tuple(v))


class KVSendSide(Protocol):
    """What a prefill worker calls, whichever transfer is configured."""

    def extract(self, layers: range, src_blocks) -> list:
        """Starts moving the pages of `layers` at `src_blocks`; returns tickets (one per
        run of pages). Never blocks."""


class KVReceiveSide(Protocol):
    """What a decode worker calls with the tickets the prefill side produced."""

    def insert(self, tickets: list, dst_blocks) -> None:
        """Lands the tickets' pages in the decode pool at `dst_blocks`."""


def check_compatible(src: PoolInstance, dst: PoolInstance) -> None:
    if src.layout.block_size != dst.layout.block_size:
        raise ValueError(f"block sizes differ: prefill {src.layout.block_size}, "
                         f"decode {dst.layout.block_size}")
    if src.config.replace(num_kv_heads=1) != dst.config.replace(num_kv_heads=1):
        raise ValueError("prefill and decode instances serve different models")


def all_buckets(max_pages: int) -> list[int]:
    return sorted({page_bucket(n, max_pages) for n in range(1, max_pages + 1)})


def moved_layer_groups(inst: PoolInstance) -> list[range]:
    """One layer range of each size a transfer moves (programs are per size): the
    instance's streaming groups, and the whole model (what a request moves when
    streaming is off)."""
    sizes = {len(g): g for g in inst.groups}
    sizes.setdefault(inst.config.num_layers, range(inst.config.num_layers))
    return list(sizes.values())


class InProcessTransfer:
    """KV from one prefill instance to one decode instance in the same process.

    Both sides of the transfer interface in one object: `extract` returns
    `InFlightKV` tickets (pages already moving), `insert` lands them. The
    cross-process pair (`xproc.KVSender.extract` -> `KVOffer` tickets sent over the
    control channel, `xproc.KVReceiver.insert`) has the same two calls.
    """

    def __init__(self, src: PoolInstance, dst: PoolInstance):
        check_compatible(src, dst)
        self.src, self.dst = src, dst
        self.source, self.sink = KVSource(src), KVSink(dst)

    def extract(self, layers: range, src_blocks) -> list[InFlightKV]:
        """Starts moving pages `src_blocks` of `layers` from the prefill pool, one part
        per run of `page_runs`. Never blocks."""
        parts = []
        for offset, count in page_runs(len(src_blocks), self.src.max_pages):
            staged, nbytes = self.source.stage(layers, src_blocks[offset:offset + count])
            parts.append(InFlightKV(layers, self.sink.assemble(self.source.pieces(staged)),
                                    count, nbytes, offset=offset))
        return parts

    def insert(self, parts: list[InFlightKV], dst_blocks) -> None:
        self.sink.insert(parts, dst_blocks)

    def warmup(self) -> None:
        """Compiles the gather, copy and scatter programs for every bucket and layer group."""
        for layers in moved_layer_groups(self.src):
            for bucket in all_buckets(self.src.max_pages):
                blocks = list(range(bucket))
                self.insert(self.extract(layers, blocks), blocks)
        jax.block_until_ready(self.dst.kv)
        self.dst.kv = self.dst._allocate()
