"""Deployment configuration: YAML -> typed dataclasses, validated before anything starts.

Every error names the field path (`prefill.devices`) and says how to fix it.
Structural checks (types, unknown keys, positive sizes) need nothing else;
`validate_deployment` adds the checks that need the model and the devices present
(disjoint device sets, indices in range, `tp` dividing the query heads).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from jaxdisagg.pallas.blocks import DecodeBlocks, PrefillBlocks


class ConfigError(ValueError):
    """A deployment config that cannot run; the message starts with the field path."""


@dataclass(frozen=True)
class ModelSpec:
    # A preset name (random weights) or a checkpoint directory (HF or Orbax).
    name: str = "tiny"
    dtype: Literal["float32", "bfloat16"] = "float32"
    attention_backend: str = "auto"
    seed: int = 0


@dataclass(frozen=True)
class PoolConfig:
    """One pool: `instances` replicas, each on `tp` devices (instances * tp devices in all)."""

    # Device indices, or a count taken from the first devices no earlier pool uses.
    devices: list[int] | int = 1
    tp: int = 1
    instances: int = 1
    num_blocks: int = 256
    block_size: int = 16
    chunk_size: int = 64  # prefill tokens per program call
    max_slots: int = 8  # decode batch slots
    max_pages_per_request: int = 64  # block-table width: longest request = this * block_size
    # Prefix-cache blocks evicted from device memory are kept in host memory, up to this
    # many, and copied back on a later hit (0 = evicted blocks are simply dropped).
    host_cache_blocks: int = 0
    # Decode dispatches step N+1 before reading step N's tokens, so the host's work per
    # step (inputs, emitting tokens, stop checks) overlaps the device's.
    overlap_steps: bool = True
    # A batching window for decode (off by default): while fewer than
    # `decode_min_batch` rows are busy and more requests are on their way to this
    # instance, a step is held up to `decode_wait_s` for them. Each token is then late by
    # at most that wait; in exchange, where the pools share processors (one host, both
    # pools in a process), decode stops streaming all the weights for one or two rows
    # while prefill needs the cores.
    decode_min_batch: int = 1
    decode_wait_s: float = 0.0
    # The GPU kernels' launch shapes (tile sizes, splits, warps, stages); a field left
    # out is chosen by shape, from the tuned table or the defaults (`pallas/blocks.py`).
    decode_kernel: DecodeBlocks | None = None
    prefill_kernel: PrefillBlocks | None = None


@dataclass(frozen=True)
class TransferConfig:
    kind: Literal["in_process", "cross_process"] = "in_process"
    layer_streaming: bool = True
    layer_group_size: int = 1
    pull_timeout_s: float = 30.0
    lease_s: float = 60.0
    # Cross-process: after a step that offered KV, the prefill process waits up to this
    # long for the pulls before it computes more (a pull queues behind the compute
    # dispatched before it on a CPU client; 0 = do not wait).
    pull_hold_s: float = 0.25
    # A request whose KV never arrives (prefill process gone, pull timed out) fails, or
    # is prefilled again on the decode instance.
    on_failure: Literal["fail", "recompute"] = "fail"


@dataclass(frozen=True)
class RouterConfig:
    """How requests reach the pools (the serving engine reads this; pools do not)."""

    # Conditional disaggregation: prompts of at most this many tokens are prefilled on
    # the decode instance itself, skipping the transfer (0 = always disaggregate).
    local_prefill_threshold: int = 0
    max_requests: int = 1024  # requests in flight (any stage) before submit refuses more
    handoff_queue: int = 4  # prefilled requests (KV staged) waiting per decode instance
    prefix_cache: bool = True


@dataclass(frozen=True)
class DeploymentConfig:
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    model: ModelSpec = field(default_factory=ModelSpec)
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    colocated: PoolConfig | None = None
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def pools(self) -> dict[str, PoolConfig]:
        names = ("colocated",) if self.mode == "colocated" else ("prefill", "decode")
        return {n: getattr(self, n) for n in names}


_POSITIVE = {"tp", "instances", "num_blocks", "block_size", "chunk_size", "max_slots",
             "max_pages_per_request", "layer_group_size", "pull_timeout_s", "lease_s",
             "max_requests", "handoff_queue", "decode_min_batch"}


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value, tp, path: str):
    """Checks value against a dataclass field type, recursing into nested configs."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(tp)):
            return None
        if len(options) == 1:  # Optional[X]: X's own error is the precise one
            return _coerce(value, options[0], path)
        for option in options:
            try:
                return _coerce(value, option, path)
            except ConfigError:
                pass
        names = " | ".join(_type_name(a) for a in options)
        raise ConfigError(f"{path}: expected {names}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}: must be one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, path)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got "
                          f"{type(value).__name__} {value!r}")
    return value


