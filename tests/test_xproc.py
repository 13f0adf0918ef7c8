"""KV between two processes: bit for bit, any tp pair, and every failure bounded in time.

This process is the prefill side (8 CPU devices); tests/xproc_peer.py is the decode
side, a real second process with its own 4 CPU devices and its own control server.
"""

import dataclasses
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from kv_util import make_pool, pages_digest

from jaxdisagg.mesh.config import ConfigError
from jaxdisagg.mesh.control import ControlClient
from jaxdisagg.mesh.deployment import Deployment, prefill_request
from jaxdisagg.mesh.xproc import KVSender
from jaxdisagg.model import ReferenceGenerator, SamplingParams

PEER = Path(__file__).resolve().parent / "xproc_peer.py"
PROMPT = list(np.random.default_rng(1).integers(0, 256, 45))
SRC_BLOCKS, DST_BLOCKS = [7, 2, 19, 4, 11, 0], [3, 22, 5, 14, 8, 1]
PULL_TIMEOUT = 3.0


class Peer:
    def __init__(self, *args):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        args = [str(a) for a in args] if len(args) != 1 else [str(args[0]), str(PULL_TIMEOUT)]
        self.proc = subprocess.Popen([sys.executable, str(PEER), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        line = self.proc.stdout.readline()  # bounded: the peer prints or dies
        if not line.startswith("READY"):
            self.proc.kill()
            raise RuntimeError(f"peer did not start: {line!r}")
        self.client = ControlClient(line.split()[1])

    def call(self, method, payload, timeout=60):
        return self.client.call(method, payload, timeout=timeout)

    def stop(self):
        self.call("stop", {}, timeout=10)
        self.proc.wait(timeout=30)

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def peer_tp2():
    peer = Peer(2)
    yield peer
    peer.kill()


@pytest.fixture
def sender_tp4(tiny_model):
    inst = make_pool(tiny_model, [0, 1, 2, 3], 4)
    sender = KVSender(inst, lease_s=2.0)
    yield inst, sender
    sender.close()


def prefilled(inst, prompt=PROMPT):
    logits, _, _ = prefill_request(inst, prompt, SRC_BLOCKS)
    return int(np.argmax(np.asarray(logits)))


def test_kv_crosses_processes_bit_for_bit_and_decodes(tiny_model, sender_tp4, peer_tp2):
    """tp4 here -> tp2 there; then the peer decodes and matches the reference."""
    inst, sender = sender_tp4
    first = prefilled(inst)
    # Streamed groups, each in runs of 4 + 2 pages: exact bytes, no bucket padding.
    offers = [o for g in inst.groups for o in sender.extract(g, SRC_BLOCKS, "req-1")]
    assert [(o.offset, o.num_pages) for o in offers[:2]] == [(0, 4), (4, 2)]
    assert sender.held() == len(offers) == 2 * len(inst.groups)
    assert not sender.wait_released(0.05)  # nobody pulled yet: the prefill hold times out
    # What the prefill process's hold does: wait while the receiver pulls and releases.
    waiter = ThreadPoolExecutor(1).submit(sender.wait_released, 120.0)
    got = peer_tp2.call("receive", {"offers": [o.to_json() for o in offers],
                                    "dst_blocks": DST_BLOCKS})
    assert got["digest"] == pages_digest(inst, SRC_BLOCKS)
    assert waiter.result(timeout=30) is True  # woken by the last release, not its timeout
    assert sender.held() == 0  # the receiver released every offer
    steps = 6
    want = ReferenceGenerator(tiny_model).generate([PROMPT], SamplingParams(max_tokens=steps),
                                                   stop_token_ids=[])[0]
    tokens = peer_tp2.call("decode", {"first_token": first, "prompt_len": len(PROMPT),
                                      "dst_blocks": DST_BLOCKS, "steps": steps})["tokens"]
    assert tokens == want


def test_heterogeneous_tp_the_other_way(tiny_model):
    """tp1 here -> tp4 there (the peer replicates each KV head twice)."""
    inst = make_pool(tiny_model, [5], 1)
    sender = KVSender(inst, lease_s=5.0)
    peer = Peer(4)
    try:
        prefilled(inst)
        offers = sender.extract(range(0, 4), SRC_BLOCKS, "req-2")
        got = peer.call("receive", {"offers": [o.to_json() for o in offers],
                                    "dst_blocks": DST_BLOCKS})
        assert got["digest"] == pages_digest(inst, SRC_BLOCKS)
    finally:
        peer.kill()
        sender.close()


def test_pull_of_a_never_offered_id_fails_within_the_timeout(sender_tp4, peer_tp2):
    inst, sender = sender_tp4
    prefilled(inst)
    offers = sender.extract(range(0, 4), SRC_BLOCKS, "req-3")
    ghosts = [dataclasses.replace(o, uuid=o.uuid + 10_000, request_id="ghost") for o in offers]
    t = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        peer_tp2.call("receive", {"offers": [g.to_json() for g in ghosts],
                                  "dst_blocks": DST_BLOCKS}, timeout=PULL_TIMEOUT + 20)
    elapsed = time.monotonic() - t
    assert "did not finish within 3.0s" in err.value.details()
    assert "'ghost'" in err.value.details()
    assert elapsed < PULL_TIMEOUT + 10  # bounded by our watchdog, not by gRPC's deadline
    # The peer keeps serving after the failed pull.
    got = peer_tp2.call("receive", {"offers": [o.to_json() for o in offers],
                                    "dst_blocks": DST_BLOCKS})
    assert got["digest"] == pages_digest(inst, SRC_BLOCKS)


def test_incompatible_offer_is_refused_before_any_pull(sender_tp4, peer_tp2):
    inst, sender = sender_tp4
    prefilled(inst)
    offer = sender.extract(range(0, 4), SRC_BLOCKS, "req-4")[0]
    other = dataclasses.replace(offer, compat="0" * 16)
    with pytest.raises(grpc.RpcError) as err:
        peer_tp2.call("receive", {"offers": [other.to_json()], "dst_blocks": DST_BLOCKS})
    assert "incompatible KV" in err.value.details() and "nothing was pulled" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        peer_tp2.call("receive", {"offers": [{"uuid": 1}], "dst_blocks": DST_BLOCKS})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_receiver_that_dies_leaves_no_kv_past_the_lease(sender_tp4):
    inst, sender = sender_tp4  # lease 2 s
    peer = Peer(2)
    prefilled(inst)
    sender.extract(range(0, 4), SRC_BLOCKS, "req-5")
    peer.kill()  # it never pulls or releases
    assert sender.held() == 2  # runs of 4 + 2 pages
    assert sender.wait_released(sender.lease_s + 3)  # the reaper's expiry wakes a waiter
    assert sender.held() == 0


def test_two_process_config(tiny_model):
    """configs/cpu-2proc.yaml: this process is its prefill role, the peer its decode role."""
    config = str(Path(__file__).resolve().parents[1] / "configs" / "cpu-2proc.yaml")
    with pytest.raises(ConfigError, match="build each with role="):
        Deployment.build(config)
    dep = Deployment.build(config, role="prefill")
    assert set(dep.pools) == {"prefill"} and not dep.transfers
    inst = dep.pools["prefill"][0]
    sender = KVSender(inst, lease_s=dep.config.transfer.lease_s)
    peer = Peer("--config", config)
    try:
        blocks = [4, 9, 1]
        logits, _, _ = prefill_request(inst, PROMPT, blocks)
        offers = sender.extract(range(0, 4), blocks, "req-6")
        got = peer.call("receive", {"offers": [o.to_json() for o in offers],
                                    "dst_blocks": [2, 3, 5]})
        assert got["digest"] == pages_digest(inst, blocks)
        want = ReferenceGenerator(tiny_model).generate([PROMPT], SamplingParams(max_tokens=5),
                                                       stop_token_ids=[])[0]
        tokens = peer.call("decode", {"first_token": int(np.argmax(np.asarray(logits))),
                                      "prompt_len": len(PROMPT), "dst_blocks": [2, 3, 5],
                                      "steps": 5})["tokens"]
        assert tokens == want
        peer.stop()  # graceful: the peer exits on request
        assert peer.proc.returncode == 0
    finally:
        peer.kill()
        sender.close()
