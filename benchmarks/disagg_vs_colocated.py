"""Disaggregated against colocated goodput, repeated until the difference shows (or
plainly does not), with the calibrated simulator's prediction beside it.

    python benchmarks/disagg_vs_colocated.py --model tiny --workload long
    python benchmarks/disagg_vs_colocated.py --model smollm2 --workload short --repeats 2
    python benchmarks/disagg_vs_colocated.py --report     # rewrite the .md from results/

One experiment = one model x one workload kind:

1. Calibrate: each pool's step times are measured as it will run (the disaggregated
   pools pinned to one core each, as `launch` pins them; the colocated pool on both)
   and fitted (`jaxdisagg simulate --calibrate`), in subprocesses; each pinned pool
   again while the other one runs its heaviest program (`simulate --busy`), for the
   slowdown their sharing of the memory system costs.
2. Tune the colocated baseline: every candidate chunk size x slot count runs one
   sweep over the coarse rate grid; the one with the most attained requests is kept
   (among equals, the one with the lowest 90th percentile of SLO use).
3. Start both deployments and keep them up. Each repeat draws a fresh seed and runs
   every rate of the fine grid on both, the order alternating from repeat to repeat.
4. Goodput rate (where SLO attainment falls through 90%) per deployment, as the
   median of a two-level bootstrap (runs resampled, then requests within each rate)
   with its 95% interval; a verdict only when the intervals do not overlap.
5. Simulate the same seeds on the calibrated costs, with the host overheads that
   probes of the running servers measured (`probe`), and put prediction beside
   measurement: TTFT and TPOT p50/p99 per rate and the goodput rate.

`--analyse` redoes 4-5 from the saved raw runs; with `--recalibrate` and `--reprobe`
it measures the simulator's inputs again first (both deployments started as they
were measured).

Writes benchmarks/results/goodput_<model>_<workload>.json and regenerates
benchmarks/disagg_vs_colocated.md from every such file present.
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxdisagg import bench  # noqa: E402
from jaxdisagg import roofline as rl  # noqa: E402
from jaxdisagg import simulate as sim  # noqa: E402
from jaxdisagg.cli import pool_cores  # noqa: E402
from jaxdisagg.mesh.config import load_config  # noqa: E402
from jaxdisagg.model.config import get_preset  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REPORT = ROOT / "benchmarks" / "disagg_vs_colocated.md"

# Per model: the disaggregated config, the workload kinds with their SLOs and grids.
# "long" is where the argument expects disaggregation to win (long prompts, a TPOT
# SLO near the bare decode step); "short" where it expects no gain (short prompts,
# a loose SLO). tiny short runs to 80 req/s: colocated attained 40, the old top, in two
# repeats of three on an EPYC host (2026-12-03) and 56 on a Xeon (2026-12-04), which
# left its goodput a lower bound; its coarse grid reaches past both knees. SmolLM2 short
# runs to 10 req/s for a host whose prefill is twice the EPYC's (knees near 4.5 there).
# tiny long runs to 48 req/s with at least 4 s of arrivals: on the Xeon the disaggregated
# one attained 14, the older top, and on the Zen 5 host both attained 24, the old top, in
# every repeat (2026-12-04 18:11-18:24).
# SmolLM2 long runs 0.3-2 req/s with at least 20 s of arrivals: in a run of 2026-12-04
# (06:09) both deployments attained every request at 0.4, the old top, in all three
# repeats, and 12 requests alone queue too little past a knee to miss a 6 s TTFT; on a
# Zen 5 host that afternoon, on a grid to 1.2, each still reached the top in a repeat.
EXPERIMENTS = {
    "tiny": {
        "config": "configs/cpu-2proc.yaml", "candidates": [(32, 8), (64, 8), (128, 8), (64, 16)],
        "long": {"prompt": ("uniform", 400, 900), "output": 64, "requests": 40,
                 "window_s": 4, "slo": (500, 15), "coarse": (12, 26, 40),
                 "rates": (8, 12, 16, 20, 24, 26, 28, 30, 32, 36, 40, 44, 48)},
        "short": {"prompt": ("uniform", 16, 64), "output": 64, "requests": 40,
                  "window_s": 10, "slo": (1000, 40), "coarse": (24, 48, 72),
                  "rates": (12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 72, 80)},
    },
    "smollm2": {
        "config": "configs/cpu-smollm2-2proc.yaml", "candidates": [(128, 8), (64, 8)],
        "long": {"prompt": ("uniform", 300, 600), "output": 24, "requests": 12,
                 "window_s": 20, "slo": (6000, 250), "coarse": (0.4, 1.0, 1.7),
                 "rates": (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.4, 1.7, 2.0)},
        "short": {"prompt": ("uniform", 16, 64), "output": 24, "requests": 12,
                  "window_s": 12, "slo": (4000, 400), "coarse": (2, 5, 8),
                  "rates": (1, 2, 3, 4, 5, 6, 7, 8, 10)},
    },
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def workload(spec: dict, seed: int, rate: float) -> bench.Workload:
    """At least `requests`, and at least `window_s` seconds of arrivals: a rate above
    capacity must build a queue longer than the TTFT SLO before arrivals stop."""
    kind, a, b = spec["prompt"]
    n = max(spec["requests"], int(np.ceil(rate * spec.get("window_s", 0))))
    return bench.Workload(requests=n, rate=rate, prompt=bench.Lengths(kind, a, b),
                          output=bench.Lengths("fixed", spec["output"]), seed=seed, warmup=2)


def colocated_config(disagg_path: str, chunk: int, slots: int) -> str:
    """The colocated deployment given what the disaggregated one's decode pool has:
    the same model, blocks and block size, in one process on both cores."""
    cfg = yaml.safe_load((ROOT / disagg_path).read_text())
    d = cfg["decode"]
    text = yaml.safe_dump({"mode": "colocated", "model": cfg["model"], "colocated": {
        "devices": [0], "tp": 1, "chunk_size": chunk, "max_slots": slots,
        "num_blocks": d["num_blocks"], "block_size": d["block_size"]}})
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    f.write(text)
    f.close()
    return f.name


def cli(*args) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, "-m", "jaxdisagg.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def start(*args) -> tuple[subprocess.Popen, str]:
    proc = cli(*args)
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    proc.ready_line = line
    return proc, (line.split() + [""])[1]


def _named_pids(proc) -> dict[str, int]:
    return dict((n, int(p)) for n, p in re.findall(r"(\w+) pid (\d+)", proc.ready_line))


def decode_core_pids(proc) -> list[int]:
    """The processes that share the decode instance's cores: launch's decode and router
    processes (pinned to one core together), or the one colocated serve process."""
    named = _named_pids(proc)
    return [named[n] for n in ("decode", "router") if n in named] or [proc.pid]


def prefill_core_pids(proc) -> list[int]:
    """launch's prefill process (alone on its core); none for a colocated server."""
    return [pid for n, pid in _named_pids(proc).items() if n == "prefill"]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time so far of these processes, all their threads."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


POOLS = ("prefill", "decode", "colocated")


