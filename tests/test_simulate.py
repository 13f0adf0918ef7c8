"""The discrete-event simulator against cases with closed-form answers, and the planner
against an exhaustive search."""

import dataclasses
import json
import os
import statistics

import numpy as np
import pytest

from jaxdisagg import bench, planner
from jaxdisagg import roofline as rl
from jaxdisagg import simulate as sim
from jaxdisagg.model.config import get_preset


def costs(prefill=(0.0, 0.0, 0.0), decode=(0.0, 0.0, 0.0, 0.0)) -> sim.FittedCosts:
    return sim.FittedCosts(prefill, decode, (1 << 20,))


def disagg(prefill_costs, decode_costs, slots=8, chunk=64, transfer=None, queue=4,
           decoders=1, prefillers=1) -> sim.System:
    return sim.System("disaggregated", sim.PoolSpec(decoders, decode_costs, chunk, slots),
                      sim.PoolSpec(prefillers, prefill_costs, chunk),
                      transfer or sim.Transfer(0, 1.0), queue)


def test_buckets_are_the_pools_buckets():
    from jaxdisagg.mesh.pool import chunk_buckets

    for size in (16, 48, 64, 100, 512, 2048):
        assert list(sim.buckets(size)) == chunk_buckets(size)


def test_one_request_timeline_is_the_sum_of_its_steps():
    """prompt 100 in chunks of 64: pieces of 64 and 36 (run as 48), a transfer, then
    O-1 decode steps."""
    a, b, d = 0.010, 0.001, 0.004
    tr = sim.Transfer(bytes_per_token=1000, bandwidth=1e6, base_s=0.002)  # 0.102 s
    system = disagg(costs((a, b, 0.0)), costs(decode=(d, 0.0, 0.0, 0.0)), transfer=tr)
    (rec,) = sim.simulate(system, [(1.0, 100, 5)])
    prefill = (a + 64 * b) + (a + 48 * b)
    assert rec.ttft == pytest.approx(prefill + 0.102)
    assert rec.itl == pytest.approx([d] * 4)
    assert rec.e2e == pytest.approx(prefill + 0.102 + 4 * d)
    assert rec.stages["prefill"] == pytest.approx(prefill)
    assert rec.tokens == 5


def test_a_blocking_pull_stalls_the_decode_batch():
    """Cross-process: the decode thread pulls the KV itself, so a request decoding
    meanwhile sees one gap of a step plus the pull."""
    d, pull = 0.004, 0.050
    tr = sim.Transfer(1, 1e9, base_s=pull, blocking=True)
    system = disagg(costs((0.001, 0.0, 0.0)), costs(decode=(d, 0.0, 0.0, 0.0)), transfer=tr)
    first, second = sim.simulate(system, [(0.0, 16, 40), (0.030, 16, 2)])
    assert first.ttft == pytest.approx(0.001 + pull)
    assert max(first.itl) == pytest.approx(pull + d, rel=1e-6)
    assert sorted(first.itl)[-2] == pytest.approx(d)
    assert second.ttft >= pull


def test_transfer_latency_delays_admission_but_stalls_nobody():
    d, latency = 0.004, 0.050
    tr = sim.Transfer(1, 1e12, blocking=True, latency_s=latency)
    system = disagg(costs((0.001, 0.0, 0.0)), costs(decode=(d, 0.0, 0.0, 0.0)), transfer=tr)
    first, second = sim.simulate(system, [(0.0, 16, 40), (0.060, 16, 2)])
    assert max(first.itl) == pytest.approx(d, rel=1e-3)  # no gap for the batch
    assert second.ttft == pytest.approx(0.001 + latency, abs=d)  # admitted at a step's end


def test_front_end_time_delays_each_request_and_occupies_no_pool():
    d, admit = 0.004, 0.030
    system = dataclasses.replace(disagg(costs((0.001, 0.0, 0.0)),
                                        costs(decode=(d, 0.0, 0.0, 0.0))), admit_s=admit)
    base = dataclasses.replace(system, admit_s=0.0)
    plan = [(0.0, 16, 10), (0.002, 16, 10)]
    for with_, without in zip(sim.simulate(system, plan), sim.simulate(base, plan),
                              strict=True):
        assert with_.ttft == pytest.approx(without.ttft + admit)
        assert with_.itl == pytest.approx(without.itl)


