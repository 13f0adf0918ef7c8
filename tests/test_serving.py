"""Both engines, stepped by the test (start=False) so every stage can be hit on purpose.

Greedy fp32 tokens equal the reference generator's for every shipped config, with
requests of mixed lengths arriving at different steps; cancellation at every stage,
preemption, prefix reuse, routing and backpressure; after each scenario every block
of every pool is back and the invariants hold.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from serve_util import assert_all_back, engine_for, prompts

from jaxdisagg.mesh import Deployment, load_config
from jaxdisagg.mesh.config import ModelSpec
from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.serve.engine import (
    QueueFull,
    UnknownRequestError,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ON_CPU = {"cpu-1p1d.yaml", "cpu-hetero.yaml", "cpu-colocated.yaml"}
# The GPU configs' layouts (devices, tp, instances, mode, transfer) with the tiny model
# and CPU-sized pools: the same routing, sharding and transfer code paths.
GPU_LAYOUTS = {"gpu-8-4p4d.yaml", "gpu-1-colocated.yaml"}
# One pool per process: tests/test_multiprocess.py serves it through `jaxdisagg launch`
# (and test_xproc.py::test_two_process_config through its roles) and checks the greedy
# tokens against the reference generator.
CROSS_PROCESS = {"cpu-2proc.yaml"}
# The real model (SmolLM2-135M): tests/test_smollm2.py checks each against transformers.
SMOLLM2 = {"cpu-smollm2.yaml", "cpu-smollm2-colocated.yaml", "cpu-smollm2-2proc.yaml"}


def run(engine, arrivals, max_steps=3000):
    """arrivals: (step, prompt, params); returns the Results in arrival-list order."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    ids = [None] * len(arrivals)
    step = 0
    while order or engine._live:
        while order and arrivals[order[0]][0] <= step:
            i = order.pop(0)
            ids[i] = engine.submit(arrivals[i][1], arrivals[i][2], stop_token_ids=[])
        engine.step_all()
        step += 1
        assert step < max_steps, "requests left unfinished"
    return [engine.result(rid) for rid in ids]


@pytest.fixture(scope="module")
def gpu_layout():
    built = {}

    def get(name):
        if name not in built:
            cfg = load_config(CONFIGS / name)
            small = {n: dataclasses.replace(p, chunk_size=64, num_blocks=256, max_slots=8,
                                            max_pages_per_request=64)
                     for n, p in cfg.pools().items()}
            cfg = dataclasses.replace(cfg, model=ModelSpec("tiny", "float32"), **small)
            built[name] = Deployment.build(cfg)
        return built[name]

    return get


def test_every_shipped_config_is_covered():
    shipped = {p.name for p in CONFIGS.glob("*.yaml")}
    assert shipped == ON_CPU | GPU_LAYOUTS | CROSS_PROCESS | SMOLLM2, \
        "a new config needs a parity test"


@pytest.mark.parametrize("name", sorted(ON_CPU | GPU_LAYOUTS))
def test_greedy_tokens_equal_reference_for_every_config(deployments, gpu_layout, name):
    dep = deployments(name) if name in ON_CPU else gpu_layout(name)
    ps = prompts(0, (5, 70, 33, 130, 9, 64))  # 70 and 130 span several 64-token chunks
    params = [SamplingParams(max_tokens=n) for n in (7, 5, 9, 4, 6, 3)]
    arrivals = [(s, p, sp) for s, p, sp in zip((0, 0, 1, 3, 8, 9), ps, params, strict=True)]
    # Disaggregated: prompts <= 16 tokens are prefilled on the decode pool, the rest move.
    engine = engine_for(dep, local_prefill_threshold=16)
    results = run(engine, arrivals)
    want = ReferenceGenerator(dep.model).generate(ps, params, stop_token_ids=[])
    assert [r.token_ids for r in results] == want
    if dep.config.mode == "disaggregated":
        for r in results:
            local = len(r.prompt_ids) <= 16
            assert (r.route["prefill"] == r.route["decode"]) == local
            assert (r.transfer_bytes == 0) == local
    assert_all_back(engine)
    engine.close()