def _calibrate_one(path: Path, config: str, pool: str, cores: str | None) -> None:
    args = ["simulate", "--calibrate", str(path), "--config", config, "--pools", pool]
    if cores is not None:
        args += ["--cores", cores]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-m", "jaxdisagg.cli", *args], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"calibrating {path.name} failed: {done.stderr[-2000:]}")


def calibrate(model: str, kind: str, disagg: str, colocated: str,
              names=POOLS) -> dict[str, str]:
    """Calibration files per deployment: the pinned pools on their halves of the cores,
    the colocated pool unpinned. Each disaggregated pool is measured twice: alone, and
    while the other pool runs its heaviest program on the other half (`simulate --busy`), for
    the slowdown that sharing the memory bus and cache costs (`PoolSpec.contended`).
    Pools not in `names` keep their files from the last calibration."""
    out = {}
    # The cores `launch` pins each pool to (one each on a 2-core machine).
    halves = [",".join(map(str, h)) for h in pool_cores(os.sched_getaffinity(0))]
    jobs = [("prefill", disagg, "prefill", halves[0], "decode"),
            ("decode", disagg, "decode", halves[1], "prefill"),
            ("colocated", colocated, "colocated", None, None)]
    for name, config, pool, cores, neighbour in jobs:
        path = RESULTS / f"calibration_{model}_{kind}_{name}.json"
        if name not in names:
            out[name] = str(path)
            loaded = RESULTS / f"calibration_{model}_{kind}_{name}_loaded.json"
            if neighbour is not None and loaded.exists():
                out[f"{name}_loaded"] = str(loaded)
            continue
        log(f"calibrating {name}")
        _calibrate_one(path, config, pool, cores)
        out[name] = str(path)
        if neighbour is None:
            continue
        loaded = RESULTS / f"calibration_{model}_{kind}_{name}_loaded.json"
        log(f"calibrating {name} while {neighbour} runs on the other cores")
        load, _ = start("simulate", "--config", config, "--busy", neighbour, "--cores",
                        halves[1] if cores == halves[0] else halves[0])
        try:
            _calibrate_one(loaded, config, pool, cores)
        finally:
            stop(load)
        out[f"{name}_loaded"] = str(loaded)
    return out


def per_request(records: list[bench.Record], slo: bench.SLO) -> list[dict]:
    def num(x):
        return None if x is None else float(x)

    return [{"ttft": num(r.ttft), "tpot": num(r.tpot), "met": bool(slo.met(r)),
             "status": r.status} for r in records]


def rate_seed(seed: int, k: int) -> int:
    """Each rate of a sweep draws its own prompts: with one seed for every rate, the
    prefix cache would serve the later rates' prompts from the earlier ones'."""
    return seed * 1000 + k


def sweep(address: str, spec: dict, seed: int, rates) -> dict:
    target = bench.ServerTarget(address)
    slo = bench.SLO(*spec["slo"])
    out = {}
    try:
        for k, rate in enumerate(rates):
            records = bench.run(target, workload(spec, rate_seed(seed, k), rate))
            out[str(float(rate))] = {"summary": bench.summarize(records, slo),
                                     "requests": per_request(records, slo)}
    finally:
        target.client.close()
    return out


PROBE_PROMPT = 512
PROBE_SHORT = 16


def probe(address: str, slots: int, pids: list[int] | None = None,
          prefill_pids: list[int] | None = None) -> dict:
    """The served system's overheads, measured before the experiment (its only input
    to the simulator besides the step calibration): a lone request's TTFT at a short
    and a long prompt (PROBE_SHORT, PROBE_PROMPT tokens), and the inter-token gap of
    a lone request and of a full batch of short requests. `simulated` charges the
    gaps' excess over the calibrated steps to host time per decode iteration and per
    token emitted (detokenizing, streaming: other threads on the instance's cores),
    and the TTFT excess to the front end and, disaggregated, to the cross-process KV
    pull (the decode thread pulls, so the batch waits for all of it). The pull's cost
    per prompt token is the growth, from the short probe to the long one, of the
    pull stage (on the decode thread) in the server's own timeline of each request, and
    its fixed part what is left at the short prompt; the rest of the transfer stage is
    the handoff (the offer's way to the decode process, which stalls nobody); the front
    end takes the rest of the short probe's excess. With `pids` (the processes on the
    decode instance's cores), the CPU time they spend per lone short request is
    recorded too: what each request's front end, handoff and pull take from the cores
    the decode steps run on; with `prefill_pids` the same for the prefill process."""
    target = bench.ServerTarget(address)

    stages = {}

    def ttft(length):
        out = []
        for seed in range(3):
            rec = bench.Record(length, 0.0)
            prompt = np.random.default_rng(seed).integers(3, 250, length).tolist()
            target.run_one(prompt, 2, rec)
            out.append(rec.ttft)
            for k, v in rec.stages.items():  # the server's own timeline of each stage
                stages.setdefault(f"{length}_{k}", []).append(v)
        return statistics.median(out)

    def itl(n):
        wl = bench.Workload(requests=n, prompt=bench.Lengths("fixed", 16),
                            output=bench.Lengths("fixed", 64), seed=7, warmup=0)
        return statistics.median(g for r in bench.run(target, wl) for g in r.itl[8:56])

    try:
        out = {"idle_ttft_s": ttft(PROBE_PROMPT), "short_ttft_s": ttft(PROBE_SHORT)}
        if pids:
            out.update(request_cpu(target, pids, prefill_pids))
        out.update({"lone_itl_s": itl(1), "batch_itl_s": itl(slots), "slots": slots})
        out["stages_s"] = {k: statistics.median(v) for k, v in stages.items()}
        return out
    finally:
        target.client.close()


OVERLOAD_SEED = 4242


def overload_workload(spec: dict, slots: int) -> bench.Workload:
    """The overload probe's requests: the workload's lengths arriving at the top of its
    grid (above both deployments' knees) for at least 2 s and 4 full batches, on a seed
    the sweeps never draw."""
    kind, a, b = spec["prompt"]
    top = max(spec["rates"])
    return bench.Workload(requests=max(4 * slots, int(np.ceil(2 * top))), rate=float(top),
                          prompt=bench.Lengths(kind, a, b),
                          output=bench.Lengths("fixed", spec["output"]), seed=OVERLOAD_SEED,
                          warmup=0)


def overload_summary(records: list[bench.Record]) -> dict:
    """Throughput while overloaded (requests over the span from the first arrival to the
    last finish) and the median TPOT: the same figures of a simulated run are comparable."""
    span = max(r.arrival + r.e2e for r in records) - min(r.arrival for r in records)
    tpots = [r.tpot for r in records if r.tpot is not None]
    return {"requests": len(records), "throughput_rps": len(records) / span,
            "tpot_p50_s": statistics.median(tpots) if tpots else None,
            "failed": sum(r.status != "ok" for r in records)}


