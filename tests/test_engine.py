"""The Python API: generate, stream, cancel, bad input; threads joined, blocks returned."""

import threading

import numpy as np
import pytest

from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.serve.engine import Engine


@pytest.fixture(scope="module")
def engine():
    with Engine.from_config("configs/cpu-1p1d.yaml") as eng:
        yield eng
    assert not eng._thread.is_alive()


def all_blocks_back(engine):
    core = engine._core
    for mgr in (core.prefill_blocks, core.decode_blocks):
        mgr.check()
        assert mgr.num_available == mgr.num_blocks


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


def test_stream_yields_tokens_as_they_come(engine):
    params = SamplingParams(max_tokens=5)
    got = [tok for tok, _ in engine.stream([256, 40, 41, 42], params)]
    want = ReferenceGenerator(engine.deployment.model).generate([[256, 40, 41, 42]], params)[0]
    assert got == want


def test_abandoned_stream_and_cancel_free_blocks(engine):
    stream = engine.stream([256] + list(range(60)), SamplingParams(max_tokens=200))
    next(stream)
    stream.close()  # the caller walks away: the request is cancelled
    rid = engine.submit([256, 5, 6], SamplingParams(max_tokens=200))
    engine.cancel(rid)
    assert engine.result(rid, timeout=30).finish_reason == "cancelled"
    with pytest.raises(KeyError, match="request_id"):
        engine.cancel("no-such-request")
    for _ in range(100):  # the loop thread finishes the cancellations
        if not engine._live:
            break
        threading.Event().wait(0.05)
    all_blocks_back(engine)


@pytest.mark.parametrize("prompt,params,message", [
    ("", None, "prompt: must not be empty"),
    ([], None, "prompt: must not be empty"),
    ([256, 9999], None, "prompt: token ids outside the vocabulary"),
    ([256, -1], None, "prompt: token ids outside the vocabulary"),
    ([1] * 1020, SamplingParams(max_tokens=10), "exceed the context of 1024"),
])
def test_bad_input_is_a_clear_error_and_serving_goes_on(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, params)
    assert engine.generate([[256, 1]], SamplingParams(max_tokens=2))[0].finish_reason
    all_blocks_back(engine)


def test_concurrent_submitters(engine):
    prompts = [np.random.default_rng(i).integers(0, 256, 5 + 7 * i).tolist() for i in range(6)]
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
    for _ in range(200):  # let them all finish before anyone asks
        if not engine._live:
            break
        threading.Event().wait(0.05)
    assert [len(engine.result(rid, timeout=30).token_ids) for rid in ids] == [1, 1, 1]
    with pytest.raises(KeyError, match="no pending request"):
        engine.result(ids[0])  # a result is taken once
