"""Deployment configs: every shipped file places, every mistake gets a clear error."""

from pathlib import Path

import pytest
import yaml

from jaxdisagg.mesh.config import ConfigError, load_config, parse_config, place_pools
from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.model import Llama, get_preset

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
TINY = get_preset("tiny")


def test_every_shipped_config_is_present():
    names = {p.name for p in CONFIGS}
    assert {"cpu-1p1d.yaml", "cpu-hetero.yaml", "cpu-colocated.yaml", "cpu-2proc.yaml",
            "gpu-8-4p4d.yaml", "gpu-1-colocated.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_places(path):
    cfg = load_config(path)
    model = get_preset(cfg.model.name)
    devices = 8
    placements = place_pools(cfg, devices, model.num_heads, model.num_kv_heads)
    assert set(placements) == set(cfg.pools())
    if cfg.transfer.kind == "in_process":
        used = [d for p in placements.values() for d in p.devices]
        assert len(used) == len(set(used))


def test_default_config_is_4_and_4_disjoint():
    cfg = load_config(CONFIGS[[p.name for p in CONFIGS].index("cpu-1p1d.yaml")])
    placed = place_pools(cfg, 8, TINY.num_heads, TINY.num_kv_heads)
    assert placed["prefill"].devices == (0, 1, 2, 3)
    assert placed["decode"].devices == (4, 5, 6, 7)


def base():
    return {
        "model": {"name": "tiny"},
        "prefill": {"devices": [0, 1, 2, 3], "tp": 4},
        "decode": {"devices": [4, 5], "tp": 2},
    }


def with_(path, value):
    data = base()
    node = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return data


PARSE_ERRORS = [
    (with_("prefill.chunk_sise", 64),
     r"prefill\.chunk_sise: unknown key; did you mean 'chunk_size'"),
    (with_("trasnfer", {}), r"trasnfer: unknown key; did you mean 'transfer'"),
    (with_("decode.tp", "2"), r"decode\.tp: expected int, got str '2'"),
    (with_("decode.tp", True), r"decode\.tp: expected int, got bool"),
    (with_("prefill.devices", "0-3"), r"prefill\.devices: expected list \| int"),
    (with_("prefill.devices", [0, "x"]), r"prefill\.devices: expected list \| int"),
    (with_("decode.block_size", 0), r"decode\.block_size: must be positive, got 0"),
    (with_("prefill.chunk_size", -8), r"prefill\.chunk_size: must be positive, got -8"),
    (with_("transfer.kind", "rdma"), r"transfer\.kind: must be one of 'in_process'"),
    (with_("model.dtype", "float16"), r"model\.dtype: must be one of 'float32', 'bfloat16'"),
    (with_("mode", "colocated"), r"colocated: missing"),
    (with_("prefill.block_size", 8), r"prefill\.block_size: 8 differs from decode\.block_size"),
    (with_("prefill", [1, 2]), r"prefill: expected a mapping of devices, tp"),
    (with_("transfer.lease_s", 0), r"transfer\.lease_s: must be positive"),
    (with_("transfer.pull_hold_s", -0.1), r"transfer\.pull_hold_s: must be 0 \(off\) or a posi"),
    (with_("decode.decode_kernel", {"keys_per_step": 48}),
     r"decode\.decode_kernel\.keys_per_step: must be a positive power of two, got 48"),
    (with_("prefill.prefill_kernel", {"block_rows": 8}),
     r"prefill\.prefill_kernel\.block_rows: tensor-core tiles need at least 16"),
    (with_("decode.decode_kernel", {"num_wraps": 8}),
     r"decode\.decode_kernel\.num_wraps: unknown key; did you mean 'num_warps'"),
]


def test_kernel_launch_shapes_parse_into_their_dataclasses():
    from jaxdisagg.pallas.blocks import DecodeBlocks

    cfg = parse_config(with_("decode.decode_kernel", {"num_splits": 4, "num_warps": 8}))
    assert cfg.decode.decode_kernel == DecodeBlocks(num_splits=4, num_warps=8)
    assert cfg.prefill.decode_kernel is None  # not set: chosen by shape


@pytest.mark.parametrize("data,message", PARSE_ERRORS)
def test_parse_errors_name_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


PLACE_ERRORS = [
    (with_("decode.devices", [3, 4]), r"decode\.devices: device 3 is also in prefill\.devices"),
    (with_("decode.devices", [8, 9]),
     r"decode\.devices: indices \[8, 9\] are beyond the 8 devices"),
    (with_("prefill.tp", 3), r"prefill\.devices: 4 devices given, but tp \(3\) x instances"),
    (base() | {"decode": {"devices": [4, 5, 6], "tp": 3}},
     r"decode\.tp: 3 does not divide the model's 4 query heads; valid tp values for this "
     r"model: 1, 2, 4"),
    (with_("decode.devices", 7), r"decode\.devices: asks for 7 devices but only 4"),
    (with_("decode.devices", [4, 4]), r"decode\.devices: lists a device twice"),
]


@pytest.mark.parametrize("data,message", PLACE_ERRORS)
def test_placement_errors_name_the_field(data, message):
    cfg = parse_config(data)
    with pytest.raises(ConfigError, match=message):
        place_pools(cfg, 8, TINY.num_heads, TINY.num_kv_heads)


def test_tp_that_cannot_replicate_kv_heads_evenly():
    cfg = parse_config({"prefill": {"devices": [0, 1, 2, 3, 4, 5], "tp": 6},
                        "decode": {"devices": [6], "tp": 1}})
    with pytest.raises(ConfigError, match=r"prefill\.tp: 6 cannot split or evenly replicate "
                                          r"the model's 4 KV heads; valid tp values for "
                                          r"this model: 1, 2, 4, 12"):
        place_pools(cfg, 8, num_heads=12, num_kv_heads=4)


def test_smollm2_heads_allow_tp_1_and_3():
    from jaxdisagg.mesh.config import valid_tp

    assert valid_tp(9, 3, 1536) == [1, 3]
    cfg = parse_config({"prefill": {"devices": [0, 1], "tp": 2}, "decode": {"devices": [2]}})
    with pytest.raises(ConfigError, match=r"prefill\.tp: 2 does not divide the model's 9 "
                                          r"query heads; valid tp values for this model: 1, 3"):
        place_pools(cfg, 8, num_heads=9, num_kv_heads=3, ffn=1536)


def test_ffn_not_divisible_by_tp_is_a_config_error():
    cfg = parse_config({"prefill": {"devices": [0, 1], "tp": 2}, "decode": {"devices": [2]}})
    with pytest.raises(ConfigError, match=r"prefill\.tp: 2 does not divide the model's "
                                          r"intermediate_size 1001"):
        place_pools(cfg, 8, num_heads=4, num_kv_heads=2, ffn=1001)


def test_device_counts_fill_free_devices_in_order():
    cfg = parse_config({"prefill": {"devices": 2, "tp": 2}, "decode": {"devices": [0, 1], "tp": 2}})
    placed = place_pools(cfg, 8, TINY.num_heads, TINY.num_kv_heads)
    assert placed["prefill"].devices == (2, 3) and placed["decode"].devices == (0, 1)


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(with_("decode.max_slot", 4)))
    with pytest.raises(ConfigError, match=r"typo.yaml: decode\.max_slot: unknown key; did you "
                                          r"mean 'max_slots'"):
        load_config(typo)