@pytest.mark.parametrize("name", ["cpu-1p1d.yaml", "cpu-colocated.yaml"])
def test_seeded_sampling_is_reproducible_and_equals_reference(deployments, name):
    dep = deployments(name)
    engine = engine_for(dep)
    ps = prompts(4, (12, 40))
    sampled = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=s, max_tokens=8)
               for s in (7, 8)]
    first = run(engine, [(0, p, sp) for p, sp in zip(ps, sampled, strict=True)])
    again = run(engine, [(i, p, sp) for i, (p, sp) in enumerate(zip(ps, sampled, strict=True))])
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    want = ReferenceGenerator(dep.model).generate(ps, sampled, stop_token_ids=[])
    assert [r.token_ids for r in first] == want  # same key convention as the reference
    top1 = run(engine, [(0, p, SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=8))
                        for p in ps])
    greedy = run(engine, [(0, p, SamplingParams(max_tokens=8)) for p in ps])
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]
    assert_all_back(engine)


def test_logprobs_match_the_reference_logits(deployments):
    dep = deployments("cpu-1p1d.yaml")
    engine = engine_for(dep)
    (prompt,) = prompts(5, (30,))
    params = SamplingParams(max_tokens=5, logprobs=True)
    (r,) = run(engine, [(0, prompt, params)])
    logits = []
    list(ReferenceGenerator(dep.model).stream([prompt], params, stop_token_ids=[],
                                              logits_out=logits))
    want = [float(np.asarray(lg[0] - np.logaddexp.reduce(lg[0]))[t])
            for lg, t in zip(logits, r.token_ids, strict=True)]
    np.testing.assert_allclose(r.logprobs, want, atol=1e-4)
    assert_all_back(engine)


def test_cancel_at_every_stage_frees_both_pools(deployments):
    dep = deployments("cpu-1p1d.yaml")
    engine = engine_for(dep)
    pre, dec = engine.prefillers[0], engine.decoders[0]
    ps = prompts(2, (150, 20, 20, 20))
    params = SamplingParams(max_tokens=40)
    ids = [engine.submit(p, params) for p in ps]
    engine.cancel(ids[3])  # queued, never started
    pre.step()  # r0 mid-prefill (150 tokens = 3 chunks)
    assert pre.scheduler.queue[0].next_pos == 64
    engine.cancel(ids[0])
    hog = dec.blocks.allocate(dec.blocks.num_available)  # decode pool full
    pre.step()  # r1 and r2 prefilled (40 tokens: one budget): their KV moved to decode
    dec.step()  # ... and waits there for blocks
    assert [h.job.request_id for h in dec.ready] == [ids[1], ids[2]]
    engine.cancel(ids[1])  # in transfer
    dec.blocks.release(hog)
    for _ in range(3):
        engine.step_all()
    assert [s.request_id for s in dec.decode.active] == [ids[2]]
    engine.cancel(ids[2])  # decoding
    engine.step_all()
    results = [engine.result(rid) for rid in ids]
    assert [r.finish_reason for r in results] == ["cancelled"] * 4
    assert results[2].token_ids  # it had decoded some tokens
    with pytest.raises(UnknownRequestError, match="request_id"):
        engine.cancel("nope")
    with pytest.raises(ValueError):  # the ValueError family, as for any bad input
        engine.cancel(ids[0])
    assert_all_back(engine)


def test_cancel_in_the_handoff_queue(deployments):
    """Cancelled between the workers: the decode side drops it when it arrives."""
    engine = engine_for(deployments("cpu-1p1d.yaml"))
    pre, dec = engine.prefillers[0], engine.decoders[0]
    rid = engine.submit(prompts(6, (20,))[0], SamplingParams(max_tokens=9))
    pre.step()
    assert dec.handoffs.qsize() == 1
    engine.cancel(rid)
    engine.run_until_idle()
    assert engine.result(rid).finish_reason == "cancelled"
    assert_all_back(engine)


def test_colocated_cancel_at_every_stage(deployments):
    engine = engine_for(deployments("cpu-colocated.yaml"))
    w0, w1 = engine.decoders
    ids = [engine.submit(p, SamplingParams(max_tokens=30))
           for p in prompts(7, (150, 30, 30))]  # -> instance 0, 1, 0 (least loaded)
    engine.step_all()
    assert w0.scheduler.queue[0].request_id == ids[0]  # mid-prefill
    assert w0.scheduler.queue[1].request_id == ids[2]  # queued behind it
    assert w1.decode.find(ids[1])  # prefilled in one chunk and decoding
    engine.cancel(ids[2])
    engine.cancel(ids[0])
    engine.step_all()
    engine.cancel(ids[1])
    engine.run_until_idle()
    assert [engine.result(rid).finish_reason for rid in ids] == ["cancelled"] * 3
    assert_all_back(engine)


