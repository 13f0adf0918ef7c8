"""Helpers shared by the transfer tests and their peer process."""

import hashlib

import numpy as np

from jaxdisagg.mesh.config import PoolConfig
from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.model.sampling import row_params


def make_pool(model, devices, tp, group=2, backend="auto", **pool):
    cfg = PoolConfig(devices=devices, tp=tp, num_blocks=24, block_size=8, chunk_size=16,
                     max_slots=3, max_pages_per_request=8, **pool)
    return PoolInstance("pool", model, devices, cfg, layer_group_size=group, backend=backend)


def original_heads(inst, pages):
    """[blocks, bs, K_expanded, H] -> the first copy of each original KV head."""
    return np.asarray(pages)[:, :, ::inst.kv_replication]


def pages_digest(inst, blocks):
    """sha256 over every layer's K and V pages at `blocks` (original heads only)."""
    h = hashlib.sha256()
    for pages in (*inst.kv.k, *inst.kv.v):
        h.update(np.ascontiguousarray(original_heads(inst, pages)[blocks]).tobytes())
    return h.hexdigest()


def decode_greedy(inst, first_token, prompt_len, blocks, steps):
    """Greedy decode of one request in slot 1 of the instance (the other slots empty)."""
    b, p = inst.pool.max_slots, inst.max_pages
    tables = np.zeros((b, p), np.int32)
    tables[1, :len(blocks)] = blocks
    out = [first_token]
    greedy = row_params([None] * b, 0, inst.config.vocab_size)
    for pos in range(prompt_len, prompt_len + steps - 1):
        tokens, positions, lens = (np.zeros(b, np.int32) for _ in range(3))
        tokens[1], positions[1], lens[1] = out[-1], pos, pos + 1
        new, _ = inst.decode(tokens, positions, tables, lens, greedy)  # the served program
        out.append(int(np.asarray(new)[1]))
    return out
