"""Isolation in-process: one request can never hurt another.

* values that pass validation never blow up inside a step (a seed over 2^31, a huge
  top_k), and bad values are refused naming the field, before any work;
* the chaos test: failpoints raise at random points of prefill, transfer, admission
  and decode for one random request under concurrent load, on both engines; that
  request fails alone, every other one gets the reference tokens, every block is back;
* a request that fails in the same prefill step as another one's last chunk does
  not take that handoff (or its blocks) with it;
* server ids are unguessable and live in their own namespace; uncollected results
  expire; a pool too small for one request is refused, never livelocked;
* metrics read from another thread while the workers run never touch their state.

Stepped engines (start=False) where order matters, threaded ones elsewhere.
"""

import random
import re
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_util import assert_all_back, engine_for, prompts

from jaxdisagg.mesh.config import ConfigError, parse_config
from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.serve import faults
from jaxdisagg.serve.decode import DecodeScheduler, Sequence
from jaxdisagg.serve.engine import DisaggregatedEngine, UnknownRequestError
from jaxdisagg.serve.kv_cache import BlockManager
from jaxdisagg.serve.validation import RequestLimits

ENGINES = ["cpu-1p1d.yaml", "cpu-colocated.yaml"]


def run(engine, requests, max_steps=3000):
    """requests: (request_id, prompt, params), all submitted at once; Results by id."""
    ids = [engine.submit(p, sp, request_id=rid, stop_token_ids=[]) for rid, p, sp in requests]
    for _ in range(max_steps):
        if not engine._live:
            break
        engine.step_all()
    assert not engine._live, "requests left unfinished"
    return {rid: engine.result(rid) for rid in ids}


@pytest.fixture(autouse=True)
def no_failpoints():
    faults.disarm()
    yield
    faults.disarm()


@pytest.fixture(scope="module")
def reference_tokens(deployments):
    """Greedy reference tokens per prompt (the model is the same in every config)."""
    ref = ReferenceGenerator(deployments("cpu-1p1d.yaml").model)
    cache = {}

    def get(prompt, max_tokens):
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = ref.generate([prompt], SamplingParams(max_tokens=max_tokens),
                                      stop_token_ids=[])[0]
        return cache[key]

    return get


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("name", ENGINES)
def test_wide_seeds_and_huge_top_k_serve_beside_their_neighbours(deployments, name,
                                                                 reference_tokens):
    """Seeds in [2^31, 2^64) and top_k >= 2^31 used to overflow an int32 inside the
    prefill step and fail every request pending there."""
    engine = engine_for(deployments(name))
    ps = prompts(1, (40, 20, 70, 9))
    wide = [SamplingParams(temperature=0.8, seed=s, max_tokens=5)
            for s in (2**31, 2**32 + 7, 2**64 - 1)]
    reqs = [("n0", ps[0], SamplingParams(max_tokens=5)),
            ("w0", ps[1], wide[0]), ("w1", ps[2], wide[1]),
            ("k", ps[3], SamplingParams(temperature=0.7, top_k=2**31 + 5, seed=3, max_tokens=5)),
            ("w2", ps[0], wide[2])]
    results = run(engine, reqs)
    assert all(r.finish_reason == "length" for r in results.values()), results
    assert results["n0"].token_ids == reference_tokens(ps[0], 5)
    # The wide seeds draw their own streams, reproducibly, as the reference does.
    ref = ReferenceGenerator(engine.deployment.model)
    assert results["w1"].token_ids == ref.generate([ps[2]], wide[1], stop_token_ids=[])[0]
    again = run(engine, [("w1b", ps[2], wide[1])])
    assert again["w1b"].token_ids == results["w1"].token_ids
    # top_k past the vocabulary keeps every token: the same draw as top_k off.
    off = run(engine, [("k0", ps[3], SamplingParams(temperature=0.7, seed=3, max_tokens=5))])
    assert off["k0"].token_ids == results["k"].token_ids
    assert_all_back(engine)
    engine.close()