def test_request_host_time_holds_the_decode_loop_once_per_admission():
    """Per-request CPU on the decode instance's cores (`request_s`): a lone request's
    TTFT grows by it, and a request already decoding sees one gap of a step plus it
    when another is admitted, and plain steps otherwise."""
    d, req = 0.004, 0.020
    base = disagg(costs((0.001, 0.0, 0.0)), costs(decode=(d, 0.0, 0.0, 0.0)))
    system = dataclasses.replace(base, request_s=req)
    (alone,) = sim.simulate(system, [(0.0, 16, 5)])
    (plain,) = sim.simulate(base, [(0.0, 16, 5)])
    assert alone.ttft == pytest.approx(plain.ttft + req)
    assert alone.itl == pytest.approx([d] * 4)
    first, second = sim.simulate(system, [(0.0, 16, 40), (0.050, 16, 2)])
    assert max(first.itl) == pytest.approx(d + req, rel=1e-6)
    assert sorted(first.itl)[-2] == pytest.approx(d)
    assert sum(first.itl) == pytest.approx(39 * d + req)


@pytest.mark.parametrize("cores", [1, 2])
def test_request_host_time_beside_the_loop_costs_it_a_share_of_the_cores(cores):
    """With `request_cores` c the request's host work runs beside the loop as one more
    thread on c cores: a lone request's TTFT still grows by it, but a request already
    decoding loses req / c in all, spread over the steps (each slowed by (c + 1) / c
    while it is owed), not one gap of req."""
    d, req = 0.004, 0.020
    base = disagg(costs((0.001, 0.0, 0.0)), costs(decode=(d, 0.0, 0.0, 0.0)))
    system = dataclasses.replace(base, request_s=req, request_cores=cores)
    (alone,) = sim.simulate(system, [(0.0, 16, 5)])
    (plain,) = sim.simulate(base, [(0.0, 16, 5)])
    assert alone.ttft == pytest.approx(plain.ttft + req)
    first, second = sim.simulate(system, [(0.0, 16, 40), (0.050, 16, 2)])
    # its own host work is done before it joins, so only the second's slows it
    assert sum(first.itl) == pytest.approx(39 * d + req / cores)
    assert max(first.itl) == pytest.approx(d * (cores + 1) / cores, rel=1e-6)
    step = d * (cores + 1) / cores  # it joins at the end of the step its host work ends in
    assert plain.ttft + req <= second.ttft <= plain.ttft + req + step + 1e-9


def test_prefill_host_time_holds_the_prefill_loop_after_each_request():
    """Per-request CPU on a prefill instance's cores beyond its chunks
    (`prefill_request_s`): a lone request's TTFT does not change; of two requests that
    arrive together, the second's prefill starts that long after the first's ends; and
    a saturated instance serves one request per chunk + that time."""
    c, hold = 0.010, 0.004
    base = disagg(costs((c, 0.0, 0.0)), costs(decode=(0.001, 0.0, 0.0, 0.0)), queue=1 << 20)
    system = dataclasses.replace(base, prefill_request_s=hold)
    (alone,) = sim.simulate(system, [(0.0, 16, 2)])
    (plain,) = sim.simulate(base, [(0.0, 16, 2)])
    assert alone.ttft == pytest.approx(plain.ttft)
    first, second = sim.simulate(system, [(0.0, 16, 2), (0.0, 16, 2)])
    assert second.ttft - first.ttft == pytest.approx(c + hold)
    n = 50
    recs = sim.simulate(system, [(0.0, 16, 2)] * n)
    assert max(r.ttft for r in recs) == pytest.approx(n * c + (n - 1) * hold, rel=1e-3,
                                                      abs=0.002)