def overload(address: str, spec: dict, slots: int) -> dict:
    """The served system at sustained overload, probed before and after the repeats: a
    drift check on the machine (its second core is shared) and a test of the simulator
    outside the lone and one-batch cases its overheads are fitted on; nothing is fitted
    to it."""
    target = bench.ServerTarget(address)
    try:
        out = overload_summary(bench.run(target, overload_workload(spec, slots)))
    finally:
        target.client.close()
    return {**out, "at": time.strftime("%H:%M:%S")}


LOADED_CLIENTS = 4


def loaded_gap(address: str, spec: dict, n: int = 8) -> dict:
    """A lone short request's inter-token gap while the prefill core is kept busy by
    served prompts of the workload's lengths (LOADED_CLIENTS closed-loop clients, 2
    tokens out each, fresh prompts so the prefix cache never hits), with the gap of the
    same requests idle beside it: the disaggregated decode loop's slowdown while its
    neighbour prefills, as served (the calibration's `--busy` load runs a bare program,
    and the decode program alone under it slowed by x1.00 on tiny, 2026-12-07)."""
    kind, a, b = spec["prompt"]
    fg, bg = bench.ServerTarget(address), bench.ServerTarget(address)
    stop_bg, done = threading.Event(), []

    def background(k):
        rng = np.random.default_rng(7000 + k)
        while not stop_bg.is_set():
            length = int(bench.Lengths(kind, a, b).draw(rng, 1)[0])
            bg.run_one(rng.integers(3, 250, length).tolist(), 2, bench.Record(length, 0.0))
            done.append(length)

    def gap(offset):
        gaps = []
        for i in range(n):
            rec = bench.Record(PROBE_SHORT, 0.0)
            prompt = np.random.default_rng(offset + i).integers(3, 250, PROBE_SHORT).tolist()
            fg.run_one(prompt, 64, rec)
            gaps += rec.itl[8:56]
        return statistics.median(gaps)

    try:
        gap(8000)  # warm
        idle = gap(8100)
        threads = [threading.Thread(target=background, args=(k,), daemon=True)
                   for k in range(LOADED_CLIENTS)]
        for th in threads:
            th.start()
        time.sleep(0.3)
        t0 = time.perf_counter()
        start = len(done)
        loaded = gap(8200)
        rate = (len(done) - start) / (time.perf_counter() - t0)
        stop_bg.set()
        for th in threads:
            th.join()
    finally:
        fg.client.close()
        bg.client.close()
    return {"idle_itl_s": idle, "loaded_itl_s": loaded, "background_rps": rate,
            "background_prompt": statistics.mean(done) if done else None}


def overload_both(d_addr: str, c_addr: str, spec: dict, slots: int) -> dict:
    out = {name: overload(address, spec, slots)
           for name, address in (("disaggregated", d_addr), ("colocated", c_addr))}
    log(f"overload probe: {out}")
    return out


def request_cpu(target, pids: list[int], prefill_pids: list[int] | None = None,
                n: int = 30) -> dict:
    """CPU time the processes spend per lone short request (PROBE_SHORT tokens in, 2
    out), warm, less what they burn idle over the same time (`short_cpu_s`; with
    `prefill_pids`, the same of those in `prefill_cpu_s`, from the same requests).
    The kernel counts CPU in 10 ms ticks, hence n requests."""
    groups = {"short_cpu_s": pids, **({"prefill_cpu_s": prefill_pids} if prefill_pids else {})}
    def lone(seed):
        prompt = np.random.default_rng(100 + seed).integers(3, 250, PROBE_SHORT).tolist()
        target.run_one(prompt, 2, bench.Record(PROBE_SHORT, 0.0))

    def cpu():
        return {k: cpu_seconds(v) for k, v in groups.items()}

    lone(0)  # anything a first request of this shape still sets up
    t0, c0 = time.perf_counter(), cpu()
    time.sleep(2.0)
    wall = time.perf_counter() - t0
    idle = {k: (c - c0[k]) / wall for k, c in cpu().items()}
    t0, c0 = time.perf_counter(), cpu()
    for seed in range(n):
        lone(seed + 1)
    wall = time.perf_counter() - t0
    out = {k: (c - c0[k] - idle[k] * wall) / n for k, c in cpu().items()}
    return {**out, "short_wall_s": wall / n, "idle_cpu_share": idle["short_cpu_s"]}


def reprobe(model: str, kind: str) -> None:
    """New probes for saved runs: both deployments started as they were measured."""
    path = RESULTS / f"goodput_{model}_{kind}.runs.json"
    raw = json.loads(path.read_text())
    disagg = EXPERIMENTS[model]["config"]
    colocated = colocated_config(disagg, *raw["best"])
    probes = {}
    for name, args, slots in (
            ("disaggregated", ("launch", "--config", str(ROOT / disagg)),
             load_config(str(ROOT / disagg)).decode.max_slots),
            ("colocated", ("serve", "--config", colocated), raw["best"][1])):
        proc, address = start(*args, "--port", "0")
        try:
            probes[name] = probe(address, slots, decode_core_pids(proc),
                                 prefill_core_pids(proc))
        finally:
            stop(proc)
    log(f"probes: {probes}")
    raw["probes"] = probes
    path.write_text(json.dumps(raw))


def _add_disaggregated_probe(model: str, kind: str, measure) -> None:
    """Runs `measure(proc, address, raw)` on a fresh `launch` of the experiment's config
    and merges the dict it returns into the saved runs' disaggregated probes, keeping
    every other probe as it was measured (a newer probe's other terms would carry the
    machine's drift since)."""
    path = RESULTS / f"goodput_{model}_{kind}.runs.json"
    raw = json.loads(path.read_text())
    proc, address = start("launch", "--config", str(ROOT / EXPERIMENTS[model]["config"]),
                          "--port", "0")
    try:
        added = measure(proc, address, raw)
    finally:
        stop(proc)
    log(f"added to the disaggregated probes: {added}")
    raw["probes"]["disaggregated"].update(added)
    path.write_text(json.dumps(raw))


def reprobe_prefill_cpu(model: str, kind: str) -> None:
    """Adds the prefill process's CPU per lone short request to saved runs' probes."""
    def measure(proc, address, raw):
        target = bench.ServerTarget(address)
        try:
            cpu = request_cpu(target, decode_core_pids(proc), prefill_core_pids(proc))
        finally:
            target.client.close()
        return {"prefill_cpu_s": cpu["prefill_cpu_s"],
                "prefill_cpu_probed": time.strftime("%Y-%m-%d %H:%M")}

    _add_disaggregated_probe(model, kind, measure)


def reprobe_loaded_gap(model: str, kind: str) -> None:
    """Adds the loaded-gap probe (`loaded_gap`) to saved runs' disaggregated probes."""
    _add_disaggregated_probe(model, kind, lambda proc, address, raw: {"loaded": {
        **loaded_gap(address, raw["spec"]), "probed": time.strftime("%Y-%m-%d %H:%M")}})


def slo_use_p90(run: dict, slo: bench.SLO) -> float:
    """The 90th percentile of the requests' SLO use over a whole sweep: below 1.0 the
    sweep attained 90%, and lower means further from the knee."""
    return float(np.percentile([slo.use(q["ttft"], q["tpot"], q["status"] == "ok")
                                for v in run.values() for q in v["requests"]], 90,
                                method="higher"))  # no interpolating between infs


