"""The load generator: workloads from a seed, SLO accounting, the goodput rate, and
`jaxdisagg bench` against the in-process engines and a running server."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxdisagg.bench import SLO, Lengths, Record, Workload, goodput_rate, stages, summarize

SCRIPT = Path(sys.executable).parent / "jaxdisagg"
ROOT = Path(__file__).resolve().parents[1]


def test_lengths_parse_and_draw():
    rng = np.random.default_rng(0)
    assert (Lengths.parse("fixed:64", "x").draw(rng, 5) == 64).all()
    u = Lengths.parse("uniform:10:20", "x").draw(rng, 2000)
    assert u.min() >= 10 and u.max() <= 20
    ln = Lengths.parse("lognormal:300:0.5", "x").draw(rng, 20000)
    assert ln.mean() == pytest.approx(300, rel=0.03)  # MEAN is the mean, not the median
    for bad in ("fixed", "fixed:-3", "poisson:4", "uniform:1", "fixed:x"):
        with pytest.raises(ValueError, match="--len"):
            Lengths.parse(bad, "--len")


def test_stages_split_the_transfer_into_handoff_and_the_decode_threads_pull():
    t = {"arrival": 0.0, "prefill_start": 0.01, "prefill_end": 0.05, "transfer_start": 0.052,
         "pull_start": 0.056, "transfer_end": 0.058, "decode_insert": 0.059, "finish": 0.2}
    got = stages(t)
    assert got == pytest.approx({"queue": 0.01, "prefill": 0.04, "transfer": 0.009,
                                 "pull": 0.002, "decode": 0.141})
    del t["pull_start"]  # an older server, or an in-process run without a pull
    assert "pull" not in stages(t)


def test_workload_is_reproducible_with_poisson_and_bursty_arrivals():
    w = Workload(requests=4000, rate=20.0, prompt=Lengths("fixed", 5), shared_prefix=3,
                 warmup=2)
    a, b = w.build(384), w.build(384)
    assert a == b  # one seed, one workload
    measured = a[2:]
    assert all(p[:3] == measured[0][1][:3] for _, p, _ in measured)  # the shared prefix
    assert all(len(p) == 8 for _, p, _ in measured)
    gaps = np.diff([t for t, _, _ in measured])
    assert measured[0][0] == 0.0
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = np.diff([t for t, _, _ in Workload(requests=4000, rate=20.0,
                                                burstiness=0.25).build(384)[2:]])
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # CV = 1/sqrt(shape)
    assert all(t == 0 for t, _, _ in Workload(requests=5).build(384))


def test_slo_summary_and_goodput():
    slo = SLO.parse("ttft_ms=100,tpot_ms=20")
    recs = [Record(10, 0.0, tokens=11, ttft=0.05, itl=[0.01] * 10, e2e=0.15),  # meets
            Record(10, 0.5, tokens=11, ttft=0.2, itl=[0.01] * 10, e2e=0.3),  # TTFT too slow
            Record(10, 1.0, tokens=11, ttft=0.05, itl=[0.03] * 10, e2e=0.35),  # TPOT too slow
            Record(10, 1.5, status="aborted")]
    s = summarize(recs, slo)
    assert (s["completed"], s["aborted"], s["failed"]) == (3, 1, 0)
    assert s["slo_attainment"] == 0.25
    assert s["duration_s"] == pytest.approx(1.5)
    assert s["goodput_req_s"] == pytest.approx(1 / 1.5)
    assert s["throughput_tok_s"] == pytest.approx(33 / 1.5)
    assert s["tpot_p50_ms"] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="--slo"):
        SLO.parse("latency=3")
    assert goodput_rate([(1, 1.0), (2, 0.95), (4, 0.85)]) == pytest.approx(3.0)
    assert goodput_rate([(1, 0.5)]) is None
    assert goodput_rate([(1, 1.0), (2, 1.0)]) == 2
    # SLO use: the tighter of the two budgets, and the ordering met() implies.
    assert [slo.use(r.ttft, r.tpot, r.status == "ok") for r in recs] == \
        pytest.approx([0.5, 2.0, 1.5, float("inf")])
    assert [slo.met(r) for r in recs] == [slo.use(r.ttft, r.tpot, r.status == "ok") <= 1
                                          for r in recs]
    assert SLO(ttft_ms=100).use(0.02, None) == pytest.approx(0.2)
    assert SLO().use(None, None) == 0.0


def run(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([str(SCRIPT), "bench", *map(str, args)], capture_output=True,
                          text=True, env={**env, "JAX_PLATFORMS": "cpu"}, timeout=timeout)


def test_bench_compares_both_engines_with_a_sweep(tmp_path):
    out = run("--compare", "colocated,disaggregated", "--requests", "6", "--sweep", "5,40",
              "--prompt-len", "uniform:10:120", "--output-len", "fixed:6", "--warmup", "1",
              "--slo", "ttft_ms=60000,tpot_ms=60000", "--json", tmp_path / "b.json",
              "--plot", tmp_path / "b.png")
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "b.json").read_text())
    assert set(data["results"]) == {"colocated@5", "colocated@40", "disaggregated@5",
                                    "disaggregated@40"}
    for summary in data["results"].values():
        assert summary["completed"] == 6 and summary["slo_attainment"] == 1.0
        assert summary["itl_p99_ms"] > 0 and summary["decode_median_ms"] > 0
    assert data["results"]["disaggregated@5"]["transfer_median_ms"] is not None
    assert data["goodput_rate"] == {"colocated": 40, "disaggregated": 40}
    assert len(data["requests"]["colocated@5"]) == 6
    assert "never fell below 90% up to 40 req/s" in out.stdout and (tmp_path / "b.png").exists()
    assert "SLO: TTFT <= 60000 ms and TPOT <= 60000 ms" in out.stderr


def test_bench_drives_a_server_and_rejects_bad_options(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    server = subprocess.Popen([str(SCRIPT), "serve", "--config",
                               ROOT / "configs/cpu-colocated.yaml", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**env, "JAX_PLATFORMS": "cpu"})
    try:
        line = server.stdout.readline()
        assert line.startswith("READY")
        out = run("--server", line.split()[1], "--requests", "5", "--rate", "20",
                  "--output-len", "fixed:5", "--json", tmp_path / "s.json")
        assert out.returncode == 0, out.stderr[-2000:]
        summary = json.loads((tmp_path / "s.json").read_text())["results"]["server"]
        assert summary["completed"] == 5 and summary["ttft_p50_ms"] > 0
        assert summary["prefill_median_ms"] is not None  # the server's own timeline
    finally:
        server.terminate()
        server.wait(timeout=60)
    for args, message in ((("--rate", "-1"), "must be positive"),
                          (("--prompt-len", "gauss:3"), "--prompt-len"),
                          (("--compare", "fast"), "--compare: unknown")):
        bad = run(*args)
        assert bad.returncode == 2 and message in bad.stderr
