"""What both Pallas kernels need to meet Triton's tile rules on any real head layout.

Triton tiles have power-of-two sides. Head dims of 80 or 96 (and any other) run as
the next power of two: the queries are zero-padded outside the kernel, the pages
are read through a masked load whose padding lanes are zeros (pages are never
copied), and the padded lanes of the output are dropped. Zeros in the padded lanes
add nothing to q.k, and their output lanes are discarded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxdisagg.pallas.blocks import table_key

NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked logits: exp() underflows to 0
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E)


def padded_head_dim(h: int) -> int:
    return pl.next_power_of_2(h)


def layout_key(k_pages, group: int) -> tuple[str, int]:
    """(tuned-table key, bytes per element) of a call on these pages [NB, bs, K, H]:
    the device kind, dtype, group, head dim and block size choose its launch shape."""
    _, bs, _, h = k_pages.shape
    dtype = jnp.dtype(k_pages.dtype)
    return table_key(jax.devices()[0].device_kind, dtype.name, group, h, bs), dtype.itemsize


def load_pages(ref, pages, head_dim: int):
    """ref[pages] -> [pages, bs, Hp]; lanes >= head_dim read as zeros."""
    if ref.shape[-1] == head_dim:
        return ref[pages]
    _, bs, hp = ref.shape
    # Every axis indexed by an array (interpret mode's masked load takes no mix of
    # arrays and slices); on the GPU it is one gather of whole rows, as ref[pages] is.
    slot = jax.lax.broadcasted_iota(jnp.int32, (pages.shape[0], bs, hp), 1)
    lane = jax.lax.broadcasted_iota(jnp.int32, (pages.shape[0], bs, hp), 2)
    page = jnp.broadcast_to(pages[:, None, None], (pages.shape[0], bs, hp))
    return plgpu.load(ref.at[page, slot, lane], mask=lane < head_dim, other=0.0)