def tuned_best(candidates, attained: dict, use_p90: dict):
    """The candidate with the most attained requests; among equals, the one with the
    most headroom. Without the tie-break a sweep that every candidate passes would
    keep the first one, whatever the others could have sustained."""
    return min(candidates, key=lambda c: (-attained[f"{c[0]}x{c[1]}"],
                                          use_p90.get(f"{c[0]}x{c[1]}", 0.0)))


def use_note(colocated: dict, key: str) -> str:
    use = colocated.get("tuning_slo_use_p90", {}).get(key)
    return "" if use is None else f" (p90 SLO use {use:.2f})"


def goodput_of(run: dict) -> float | None:
    return bench.goodput_rate([(float(r), v["summary"]["slo_attainment"])
                               for r, v in run.items()])


def bootstrap(runs: list[dict], draws: int = 2000, seed: int = 0) -> dict:
    """Goodput rate of the pooled attainment curve (every run's requests at each rate
    together: the rate where the expected attainment falls through 90%), with the 95%
    interval of a two-level bootstrap (runs resampled, then requests within each rate
    of each drawn run). A curve that never falls below 90% counts as its highest rate;
    one that starts below counts as 0. Each run's own goodput rate is kept too."""
    rng = np.random.default_rng(seed)
    rates = sorted(float(r) for r in runs[0])
    met = [[np.array([q["met"] for q in run[str(r)]["requests"]], float) for r in rates]
           for run in runs]
    pooled = bench.goodput_rate([(rate, np.concatenate([m[k] for m in met]).mean())
                                 for k, rate in enumerate(rates)]) or 0.0
    values = []
    for _ in range(draws):
        picked = rng.integers(0, len(runs), len(runs))
        curve = []
        for k, rate in enumerate(rates):
            flags = np.concatenate([met[i][k] for i in picked])
            curve.append((rate, rng.choice(flags, flags.size).mean()))
        values.append(bench.goodput_rate(curve) or 0.0)
    lo, hi = np.percentile(values, [2.5, 97.5])
    per_run = [goodput_of(run) or 0.0 for run in runs]
    return {"pooled": pooled, "lo": float(lo), "hi": float(hi), "per_run": per_run,
            "per_run_median": statistics.median(per_run)}


def verdict(a: dict, b: dict, names=("disaggregated", "colocated")) -> str:
    if a["lo"] > b["hi"]:
        return f"{names[0]} higher: the 95% intervals do not overlap"
    if b["lo"] > a["hi"]:
        return f"{names[1]} higher: the 95% intervals do not overlap"
    return "no difference stands out of the noise: the 95% intervals overlap"


def _contention(calib: dict[str, str]) -> dict[str, float]:
    """Each pinned pool's step-time multiplier under its neighbour's load: the
    median ratio of its loaded calibration's points to its own."""
    from jaxdisagg.calibrate import contention

    out = {}
    for pool in ("prefill", "decode"):
        if f"{pool}_loaded" not in calib:
            continue
        phase = "prefill" if pool == "prefill" else "decode"
        alone, loaded = (json.loads(Path(calib[k]).read_text())["pools"][pool]["points"][phase]
                         for k in (pool, f"{pool}_loaded"))
        out[pool] = contention(alone, loaded)
    return out


def _cpu_share(calib: dict[str, str], pool: str) -> dict | None:
    """A pool's calibrated CPU seconds per wall second of its programs (None in older
    calibration files)."""
    return json.loads(Path(calib[pool]).read_text())["pools"][pool]["points"].get("cpu_share")


def request_cores(name: str) -> float:
    """The cores a deployment's per-request host CPU shares with its decode loop
    (`System.request_cores`). The colocated server spans the machine's cores, and its
    front end's threads run beside XLA's: re-analysing the saved runs of 2026-12-04 with
    them shared put 26 of 48 of tiny short's colocated TTFT/TPOT cells within 20%
    against 20 with each admission holding the loop (its goodput error -6% -> +8%), the
    other experiments' colocated cells unchanged but one.
    The disaggregated decode pool is pinned to one core with its router; there sharing
    moved cells both ways (tiny +5, SmolLM2 short -3), so it keeps the hold."""
    return float(os.cpu_count() or 1) if name == "colocated" else 0.0


def loaded_gap_simulated(system, spec: dict, measured: dict) -> float:
    """`loaded_gap` through the simulator: the background prompts arriving at the rate
    the probe measured, the probe's lone requests one after another among them."""
    kind, a, b = spec["prompt"]
    rng = np.random.default_rng(0)
    n_fg, spacing, warm = 8, 0.1, 0.3
    span = warm + n_fg * spacing
    rate = max(measured["background_rps"], 1e-3)
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * span * 2) + 1))
    arrivals = arrivals[arrivals < span]
    plan = [(float(t), int(n), 2) for t, n in zip(
        arrivals, bench.Lengths(kind, a, b).draw(rng, len(arrivals)), strict=True)]
    fg = [(warm + i * spacing, PROBE_SHORT, 64) for i in range(n_fg)]
    records = sim.simulate(system, plan + fg)
    return statistics.median(g for r in records[len(plan):] for g in r.itl[8:56])