def test_sampling_params_hold_only_what_the_sampler_can():
    ok = SamplingParams(seed=2**64 - 1, top_k=2**40, temperature=1, top_p=np.float32(0.5))
    assert isinstance(ok.temperature, float) and ok.top_p == 0.5
    for bad, field in [({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"),
                       ({"top_k": True}, "top_k"), ({"top_k": 1.5}, "top_k"),
                       ({"temperature": float("inf")}, "temperature"),
                       ({"temperature": "0.5"}, "temperature"), ({"max_tokens": True},
                                                                  "max_tokens"),
                       ({"logprobs": 1}, "logprobs"), ({"stop": ("a", 3)}, "stop")]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**bad)


@pytest.fixture(scope="module")
def engine(deployments):
    limits = RequestLimits(max_prompt_bytes=2000, max_stop_bytes=64, max_stop_strings=4)
    with DisaggregatedEngine(deployments("cpu-1p1d.yaml"), limits=limits) as eng:
        yield eng


@pytest.mark.parametrize("kwargs,message", [
    ({"request_id": "x" * 129}, "request_id: must be 1 to 128"),
    ({"request_id": "jd-0123"}, "request_id: ids starting with 'jd-'"),
    ({"request_id": "a b"}, "request_id: only letters"),
    ({"request_id": 7}, "request_id: expected a string"),
    ({"params": SamplingParams(stop=("abcdefghij" * 7,))}, "SamplingParams.stop: 70 bytes"),
    ({"params": SamplingParams(stop=tuple("abcde"))}, "SamplingParams.stop: at most 4"),
    ({"stop_token_ids": list(range(2000))}, "stop_token_ids: at most 1024"),
    ({"stop_token_ids": "12"}, "stop_token_ids: expected a list"),
    ({"prompt": b"bytes"}, "prompt: expected text or a list of token ids, got bytes"),
    ({"prompt": 12}, "prompt: expected text or a list of token ids, got int"),
    ({"prompt": [1.5]}, "prompt: expected text or a list of token ids"),
    ({"prompt": [True]}, "prompt: expected text or a list of token ids"),
])
def test_bad_requests_are_refused_naming_the_field(engine, kwargs, message):
    args = {"prompt": [256, 1, 2], **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.submit(args.pop("prompt"), args.pop("params", None), **args)
    assert engine.result(engine.submit([256, 1], SamplingParams(max_tokens=2))).finish_reason \
        == "length"


def test_a_huge_text_prompt_is_refused_before_tokenizing(engine, monkeypatch):
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: calls.append(text) or [1])
    with pytest.raises(ValueError, match="prompt: 4000 bytes exceed the limit of 2000"):
        engine.submit("ab" * 2000)
    assert not calls


def test_server_ids_are_random_and_in_their_own_namespace(engine):
    ids = [engine.submit([256, 1], SamplingParams(max_tokens=1)) for _ in range(20)]
    assert all(re.fullmatch(r"jd-[0-9a-f]{32}", rid) for rid in ids)
    assert len(set(ids)) == len(ids)
    for rid in ids:
        engine.result(rid)
    mine = engine.submit([256, 1], SamplingParams(max_tokens=1), request_id="client-1")
    with pytest.raises(ValueError, match="already in use"):
        engine.submit([256, 1], request_id="client-1")
    engine.result(mine)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=st.one_of(st.text(max_size=40), st.lists(st.integers(-2**70, 2**70), max_size=6),
                        st.lists(st.floats(allow_nan=True), max_size=3), st.none(),
                        st.binary(max_size=8)),
       temperature=st.one_of(st.floats(allow_nan=True), st.integers(-5, 5), st.text(max_size=2)),
       top_k=st.one_of(st.integers(-2**70, 2**70), st.booleans()),
       top_p=st.one_of(st.floats(allow_nan=True), st.integers(-1, 2)),
       seed=st.integers(-2**70, 2**70), max_tokens=st.integers(-3, 2**40),
       stop=st.lists(st.text(max_size=6), max_size=5),
       request_id=st.one_of(st.none(), st.text(max_size=140)))