def test_prefix_reuse_skips_tokens_and_matches_reference(deployments):
    for name in ("cpu-1p1d.yaml", "cpu-colocated.yaml"):
        dep = deployments(name)
        engine = engine_for(dep)
        shared = prompts(1, (40,))[0]
        a, b = shared + [1, 2, 3], shared + [7, 8]
        params = SamplingParams(max_tokens=5)
        (ra,) = run(engine, [(0, a, params)])
        (rb,) = run(engine, [(0, b, params)])
        assert ra.cached_tokens == 0 or name == "cpu-colocated.yaml" and ra.cached_tokens == 32
        assert rb.cached_tokens == 32  # two full 16-token blocks of the shared prefix
        want = ReferenceGenerator(dep.model).generate([a, b], params, stop_token_ids=[])
        assert [ra.token_ids, rb.token_ids] == want
        assert rb.route["prefill"] == ra.route["prefill"]  # routed to the instance holding it
        assert engine.metrics()["pools"][rb.route["prefill"]]["prefix_hit_rate"] > 0
        assert_all_back(engine)


def test_router_prefers_the_prefill_instance_with_the_prefix():
    cfg = load_config(CONFIGS / "cpu-1p1d.yaml")
    cfg = dataclasses.replace(cfg, prefill=dataclasses.replace(cfg.prefill, tp=2, instances=2))
    dep = Deployment.build(cfg)
    engine = engine_for(dep)
    assert [w.name for w in engine.prefillers] == ["prefill[0]", "prefill[1]"]
    shared = prompts(8, (48,))[0]
    params = SamplingParams(max_tokens=3)
    ra, rb, rc = run(engine, [(0, shared + [1], params), (0, prompts(9, (60,))[0], params),
                              (0, prompts(10, (60,))[0], params)])
    assert {ra.route["prefill"], rb.route["prefill"]} == {"prefill[0]", "prefill[1]"}
    # The holder of the prefix gets more queued work, yet the next request goes there.
    busy = engine.submit(shared + prompts(11, (200,))[0], params)
    rid = engine.submit(shared + [2, 3], params)
    assert engine._live[busy].route["prefill"] == ra.route["prefill"]
    assert engine._live[rid].route["prefill"] == ra.route["prefill"]
    engine.run_until_idle()
    rd = engine.result(rid)
    assert rd.cached_tokens == 48
    want = ReferenceGenerator(dep.model).generate([shared + [2, 3]], params, stop_token_ids=[])
    assert rd.token_ids == want[0]
    engine.result(busy)
    for r in (ra, rb, rc):
        assert r.finish_reason == "length"
    assert_all_back(engine)


def test_kv_exhaustion_preempts_and_outputs_stay_identical():
    cpu1 = load_config(CONFIGS / "cpu-1p1d.yaml")
    disagg = dataclasses.replace(cpu1, decode=dataclasses.replace(cpu1.decode, num_blocks=9,
                                                                  max_slots=3))
    coloc = dataclasses.replace(load_config(CONFIGS / "gpu-1-colocated.yaml"),
                                model=ModelSpec("tiny", "float32"))
    coloc = dataclasses.replace(coloc, colocated=dataclasses.replace(
        coloc.colocated, chunk_size=64, num_blocks=9, max_slots=3, max_pages_per_request=64))
    ps = prompts(3, (40, 45, 38))  # 3 blocks each, growing to 5: 15 > 9 blocks
    params = SamplingParams(max_tokens=30)
    for cfg in (disagg, coloc):
        dep = Deployment.build(cfg)
        engine = engine_for(dep)
        results = run(engine, [(0, p, params) for p in ps])
        assert sum(r.preemptions for r in results), "the scenario must run out of blocks"
        want = ReferenceGenerator(dep.model).generate(ps, params, stop_token_ids=[])
        assert [r.token_ids for r in results] == want
        assert_all_back(engine)