def simulated(model: str, spec: dict, seeds, rates, calib: dict[str, str],
              disagg_path: str, colocated_path: str, probes: dict,
              pull_hold_s: float = 0.0, overload_slots: int | None = None
              ) -> tuple[dict, dict]:
    """The same seeds and rates through the simulator: step costs (and the pinned
    pools' contention) from the calibration files, the transfer's bytes from the
    fabric table's loopback row, and the overheads the probes measured (see `probe`):
    each fitted so that the simulated probe equals the measured one."""
    slo = bench.SLO(*spec["slo"])
    m = rl.Model.from_config(get_preset("smollm2-135m" if model == "smollm2" else model), 4)
    costs = {}
    for key, path in calib.items():
        if not key.endswith("_loaded"):
            costs.update(sim.load_calibration(path)[0])
    contended = _contention(calib)
    # The colocated pool's CPU per wall second of a lone request's programs (older
    # calibration files lack it: no per-request charge then).
    colocated_share = _cpu_share(calib, "colocated")
    configs = {"disaggregated": load_config(str(ROOT / disagg_path)),
               "colocated": load_config(colocated_path)}
    out, overheads = {}, {}
    for name, cfg in configs.items():
        def system(it=0.0, token=0.0, admit=0.0, pull=0.0, base=0.0, handoff=0.0, req=0.0,
                   preq=0.0, cfg=cfg, name=name):
            # pull: the cross-process pull's time per prompt token beyond the fabric
            # table's bandwidth, and base its fixed part (the decode thread waits for
            # both); handoff: the offer's way to the decode process (delays only it)
            per_token = m.kv_bytes_per_token / rl.FABRICS["loopback"] + pull
            # The prefill process serves a pull only once it computes nothing
            # (`benchmarks/pull_stall.py`): its pinned core runs XLA or the transfer;
            # runs since `transfer.pull_hold_s` hold the prefill for each pull instead.
            transfer = sim.Transfer(m.kv_bytes_per_token, m.kv_bytes_per_token / per_token,
                                    base_s=base, blocking=True, latency_s=handoff,
                                    stalled_by_prefill=True, pull_hold_s=pull_hold_s)
            return sim.system_from_config(cfg, costs, transfer, it, token, admit, contended,
                                          req, preq, request_cores(name))

        def gap(n, **kw):
            batch = [(0.0, 16, 64)] * n
            return statistics.median(g for r in sim.simulate(system(**kw), batch)
                                     for g in r.itl[8:56])

        def lone_ttft(length, **kw):
            return sim.simulate(system(**kw), [(0.0, length, 2)])[0].ttft

        pr = probes[name]
        slots = pr["slots"]
        itl_batch, itl_lone = gap(slots), gap(1)
        excess_batch = pr["batch_itl_s"] - itl_batch
        if "lone_itl_s" in pr:  # gap(n) - simulated = iteration + n * token
            excess_lone = pr["lone_itl_s"] - itl_lone
            token = max(0.0, (excess_batch - excess_lone) / (slots - 1))
            it = max(0.0, excess_lone - token)
        else:  # an older probe: all of it per token
            token, it = max(0.0, excess_batch) / slots, 0.0
        stage = pr.get("stages_s", {})
        req = 0.0
        share = colocated_share if name == "colocated" else None
        if name == "disaggregated" and "short_cpu_s" in pr:
            # CPU the decode core's processes spent per lone short request, less what the
            # model charges there already: its one decode step with that step's host
            # time, and its pull.
            req = max(0.0, pr["short_cpu_s"] - itl_lone - it - 2 * token
                      - stage.get(f"{PROBE_SHORT}_pull", 0.0))
        elif "short_cpu_s" in pr and share:
            # Colocated, the same process also runs the request's prefill, and XLA's
            # threads may spread the model's work over both cores: its programs' CPU
            # is their simulated time times their measured CPU share (calibration).
            chunk = sim.fit(PROBE_SHORT, sim.buckets(cfg.colocated.chunk_size))
            model_cpu = (share["prefill"] * costs[name].prefill_s(chunk, 0)
                         + share["decode"] * itl_lone)
            req = max(0.0, pr["short_cpu_s"] - model_cpu - it - 2 * token)
        preq = 0.0
        if name == "disaggregated" and "prefill_cpu_s" in pr:
            # The prefill process's CPU per lone short request beyond its one chunk
            # (RPCs, the KV's extraction and offer): it holds the prefill core after
            # the request's last chunk. The process is pinned to one core, so its
            # chunk's CPU is at most its time (a share of 1 unless calibrated).
            p_share = (_cpu_share(calib, "prefill") or {}).get("prefill", 1.0)
            chunk = sim.fit(PROBE_SHORT, sim.buckets(cfg.prefill.chunk_size))
            preq = max(0.0, pr["prefill_cpu_s"] - p_share * costs["prefill"].prefill_s(chunk, 0))
        long_ttft = lone_ttft(PROBE_PROMPT, it=it, token=token, req=req)
        excess_long = pr["idle_ttft_s"] - long_ttft
        admit = pull = base = handoff = 0.0
        pull_from = None
        if "short_ttft_s" in pr:  # TTFT excess = front end + (disaggregated) the handoff
            excess_short = pr["short_ttft_s"] - lone_ttft(PROBE_SHORT, it=it, token=token,
                                                          req=req)
            short, long_ = PROBE_SHORT, PROBE_PROMPT
            if name == "disaggregated" and all(f"{n}_{k}" in stage for n in (short, long_)
                                               for k in ("pull", "transfer")):
                # The server's own timeline: the pull (on the decode thread) at two
                # prompt lengths gives its cost per token and its fixed part; the rest
                # of the transfer stage is the offer's way there. TTFTs alone would
                # also take in any drift of the machine between the probes.
                slope = (stage[f"{long_}_pull"] - stage[f"{short}_pull"]) / (long_ - short)
                base = max(0.0, stage[f"{short}_pull"] - short * slope)
                pull = max(0.0, slope - m.kv_bytes_per_token / rl.FABRICS["loopback"])
                handoff = max(0.0, statistics.median(
                    stage[f"{n}_transfer"] - stage[f"{n}_pull"] for n in (short, long_)))
                pull_from = "stage timeline"
            elif name == "disaggregated":
                pull = max(0.0, (excess_long - excess_short) / (long_ - short))
                pull_from = "TTFT slope"
            admit = max(0.0, excess_short - short * pull - base - handoff)
        elif name == "disaggregated":  # an older probe: all of it in the pull
            pull = max(0.0, excess_long) / PROBE_PROMPT
        overheads[name] = {"iteration_s": it, "token_s": token, "admit_s": admit,
                           "pull_s_per_token": pull, "pull_base_s": base,
                           "handoff_s": handoff, "pull_from": pull_from,
                           "request_s": req, "prefill_request_s": preq, "cpu_share": share,
                           "request_cores": request_cores(name),
                           "calibrated_itl_s": itl_batch,
                           "calibrated_lone_itl_s": itl_lone,
                           "calibrated_idle_ttft_s": long_ttft,
                           "contended": contended if name == "disaggregated" else {}}
        fitted = system(it, token, admit, pull, base, handoff, req, preq)
        if name == "disaggregated" and pr.get("loaded"):
            # The loaded-gap probe, simulated (fitted to nothing: fitting the decode
            # pool's contention to it did not hold up on a fresh run, BENCHMARKS.md).
            overheads[name]["loaded_simulated_s"] = loaded_gap_simulated(fitted, spec,
                                                                         pr["loaded"])
        if overload_slots:  # the overload probe's requests, simulated (nothing fitted)
            overheads[name]["overload_simulated"] = overload_summary(sim.simulate(
                fitted, sim.plan_of(overload_workload(spec, overload_slots))))
        runs = []
        for seed in seeds:
            run = {}
            for k, rate in enumerate(rates):
                wl = workload(spec, rate_seed(seed, k), rate)
                records = sim.simulate(fitted, sim.plan_of(wl))
                run[str(float(rate))] = {"summary": bench.summarize(records, slo),
                                         "requests": per_request(records, slo)}
            runs.append(run)
        out[name] = runs
    return out, overheads


