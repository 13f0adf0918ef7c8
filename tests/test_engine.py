"""The Python API with its threads running: generate, stream, stop strings, asyncio,
cancel, bad input, metrics; every thread joined and every block back at the end."""

import asyncio
import threading
import time

import numpy as np
import pytest

from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.serve.aio import AsyncEngine
from jaxdisagg.serve.engine import ColocatedEngine, DisaggregatedEngine, Engine


@pytest.fixture(scope="module")
def engine(deployments):
    eng = DisaggregatedEngine(deployments("cpu-1p1d.yaml"))
    yield eng
    eng.close()
    assert eng._threads and not any(t.is_alive() for t in [*eng._threads, eng._output])


def wait_idle(engine, timeout=60):
    deadline = time.monotonic() + timeout
    while engine._live and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine._live, "requests still in flight"


def all_blocks_back(engine):
    wait_idle(engine)
    for name, mgr in engine.block_managers().items():
        mgr.check()
        assert mgr.num_available == mgr.num_blocks, name


def test_from_config_picks_the_engine_for_the_mode(deployments):
    from jaxdisagg.mesh.config import ConfigError

    with pytest.raises(ConfigError, match="launch"):
        Engine.from_config("configs/cpu-2proc.yaml")
    with pytest.raises(ConfigError, match="ColocatedEngine"):
        DisaggregatedEngine.from_config("configs/cpu-colocated.yaml")


def test_generate_matches_reference_text_and_ids(engine):
    prompts = ["Hello, disaggregated world", [256, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(max_tokens=6)
    results = engine.generate(prompts, params)
    ids = [engine.tokenizer.encode(prompts[0]), prompts[1]]
    want = ReferenceGenerator(engine.deployment.model).generate(ids, params)
    assert [r.token_ids for r in results] == want
    assert results[0].text == engine.tokenizer.decode(want[0])
    for r in results:
        assert r.finish_reason in ("length", "stop") and r.ttft_s > 0
        assert len(r.tbt_s) == len(r.token_ids) - 1
    all_blocks_back(engine)


def test_short_prompts_are_prefilled_in_small_buckets(engine):
    """64 prompts of 16-64 tokens: prefill pads each chunk to the smallest compiled
    bucket, not chunk_size, so executed tokens stay within 1.25x the real ones."""
    def counts():
        pools = engine.metrics()["pools"].values()
        return (sum(g.get("prefill_tokens", 0) for g in pools),
                sum(g.get("prefill_tokens_executed", 0) for g in pools))

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in rng.integers(16, 65, 64)]
    params = SamplingParams(max_tokens=2)
    real0, executed0 = counts()
    results = engine.generate(prompts, params)
    wait_idle(engine)
    real, executed = (a - b for a, b in zip(counts(), (real0, executed0), strict=True))
    assert real == sum(map(len, prompts))
    assert executed <= 1.25 * real, (executed, real)
    want = ReferenceGenerator(engine.deployment.model).generate(prompts, params)
    assert [r.token_ids for r in results] == want
    all_blocks_back(engine)


def test_stream_yields_tokens_as_they_come(engine):
    params = SamplingParams(max_tokens=5)
    got = [tok for tok, _ in engine.stream([256, 40, 41, 42], params)]
    want = ReferenceGenerator(engine.deployment.model).generate([[256, 40, 41, 42]], params)[0]
    assert got == want


def test_stop_strings_cut_the_text_and_end_the_request(engine):
    prompt = "The quick brown fox"
    full = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    text = full.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                if text[i:i + 2].isprintable() and text[i:i + 2].strip())
    cut = text.find(stop)
    r = engine.generate([prompt], SamplingParams(max_tokens=24, stop=stop))[0]
    assert r.finish_reason == "stop"
    assert r.text == text[:cut]
    assert r.token_ids == full.token_ids[:len(r.token_ids)]
    streamed = "".join(d for _, d in engine.stream(prompt, SamplingParams(max_tokens=24,
                                                                          stop=[stop])))
    assert streamed == text[:cut]
    all_blocks_back(engine)


def test_abandoned_stream_and_cancel_free_blocks(engine):
    stream = engine.stream([256] + list(range(60)), SamplingParams(max_tokens=200))
    next(stream)
    stream.close()  # the caller walks away: the request is cancelled
    rid = engine.submit([256, 5, 6], SamplingParams(max_tokens=200))
    engine.cancel(rid)
    assert engine.result(rid, timeout=30).finish_reason == "cancelled"
    with pytest.raises(KeyError, match="request_id"):
        engine.cancel("no-such-request")
    all_blocks_back(engine)


