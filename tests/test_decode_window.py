"""The decode batching window (`decode_min_batch`, `decode_wait_s`): a step waits for
rows that are on their way, never for rows that are not, and never past the wait; the
tokens are the reference's and every block comes back, a cancel during a hold included."""

import time

import pytest
from serve_util import assert_all_back, engine_for, prompts

from jaxdisagg.mesh.config import ConfigError, parse_config
from jaxdisagg.model import ReferenceGenerator, SamplingParams

WAIT_S = 1.0


def config(**decode) -> dict:
    return {"mode": "disaggregated", "model": {"name": "tiny"},
            "prefill": {"devices": [0], "chunk_size": 64, "num_blocks": 64},
            "decode": {"devices": [1], "max_slots": 4, "num_blocks": 64, **decode}}


@pytest.mark.parametrize("decode, field", [
    ({"decode_min_batch": 5}, "decode.decode_min_batch: 5 is more rows"),
    ({"decode_min_batch": 0}, "decode.decode_min_batch: must be positive"),
    ({"decode_wait_s": -1.0}, "decode.decode_wait_s: must be 0"),
])
def test_a_bad_window_names_its_field(decode, field):
    with pytest.raises(ConfigError, match=field):
        parse_config(config(**decode))


def test_a_prefill_pool_takes_no_window():
    data = config()
    data["prefill"]["decode_wait_s"] = 0.5
    with pytest.raises(ConfigError, match="prefill.decode_min_batch / decode_wait_s"):
        parse_config(data)


@pytest.fixture(scope="module")
def window():
    from jaxdisagg.mesh import Deployment

    return Deployment.build(parse_config(config(decode_min_batch=4, decode_wait_s=WAIT_S)))


def handed_off(engine, request_id):
    """Steps the prefill worker until the request's KV sits in the decode worker's queue."""
    pre, dec = engine.prefillers[0], engine.decoders[0]
    for _ in range(20):
        if any(h.job.request_id == request_id for h in list(dec.handoffs.queue)):
            return
        pre.step()
    raise AssertionError(f"{request_id} was never handed off")


def test_the_window_holds_for_routed_rows_only_and_never_past_the_wait(window):
    engine = engine_for(window)
    dec = engine.decoders[0]
    params = SamplingParams(max_tokens=40)
    a_prompt, b_prompt, c_prompt = prompts(11, (20, 150, 30))
    a = engine.submit(a_prompt, params, stop_token_ids=[])
    handed_off(engine, a)
    for _ in range(4):  # alone, with nothing else routed here: it never waits
        dec.step()
    seq_a = dec.decode.find(a)
    assert len(seq_a.tokens) >= 3 and dec.held_s == 0

    b = engine.submit(b_prompt, params, stop_token_ids=[])  # routed here, not prefilled
    start = time.monotonic()
    dec.step()  # held: reads the step in flight, dispatches none
    held_at = len(seq_a.tokens)
    while time.monotonic() - start < WAIT_S / 2:
        dec.step()
        assert len(seq_a.tokens) == held_at and not dec.decode.in_flight
    time.sleep(WAIT_S)
    dec.step(), dec.step()  # the wait is over: one step, then the next one is held
    assert len(seq_a.tokens) == held_at + 1 and dec.held_s >= WAIT_S

    handed_off(engine, b)
    dec.step()  # b joins: as many rows as routed, so nothing holds
    seq_b = dec.decode.find(b)
    before = len(seq_a.tokens), len(seq_b.tokens)
    dec.step(), dec.step()
    assert (len(seq_a.tokens), len(seq_b.tokens)) == (before[0] + 2, before[1] + 2)

    c = engine.submit(c_prompt, params, stop_token_ids=[])
    dec.step()  # held for c
    engine.cancel(a)  # during the hold
    engine.run_until_idle()
    results = {rid: engine.result(rid) for rid in (a, b, c)}
    assert results[a].finish_reason == "cancelled"
    want = ReferenceGenerator(window.model).generate([b_prompt, c_prompt], params, [])
    assert [results[b].token_ids, results[c].token_ids] == want
    assert_all_back(engine)


def test_threaded_engine_with_a_window_serves_the_reference_tokens(window):
    from jaxdisagg.serve.engine import DisaggregatedEngine

    ps = prompts(12, (17, 90, 200, 40))
    params = SamplingParams(max_tokens=12)
    with DisaggregatedEngine(window) as engine:
        results = engine.generate(ps, params)
        gauges = engine.metrics()["pools"]
        assert_all_back(engine)
    want = ReferenceGenerator(window.model).generate(ps, params)
    assert [r.token_ids for r in results] == want
    assert any("decode_held_s" in g for g in gauges.values())