def experiment(model: str, kind: str, repeats: int, tune: bool, restart: bool = True) -> dict:
    exp = EXPERIMENTS[model]
    spec, disagg = exp[kind], exp["config"]
    best = exp["candidates"][1] if model == "tiny" else exp["candidates"][0]  # untuned
    tuning, headroom = {}, {}
    saved = RESULTS / f"goodput_{model}_{kind}.runs.json"
    if not tune and saved.exists():  # the last tuning sweep's choice, and its record
        last = json.loads(saved.read_text())
        if last.get("tuning"):
            best, tuning = tuple(last["best"]), {**last["tuning"],
                                                 "reused from": last["date"]}
            headroom = last.get("tuning_slo_use_p90", {})
            log(f"reusing the tuning sweep of {last['date']}: chunk {best[0]} slots {best[1]}")
    if tune:
        for chunk, slots in exp["candidates"]:
            path = colocated_config(disagg, chunk, slots)
            proc, address = start("serve", "--config", path, "--port", "0")
            try:
                log(f"tuning colocated chunk {chunk} slots {slots}")
                run = sweep(address, spec, 1000, spec["coarse"])
            finally:
                stop(proc)
            key = f"{chunk}x{slots}"
            tuning[key] = sum(q["met"] for v in run.values() for q in v["requests"])
            headroom[key] = slo_use_p90(run, bench.SLO(*spec["slo"]))
            log(f"  attained {tuning[key]} requests, p90 SLO use {headroom[key]:.2f}")
        best = tuned_best(exp["candidates"], tuning, headroom)
    colocated = colocated_config(disagg, *best)
    calib = calibrate(model, kind, disagg, colocated)
    runs = {"disaggregated": [], "colocated": []}
    slots = load_config(str(ROOT / disagg)).decode.max_slots
    probes = None
    overload_slots = max(slots, best[1])
    overloads = {"slots": overload_slots}
    for seed in range(repeats):
        # Fresh servers for every repeat unless asked otherwise: one start of the same
        # launch config served tiny short prompts at TPOT p50 1.6-2.4 ms and another at
        # 5.2-5.4 ms (same rate and seed, an EPYC host, 2026-12-03), so repeats on one
        # start would leave out the largest source of variance. On a Xeon host four
        # starts agreed within 10% (2026-12-04): the restarts cost ~40 s a repeat.
        if seed == 0 or restart:
            launch, d_addr = start("launch", "--config", str(ROOT / disagg), "--port", "0")
            serve, c_addr = start("serve", "--config", colocated, "--port", "0")
        try:
            if probes is None:  # the simulator's inputs: the first start's servers
                probes = {"disaggregated": probe(d_addr, slots, decode_core_pids(launch),
                                                 prefill_core_pids(launch)),
                          "colocated": probe(c_addr, best[1], decode_core_pids(serve))}
                probes["disaggregated"]["loaded"] = loaded_gap(d_addr, spec)
                log(f"probes: {probes}")
                overloads["before"] = overload_both(d_addr, c_addr, spec, overload_slots)
            order = [("disaggregated", d_addr), ("colocated", c_addr)]
            for name, address in order if seed % 2 == 0 else order[::-1]:
                log(f"{model}/{kind} repeat {seed}: {name}")
                runs[name].append(sweep(address, spec, seed, spec["rates"]))
                log(f"  goodput rate {goodput_of(runs[name][-1])}")
            if seed == repeats - 1:
                overloads["after"] = overload_both(d_addr, c_addr, spec, overload_slots)
        except BaseException:
            stop(launch)
            stop(serve)
            raise
        if restart or seed == repeats - 1:
            stop(launch)
            stop(serve)
    raw = RESULTS / f"goodput_{model}_{kind}.runs.json"  # before any analysis can fail
    raw.write_text(json.dumps({"runs": runs, "tuning": tuning, "best": best,
                               "tuning_slo_use_p90": headroom, "spec": spec,
                               "probes": probes, "overload": overloads,
                               "repeats": repeats, "calibration": calib,
                               "servers_restarted_per_repeat": restart,
                               "pull_hold_s": load_config(str(ROOT / disagg)).transfer.pull_hold_s,
                               "date": time.strftime("%Y-%m-%d %H:%M")}))
    return analyse(model, kind)


def recalibrate(model: str, kind: str, names=POOLS) -> None:
    """New calibration files for saved runs (the deployments as they were measured)."""
    path = RESULTS / f"goodput_{model}_{kind}.runs.json"
    raw = json.loads(path.read_text())
    disagg = EXPERIMENTS[model]["config"]
    raw["calibration"] = calibrate(model, kind, disagg, colocated_config(disagg, *raw["best"]),
                                   names)
    path.write_text(json.dumps(raw))


def analyse(model: str, kind: str) -> dict:
    """Statistics, verdict and the simulator's prediction from the saved raw runs."""
    exp = EXPERIMENTS[model]
    spec, disagg = exp[kind], exp["config"]
    raw = json.loads((RESULTS / f"goodput_{model}_{kind}.runs.json").read_text())
    # The workload the runs were made with (the grids move between runs): saved with the
    # runs since 2026-12-04, else in the report's results file from their analysis.
    saved = RESULTS / f"goodput_{model}_{kind}.json"
    if "spec" in raw:
        spec = raw["spec"]
    elif saved.exists():
        spec = json.loads(saved.read_text()).get("spec", spec)
    runs, tuning, best, probes = raw["runs"], raw["tuning"], raw["best"], raw["probes"]
    repeats, calib = raw["repeats"], raw["calibration"]
    seeds = list(range(repeats))
    colocated = colocated_config(disagg, *best)
    stats = {name: bootstrap(r) for name, r in runs.items()}
    # Runs saved before the engine held its prefill for pulls have no hold recorded.
    hold = raw.get("pull_hold_s", 0.0)
    overloads = raw.get("overload")  # runs since 2026-12-07 probe it before and after
    predicted, overheads = simulated(model, spec, seeds, spec["rates"], calib, disagg,
                                     colocated, probes, hold,
                                     overloads["slots"] if overloads else None)
    return {"model": model, "workload": kind, "spec": spec, "repeats": repeats,
            "colocated": {"chunk_size": best[0], "max_slots": best[1], "tuning": tuning,
                          "tuning_slo_use_p90": raw.get("tuning_slo_use_p90", {})},
            "disaggregated_config": disagg, "runs": runs, "goodput": stats,
            "verdict": verdict(stats["disaggregated"], stats["colocated"]),
            "simulated": predicted,
            "simulated_goodput": {n: bootstrap(r) for n, r in predicted.items()},
            "calibration": calib, "probes": probes, "overheads": overheads,
            "overload": overloads,
            "date": raw["date"],
            "machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.machine()}"}


# ---------------------------------------------------------------------- report


def _median(runs: list[dict], rate: str, key: str) -> float | None:
    values = [r[rate]["summary"][key] for r in runs if r[rate]["summary"][key] is not None]
    return statistics.median(values) if values else None


def _err(pred, meas) -> str:
    if pred is None or meas is None or meas == 0:
        return "-"
    return f"{(pred - meas) / meas:+.0%}"


KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def _within(res: dict, tol: float) -> str:
    """How many rate x deployment cells the simulator predicts within `tol`, per metric,
    and the goodput rates' errors."""
    counts = {k: [0, 0] for k in KEYS}
    for rate in (str(float(r)) for r in res["spec"]["rates"]):
        for name in ("disaggregated", "colocated"):
            for key in KEYS:
                mv = _median(res["runs"][name], rate, key)
                pv = _median(res["simulated"][name], rate, key)
                if mv:
                    counts[key][1] += 1
                    counts[key][0] += pv is not None and abs(pv - mv) / mv <= tol
    cells = ", ".join(f"{k.replace('_ms', '').replace('_', ' ')} {a}/{n}"
                      for k, (a, n) in counts.items())
    good = ", ".join(
        f"{name} {_err(res['simulated_goodput'][name]['pooled'], g['pooled'])}"
        for name, g in res["goodput"].items())
    return (f"Simulator within {tol:.0%} of the measurement (rate x deployment cells): "
            f"{cells}. Goodput rate error: {good}. {_goodput_by_run(res)}")


