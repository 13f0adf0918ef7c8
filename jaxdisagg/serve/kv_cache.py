"""KV block accounting for one pool: a reference-counted allocator with a prefix cache.

Every block is in exactly one state:

* free: holds nothing anyone can reuse;
* used: referenced by one or more requests (refcount > 0);
* cached: refcount 0 but holding a full block of KV that is registered in the
  prefix cache, so a later request with the same prefix can take it back. Cached
  blocks count as available: allocation evicts them, least recently used first.

A full block is keyed by a hash chain over its tokens and every token before it, so
a key names a whole prefix, not just a block's contents. An evicted block can spill
to host memory (through `spill`/`restore` callbacks that copy pages to and from the
device) and come back on a later hit. `check()` verifies the invariants; tests call
it after every scenario.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import numpy as np


class OutOfBlocks(RuntimeError):
    """Not enough free or evictable blocks; nothing was allocated."""


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Hash chain of the full blocks of `tokens` (a trailing partial block has none)."""
    out, prev = [], b""
    for i in range(len(tokens) // block_size):
        chunk = np.asarray(tokens[i * block_size:(i + 1) * block_size], np.int64).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        out.append(prev)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_cache: bool = True,
                 spill: Callable[[int], object] | None = None,
                 restore: Callable[[object, int], None] | None = None,
                 host_capacity: int = 0):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if (spill is None) != (restore is None):
            raise ValueError("spill and restore go together")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_cache = prefix_cache
        self._refs = np.zeros(num_blocks, np.int32)
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._hash_of: dict[int, bytes] = {}  # registered block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> registered block
        self._spill, self._restore = spill, restore
        self._host: OrderedDict[bytes, object] = OrderedDict()  # spilled KV, LRU
        self.host_capacity = host_capacity if spill else 0
        self.stats = {"hit_tokens": 0, "queried_tokens": 0, "evictions": 0, "spills": 0,
                      "restores": 0}

    # ------------------------------------------------------------ queries

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def refcount(self, block: int) -> int:
        return int(self._refs[block])

    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens served from the prefix cache."""
        return self.stats["hit_tokens"] / max(1, self.stats["queried_tokens"])

    def gauges(self) -> dict:
        return {"kv_blocks_used": self.num_used, "kv_blocks_total": self.num_blocks,
                "kv_blocks_cached": len(self._cached), "prefix_hit_rate": self.hit_rate(),
                "host_cached_blocks": len(self._host), "prefix_evictions": self.stats["evictions"],
                "host_restores": self.stats["restores"]}

    def peek_prefix(self, tokens: Sequence[int]) -> int:
        """How many blocks `match_prefix` would take from device memory now; changes
        nothing, so a router may call it from another thread (dict lookups only)."""
        if not self.prefix_cache:
            return 0
        n = 0
        for key in block_hashes(tokens[:max(0, len(tokens) - 1)], self.block_size):
            if key not in self._block_of:
                break
            n += 1
        return n

    # ------------------------------------------------------------ allocation

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (refcount 1), evicting cached blocks LRU-first if needed."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_available:
            raise OutOfBlocks(f"need {n} blocks, {self.num_available} of {self.num_blocks} "
                              "available")
        out = []
        for _ in range(n):
            block = self._free.popleft() if self._free else self._evict()
            self._refs[block] = 1
            out.append(block)
        return out

    def _evict(self) -> int:
        block, _ = self._cached.popitem(last=False)
        key = self._hash_of.pop(block)
        del self._block_of[key]
        self.stats["evictions"] += 1
        if self.host_capacity:
            self._host[key] = self._spill(block)
            self._host.move_to_end(key)
            self.stats["spills"] += 1
            while len(self._host) > self.host_capacity:
                self._host.popitem(last=False)
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Drops one reference to each block; unreferenced registered blocks become cached."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} released more often than referenced")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None  # most recently used end
                else:
                    self._free.append(block)

    # ------------------------------------------------------------ prefix cache

    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Takes a reference on the longest cached run of full blocks that prefixes `tokens`.

        At most len(tokens) - 1 tokens are matched, so the request still prefills at
        least one token (it needs the logits of its last prompt token). Spilled blocks
        come back from host memory (into a free block, or in place of the coldest cached
        block, which spills in turn).
        """
        if not self.prefix_cache:
            return []
        keys = block_hashes(tokens[:max(0, len(tokens) - 1)], self.block_size)
        self.stats["queried_tokens"] += len(tokens)
        out = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                block = self._bring_back(key)
                if block is None:
                    break
            elif self._refs[block] == 0:
                del self._cached[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
            out.append(block)
        self.stats["hit_tokens"] += len(out) * self.block_size
        return out

    def _bring_back(self, key: bytes) -> int | None:
        if key not in self._host or not self.num_available:
            return None
        data = self._host.pop(key)  # first: the eviction below may spill and trim the host
        # A hit is worth more than the coldest cached block, which spills in turn.
        block = self._free.popleft() if self._free else self._evict()
        self._restore(data, block)
        self._refs[block] = 1
        self._hash_of[block], self._block_of[key] = key, block
        self.stats["restores"] += 1
        return block

    def register(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Records the full blocks of a prefilled request so later requests can reuse them."""
        if not self.prefix_cache:
            return
        for key, block in zip(block_hashes(tokens, self.block_size), blocks, strict=False):
            if key in self._block_of or block in self._hash_of:
                continue  # the same prefix is already cached in another block
            self._hash_of[block], self._block_of[key] = key, block
            self._host.pop(key, None)

    # ------------------------------------------------------------ invariants

    def check(self) -> None:
        """Raises AssertionError unless every block is in exactly one state."""
        free, cached = list(self._free), list(self._cached)
        used = [b for b in range(self.num_blocks) if self._refs[b] > 0]
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(free) & set(cached), "a block is both free and cached"
        assert not (set(free) | set(cached)) & set(used), "a referenced block is free or cached"
        assert len(free) + len(cached) + len(used) == self.num_blocks, (
            f"blocks lost: {len(free)} free + {len(cached)} cached + {len(used)} used "
            f"!= {self.num_blocks}")
        assert (self._refs >= 0).all(), "negative refcount"
        assert all(b in self._hash_of for b in cached), "a cached block has no key"
        assert all(self._block_of[k] == b for b, k in self._hash_of.items()), "key maps broken"
        assert len(self._block_of) == len(self._hash_of), "key maps broken"
