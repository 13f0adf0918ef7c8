"""What every benchmark script shares: timing and writing the JSON result."""

import json
from pathlib import Path

from jaxdisagg.roofline import median_seconds  # noqa: F401 - the scripts import it from here


def shuffled_cache(cfg, context: int, block: int, spare_pages: int, slots: int = 8):
    """A paged KV cache for `slots` slots of `context` tokens (and `spare_pages` more
    pages each) whose block tables are shuffled across the pool, as a long-running
    server's are, and a random prompt of `context` tokens.
    Returns ([pages], tables [slots, P], prompt, rng): the list holds the pages so the
    caller's donated updates can replace them."""
    import jax.numpy as jnp
    import numpy as np

    from jaxdisagg.model import KVLayout

    pages = -(-context // block) + spare_pages
    layout = KVLayout.for_model(cfg, num_blocks=slots * pages + 1, block_size=block)
    rng = np.random.default_rng(0)
    tables = rng.permutation(layout.num_blocks)[:slots * pages].reshape(slots, pages)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, context), jnp.int32)
    return [layout.allocate()], tables.astype(np.int32), prompt, rng


def spread(values) -> dict:
    """Median and range of repeated measurements (rounds)."""
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write_result(path: str, result: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return out