def test_backpressure_holds_the_last_chunk_when_the_handoff_queue_is_full(deployments):
    engine = engine_for(deployments("cpu-1p1d.yaml"), handoff_queue=1)
    pre, dec = engine.prefillers[0], engine.decoders[0]
    ids = [engine.submit(p, SamplingParams(max_tokens=2)) for p in prompts(12, (10, 10, 10))]
    for _ in range(3):
        pre.step()
    assert dec.handoffs.qsize() == 1  # the queue is full ...
    assert len(pre.scheduler.queue) == 2  # ... so the next job's last chunk waits
    engine.run_until_idle()
    assert [engine.result(rid).finish_reason for rid in ids] == ["length"] * 3
    assert_all_back(engine)


def test_full_engine_refuses_and_nothing_leaks(deployments):
    engine = engine_for(deployments("cpu-colocated.yaml"), max_requests=2)
    ids = [engine.submit([256, 1, 2], SamplingParams(max_tokens=3)) for _ in range(2)]
    with pytest.raises(QueueFull, match="max_requests"):
        engine.submit([256, 1, 2])
    engine.run_until_idle()
    assert all(engine.result(rid).finish_reason == "length" for rid in ids)
    engine.submit([256, 3])  # room again
    engine.run_until_idle()
    assert_all_back(engine)


def test_first_token_can_end_the_request_at_prefill(deployments):
    dep = deployments("cpu-1p1d.yaml")
    engine = engine_for(dep)
    (p,) = prompts(13, (25,))
    first = ReferenceGenerator(dep.model).generate([p], SamplingParams(max_tokens=1),
                                                   stop_token_ids=[])[0][0]
    one = engine.submit(p, SamplingParams(max_tokens=1))
    stop = engine.submit(p, SamplingParams(max_tokens=9), stop_token_ids=[first])
    engine.run_until_idle()
    r1, r2 = engine.result(one), engine.result(stop)
    assert (r1.token_ids, r1.finish_reason) == ([first], "length")
    assert (r2.token_ids, r2.finish_reason) == ([first], "stop")
    assert "decode_insert" not in r2.timeline  # it never reached the decode pool
    assert_all_back(engine)


def test_timeline_is_ordered_and_metrics_add_up(deployments):
    engine = engine_for(deployments("cpu-1p1d.yaml"))
    results = run(engine, [(0, p, SamplingParams(max_tokens=4)) for p in prompts(14, (90, 20))])
    for r in results:
        t = r.timeline
        assert (t["arrival"] <= t["prefill_start"] <= t["prefill_end"] <= t["pull_start"]
                <= t["transfer_end"] <= t["decode_insert"] <= t["finish"])
        assert t["transfer_start"] <= t["prefill_end"]  # layer streaming: KV left early
        assert r.ttft_s == pytest.approx(t["first_token"], abs=1e-6)
    m = engine.metrics()
    assert m["requests"]["finished"] == 2 and m["generated_tokens"] == 8
    assert m["pools"]["prefill[0]"]["transfer_bytes"] == sum(r.transfer_bytes for r in results)
    assert m["pools"]["decode[0]"]["transfer_bytes_received"] == m["pools"]["prefill[0]"][
        "transfer_bytes"]
    assert m["pools"]["decode[0]"]["kv_blocks_used"] == 0
    assert m["latency"]["ttft_p50_s"] > 0
    assert_all_back(engine)


def test_evicted_prefix_spills_to_host_and_comes_back():
    cfg = load_config(CONFIGS / "cpu-1p1d.yaml")
    cfg = dataclasses.replace(cfg, prefill=dataclasses.replace(
        cfg.prefill, num_blocks=8, max_pages_per_request=8, host_cache_blocks=8))
    dep = Deployment.build(cfg)
    engine = engine_for(dep)
    blocks = engine.prefillers[0].blocks
    shared = prompts(15, (48,))[0]
    params = SamplingParams(max_tokens=4)
    (ra,) = run(engine, [(0, shared + [1, 2], params)])  # 3 full blocks cached
    (rc,) = run(engine, [(0, prompts(16, (100,))[0], params)])  # 7 blocks: evicts, spills
    assert blocks.stats["spills"] >= 1
    (rb,) = run(engine, [(0, shared + [3, 4], params)])
    assert blocks.stats["restores"] >= 1  # the evicted head of the prefix came back
    assert rb.cached_tokens == 48
    want = ReferenceGenerator(dep.model).generate([shared + [1, 2], shared + [3, 4]], params,
                                                  stop_token_ids=[])
    assert [ra.token_ids, rb.token_ids] == want
    assert engine.metrics()["pools"]["prefill[0]"]["host_restores"] >= 1
    assert_all_back(engine)