def _from_dict(cls, data, path: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of "
                          f"{', '.join(f.name for f in dataclasses.fields(cls))}, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"{where}: unknown key; {hint}")
        kwargs[key] = _coerce(value, hints[key], where)
        if key in _POSITIVE and kwargs[key] <= 0:
            raise ConfigError(f"{where}: must be positive, got {kwargs[key]!r}")
        if key in ("local_prefill_threshold", "host_cache_blocks") and kwargs[key] < 0:
            raise ConfigError(f"{where}: must be 0 (off) or a positive token count, "
                              f"got {kwargs[key]!r}")
        if key in ("pull_hold_s", "decode_wait_s") and kwargs[key] < 0:
            raise ConfigError(f"{where}: must be 0 (off) or a positive number of seconds, "
                              f"got {kwargs[key]!r}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # a config type's own check; its message starts with the field
        raise ConfigError(f"{path}.{e}" if path else str(e)) from None


def parse_config(data: dict) -> DeploymentConfig:
    cfg = _from_dict(DeploymentConfig, data, "")
    needed = cfg.pools()
    for name, pool in needed.items():
        if pool is None:
            raise ConfigError(f"{name}: missing; mode {cfg.mode!r} needs the pools "
                              f"{', '.join(needed)}")
        if isinstance(pool.devices, int) and pool.devices <= 0:
            raise ConfigError(f"{name}.devices: a device count must be positive, "
                              f"got {pool.devices}")
        if pool.num_blocks < pool.max_pages_per_request:
            # A request as long as the block table allows would never fit: it would
            # wait for blocks forever, or preempt itself and recompute forever.
            raise ConfigError(f"{name}.num_blocks: {pool.num_blocks} blocks cannot hold one "
                              f"request of max_pages_per_request ({pool.max_pages_per_request})"
                              " pages; raise num_blocks or lower max_pages_per_request")
        if pool.decode_min_batch > pool.max_slots:
            raise ConfigError(f"{name}.decode_min_batch: {pool.decode_min_batch} is more "
                              f"rows than the pool's max_slots ({pool.max_slots})")
        if name == "prefill" and (pool.decode_min_batch > 1 or pool.decode_wait_s > 0):
            raise ConfigError(f"{name}.decode_min_batch / decode_wait_s: a prefill pool "
                              "does not decode; set the window on the decode pool")
    for name in ("prefill", "decode", "colocated"):
        if name not in needed and getattr(cfg, name) is not None:
            raise ConfigError(f"{name}: not used in mode {cfg.mode!r}; remove it or set "
                              f"mode to {'colocated' if name == 'colocated' else 'disaggregated'}")
    if cfg.mode == "disaggregated" and cfg.prefill.block_size != cfg.decode.block_size:
        raise ConfigError(f"prefill.block_size: {cfg.prefill.block_size} differs from "
                          f"decode.block_size {cfg.decode.block_size}; KV moves page by page, "
                          "so both pools must use the same block size")
    return cfg


def load_config(path: str | Path) -> DeploymentConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    try:
        return parse_config(data or {})
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


# ------------------------------------------------------------------ placement


@dataclass(frozen=True)
class PoolPlacement:
    """Where one pool runs: device indices per instance."""

    name: str
    tp: int
    instances: tuple[tuple[int, ...], ...]

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for inst in self.instances for d in inst)


def devices_needed(cfg: DeploymentConfig, role: str | None = None) -> int:
    """How many devices of this process the config's pools name (indices or counts)."""
    pools = [p for n, p in cfg.pools().items() if role is None or n == role]
    if cfg.transfer.kind == "cross_process":  # one pool per process, its own indices
        pools = pools[:1] if role is None else pools
    explicit = {d for p in pools if isinstance(p.devices, list) for d in p.devices}
    counted = sum(p.devices for p in pools if isinstance(p.devices, int))
    return max(max(explicit, default=-1) + 1, len(explicit) + counted, 1)


def ensure_cpu_devices(n: int) -> None:
    """On CPU, asks JAX for n host devices if its backend has not started yet (tests and
    the CLI set XLA_FLAGS instead; that wins). Too late is fine: the placement check then
    says what to do."""
    import os

    import jax

    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        if jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except (RuntimeError, ValueError, AttributeError):
        pass  # the backend is up already


def valid_tp(num_heads: int, num_kv_heads: int, ffn: int | None = None) -> list[int]:
    """Tensor-parallel degrees a model allows: each divides the query heads (and the
    MLP's columns), and either divides the KV heads or is a multiple of them (KV heads
    replicated evenly)."""
    return [t for t in range(1, num_heads + 1)
            if num_heads % t == 0 and (ffn is None or ffn % t == 0)
            and (num_kv_heads % t == 0 or t % num_kv_heads == 0)]


def place_pools(cfg: DeploymentConfig, num_devices: int, num_heads: int,
                num_kv_heads: int, ffn: int | None = None) -> dict[str, PoolPlacement]:
    """Resolves device lists and checks them against the machine and the model.

    With cross-process transfer each pool runs in its own process and its device
    indices are that process's own, so pools are not checked against each other.
    """
    placements: dict[str, PoolPlacement] = {}
    shared = cfg.transfer.kind == "in_process"
    used: dict[int, str] = {}
    explicit = {d: n for n, p in cfg.pools().items() if isinstance(p.devices, list)
                for d in p.devices} if shared else {}
    for name, pool in cfg.pools().items():
        if not shared:
            used = {}
        want = pool.tp * pool.instances
        if isinstance(pool.devices, int):
            free = [d for d in range(num_devices) if d not in used and d not in explicit]
            if pool.devices > len(free):
                raise ConfigError(f"{name}.devices: asks for {pool.devices} devices but only "
                                  f"{len(free)} of the {num_devices} present are free")
            devices = free[: pool.devices]
        else:
            devices = pool.devices
            if len(set(devices)) != len(devices):
                raise ConfigError(f"{name}.devices: lists a device twice: {devices}")
            beyond = [d for d in devices if not 0 <= d < num_devices]
            if beyond:
                raise ConfigError(
                    f"{name}.devices: indices {beyond} are beyond the {num_devices} devices "
                    f"present (0-{num_devices - 1}). On CPU, JAX started with too few host "
                    "devices: build the deployment before any other JAX call in the "
                    "process (it then asks for enough), or set "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts")
        for d in devices:
            if d in used:
                raise ConfigError(f"{name}.devices: device {d} is also in {used[d]}.devices; "
                                  "pools must use disjoint devices (remove it from one)")
            used[d] = name
        if len(devices) != want:
            raise ConfigError(f"{name}.devices: {len(devices)} devices given, but tp "
                              f"({pool.tp}) x instances ({pool.instances}) = {want}; "
                              "make them agree")
        valid = valid_tp(num_heads, num_kv_heads, ffn)
        if pool.tp not in valid:
            if num_heads % pool.tp:
                why = f"does not divide the model's {num_heads} query heads"
            elif ffn is not None and ffn % pool.tp:
                why = f"does not divide the model's intermediate_size {ffn}"
            else:
                why = (f"cannot split or evenly replicate the model's {num_kv_heads} KV "
                       "heads")
            raise ConfigError(f"{name}.tp: {pool.tp} {why}; valid tp values for this model: "
                              f"{', '.join(map(str, valid))}")
        instances = tuple(tuple(devices[i * pool.tp:(i + 1) * pool.tp])
                          for i in range(pool.instances))
        placements[name] = PoolPlacement(name, pool.tp, instances)
    return placements