def test_a_pulled_transfer_frees_the_prefill_from_the_decode_side_but_not_from_its_kv():
    """Cross-process (pulled) KV: the prefill process answers each request once its KV
    is staged, so four requests prefill back to back though the decode side has one
    slot and a handoff queue of one; they wait on the decode side instead. With room
    for two prompts' KV on the prefill side, the third starts once the first is
    pulled, and the fourth only once the second is, a whole decode later."""
    c, d, out = 0.001, 0.010, 10
    tr = sim.Transfer(1, 1e12, blocking=True)
    system = disagg(costs((c, 0.0, 0.0)), costs(decode=(d, 0.0, 0.0, 0.0)), slots=1,
                    queue=1, transfer=tr)
    plan = [(0.0, 16, out)] * 4

    def prefill_ends(system):
        return [r.stages["queue"] + r.stages["prefill"] for r in sim.simulate(system, plan)]

    assert prefill_ends(system) == pytest.approx([c, 2 * c, 3 * c, 4 * c])
    held = dataclasses.replace(system, prefill=dataclasses.replace(system.prefill,
                                                                   kv_tokens=32))
    ends = prefill_ends(held)
    assert ends[:3] == pytest.approx([c, 2 * c, 3 * c])
    assert ends[3] == pytest.approx(c + (out - 1) * d + c, rel=0.05)


def test_a_stalled_pull_waits_for_a_pause_in_its_prefill_instance():
    """A sender that serves pulls only while it computes nothing: of three requests
    prefilled back to back, each one's KV lands in the pause after the next one's last
    chunk (the last one's when the instance idles), not at its own end; with the
    prefill side's KV full, the instance idles and serves what it holds."""
    c, latency = 0.100, 0.005
    tr = sim.Transfer(1, 1e12, blocking=True, latency_s=latency)
    system = disagg(costs((c, 0.0, 0.0)), costs(decode=(0.001, 0.0, 0.0, 0.0)), transfer=tr)
    plan = [(0.0, 16, 4)] * 3
    free = [r.ttft for r in sim.simulate(system, plan)]
    assert free == pytest.approx([c + latency, 2 * c + latency, 3 * c + latency])
    stalled = dataclasses.replace(system, transfer=dataclasses.replace(
        tr, stalled_by_prefill=True))
    assert [r.ttft for r in sim.simulate(stalled, plan)] == pytest.approx(
        [2 * c + latency, 3 * c + latency, 3 * c + latency], rel=0.02)
    full = dataclasses.replace(stalled, prefill=dataclasses.replace(stalled.prefill,
                                                                    kv_tokens=32))
    recs = sim.simulate(full, plan)
    assert all(r.status != "failed: never finished" for r in recs)
    assert [r.ttft for r in recs][:2] == pytest.approx([2 * c + latency] * 2, rel=0.02)
    assert recs[2].ttft > 3 * c + latency  # started once the first two were pulled


def test_a_pull_hold_pauses_the_prefill_for_each_pull_and_ends_the_stall():
    """The engine's hold (`transfer.pull_hold_s`): after each last chunk the prefill
    instance waits for that request's pull (latency + pull), so each KV lands right
    after its own prefill and the next request starts that much later; a hold shorter
    than the pull bounds the wait."""
    c, latency, per_token = 0.100, 0.005, 0.001
    tr = sim.Transfer(1, 1 / per_token, blocking=True, latency_s=latency,
                      stalled_by_prefill=True, pull_hold_s=0.25)
    system = disagg(costs((c, 0.0, 0.0)), costs(decode=(0.001, 0.0, 0.0, 0.0)), transfer=tr)
    plan = [(0.0, 16, 4)] * 3
    pull = latency + 16 * per_token
    recs = sim.simulate(system, plan)
    ends = [r.stages["queue"] + r.stages["prefill"] for r in recs]
    assert ends == pytest.approx([c, 2 * c + pull, 3 * c + 2 * pull])
    # first token: its own prefill end, then the pull the decode thread makes
    assert [r.ttft for r in recs] == pytest.approx([e + pull for e in ends], rel=0.02)
    short = dataclasses.replace(system, transfer=dataclasses.replace(tr, pull_hold_s=0.002))
    ends = [r.stages["queue"] + r.stages["prefill"] for r in sim.simulate(short, plan)]
    assert ends == pytest.approx([c, 2 * c + 0.002, 3 * c + 0.004])


