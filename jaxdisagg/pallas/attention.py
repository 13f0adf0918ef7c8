"""The one dispatch point for paged attention backends.

Every backend shares the signatures of `prefill_attention` and
`decode_attention` below. Today the only implementation is the jnp reference;
the Pallas kernels plug in here under the names `pallas` and `pallas_interpret`.
"""

from __future__ import annotations

from jaxdisagg.pallas.reference import decode_attention_ref, prefill_attention_ref

# name -> (prefill fn, decode fn)
_BACKENDS = {
    "reference": (prefill_attention_ref, decode_attention_ref),
}
BACKEND_NAMES = ("auto", *_BACKENDS)


def resolve_backend(name: str) -> str:
    """Maps a configured backend name to an implemented one (`auto` -> best available)."""
    if name == "auto":
        return "reference"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
    return name


def prefill_attention(q, k_pages, v_pages, block_table, start, num_valid, *, scale,
                      backend: str = "reference"):
    """Chunk queries [T, N, H] at start.. over the request's pages -> [T, N, H]."""
    fn = _BACKENDS[resolve_backend(backend)][0]
    return fn(q, k_pages, v_pages, block_table, start, num_valid, scale=scale)


def decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale,
                     backend: str = "reference"):
    """One query per slot [B, N, H] over each slot's pages -> [B, N, H]."""
    fn = _BACKENDS[resolve_backend(backend)][1]
    return fn(q, k_pages, v_pages, block_tables, seq_lens, scale=scale)