def _goodput_by_run(res: dict) -> str:
    """Each repeat's goodput against the same seed simulated, and whether the pooled
    prediction lies inside the measurement's own interval: the pooled error alone
    cannot tell a biased model from one unusual repeat."""
    parts = []
    for name, g in res["goodput"].items():
        sim_g = res["simulated_goodput"][name]
        errs = ", ".join(_err(p, m) for p, m in zip(sim_g["per_run"], g["per_run"],
                                                    strict=True))
        inside = "inside" if g["lo"] <= sim_g["pooled"] <= g["hi"] else "outside"
        parts.append(f"{name} {errs} by repeat, the pooled prediction {inside} the "
                     "measured 95% interval")
    return "Paired by seed: " + "; ".join(parts) + "."


def _paired(goodput: dict) -> str:
    pairs = zip(goodput["disaggregated"]["per_run"], goodput["colocated"]["per_run"],
                strict=True)
    ratios = [f"{d / c:.2f}x" if c else "undefined (colocated 0)" for d, c in pairs]
    return ", ".join(ratios)


def _overheads(name: str, pr: dict, o: dict) -> str:
    ms = 1e3
    parts = [f"{name}: a lone {PROBE_PROMPT}-token prompt's TTFT {pr['idle_ttft_s'] * ms:.1f} "
             f"ms (calibrated steps alone {o['calibrated_idle_ttft_s'] * ms:.1f})"]
    if "short_ttft_s" in pr:
        parts.append(f"a {PROBE_SHORT}-token one's {pr['short_ttft_s'] * ms:.1f} ms")
    if "lone_itl_s" in pr:
        parts.append(f"a lone request's inter-token gap {pr['lone_itl_s'] * ms:.2f} ms "
                     f"(steps alone {o['calibrated_lone_itl_s'] * ms:.2f})")
    if pr.get("stages_s"):
        parts.append(f"(the server's own stages of the {PROBE_PROMPT}-token one: "
                     + ", ".join(f"{k.split('_', 1)[1]} {v * ms:.1f} ms"
                                 for k, v in pr["stages_s"].items()
                                 if k.startswith(f"{PROBE_PROMPT}_")) + ")")
    if "short_cpu_s" in pr:
        parts.append(f"the processes on the decode core spent {pr['short_cpu_s'] * ms:.1f} "
                     f"ms of CPU per lone {PROBE_SHORT}-token request, "
                     f"{o.get('request_s', 0) * ms:.1f} ms of it beyond the decode step and "
                     "pull (charged to the decode loop per admission)"
                     if name == "disaggregated" else
                     f"the serve process spent {pr['short_cpu_s'] * ms:.1f} ms of CPU per lone "
                     f"{PROBE_SHORT}-token request"
                     + (f"; its programs take {sh['prefill']:.2f} (prefill) and "
                        f"{sh['decode']:.2f} (decode) CPU seconds per second (calibrated), so "
                        f"{o.get('request_s', 0) * ms:.1f} ms of it is beyond the model's work "
                        + (f"(run beside the engine loop, sharing its {c:g} cores)"
                           if (c := o.get("request_cores")) else
                           "(charged to the engine loop per admission)")
                        if (sh := o.get("cpu_share")) else " (prefill included; not charged)"))
    if "prefill_cpu_s" in pr:
        parts.append(f"the prefill process spent {pr['prefill_cpu_s'] * ms:.1f} ms of CPU per "
                     f"lone {PROBE_SHORT}-token request, {o['prefill_request_s'] * ms:.1f} ms "
                     "of it beyond its chunk (charged to the prefill loop after each "
                     "request's last chunk)")
    parts.append(f"a full batch's {pr['batch_itl_s'] * ms:.2f} ms (steps alone "
                 f"{o['calibrated_itl_s'] * ms:.2f}); so {o.get('iteration_s', 0) * ms:.2f} ms "
                 f"of host time per decode iteration, {o['token_s'] * ms:.2f} ms per token "
                 f"emitted, {o.get('admit_s', 0) * ms:.1f} ms in the front end"
                 + (f" and {o['pull_s_per_token'] * 1e6:.0f} us per prompt token of KV pull "
                    "beyond the fabric table's bandwidth"
                    + (f", {o['pull_base_s'] * ms:.1f} ms fixed per pull (both on the decode "
                       f"thread), {o['handoff_s'] * ms:.1f} ms handoff"
                       if o.get("pull_from") == "stage timeline" else "")
                    + (f" (from the {o['pull_from']})" if o.get("pull_from") else "")
                    if "pull_s_per_token" in o else
                    f" and {o['transfer_latency_s'] * ms:.1f} ms of latency per transfer"
                    if name == "disaggregated" else ""))
    if (ld := pr.get("loaded")) and "loaded_simulated_s" in o:
        parts.append(f"a lone request's gap {ld['loaded_itl_s'] * ms:.2f} ms while the prefill "
                     f"core served {ld['background_rps']:.1f} req/s of the workload's prompts "
                     f"({ld['idle_itl_s'] * ms:.2f} ms idle just before; simulated "
                     f"{o['loaded_simulated_s'] * ms:.2f} ms, not fitted)")
    return ", ".join(parts)


def _overload_note(res: dict) -> list[str]:
    """The overload probe before and after the repeats against its simulation."""
    ov = res.get("overload")
    if not ov or "before" not in ov:
        return []
    wl = overload_workload(res["spec"], ov["slots"])

    def fig(o):
        tpot = "-" if o["tpot_p50_s"] is None else f"{o['tpot_p50_s'] * 1e3:.1f}"
        return f"{o['throughput_rps']:.1f} req/s (TPOT p50 {tpot} ms)"

    parts = []
    for name in ("disaggregated", "colocated"):
        seen = [fig(ov[when][name]) + f" at {ov[when][name]['at'][:5]}"
                for when in ("before", "after") if when in ov]
        simulated = res["overheads"][name].get("overload_simulated")
        parts.append(f"{name} {' then '.join(seen)}"
                     + (f", simulated {fig(simulated)}" if simulated else ""))
    return [f"- Overload probe ({wl.requests} requests at {wl.rate:g} req/s, the workload's "
            "lengths, before and after the repeats; a drift check, fitted to nothing): "
            + "; ".join(parts) + "."]