def test_contention_slows_a_pool_only_while_the_other_phase_works():
    """The decode step costs `contended` times more exactly while a prefill runs: a
    request decoding alone sees plain steps; one decoding while another's 0.100 s
    prefill runs sees the slowed steps for those 0.100 s, and plain ones after."""
    d, slow, pre = 0.010, 2.0, 0.100
    system = disagg(costs((pre, 0.0, 0.0)), costs(decode=(d, 0.0, 0.0, 0.0)))
    system = dataclasses.replace(system, decode=dataclasses.replace(system.decode,
                                                                    contended=slow))
    (alone,) = sim.simulate(system, [(0.0, 16, 10)])
    assert alone.itl == pytest.approx([d] * 9)  # its own prefill ended before it decodes
    first, _ = sim.simulate(system, [(0.0, 16, 40), (0.2, 16, 2)])
    slowed = [g for g in first.itl if g == pytest.approx(slow * d)]
    plain = [g for g in first.itl if g == pytest.approx(d)]
    assert len(slowed) + len(plain) == len(first.itl)
    # steps starting inside [0.2, 0.3): ten plain steps' worth of time, half as many
    assert len(slowed) == pytest.approx(pre / (slow * d), abs=1)


def test_a_decode_window_holds_for_a_routed_request_up_to_its_wait():
    """Two requests at 0, prefilled 0.1 s each: the first one's first decode step waits
    for the second (admitted at 0.2) under a long window, for the wait under a short one,
    and not at all when it is the only request routed there."""
    pre, d = 0.100, 0.010

    def system(min_batch, wait):
        s = disagg(costs((pre, 0.0, 0.0)), costs(decode=(d, 0.0, 0.0, 0.0)))
        return dataclasses.replace(s, decode=dataclasses.replace(
            s.decode, min_batch=min_batch, wait_s=wait))

    first, second = sim.simulate(system(2, 1.0), [(0.0, 16, 5), (0.0, 16, 5)])
    assert first.itl == pytest.approx([pre + d] + [d] * 3)
    assert second.itl == pytest.approx([d] * 4)
    (alone,) = sim.simulate(system(2, 1.0), [(0.0, 16, 5)])
    assert alone.itl == pytest.approx([d] * 4)
    first, _ = sim.simulate(system(2, 0.03), [(0.0, 16, 5), (0.0, 16, 5)])
    assert first.itl[:2] == pytest.approx([0.03 + d] * 2)  # held 0.1-0.13, 0.14-0.17


def test_saturated_decode_throughput_is_batch_over_step_time():
    """With more requests waiting than slots, a decode instance emits slots / step
    decode tokens per second (first tokens surface at admission and are left out;
    counted once the ramp-up, as handoffs trickle in, is over), and the whole run
    takes about n / slots * (out - 1) steps."""
    d, slots, out, n = 0.010, 8, 33, 64
    system = disagg(None, costs(decode=(d, 0.0, 0.0, 0.0)), slots=slots, queue=1 << 20)
    recs = sim.simulate(system, [(0.0, 16, out)] * n)
    times = np.concatenate([r.arrival + r.ttft + np.cumsum(r.itl) for r in recs])  # no 1st
    lo, hi = 0.5, 2.0
    assert ((times > lo) & (times <= hi)).sum() / (hi - lo) == pytest.approx(slots / d)
    assert max(r.e2e for r in recs) == pytest.approx(n / slots * (out - 1) * d, abs=2 * d)


@pytest.mark.parametrize("rho", [0.2, 0.5])
def test_prefill_queue_is_md1(rho):
    """One prefill instance with a deterministic service time S under Poisson arrivals:
    mean wait = rho S / (2 (1 - rho)) (Pollaczek-Khinchine), so mean TTFT = S + wait
    when transfer and decode cost nothing."""
    s = 0.020
    system = disagg(costs((s, 0.0, 0.0)), None, queue=1 << 20)
    wl = bench.Workload(requests=6000, rate=rho / s, prompt=bench.Lengths("fixed", 64),
                        output=bench.Lengths("fixed", 2), seed=1, warmup=0)
    ttft = statistics.mean(r.ttft for r in sim.simulate(system, sim.plan_of(wl)))
    assert ttft == pytest.approx(s + rho * s / (2 * (1 - rho)), rel=0.05)