def test_fuzz_the_python_api(engine, prompt, temperature, top_k, top_p, seed, max_tokens,
                             stop, request_id):
    """Any input: a ValueError naming a field, or a served request; nothing leaks."""
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                max_tokens=min(max_tokens, 4) if max_tokens > 0 else max_tokens,
                                stop=tuple(stop))
        rid = engine.submit(prompt, params, request_id=request_id)
    except ValueError as e:
        assert re.match(r"(SamplingParams\.\w+|prompt|request_id|stop_token_ids|params)\b",
                        str(e)), str(e)
        return
    result = engine.result(rid, timeout=60)
    assert not result.finish_reason.startswith("error"), result.finish_reason


def test_after_the_fuzz_the_engine_is_whole(engine, reference_tokens):
    (p,) = prompts(2, (33,))
    r = engine.result(engine.submit(p, SamplingParams(max_tokens=6), stop_token_ids=[]))
    assert r.token_ids == reference_tokens(p, 6)
    assert engine.metrics()["in_flight"] == 0
    assert_all_back(engine)


# ---------------------------------------------------------------- containment


@pytest.mark.parametrize("name", ENGINES)
def test_chaos_one_failing_request_fails_alone(deployments, name, reference_tokens):
    """Rounds of concurrent requests; in each, one random request fails at one random
    failpoint. Everything else equals the reference, and every block comes back."""
    rng = random.Random(11)
    engine = engine_for(deployments(name), local_prefill_threshold=12)
    lens = (5, 70, 33, 130, 9, 64, 20)
    ps = prompts(3, lens)
    points = list(faults.POINTS)
    if name == "cpu-colocated.yaml":  # nothing is transferred there
        points = [p for p in points if not p.startswith(("transfer", "prefill.handoff"))]
    failed = 0
    for rnd, point in enumerate(points * 2):
        victim = rng.randrange(len(ps))
        faults.disarm()
        faults.arm(point, f"r{rnd}-v")
        reqs = [(f"r{rnd}-{'v' if i == victim else ''}{i}", p, SamplingParams(max_tokens=4))
                for i, p in enumerate(ps)]
        results = run(engine, reqs)
        for i, (rid, r) in enumerate(results.items()):
            # A short prompt is prefilled on its decode instance: it never hands off
            # or transfers, so those points cannot touch it.
            local = lens[i] <= 12 or name == "cpu-colocated.yaml"
            crosses = not (local and point in ("prefill.handoff", "transfer.send",
                                               "transfer.insert"))
            if i == victim and crosses:
                assert r.finish_reason.startswith("error") and "failpoint" in \
                    r.finish_reason, (point, rid, r.finish_reason)
                failed += 1
                continue
            assert r.finish_reason == "length", (point, rid, r.finish_reason)
            assert r.token_ids == reference_tokens(ps[i], 4), (point, rid)
        assert_all_back(engine)
    assert failed >= len(points)  # the failpoints did fire
    engine.close()


def test_a_failure_in_the_same_prefill_step_keeps_the_other_handoff(deployments,
                                                                    reference_tokens):
    """Job A's last chunk runs, then job B raises in the same step: A's handoff (and
    its staged KV) survive, B fails, nothing leaks. This once leaked 253 of 256 blocks."""
    engine = engine_for(deployments("cpu-1p1d.yaml"), local_prefill_threshold=0)
    pre = engine.prefillers[0]
    a, b = prompts(4, (20, 30))  # both fit one chunk budget: one step prefills both
    faults.arm("prefill.sample", "B")
    engine.submit(a, SamplingParams(max_tokens=3), request_id="A", stop_token_ids=[])
    engine.submit(b, SamplingParams(max_tokens=3), request_id="B", stop_token_ids=[])
    pre.step()
    assert not pre.scheduler.queue
    results = run(engine, [])
    results = {rid: engine.result(rid) for rid in ("A", "B")}
    assert results["A"].token_ids == reference_tokens(a, 3)
    assert results["B"].finish_reason.startswith("error: InjectedFault")
    assert_all_back(engine)


