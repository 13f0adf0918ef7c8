"""The one dispatch point for paged attention backends.

Every backend has the signatures of `prefill_attention` and `decode_attention`:

* `reference`: plain jnp (`reference.py`), the oracle, and the fallback where `cpu`
  cannot be built;
* `cpu`: decode attention as one C++ custom call per layer (`cpu.py`), the CPU default;
  prefill, already matmul-bound on XLA:CPU, and non-fp32 pages use the reference;
* `pallas`: the Pallas kernels (`prefill.py`, `decode.py`) lowered for NVIDIA GPUs
  through Pallas' Triton backend;
* `pallas_interpret`: the same kernels in interpret mode (CPU, for tests);
* `auto`: `pallas` on a GPU, else `cpu` where its kernel builds, else `reference`.

Inside a sharded program, pass the pool's `mesh`: the kernels then run under
`jax.shard_map` over the `tp` axis, each device on its own KV heads and their query
heads (plain jit would all-gather the pages and run the kernel replicated). The
reference backend needs no mesh: XLA partitions it.

Where a backend name is taken, an `AttentionSpec` may be passed instead: the name
plus the kernels' launch shapes a deployment config set (`blocks.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxdisagg.pallas import cpu
from jaxdisagg.pallas.blocks import DecodeBlocks, PrefillBlocks
from jaxdisagg.pallas.decode import paged_decode_attention
from jaxdisagg.pallas.prefill import paged_prefill_attention
from jaxdisagg.pallas.reference import decode_attention_ref, prefill_attention_ref

BACKEND_NAMES = ("auto", "reference", "cpu", "pallas", "pallas_interpret")
TP = "tp"


@dataclass(frozen=True)
class AttentionSpec:
    """A backend and the launch shapes set for its kernels (None: chosen by shape)."""

    backend: str = "auto"
    decode: DecodeBlocks | None = None
    prefill: PrefillBlocks | None = None


def _spec(backend: str | AttentionSpec) -> AttentionSpec:
    spec = backend if isinstance(backend, AttentionSpec) else AttentionSpec(backend)
    return AttentionSpec(resolve_backend(spec.backend), spec.decode, spec.prefill)


def resolve_backend(name: str) -> str:
    """Maps a configured backend name to an implemented one (`auto` -> best available)."""
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        if jax.default_backend() == "gpu":
            return "pallas"
        return "cpu" if cpu.available() else "reference"
    if name == "cpu" and not cpu.available():
        raise ValueError(f"attention backend 'cpu' is unavailable: {cpu.unavailable_reason()}")
    return name


def _kernels(spec: AttentionSpec):
    interpret = spec.backend == "pallas_interpret"
    return (functools.partial(paged_prefill_attention, interpret=interpret, blocks=spec.prefill),
            functools.partial(paged_decode_attention, interpret=interpret, blocks=spec.decode))


def _sharded(fn, mesh: Mesh | None, in_specs, out_spec):
    if mesh is None or mesh.shape.get(TP, 1) == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                         check_vma=False)


_HEADS = PartitionSpec(None, TP, None)  # q and outputs: [tokens or slots, heads, H]
_PAGES = PartitionSpec(None, None, TP, None)  # [blocks, block_size, KV heads, H]


def prefill_attention(q, k_pages, v_pages, block_table, start, num_valid, *, scale,
                      backend: str | AttentionSpec = "reference", mesh: Mesh | None = None):
    """Chunk queries [T, N, H] at start.. over the request's pages -> [T, N, H]."""
    spec = _spec(backend)
    if spec.backend in ("reference", "cpu"):
        return prefill_attention_ref(q, k_pages, v_pages, block_table, start, num_valid,
                                     scale=scale)
    kernel = functools.partial(_kernels(spec)[0], scale=scale)
    fn = _sharded(kernel, mesh, (_HEADS, _PAGES, _PAGES, PartitionSpec(), PartitionSpec(),
                                 PartitionSpec()), _HEADS)
    return fn(q, k_pages, v_pages, block_table, start, num_valid)


def decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale,
                     backend: str | AttentionSpec = "reference", mesh: Mesh | None = None):
    """One query per slot [B, N, H] over each slot's pages -> [B, N, H]."""
    spec = _spec(backend)
    backend = spec.backend
    if backend == "cpu" and not cpu.supports(k_pages.dtype, q.shape[-1]):
        backend = "reference"
    if backend == "reference":
        return decode_attention_ref(q, k_pages, v_pages, block_tables, seq_lens, scale=scale)
    if backend == "cpu":
        kernel = functools.partial(cpu.paged_decode_attention_cpu, scale=scale)
    else:
        kernel = functools.partial(_kernels(spec)[1], scale=scale)
    fn = _sharded(kernel, mesh, (_HEADS, _PAGES, _PAGES, PartitionSpec(), PartitionSpec()),
                  _HEADS)
    return fn(q, k_pages, v_pages, block_tables, seq_lens)