def test_colocated_steps_carry_one_chunk_each():
    """A colocated instance piggybacks one chunk on each decode step: a request decoding
    while a 128-token prompt arrives sees two gaps of chunk + step."""
    chunk_s, d = 0.030, 0.005
    system = sim.System("colocated", sim.PoolSpec(1, costs((chunk_s, 0.0, 0.0),
                                                           (d, 0.0, 0.0, 0.0)), 64, 4))
    first, _ = sim.simulate(system, [(0.0, 16, 30), (0.050, 128, 2)])
    gaps = sorted(first.itl)
    assert gaps[-2:] == pytest.approx([chunk_s + d] * 2)
    assert gaps[0] == pytest.approx(d)


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    p, d = (0.002, 1e-5, 3e-9), (0.004, 2e-4, 1e-6, 5e-7)
    pre = [(t, s, p[0] + p[1] * t + p[2] * t * (s + (t + 1) / 2))
           for t in (16, 64, 256) for s in (0, 512, 1024)]
    dec = [(b, w, d[0] + d[1] * b + d[2] * w + d[3] * b * w) for b in (1, 4, 8)
           for w in (128, 512, 1024)]
    fitted = sim.fit_costs(pre, dec, [128, 512, 1024])
    assert fitted.prefill == pytest.approx(p, rel=1e-6)
    assert fitted.decode == pytest.approx(d, rel=1e-6)
    # noise that would push a term below zero drops the term instead
    flat = [(b, w, 0.004 + rng.normal(0, 1e-6)) for b, w, _ in dec]
    assert min(sim.fit_costs(pre, flat, [128, 512, 1024]).decode) >= 0


def test_a_fit_over_batch_sizes_costs_the_program_that_ran():
    """With compiled batch sizes, 3 active rows run the 4-row program at the full width,
    and 8 over the narrowest width that holds the longest: the fit and `decode_s` both
    cost those programs, not the active rows. (Measured only where programs run, the
    four coefficients are not all identifiable; every program that runs is.)"""
    d, widths, batches = (0.004, 2e-4, 1e-6, 5e-7), (128, 512, 1024), (1, 2, 4, 8)
    def cost(rows, width):
        return d[0] + d[1] * rows + d[2] * width + d[3] * rows * width
    dec = [(1, 1024, cost(1, 1024)), (4, 1024, cost(4, 1024))] + [
        (8, w, cost(8, w)) for w in widths]
    fitted = sim.fit_costs([(16, 0, 1.0), (32, 0, 2.0), (64, 64, 4.0)], dec, widths,
                           batches=batches)
    assert fitted.decode_s(2, 300, 100) == pytest.approx(cost(2, 1024))
    assert fitted.decode_s(3, 300, 100) == pytest.approx(cost(4, 1024))
    assert fitted.decode_s(8, 800, 100) == pytest.approx(cost(8, 128))
    assert fitted.decode_s(1, 1000, 1000) == pytest.approx(cost(1, 1024))


def test_calibration_file_round_trips(tmp_path):
    c = sim.FittedCosts((1.0, 2.0, 3.0), (4.0, 5.0, 6.0, 7.0), (16, 32), "decode", (1, 2))
    sim.save_calibration(tmp_path / "c.json", {"decode": (c, {"prefill": [], "decode": []})},
                         {"config": "x"})
    loaded, extra = sim.load_calibration(tmp_path / "c.json")
    assert loaded == {"decode": c} and extra["config"] == "x"


def test_max_rate_finds_the_knee_of_a_known_queue():
    """One prefill server of S = 20 ms with a TTFT SLO of 60 ms: M/D/1 response times
    exceed 3 S for 10% of requests near rho ~ 0.65; the bisection lands there."""
    s = 0.020
    system = disagg(costs((s, 0.0, 0.0)), None, queue=1 << 20)
    wl = bench.Workload(requests=3000, prompt=bench.Lengths("fixed", 64),
                        output=bench.Lengths("fixed", 2), seed=2, warmup=0)
    rate = sim.max_rate(system, wl, bench.SLO(ttft_ms=60), guess=10)
    assert 0.5 / s < rate < 0.85 / s
    assert sim.max_rate(system, wl, bench.SLO(ttft_ms=10), guess=10) == 0.0  # S > SLO


