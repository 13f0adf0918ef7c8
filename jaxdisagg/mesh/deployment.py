"""A deployment built from a config: pools of instances on their devices, and the KV path.

`Deployment.build` validates everything before it allocates anything, then puts
each pool instance on its own sub-mesh with its own copy of the weights, and (for
in-process disaggregation) one transfer per prefill/decode instance pair.
`prefill_request` is the prefill side of one request: chunked prefill, with the
request's KV streamed to the decode devices layer group by layer group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxdisagg.mesh.config import (
    ConfigError,
    DeploymentConfig,
    devices_needed,
    ensure_cpu_devices,
    load_config,
    place_pools,
)
from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.mesh.transfer import InFlightKV, InProcessTransfer, TransferStats
from jaxdisagg.model.llama import Llama
from jaxdisagg.model.paged import smallest_fit
from jaxdisagg.model.tokenizer import Tokenizer
from jaxdisagg.model.weights import load_model

log = logging.getLogger(__name__)


@dataclass
class Deployment:
    config: DeploymentConfig
    model: Llama
    tokenizer: Tokenizer | None
    pools: dict[str, list[PoolInstance]]
    transfers: dict[tuple[int, int], InProcessTransfer]  # (prefill i, decode j) -> transfer

    @classmethod
    def build(cls, config: DeploymentConfig | str, *, role: str | None = None,
              warmup: bool = True, progress: bool = False, devices=None) -> Deployment:
        """Everything validated first, then the pools (only `role`'s pool if given).

        A cross-process config runs one pool per process: each process builds its
        own with `role="prefill"` or `role="decode"` and moves KV with
        `xproc.KVSender` / `xproc.KVReceiver`.
        """
        cfg = load_config(config) if isinstance(config, str) else config
        if devices is None:
            ensure_cpu_devices(devices_needed(cfg, role))
            devices = jax.devices()
        if role is not None and role not in cfg.pools():
            raise ConfigError(f"role {role!r}: this config's pools are {', '.join(cfg.pools())}")
        if cfg.transfer.kind == "cross_process" and role is None:
            raise ConfigError("transfer.kind: 'cross_process' runs each pool in its own "
                              "process; build each with role='prefill' or role='decode'")
        model, tokenizer = load_model(cfg.model.name, jnp.dtype(cfg.model.dtype),
                                      seed=cfg.model.seed)
        placements = place_pools(cfg, len(devices), model.config.num_heads,
                                 model.config.num_kv_heads, model.config.intermediate_size)
        # Only the prefill pool streams KV out layer group by layer group.
        group = cfg.transfer.layer_group_size if cfg.transfer.layer_streaming else None
        pools = {
            name: [PoolInstance(name, model, inst, cfg.pools()[name],
                                backend=cfg.model.attention_backend,
                                layer_group_size=group if name == "prefill" else None,
                                devices=devices)
                   for inst in placements[name].instances]
            for name in placements if role in (None, name)}
        transfers = {}
        if cfg.mode == "disaggregated" and role is None:
            transfers = {(i, j): InProcessTransfer(p, d)
                         for i, p in enumerate(pools["prefill"])
                         for j, d in enumerate(pools["decode"])}
        dep = cls(cfg, model, tokenizer, pools, transfers)
        if warmup:
            dep.warmup(progress)
        return dep

    def warmup(self, progress: bool = False) -> None:
        """Compiles every program serving will use; afterwards nothing compiles."""
        jobs = [(f"{inst.name}[{i}]", inst) for name, insts in self.pools.items()
                for i, inst in enumerate(insts)]
        jobs += [(f"transfer {i}->{j}", t) for (i, j), t in self.transfers.items()]
        bar = tqdm(jobs, desc="compiling", unit="program set",
                   disable=None if progress else True)  # None: bars only on a terminal
        for label, job in bar:
            bar.set_postfix_str(label)
            t0 = time.perf_counter()
            if isinstance(job, PoolInstance):
                # Decode instances prefill too: short prompts under conditional
                # disaggregation, and recomputation after preemption.
                job.warmup(decode=job.name != "prefill")
            else:
                job.warmup()
            # A slow start (compiling on few cores, a large model) shows in the log as
            # progress, not as silence.
            log.info("warm-up: %s compiled in %.1f s", label, time.perf_counter() - t0)


def block_table(inst: PoolInstance, blocks: Sequence[int]) -> np.ndarray:
    """A request's block list padded to the instance's table width."""
    table = np.zeros(inst.max_pages, np.int32)
    table[:len(blocks)] = blocks
    return table


def chunk_at(inst: PoolInstance, prompt: Sequence[int], start: int,
             limit: int | None = None) -> tuple[np.ndarray, int]:
    """The chunk of `prompt` starting at `start` (at most `limit` tokens), padded to
    the smallest compiled chunk bucket that holds it; and its real length."""
    size = inst.pool.chunk_size if limit is None else min(limit, inst.pool.chunk_size)
    piece = prompt[start:start + size]
    tokens = np.zeros(smallest_fit(len(piece), inst.chunk_buckets), np.int32)
    tokens[:len(piece)] = piece
    return tokens, len(piece)


def prefill_last_chunk(inst: PoolInstance, tokens: np.ndarray, start: int, num_valid: int,
                       table: np.ndarray, blocks: Sequence[int], transfer=None,
                       layer_streaming: bool = True) -> tuple[jax.Array, list]:
    """A request's final chunk, its KV sent through `transfer`; (logits, tickets).

    With layer streaming the chunk runs layer group by layer group and each group's
    pages start moving as soon as that group is dispatched, so the copy of early
    layers overlaps the compute of later ones. Without it, all pages move after the
    last layer. Nothing here blocks.
    """
    if transfer is None:
        return inst.prefill(tokens, start, num_valid, table), []
    if layer_streaming and len(inst.groups) > 1:
        tickets, out = [], tokens
        for i, group in enumerate(inst.groups):
            out = inst.prefill_group(i, out, start, num_valid, table)
            tickets += transfer.extract(group, blocks)
        return out, tickets
    logits = inst.prefill(tokens, start, num_valid, table)
    return logits, transfer.extract(range(inst.config.num_layers), blocks)


def prefill_request(inst: PoolInstance, prompt: Sequence[int], src_blocks: Sequence[int],
                    transfer: InProcessTransfer | None = None,
                    layer_streaming: bool = True) -> tuple[jax.Array, list[InFlightKV], float]:
    """Chunked prefill of one prompt into `src_blocks`; returns (logits of the last token,
    KV parts in flight to the decode devices, dispatch time of the first part).
    """
    bs = inst.layout.block_size
    if not 0 < len(prompt) <= inst.max_pages * bs:
        raise ValueError(f"prompt of {len(prompt)} tokens does not fit "
                         f"1..{inst.max_pages * bs}")
    if len(src_blocks) < -(-len(prompt) // bs):
        raise ValueError(f"{len(src_blocks)} blocks cannot hold {len(prompt)} tokens")
    table = block_table(inst, src_blocks)
    starts = list(range(0, len(prompt), inst.pool.chunk_size))
    for start in starts[:-1]:
        tokens, n = chunk_at(inst, prompt, start)
        inst.prefill(tokens, start, n, table)
    tokens, n = chunk_at(inst, prompt, starts[-1])
    logits, parts = prefill_last_chunk(inst, tokens, starts[-1], n, table, src_blocks,
                                       transfer, layer_streaming)
    return logits, parts, parts[0].dispatched_at if parts else None


def finish_transfer(transfer: InProcessTransfer, logits: jax.Array, parts: list[InFlightKV],
                    dst_blocks: Sequence[int], first_dispatch: float) -> TransferStats:
    """Inserts the parts into the decode pool and measures the transfer.

    The inserts are dispatched before waiting for anything, so with layer
    streaming the scatter of early layers runs while prefill still computes.
    exposed_s runs from the end of prefill compute (the logits ready) to the KV
    ready in the decode pool: the part of the transfer prefill did not hide.
    """
    transfer.insert(parts, dst_blocks)
    jax.block_until_ready(logits)
    compute_end = time.perf_counter()
    jax.block_until_ready(transfer.dst.kv)
    ready = time.perf_counter()
    return TransferStats(bytes_moved=sum(p.nbytes for p in parts),
                         transfer_s=ready - first_dispatch,
                         exposed_s=max(0.0, ready - compute_end))
