"""Disaggregated against colocated goodput, repeated until the difference shows (or
plainly does not), with the calibrated simulator's prediction beside it.

    python benchmarks/disagg_vs_colocated.py --model tiny --workload long
    python benchmarks/disagg_vs_colocated.py --model smollm2 --workload short --repeats 2
    python benchmarks/disagg_vs_colocated.py --report     # rewrite the .md from results/

One experiment = one model x one workload kind:

1. Calibrate: each pool's step times are measured as it will run (the disaggregated
   pools pinned to one core each, as `launch` pins them; the colocated pool on both)
   and fitted (`jaxdisagg simulate --calibrate`), in subprocesses.
2. Tune the colocated baseline: every candidate chunk size x slot count runs one
   sweep over the coarse rate grid; the one with the most attained requests is kept.
3. Start both deployments and keep them up. Each repeat draws a fresh seed and runs
   every rate of the fine grid on both, the order alternating from repeat to repeat.
4. Goodput rate (where SLO attainment falls through 90%) per deployment, as the
   median of a two-level bootstrap (runs resampled, then requests within each rate)
   with its 95% interval; a verdict only when the intervals do not overlap.
5. Simulate the same seeds on the calibrated costs and put prediction beside
   measurement: TTFT and TPOT p50/p99 per rate and the goodput rate.

Writes benchmarks/results/goodput_<model>_<workload>.json and regenerates
benchmarks/disagg_vs_colocated.md from every such file present.
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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
from jaxdisagg.mesh.config import load_config  # noqa: E402
from jaxdisagg.model.config import get_preset  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REPORT = ROOT / "benchmarks" / "disagg_vs_colocated.md"

# Per model: the disaggregated config, the workload kinds with their SLOs and grids.
# "long" is where the argument expects disaggregation to win (long prompts, a TPOT
# SLO near the bare decode step); "short" where it expects no gain (short prompts,
# a loose SLO).
EXPERIMENTS = {
    "tiny": {
        "config": "configs/cpu-2proc.yaml", "candidates": [(32, 8), (64, 8), (128, 8), (64, 16)],
        "long": {"prompt": ("uniform", 400, 900), "output": 64, "requests": 40,
                 "slo": (500, 15), "coarse": (3, 6, 10), "rates": (3, 4, 5, 6, 7, 8, 10)},
        "short": {"prompt": ("uniform", 16, 64), "output": 64, "requests": 40,
                  "slo": (1000, 40), "coarse": (8, 16, 32), "rates": (6, 9, 12, 15, 18, 24)},
    },
    "smollm2": {
        "config": "configs/cpu-smollm2-2proc.yaml", "candidates": [(64, 8), (128, 8)],
        "long": {"prompt": ("uniform", 300, 600), "output": 24, "requests": 16,
                 "slo": (4000, 150), "coarse": (0.3, 0.6, 1.2),
                 "rates": (0.2, 0.35, 0.5, 0.7, 1.0)},
        "short": {"prompt": ("uniform", 16, 64), "output": 24, "requests": 16,
                  "slo": (4000, 400), "coarse": (0.5, 1.0, 2.0), "rates": (0.5, 1, 1.5, 2, 3)},
    },
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def workload(spec: dict, seed: int) -> bench.Workload:
    kind, a, b = spec["prompt"]
    return bench.Workload(requests=spec["requests"], prompt=bench.Lengths(kind, a, b),
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
    return proc, line.split()[1]


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def calibrate(model: str, disagg: str, colocated: str) -> dict[str, str]:
    """Calibration files per deployment: the pinned pools one per core, the colocated
    pool unpinned."""
    out = {}
    jobs = [("prefill", disagg, "prefill", "0"), ("decode", disagg, "decode", "1"),
            ("colocated", colocated, "colocated", None)]
    for name, config, pool, cores in jobs:
        path = RESULTS / f"calibration_{model}_{name}.json"
        args = ["simulate", "--calibrate", str(path), "--config", config, "--pools", pool]
        if cores is not None:
            args += ["--cores", cores]
        log(f"calibrating {name}")
        proc = cli(*args)
        proc.wait()
        if proc.returncode:
            raise RuntimeError(f"calibrating {name} failed ({proc.returncode})")
        out[name] = str(path)
    return out


def per_request(records: list[bench.Record], slo: bench.SLO) -> list[dict]:
    return [{"ttft": r.ttft, "tpot": r.tpot, "met": slo.met(r), "status": r.status}
            for r in records]


def sweep(address: str, spec: dict, seed: int, rates) -> dict:
    target = bench.ServerTarget(address)
    slo = bench.SLO(*spec["slo"])
    out = {}
    try:
        for rate in rates:
            records = bench.run(target, dataclasses.replace(workload(spec, seed), rate=rate))
            out[str(rate)] = {"summary": bench.summarize(records, slo),
                              "requests": per_request(records, slo)}
    finally:
        target.client.close()
    return out


def goodput_of(run: dict) -> float | None:
    return bench.goodput_rate([(float(r), v["summary"]["slo_attainment"])
                               for r, v in run.items()])


def bootstrap(runs: list[dict], draws: int = 2000, seed: int = 0) -> dict:
    """Goodput rate: median and 95% interval of a two-level bootstrap (runs, then
    requests within each rate of each drawn run). A curve that never falls below 90%
    counts as its highest rate; one that starts below counts as 0."""
    rng = np.random.default_rng(seed)
    rates = sorted(float(r) for r in runs[0])
    met = [[np.array([q["met"] for q in run[str(r)]["requests"]], float) for r in rates]
           for run in runs]
    values = []
    for _ in range(draws):
        picked = rng.integers(0, len(runs), len(runs))
        curve = []
        for k, rate in enumerate(rates):
            flags = np.concatenate([met[i][k] for i in picked])
            curve.append((rate, rng.choice(flags, flags.size).mean()))
        values.append(bench.goodput_rate(curve) or 0.0)
    lo, mid, hi = np.percentile(values, [2.5, 50, 97.5])
    per_run = [goodput_of(run) or 0.0 for run in runs]
    return {"median": float(mid), "lo": float(lo), "hi": float(hi), "per_run": per_run}


def verdict(a: dict, b: dict, names=("disaggregated", "colocated")) -> str:
    if a["lo"] > b["hi"]:
        return f"{names[0]} higher: the 95% intervals do not overlap"
    if b["lo"] > a["hi"]:
        return f"{names[1]} higher: the 95% intervals do not overlap"
    return "no difference stands out of the noise: the 95% intervals overlap"


def simulated(model: str, spec: dict, seeds, rates, calib: dict[str, str],
              disagg_path: str, colocated_path: str) -> dict:
    """The same seeds and rates through the simulator on the calibrated costs."""
    slo = bench.SLO(*spec["slo"])
    m = rl.Model.from_config(get_preset("smollm2-135m" if model == "smollm2" else model), 4)
    transfer = sim.Transfer(m.kv_bytes_per_token, rl.FABRICS["loopback"], 3e-3, blocking=True)
    costs = {}
    for path in calib.values():
        costs.update(sim.load_calibration(path)[0])
    systems = {"disaggregated": sim.system_from_config(load_config(str(ROOT / disagg_path)),
                                                       costs, transfer),
               "colocated": sim.system_from_config(load_config(colocated_path), costs)}
    out = {}
    for name, system in systems.items():
        runs = []
        for seed in seeds:
            run = {}
            for rate in rates:
                wl = dataclasses.replace(workload(spec, seed), rate=rate)
                records = sim.simulate(system, sim.plan_of(wl))
                run[str(rate)] = {"summary": bench.summarize(records, slo),
                                  "requests": per_request(records, slo)}
            runs.append(run)
        out[name] = runs
    return out


def experiment(model: str, kind: str, repeats: int, tune: bool) -> dict:
    exp = EXPERIMENTS[model]
    spec, disagg = exp[kind], exp["config"]
    best = exp["candidates"][1] if model == "tiny" else exp["candidates"][0]
    tuning = {}
    if tune:
        for chunk, slots in exp["candidates"]:
            path = colocated_config(disagg, chunk, slots)
            proc, address = start("serve", "--config", path, "--port", "0")
            try:
                log(f"tuning colocated chunk {chunk} slots {slots}")
                run = sweep(address, spec, 1000, spec["coarse"])
            finally:
                stop(proc)
            tuning[f"{chunk}x{slots}"] = sum(
                q["met"] for v in run.values() for q in v["requests"])
            log(f"  attained {tuning[f'{chunk}x{slots}']} requests")
        best = max(exp["candidates"], key=lambda c: tuning[f"{c[0]}x{c[1]}"])
    colocated = colocated_config(disagg, *best)
    calib = calibrate(model, disagg, colocated)
    runs = {"disaggregated": [], "colocated": []}
    launch, d_addr = start("launch", "--config", str(ROOT / disagg), "--port", "0")
    serve, c_addr = start("serve", "--config", colocated, "--port", "0")
    seeds = list(range(repeats))
    try:
        for seed in seeds:
            order = [("disaggregated", d_addr), ("colocated", c_addr)]
            for name, address in order if seed % 2 == 0 else order[::-1]:
                log(f"{model}/{kind} repeat {seed}: {name}")
                runs[name].append(sweep(address, spec, seed, spec["rates"]))
                log(f"  goodput rate {goodput_of(runs[name][-1])}")
    finally:
        stop(launch)
        stop(serve)
    stats = {name: bootstrap(r) for name, r in runs.items()}
    predicted = simulated(model, spec, seeds, spec["rates"], calib, disagg, colocated)
    return {"model": model, "workload": kind, "spec": spec, "repeats": repeats,
            "colocated": {"chunk_size": best[0], "max_slots": best[1], "tuning": tuning},
            "disaggregated_config": disagg, "runs": runs, "goodput": stats,
            "verdict": verdict(stats["disaggregated"], stats["colocated"]),
            "simulated": predicted,
            "simulated_goodput": {n: bootstrap(r) for n, r in predicted.items()},
            "calibration": calib, "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.machine()}"}


# ---------------------------------------------------------------------- report


def _median(runs: list[dict], rate: str, key: str) -> float | None:
    values = [r[rate]["summary"][key] for r in runs if r[rate]["summary"][key] is not None]
    return statistics.median(values) if values else None


def _err(pred, meas) -> str:
    if pred is None or meas is None or meas == 0:
        return "-"
    return f"{(pred - meas) / meas:+.0%}"


def render(results: list[dict]) -> str:
    out = ["# Disaggregated against colocated: repeated goodput experiments on a 2-core CPU",
           "",
           "Generated by `python benchmarks/disagg_vs_colocated.py` (see its docstring for "
           "the procedure); raw runs in `results/goodput_<model>_<workload>.json`.", ""]
    summary = ["| model | workload | SLO (TTFT, TPOT ms) | disaggregated goodput req/s "
               "[95% CI] | colocated goodput req/s [95% CI] | verdict | simulated "
               "disagg / colocated (error) |", "|---" * 7 + "|"]
    for res in results:
        g, s = res["goodput"], res["simulated_goodput"]
        d, c = g["disaggregated"], g["colocated"]
        sd, sc = s["disaggregated"]["median"], s["colocated"]["median"]
        summary.append(
            f"| {res['model']} | {res['workload']} | {res['spec']['slo'][0]}, "
            f"{res['spec']['slo'][1]} | {d['median']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}] | "
            f"{c['median']:.2f} [{c['lo']:.2f}, {c['hi']:.2f}] | {res['verdict']} | "
            f"{sd:.2f} ({_err(sd, d['median'])}) / {sc:.2f} ({_err(sc, c['median'])}) |")
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
                + (", ".join(f"{k}: {v} requests attained" for k, v in co["tuning"].items())
                   or "not tuned this run") + ".",
                f"- Per-run goodput rates: disaggregated "
                f"{', '.join(f'{v:.2f}' for v in res['goodput']['disaggregated']['per_run'])}; "
                f"colocated "
                f"{', '.join(f'{v:.2f}' for v in res['goodput']['colocated']['per_run'])}.",
                "", "Measured (median over repeats) against simulated (same seeds), per rate:",
                "", "| rate | deployment | TTFT p50 ms meas / sim | TTFT p99 | TPOT p50 | "
                "TPOT p99 | attainment meas / sim |", "|---" * 7 + "|"]
        for rate in (str(r) for r in spec["rates"]):
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
    p.add_argument("--no-tune", action="store_true",
                   help="skip the colocated tuning sweep (use the default candidate)")
    p.add_argument("--report", action="store_true", help="only rewrite the report")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.report:
        kinds = ("long", "short") if args.workload == "both" else (args.workload,)
        for kind in kinds:
            res = experiment(args.model, kind, args.repeats, not args.no_tune)
            path = RESULTS / f"goodput_{args.model}_{kind}.json"
            path.write_text(json.dumps(res, indent=1))
            log(f"wrote {path}: {res['verdict']}")
    files = sorted(RESULTS.glob("goodput_*_*.json"))
    REPORT.write_text(render([json.loads(f.read_text()) for f in files]))
    print(f"wrote {REPORT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
