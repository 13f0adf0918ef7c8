"""The disaggregated core loop end to end on the shipped configs: reference tokens for
requests arriving at different steps, prefix reuse, cancellation at every stage, and
KV exhaustion; both pools' blocks all come back."""

from pathlib import Path

import numpy as np
import pytest

from jaxdisagg.mesh import Deployment
from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.serve.core import DisaggregatedCore

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def prompts(seed, lens):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lens]


def drain(core, arrivals=(), max_steps=300):
    """Runs the core, adding (step, id, prompt, params) arrivals when their step comes."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while (arrivals or not core.idle) and step < max_steps:
        while arrivals and arrivals[0][0] <= step:
            _, rid, prompt, params = arrivals.pop(0)
            core.add_request(rid, prompt, params)
        core.step()
        step += 1
    assert core.idle, "requests left unfinished"


def assert_all_blocks_back(core):
    for mgr in (core.prefill_blocks, core.decode_blocks):
        mgr.check()
        assert mgr.num_available == mgr.num_blocks


@pytest.mark.parametrize("name", ["cpu-1p1d.yaml", "cpu-hetero.yaml"])
def test_tokens_equal_reference_for_staggered_mixed_batch(deployments, name):
    dep = deployments(name)
    core = DisaggregatedCore(dep)
    ps = prompts(0, (5, 70, 33, 130, 9))  # 70 and 130 span several 64-token chunks
    params = [SamplingParams(max_tokens=n) for n in (7, 5, 9, 4, 6)]
    arrivals = [(s, f"r{i}", ps[i], params[i]) for i, s in enumerate((0, 0, 1, 3, 8))]
    drain(core, arrivals)
    want = ReferenceGenerator(dep.model).generate(ps, params, stop_token_ids=[])
    assert [core.finished[f"r{i}"].tokens for i in range(5)] == want
    assert_all_blocks_back(core)


def test_prefix_reuse_skips_tokens_and_matches_reference(deployments):
    dep = deployments("cpu-1p1d.yaml")
    core = DisaggregatedCore(dep)
    shared = prompts(1, (40,))[0]
    a, b = shared + [1, 2, 3], shared + [7, 8]
    params = SamplingParams(max_tokens=5)
    drain(core, [(0, "a", a, params)])
    drain(core, [(0, "b", b, params)])
    assert core.finished["a"].cached_tokens == 0
    assert core.finished["b"].cached_tokens == 32  # two full 16-token blocks of the prefix
    want = ReferenceGenerator(dep.model).generate([a, b], params, stop_token_ids=[])
    assert [core.finished["a"].tokens, core.finished["b"].tokens] == want
    assert_all_blocks_back(core)


def test_cancel_at_every_stage_frees_both_pools(deployments):
    dep = deployments("cpu-1p1d.yaml")
    core = DisaggregatedCore(dep)
    ps = prompts(2, (150, 20, 20, 20))
    params = SamplingParams(max_tokens=40)
    for i, p in enumerate(ps):
        core.add_request(f"r{i}", p, params)
    assert core.cancel("r3")  # queued, never started
    core.step()  # r0 mid-prefill (150 tokens = 3 chunks)
    assert core.cancel("r0")
    hog = core.decode_blocks.allocate(core.decode_blocks.num_available)  # decode pool full
    core.step()  # r1 prefilled: its KV is in flight, waiting for decode blocks
    assert core.handoffs and core.handoffs[0].job.request_id == "r1"
    assert core.cancel("r1")  # in transfer
    core.decode_blocks.release(hog)
    for _ in range(4):
        core.step()
    assert core.decode.active  # r2 decoding
    assert core.cancel("r2")
    assert not core.cancel("nope")
    assert {f.finish_reason for f in core.finished.values()} == {"cancelled"}
    assert core.idle
    assert_all_blocks_back(core)


def test_decode_kv_exhaustion_preempts_and_outputs_stay_identical():
    import dataclasses

    from jaxdisagg.mesh import load_config

    cfg = load_config(CONFIGS / "cpu-1p1d.yaml")
    cfg = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, num_blocks=9,
                                                              max_slots=3))
    dep = Deployment.build(cfg)
    core = DisaggregatedCore(dep)
    ps = prompts(3, (40, 45, 38))  # 3 blocks each, growing to 5: 15 > 9 blocks
    params = SamplingParams(max_tokens=30)
    preempted = []
    original = core.decode.step

    def counting_step():
        result = original()
        preempted.extend(s.request_id for s in result.preempted)
        return result

    core.decode.step = counting_step
    drain(core, [(0, f"r{i}", p, params) for i, p in enumerate(ps)])
    assert preempted, "the scenario must run the decode pool out of blocks"
    want = ReferenceGenerator(dep.model).generate(ps, params, stop_token_ids=[])
    assert [core.finished[f"r{i}"].tokens for i in range(3)] == want
    assert_all_blocks_back(core)