def render(results: list[dict]) -> str:
    out = ["# Disaggregated against colocated: repeated goodput experiments on a 2-core CPU",
           "",
           "Generated by `python benchmarks/disagg_vs_colocated.py` (see its docstring for "
           "the procedure); raw runs in `results/goodput_<model>_<workload>.json`.", "",
           "Goodput rate: where SLO attainment falls through 90%, read off the attainment "
           "curve of all repeats' requests pooled; the interval is a two-level bootstrap "
           "(repeats, then requests). The verdict names a winner only when the two "
           "intervals do not overlap. The simulated column runs the same seeds through "
           "`jaxdisagg simulate` on step costs measured beforehand (see each section).", ""]
    summary = ["| model | workload | SLO (TTFT, TPOT ms) | disaggregated goodput req/s "
               "[95% CI] | colocated goodput req/s [95% CI] | verdict | simulated "
               "disaggregated / colocated (error) |", "|---" * 7 + "|"]
    for res in results:
        g, s = res["goodput"], res["simulated_goodput"]
        d, c = g["disaggregated"], g["colocated"]
        sd, sc = s["disaggregated"]["pooled"], s["colocated"]["pooled"]
        summary.append(
            f"| {res['model']} | {res['workload']} | {res['spec']['slo'][0]}, "
            f"{res['spec']['slo'][1]} | {d['pooled']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}] | "
            f"{c['pooled']:.2f} [{c['lo']:.2f}, {c['hi']:.2f}] | {res['verdict']} | "
            f"{sd:.2f} ({_err(sd, d['pooled'])}) / {sc:.2f} ({_err(sc, c['pooled'])}) |")
    out += summary + [""]
    for res in results:
        spec = res["spec"]
        kind, a, b = spec["prompt"]
        co = res["colocated"]
        out += [f"## {res['model']}, {res['workload']} prompts", "",
                f"{res['date']}, {res['machine']}. {res['repeats']} repeats (seeds 0..."
                f"{res['repeats'] - 1}), {spec['requests']} requests per rate, prompts "
                f"{kind} [{a}, {b}] tokens, {spec['output']} new tokens each, Poisson "
                f"arrivals; SLO TTFT <= {spec['slo'][0]} ms and TPOT <= {spec['slo'][1]} ms.",
                "",
                f"- Disaggregated: `jaxdisagg launch --config {res['disaggregated_config']}`: "
                "prefill pinned to core 0, decode (with the router) to core 1, KV pulled "
                "across processes.",
                f"- Colocated: one `jaxdisagg serve` process free to use both cores, chunk "
                f"{co['chunk_size']}, {co['max_slots']} slots, the decode pool's blocks; "
                "chosen by the tuning sweep: "
                + (", ".join(f"{k}: {v} requests attained" + use_note(co, k)
                             if k != "reused from" else
                             f"(the sweep of {v}, reused)" for k, v in co["tuning"].items())
                   or "not tuned this run") + ".",
                f"- Per-run goodput rates: disaggregated "
                f"{', '.join(f'{v:.2f}' for v in res['goodput']['disaggregated']['per_run'])}; "
                f"colocated "
                f"{', '.join(f'{v:.2f}' for v in res['goodput']['colocated']['per_run'])}; "
                f"paired by seed (same arrivals and prompts), disaggregated / colocated "
                f"{_paired(res['goodput'])}.",
                "- Simulator inputs: each pool's step costs (`jaxdisagg simulate "
                "--calibrate`, pinned as served"
                + (", and again under the other pool's load: contention "
                   + ", ".join(f"{k} x{v:.2f}" for k, v in
                               res["overheads"]["disaggregated"].get("contended", {}).items())
                   if res["overheads"]["disaggregated"].get("contended") else "")
                + "), and probes of the running servers, each overhead fitted so that "
                "the simulated probe equals the measured one: "
                + "; ".join(_overheads(n, res["probes"][n], o)
                            for n, o in res["overheads"].items()) + ".",
                *_overload_note(res),
                "", _within(res, 0.2),
                "", "Measured (median over repeats) against simulated (same seeds), per rate:",
                "", "| rate | deployment | TTFT p50 ms meas / sim | TTFT p99 | TPOT p50 | "
                "TPOT p99 | attainment meas / sim |", "|---" * 7 + "|"]
        for rate in (str(float(r)) for r in spec["rates"]):
            for name in ("disaggregated", "colocated"):
                meas, pred = res["runs"][name], res["simulated"][name]
                cells = []
                for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
                    mv, pv = _median(meas, rate, key), _median(pred, rate, key)
                    cells.append("-" if mv is None else
                                 f"{mv:.0f} / {pv:.0f} ({_err(pv, mv)})" if mv >= 100 else
                                 f"{mv:.1f} / {pv:.1f} ({_err(pv, mv)})")
                att = (_median(meas, rate, "slo_attainment"),
                       _median(pred, rate, "slo_attainment"))
                out.append(f"| {rate} | {name} | " + " | ".join(cells) +
                           f" | {att[0]:.0%} / {att[1]:.0%} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(EXPERIMENTS), default="tiny")
    p.add_argument("--workload", choices=("long", "short", "both"), default="both")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep-servers", action="store_true",
                   help="one start of each deployment for all repeats (before 2026-12-03 "
                        "the only way; a start's own speed then goes unsampled)")
    p.add_argument("--no-tune", action="store_true",
                   help="skip the colocated tuning sweep: reuse the last saved sweep's "
                        "choice, else the default candidate")
    p.add_argument("--report", action="store_true", help="only rewrite the report")
    p.add_argument("--analyse", action="store_true",
                   help="redo the statistics and the simulation from the saved raw runs")
    p.add_argument("--reprobe", nargs="?", const="all",
                   choices=("all", "prefill-cpu", "loaded-gap"),
                   help="with --analyse: probe both deployments' overheads again first "
                        "(prefill-cpu: only add the prefill process's CPU per request; "
                        "loaded-gap: only add the decode gap under served prefill load)")
    p.add_argument("--recalibrate", action="store_true",
                   help="with --analyse: measure the step costs again first")
    p.add_argument("--pools", nargs="+", choices=POOLS, default=POOLS,
                   help="with --recalibrate: only these pools")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.report:
        kinds = ("long", "short") if args.workload == "both" else (args.workload,)
        for kind in kinds:
            if args.analyse and args.recalibrate:
                recalibrate(args.model, kind, tuple(args.pools))
            if args.analyse and args.reprobe == "all":
                reprobe(args.model, kind)
            elif args.analyse and args.reprobe == "prefill-cpu":
                reprobe_prefill_cpu(args.model, kind)
            elif args.analyse and args.reprobe == "loaded-gap":
                reprobe_loaded_gap(args.model, kind)
            res = (analyse(args.model, kind) if args.analyse else
                   experiment(args.model, kind, args.repeats, not args.no_tune,
                              not args.keep_servers))
            path = RESULTS / f"goodput_{args.model}_{kind}.json"
            path.write_text(json.dumps(res, separators=(",", ":")))  # large: per-request records
            log(f"wrote {path}: {res['verdict']}")
    files = sorted(f for f in RESULTS.glob("goodput_*_*.json") if ".runs." not in f.name)
    REPORT.write_text(render([json.loads(f.read_text()) for f in files]))
    print(f"wrote {REPORT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