def test_kv_head_replication_is_explicit_and_accounted():
    """tp=4 over 2 KV heads: each head stored twice, and the pool's layout says so."""
    model = Llama(TINY, seed=0)
    pool = parse_config(base()).prefill
    inst = PoolInstance("prefill", model, [0, 1, 2, 3], pool)
    half = PoolInstance("decode", model, [4, 5], parse_config(base()).decode)
    assert inst.kv_replication == 2 and inst.layout.num_kv_heads == 4
    assert half.kv_replication == 1 and half.layout.num_kv_heads == 2
    assert inst.layout.nbytes() == 2 * half.layout.nbytes()
    assert inst.kv.k[0].sharding.shard_shape(inst.kv.k[0].shape)[2] == 1


def test_devices_needed_counts_indices_and_counts():
    from jaxdisagg.mesh.config import devices_needed

    assert devices_needed(parse_config(base())) == 6
    assert devices_needed(parse_config({"prefill": {"devices": 2, "tp": 2},
                                        "decode": {"devices": [5], "tp": 1}})) == 6
    assert devices_needed(parse_config({"prefill": {"devices": 3, "tp": 1},
                                        "decode": {"devices": [0], "tp": 1}})) == 4


def test_a_fresh_process_gets_the_cpu_devices_a_config_needs(tmp_path):
    """No XLA_FLAGS: building the deployment asks JAX for enough host devices."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = ("from jaxdisagg.serve.engine import Engine\n"
            "from jaxdisagg.model import SamplingParams\n"
            "with Engine.from_config('configs/cpu-1p1d.yaml') as e:\n"
            "    print(len(e.generate(['Hi'], SamplingParams(max_tokens=2))[0].token_ids))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=300,
                         env={**env, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr[-1500:]