def test_match_picks_the_balanced_ratio():
    # prefill instances take 10 req/s, decode ones 30: 3P:1D serves 30 on 4 GPUs
    best = planner.match([(10.0, 1, 512)], [(30.0, 1, 64)], max_gpus=4)[0]
    assert (best["prefill"], best["decode"]) == (3, 1)
    assert best["estimate_per_gpu"] == pytest.approx(7.5)


@pytest.fixture(scope="module")
def small_search():
    wl = bench.Workload(prompt=bench.Lengths("uniform", 1024, 3072),
                        output=bench.Lengths("fixed", 128), seed=0)
    s = planner.Search(tps=(1,), chunks=(1024,), max_unit=4, requests=150, verify=2)
    return get_preset("llama2-7b"), rl.HARDWARE["h100-sxm"], wl, bench.SLO(1000, 40), s


def test_planner_matches_exhaustive_search(small_search):
    """Every disaggregated unit of at most 4 single-GPU instances, simulated whole: the
    planner's pick is within 10% of the best of them."""
    cfg, hw, wl, slo, s = small_search
    found = planner.plan(cfg, hw, 4, wl, slo, s)
    m = rl.Model.from_config(cfg, 2)
    slots = planner._slots(cfg, m, hw, 1, wl, s)
    best = 0.0
    for x in range(1, 4):
        for y in range(1, 5 - x):
            c = {"prefill": x, "decode": y, "prefill_tp": 1, "decode_tp": 1, "chunk": 1024,
                 "slots": slots}
            system = planner.unit(cfg, m, hw, c, s, planner.fabric_transfer(m, s))
            n = dataclasses.replace(wl, requests=s.requests * (x + y) + 4 * y * slots)
            best = max(best, planner._rate(system, n, slo) / (x + y))
    assert found.disaggregated["goodput_per_gpu"] >= 0.9 * best
    assert found.colocated["tp"] == 1 and found.colocated["goodput_per_gpu"] > 0


def test_planner_verifies_distinct_ratios(small_search, monkeypatch):
    """The estimate ranks 1P:1D and 2P:2D alike; the whole-unit simulations go to
    different P:D ratios, not to multiples of one (which let a 1% change of the
    per-call overhead move the study's answer by 10%)."""
    cfg, hw, wl, slo, s = small_search
    monkeypatch.setattr(planner, "_rate", lambda *a, **k: 1.0)  # every instance alike
    found = planner.plan(cfg, hw, 4, wl, slo, s)
    verified = [(c["prefill"], c["decode"]) for c in found.candidates if "rate" in c]
    assert verified == [(1, 1), (1, 2)]


def test_planner_gain_grows_as_tpot_tightens(small_search):
    """DistServe's finding, reproduced on the model: with long prompts, disaggregation's
    edge over colocation grows as the TPOT SLO tightens."""
    cfg, hw, wl, _, s = small_search
    gains = [planner.plan(cfg, hw, 8, wl, bench.SLO(1000, tpot), s).gain for tpot in (25, 200)]
    assert gains[0] > gains[1]


