"""Tile sizes, splits, warps and stages of the Pallas kernels, chosen by shape.

One small frozen dataclass per kernel. A field left `None` is chosen here, in this
order: the deployment config's value (a pool's `decode_kernel` / `prefill_kernel`),
then the tuned table (`tuned_blocks.json`, written by the GPU check's block sweep
for one device kind, dtype and head layout), then the defaults below, which follow
the published FlashAttention / FlashDecoding choices:

* decode is bandwidth-bound: long key steps (128 keys of H <= 128) so each program
  streams large contiguous tiles, and enough KV splits that B * K * splits programs
  keep many loads in flight on every SM (TARGET_PROGRAMS), at most MAX_SPLITS;
* prefill is compute-bound: 128 query rows by 64 keys per step for head_dim > 64
  (128 by 128 for smaller heads), 4 warps, two pipeline stages (the H200 sweep's
  choice for Llama-3-8B's and Llama-3.2-1B's layouts in bf16);
* fp32 pages (exact products, no tensor cores) hold twice the bytes per tile in
  registers: a half (decode) or a quarter (prefill) of the keys per step and 64-row
  blocks, or ptxas runs out of registers
  (seen on an H200: SmolLM2's fp32 prefill at 128 x 128 did not compile).

Pure Python (no jax import): the config parser uses these types.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

TUNED_PATH = Path(__file__).with_name("tuned_blocks.json")
# Decode programs (B x K x splits) to aim for: at B=32 and B=128 on an H200, K/V reads
# went from 1.7-2.4 TB/s with ~2 programs per SM to 2.3-2.7 TB/s with 8-32 per SM (the
# GPU check's `splits` part); a memory-bound kernel needs many loads in flight per SM.
TARGET_PROGRAMS = 4096
# At most this many splits: at B=1 over 32k keys, 32 splits (8 steps of 128 keys each)
# read at 1.53-1.59 TB/s and 64 (4 steps each, and twice the partials to combine) at
# 1.15-1.31 TB/s, in two H200 runs.
MAX_SPLITS = 32


def _pow2(name: str, value: int | None) -> None:
    if value is not None and (value <= 0 or value & (value - 1)):
        raise ValueError(f"{name}: must be a positive power of two, got {value!r}")


def _positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name}: must be positive, got {value!r}")


@dataclass(frozen=True)
class DecodeBlocks:
    """The decode kernel's launch shape; None = chosen by shape."""

    keys_per_step: int | None = None  # keys one loop step loads (a multiple of the block)
    num_splits: int | None = None  # flash-decoding splits of each slot's pages
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for f in ("keys_per_step", "num_warps"):
            _pow2(f, getattr(self, f))
        for f in ("num_splits", "num_stages"):
            _positive(f, getattr(self, f))


@dataclass(frozen=True)
class PrefillBlocks:
    """The chunked-prefill kernel's launch shape; None = chosen by shape."""

    block_rows: int | None = None  # query rows (token x group-head) per program, >= 16
    keys_per_step: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for f in ("block_rows", "keys_per_step", "num_warps"):
            _pow2(f, getattr(self, f))
        _positive("num_stages", self.num_stages)
        if self.block_rows is not None and self.block_rows < 16:
            raise ValueError(f"block_rows: tensor-core tiles need at least 16, got "
                             f"{self.block_rows}")


def table_key(device_kind: str, dtype: str, group: int, head_dim: int, block_size: int) -> str:
    return f"{device_kind}|{dtype}|g{group}|h{head_dim}|bs{block_size}"


@functools.cache
def _tuned(path: Path = TUNED_PATH) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _merge(chosen, *layers):
    """Each None field of `chosen` from the first layer (a dict or dataclass) that sets it."""
    values = dataclasses.asdict(chosen)
    for layer in layers:
        if not layer:
            continue
        layer = layer if isinstance(layer, dict) else dataclasses.asdict(layer)
        for k, v in layer.items():
            if values.get(k, 0) is None and v is not None:
                values[k] = v
    return type(chosen)(**values)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pages_per_step(keys: int, block_size: int, pages: int) -> int:
    """Whole pages a step, no more than the table holds (rounded up to a power of two),
    and >= 16 keys: the smallest tensor-core tile."""
    per_step = min(max(1, keys // block_size), _next_pow2(pages))
    while per_step * block_size < 16:
        per_step *= 2
    return per_step


def decode_blocks(override: DecodeBlocks | None, *, key: str, batch: int, kv_heads: int,
                  block_size: int, head_dim: int, pages: int, itemsize: int = 2
                  ) -> DecodeBlocks:
    """Concrete decode blocks for this call's shape (every field set)."""
    keys = (128 if head_dim <= 128 else 64) // (2 if itemsize >= 4 else 1)
    b = _merge(override or DecodeBlocks(), _tuned().get("decode", {}).get(key),
               DecodeBlocks(keys_per_step=keys, num_warps=4, num_stages=2))
    per_step = _pages_per_step(b.keys_per_step, block_size, pages)
    steps = -(-pages // per_step)
    splits = b.num_splits or max(1, min(steps, -(-TARGET_PROGRAMS // (batch * kv_heads)),
                                        MAX_SPLITS))
    return dataclasses.replace(b, keys_per_step=per_step * block_size,
                               num_splits=min(splits, steps))


def prefill_blocks(override: PrefillBlocks | None, *, key: str, rows: int, block_size: int,
                   head_dim: int, pages: int, itemsize: int = 2) -> PrefillBlocks:
    """Concrete prefill blocks for this call's shape (every field set)."""
    wide = itemsize >= 4
    keys = (64 if head_dim > 64 else 128) // (4 if wide else 1)
    b = _merge(override or PrefillBlocks(), _tuned().get("prefill", {}).get(key),
               PrefillBlocks(block_rows=64 if wide else 128, keys_per_step=keys,
                             num_warps=8 if wide and head_dim > 64 else 4, num_stages=2))
    per_step = _pages_per_step(b.keys_per_step, block_size, pages)
    block_rows = min(b.block_rows, max(16, _next_pow2(rows)))
    return dataclasses.replace(b, keys_per_step=per_step * block_size, block_rows=block_rows)