def test_metrics_from_another_thread_never_touch_worker_state(deployments):
    with DisaggregatedEngine(deployments("cpu-1p1d.yaml")) as eng:
        stop, errors = threading.Event(), []

        def scrape():
            while not stop.is_set():
                try:
                    m = eng.metrics()
                    assert all(isinstance(g, dict) for g in m["pools"].values())
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

        t = threading.Thread(target=scrape)
        t.start()
        eng.generate(prompts(5, (150, 90, 12, 40, 200, 7)), SamplingParams(max_tokens=4))
        stop.set()
        t.join()
        assert not errors
        gauges = eng.prefillers[0].gauges()
        gauges["queued_requests"] = 99  # a copy: the worker's snapshot is untouched
        assert eng.prefillers[0].gauges()["queued_requests"] != 99


def test_uncollected_results_expire(deployments, monkeypatch):
    eng = engine_for(deployments("cpu-1p1d.yaml"))
    monkeypatch.setattr(eng, "MAX_UNCOLLECTED", 3)
    ids = [eng.submit([256, i + 1], SamplingParams(max_tokens=1)) for i in range(6)]
    eng.run_until_idle()
    eng.submit([256, 9], SamplingParams(max_tokens=1))  # submit prunes
    eng.run_until_idle()
    assert len(eng._results) <= 4
    with pytest.raises(UnknownRequestError):
        eng.result(ids[0])
    assert eng.result(ids[-1]).finish_reason == "length"
    monkeypatch.setattr(eng, "RESULT_TTL_S", 0.0)
    eng.submit([256, 5], SamplingParams(max_tokens=1))
    eng.run_until_idle()
    eng.submit([256, 6], SamplingParams(max_tokens=1))
    assert len(eng._results) == 1  # only the newest, not yet finished
    eng.run_until_idle()
    eng.close()


# ---------------------------------------------------------------- sizes that cannot fit


def test_a_pool_that_cannot_hold_one_request_is_refused():
    cfg = {"mode": "colocated", "colocated": {"num_blocks": 8, "max_pages_per_request": 16}}
    with pytest.raises(ConfigError, match=r"colocated.num_blocks: 8 blocks cannot hold one "
                                          r"request of max_pages_per_request \(16\)"):
        parse_config(cfg)


def test_a_lone_sequence_that_cannot_grow_fails_instead_of_looping(deployments):
    """It used to preempt itself and re-prefill forever (384 times in 400 steps)."""
    inst = deployments("cpu-colocated.yaml").pools["colocated"][0]
    blocks = BlockManager(2, inst.layout.block_size, prefix_cache=False)
    sched = DecodeScheduler(inst, blocks)
    bs = blocks.block_size
    seq = Sequence("lone", list(range(1, 2 * bs)), SamplingParams(max_tokens=50), frozenset(),
                   blocks=blocks.allocate(2), tokens=[5])
    sched.admit(seq)
    assert sched.step().tokens  # writes position 2*bs - 1, the last slot of block 2
    result = sched.step()  # position 2*bs needs a third block: there is none, ever
    assert not result.preempted
    (failed, error), = result.failed
    assert failed is seq and "cannot hold" in str(error)
    assert blocks.num_available == 2
    blocks.check()


def test_capacity_counts_the_whole_pool(deployments):
    eng = engine_for(deployments("cpu-colocated.yaml"))
    w = eng.decoders[0]
    assert eng.max_context == min(w.inst.max_pages, w.blocks.num_blocks) * w.blocks.block_size
    eng.close()