@pytest.mark.parametrize("prompt,params,kwargs,message", [
    ("", None, {}, "prompt: must not be empty"),
    ([], None, {}, "prompt: must not be empty"),
    ([256, 9999], None, {}, "prompt: token ids outside the vocabulary"),
    ([256, -1], None, {}, "prompt: token ids outside the vocabulary"),
    (["a", "b"], None, {}, "prompt: expected text or a list of token ids"),
    ([1] * 1020, SamplingParams(max_tokens=10), {}, "exceed the context of 1024"),
    ([256, 1], {"max_tokens": 3}, {}, "params: expected SamplingParams"),
    ([256, 1], None, {"stop_token_ids": [100000]},
     "stop_token_ids: token ids outside the vocabulary"),
])
def test_bad_input_is_a_clear_error_and_serving_goes_on(engine, prompt, params, kwargs,
                                                         message):
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, params, **kwargs)
    assert engine.generate([[256, 1]], SamplingParams(max_tokens=2))[0].finish_reason
    all_blocks_back(engine)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_k", -2), ("top_p", 0.0),
                                         ("top_p", 1.5), ("max_tokens", 0), ("seed", 1.5),
                                         ("stop", ("",))])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_concurrent_submitters(engine):
    prompts = [np.random.default_rng(i).integers(0, 256, 5 + 17 * i).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=4)
    results = [None] * len(prompts)

    def worker(i):
        results[i] = engine.generate([prompts[i]], params)[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    want = ReferenceGenerator(engine.deployment.model).generate(prompts, params)
    assert results == want
    all_blocks_back(engine)


def test_results_can_be_taken_after_the_request_finished(engine):
    ids = [engine.submit([256, i], SamplingParams(max_tokens=1)) for i in range(3)]
    wait_idle(engine)
    assert [len(engine.result(rid, timeout=30).token_ids) for rid in ids] == [1, 1, 1]
    with pytest.raises(KeyError, match="no pending request"):
        engine.result(ids[0])  # a result is taken once


def test_asyncio_api(engine):
    aengine = AsyncEngine(engine)
    prompts = [[256, 7, 8, 9], [256] + list(range(40))]
    params = SamplingParams(max_tokens=5)
    want = ReferenceGenerator(engine.deployment.model).generate(prompts, params)

    async def main():
        results = await aengine.generate_many(prompts, params)
        streamed = [t async for t, _ in aengine.stream(prompts[1], params)]
        task = asyncio.ensure_future(aengine.generate([256, 1, 2], SamplingParams(
            max_tokens=500)))
        await asyncio.sleep(0.2)
        task.cancel()  # the awaiting task goes away: the request is cancelled
        with pytest.raises(asyncio.CancelledError):
            await task
        return results, streamed

    results, streamed = asyncio.run(main())
    assert [r.token_ids for r in results] == want and streamed == want[1]
    all_blocks_back(engine)


def test_metrics_report_pools_and_latency(engine):
    engine.generate([[256] + list(range(80))], SamplingParams(max_tokens=3))
    m = engine.metrics()
    assert m["mode"] == "disaggregated" and m["in_flight"] == 0
    assert m["requests"]["finished"] >= 1 and m["generated_tokens"] >= 3
    assert set(m["pools"]) == {"prefill[0]", "decode[0]"}
    assert m["pools"]["prefill[0]"]["transfer_bytes"] > 0
    assert m["pools"]["decode[0]"]["slots_total"] == 8
    assert m["latency"]["ttft_p50_s"] > 0 and m["latency"]["tbt_p99_s"] > 0


def test_close_cancels_what_is_in_flight_and_joins(deployments):
    eng = ColocatedEngine(deployments("cpu-colocated.yaml"))
    ids = [eng.submit([256] + list(range(n)), SamplingParams(max_tokens=400))
           for n in (10, 150, 300)]
    time.sleep(0.3)
    eng.close()
    assert not any(t.is_alive() for t in eng._threads)
    assert {eng.result(rid, timeout=5).finish_reason for rid in ids} == {"cancelled"}
    for mgr in eng.block_managers().values():
        mgr.check()
        assert mgr.num_available == mgr.num_blocks
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit([256, 1])


def test_a_failing_step_fails_its_requests_and_serving_goes_on(engine):
    dec = engine.decoders[0]
    original = dec.decode.step
    calls = []

    def broken():
        if not calls:
            calls.append(1)
            raise RuntimeError("device lost")
        return original()

    dec.decode.step = broken
    try:
        r = engine.generate([[256, 1, 2, 3]], SamplingParams(max_tokens=4))[0]
    finally:
        dec.decode.step = original
    assert r.finish_reason == "error: RuntimeError: device lost"
    ok = engine.generate([[256, 1, 2, 3]], SamplingParams(max_tokens=4))[0]
    assert ok.finish_reason == "length"
    all_blocks_back(engine)