def test_cli_simulates_a_config_on_the_roofline_and_plans(tmp_path, capsys):
    from jaxdisagg.cli import main

    out = tmp_path / "sim.json"
    assert main(["simulate", "--config", "configs/gpu-8-4p4d.yaml", "--hardware", "h200",
                 "--requests", "60", "--prompt-len", "uniform:256:1024", "--output-len",
                 "fixed:32", "--sweep", "5,50", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "goodput rate" in printed and "ttft_p99_ms" in printed
    runs = json.loads(out.read_text())
    assert runs["5.0"]["slo_attainment"] >= runs["50.0"]["slo_attainment"]
    assert main(["simulate", "--plan", "--model", "llama2-7b", "--hardware", "h100-sxm",
                 "--gpus", "2", "--prompt-len", "uniform:512:1024", "--output-len",
                 "fixed:64", "--slo", "ttft_ms=1000,tpot_ms=50"]) == 0
    assert "disaggregated / colocated goodput per GPU" in capsys.readouterr().out
    # bad input names the flag
    assert main(["simulate", "--hardware", "h900"]) == 2
    assert "--hardware" in capsys.readouterr().err


def test_cpu_share_counts_this_process_cpu_per_wall_second():
    """Busy Python code takes about one core; a function that sleeps takes next to none."""
    import time

    from jaxdisagg.calibrate import cpu_share

    def spin(until=0.01):
        t = time.perf_counter()
        while time.perf_counter() - t < until:
            pass

    assert cpu_share(lambda: time.sleep(0.01), seconds=0.2) < 0.2
    assert 0.3 < cpu_share(spin, seconds=0.2) < 1.3


def test_overlapped_decode_timing_reads_each_step_one_late():
    """Under overlap scheduling a step's tokens are read after the next step is
    dispatched; the calibration times decode the same way."""
    import numpy as np

    from jaxdisagg.calibrate import overlapped_seconds

    events = []

    class Out:
        def __init__(self, i):
            self.i = i

        def __array__(self, dtype=None, copy=None):
            events.append(("read", self.i))
            return np.zeros(1)

    def call():
        i = sum(e[0] == "call" for e in events)
        events.append(("call", i))
        return Out(i), Out(i)

    assert overlapped_seconds(call, repeats=1, steps=3) > 0
    run = events[:events.index(("call", 3))]  # the warm-up run
    assert run == [("call", 0), ("call", 1), ("read", 0), ("read", 0), ("call", 2),
                   ("read", 1), ("read", 1), ("read", 2), ("read", 2)]


def test_calibration_measures_a_pool_and_busy_keeps_one_loaded(tmp_path, capsys):
    """`simulate --calibrate` fits a served pool's own step times; `simulate --busy`
    keeps a pool's program running (the load a neighbour is calibrated under) until
    it is stopped; `contention` is the ratio of matching points."""
    import subprocess
    import sys

    from jaxdisagg.calibrate import contention
    from jaxdisagg.cli import main

    out = tmp_path / "decode.json"
    assert main(["simulate", "--calibrate", str(out), "--config", "configs/cpu-2proc.yaml",
                 "--pools", "decode"]) == 0
    fitted, extra = sim.load_calibration(out)
    points = json.loads(out.read_text())["pools"]["decode"]["points"]["decode"]
    assert extra["config"] == "configs/cpu-2proc.yaml" and points
    assert all(s > 0 for *_, s in points)
    widths, batches = fitted["decode"].widths, fitted["decode"].batches
    assert batches == (1, 2, 4, 8)  # the 8-slot pool's compiled batch sizes
    w = widths[-1]
    small, full = fitted["decode"].decode_s(1, w, w), fitted["decode"].decode_s(8, 8 * w, w)
    assert 0 < small <= full  # more rows never cost less: coefficients kept >= 0
    # all slots at every width; 1 and half of them at the full width, which serves them
    assert sorted((a, t) for a, t, _ in points) == sorted(
        [(1, w), (4, w)] + [(8, t) for t in widths])
    share = json.loads(out.read_text())["pools"]["decode"]["points"]["cpu_share"]
    assert set(share) == {"prefill", "decode"}  # a lone request's chunk and step
    assert all(0 < v <= os.cpu_count() + 0.5 for v in share.values())

    proc = subprocess.Popen([sys.executable, "-m", "jaxdisagg.cli", "simulate", "--config",
                             "configs/cpu-2proc.yaml", "--busy", "prefill"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        assert proc.poll() is None  # still looping
    finally:
        proc.kill()
        proc.wait()
    assert main(["simulate", "--config", "configs/cpu-2proc.yaml", "--busy", "nope"]) == 2
    assert "--busy" in capsys.readouterr().err

    alone, loaded = [[1, 64, 0.10], [8, 64, 0.20]], [[1, 64, 0.15], [8, 64, 0.30]]
    assert contention(alone, loaded) == pytest.approx(1.5)
    assert contention([[1, 64, 0.10]], [[1, 64, 0.09]]) == 1.0  # never a speed-up


def _plan_study():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "plan_study.py")
    spec = importlib.util.spec_from_file_location("plan_study", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plan_study_takes_the_gpu_overhead_and_checks_its_step_model(tmp_path):
    study = _plan_study()
    assert study.overhead(tmp_path)[0] == study.ASSUMED_OVERHEAD_S
    assert study.validation(1e-3, tmp_path) == []
    assert (study.hardware_of("NVIDIA H200"), study.hardware_of("NVIDIA H100 80GB HBM3"),
            study.hardware_of("cpu")) == ("h200", "h100-sxm", None)

    # What a calibration's one-row decode step took beyond the roofline becomes the
    # per-call overhead (not the fit's intercept, here 0; larger batches are not read).
    one_b = sim.RooflineCosts(rl.Model.from_config(get_preset("llama3.2-1b"), 2),
                              rl.HARDWARE["h200"])
    points = {"prefill": [], "decode": [[1, 8192, one_b.decode_s(1, 8192, 8192) + 3e-3],
                                        [64, 8192, 1.0]]}
    fitted = sim.FittedCosts((1e-3, 0.0, 0.0), (0.0, 1e-4, 0.0, 0.0), (1024,))
    sim.save_calibration(tmp_path / "calibration_gpu_x.json", {"colocated": (fitted, points)},
                         {"config": "configs/gpu-1-colocated.yaml", "device": "NVIDIA H200"})
    assert study.overhead(tmp_path)[0] == pytest.approx(3e-3)

    # The GPU check's copy rate sets memory bandwidth, at the same fraction of the
    # datasheet for the GPU that was not measured.
    (tmp_path / "gpu_e2e_steps.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "ceilings": {"copy_gbs": 2400}, "models": {}}))
    table, text = study.hardware(tmp_path)
    assert table["h200"].bandwidth == pytest.approx(2.4e12)
    assert table["h100-sxm"].bandwidth == pytest.approx(rl.HARDWARE["h100-sxm"].bandwidth / 2)
    assert table["h200"].flops == rl.HARDWARE["h200"].flops and "50%" in text
    # ... and the overhead is taken over the roofline at those rates.
    slower = sim.RooflineCosts(rl.Model.from_config(get_preset("llama3.2-1b"), 2), table["h200"])
    over = study.overhead(tmp_path)[0]
    assert over == pytest.approx(3e-3 + one_b.decode_s(1, 8192, 8192)
                                 - slower.decode_s(1, 8192, 8192))
    assert over < 3e-3
    (tmp_path / "gpu_e2e_steps.json").unlink()

    # Steps measured exactly as the step model predicts them at 3 ms per call show no
    # error at 3 ms, and the assumed 2 ms under-predicts each by 1 ms.
    cfg = get_preset("llama3-8b")
    costs = sim.RooflineCosts(rl.Model.from_config(cfg, 2), rl.HARDWARE["h200"], 1, 3e-3,
                              hidden=cfg.hidden_size, layers=cfg.num_layers)
    steps = {"prefill_tokens": 512, "context": 1024, "prefill_s": costs.prefill_s(512, 0),
             "decode_b1_s": costs.decode_s(1, 1025, 1025),
             "decode_b32_s": costs.decode_s(32, 32 * 1025, 1025)}
    (tmp_path / "gpu_e2e_steps.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "date": "d", "models": {"llama3-8b": steps}}))
    rows = study.validation(3e-3, tmp_path)
    assert [r["step"] for r in rows] == ["prefill 512", "decode B=1", "decode B=32"]
    for r in rows:
        assert r["predicted_s"]["3.00"] == pytest.approx(r["measured_s"])
        assert r["predicted_s"]["2.00"] == pytest.approx(r["measured_s"] - 1e-3)
    table = "\n".join(study.render_validation(rows))
    assert "| llama3-8b | decode B=32 |" in table and "(+0%)" in table
