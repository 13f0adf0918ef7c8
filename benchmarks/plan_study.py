"""What the simulator predicts for GPUs: the planner's best disaggregated (xPyD) and
colocated deployments for Llama-3-8B and Llama-2-7B on H100 and H200, on a
1,024-GPU cluster, as the TPOT SLO tightens and the prompts lengthen.

    python benchmarks/plan_study.py [--quick]

Step times are the roofline's: the sustained matmul rates of
`jaxdisagg.roofline.HARDWARE`, memory bandwidth at the fraction of the datasheet's that
the GPU check measured as its device copy rate (results/gpu/gpu_e2e_steps.json), plus
a fixed per-call overhead: what a one-row decode step of the calibrated model took on
that GPU beyond its roofline time (results/gpu/calibration_gpu_*.json, from `bash
benchmarks/gpu_check.sh`), or an assumed 2 ms when no task has had a GPU. That step
model is then checked against the whole-model step times the same GPU check measured
on other models, which the calibration did not see. Writes benchmarks/plan_study.md
and results/plan_study.json.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxdisagg import bench, planner  # noqa: E402
from jaxdisagg import roofline as rl  # noqa: E402
from jaxdisagg import simulate as sim  # noqa: E402
from jaxdisagg.mesh.config import load_config  # noqa: E402
from jaxdisagg.model.config import get_preset  # noqa: E402

GPUS = 1024
MODELS = ("llama3-8b", "llama2-7b")
HARDWARE = ("h100-sxm", "h200")
WORKLOADS = {  # prompt lengths, output, TTFT SLO (ms), TPOT SLOs (ms), tight to loose
    "long": (bench.Lengths("uniform", 1024, 3072), 256, 1000, (20, 40, 80, 160)),
    "short": (bench.Lengths("uniform", 64, 256), 256, 400, (20, 160)),
}


GPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu"
ASSUMED_OVERHEAD_S = 2e-3


def hardware(results: Path = GPU_RESULTS) -> tuple[dict[str, rl.Hardware], str]:
    """The study's GPUs: `roofline.HARDWARE`'s sustained matmul rates, and memory
    bandwidth at the fraction of the datasheet's that a GPU check measured (its device
    copy rate, `gpu_e2e.py steps`' ceilings), the same fraction assumed for the other
    Hopper part; the datasheet's where nothing was measured."""
    table = {k: rl.HARDWARE[k] for k in HARDWARE}
    path = results / "gpu_e2e_steps.json"
    meas = json.loads(path.read_text()) if path.exists() else {}
    name = hardware_of(meas.get("device", ""))
    if name is None or "copy_gbs" not in meas.get("ceilings", {}):
        return table, "the datasheets' memory bandwidth (no GPU measurement recorded)"
    copy = meas["ceilings"]["copy_gbs"] * 1e9
    frac = copy / rl.HARDWARE[name].bandwidth
    table = {k: dataclasses.replace(h, bandwidth=h.bandwidth * frac) for k, h in table.items()}
    return table, (f"memory bandwidth at {frac:.0%} of the datasheets': the device copy rate "
                   f"measured on the {meas['device']} ({copy / 1e12:.2f} TB/s, read plus "
                   f"written; {meas.get('date')}), the same fraction assumed for the other GPU")


def overhead(results: Path = GPU_RESULTS, table=None) -> tuple[float, str]:
    """The per-call overhead: what a one-row decode step of our served program took on
    a GPU beyond the roofline's time for its bytes (a GPU calibration's measured
    point, less the roofline at the study's rates for that GPU), else an assumed 2 ms.

    The measured point is read, not the fitted intercept: a fit of four terms to a
    few overlapped steps can put the fixed cost into its per-row term (the 2026-12-04
    calibration's intercept is 1 us, its one-row step 2.3 ms)."""
    files = sorted(results.glob("calibration_gpu_*.json"))
    if not files:
        return ASSUMED_OVERHEAD_S, "2 ms per program call (assumed: no GPU calibration recorded)"
    table = table or hardware(results)[0]
    data = json.loads(files[-1].read_text())
    # Older calibrations name no device; the step times of the same lease do.
    device = data.get("device") or json.loads(
        (results / "gpu_e2e_steps.json").read_text())["device"]
    name = load_config(ROOT / data["config"]).model.name
    costs = sim.RooflineCosts(rl.Model.from_config(get_preset(name), 2),
                              table[hardware_of(device)])
    points = next(iter(data["pools"].values()))["points"]["decode"]
    over = float(np.median([s - costs.decode_s(1, w, w) for a, w, s in points if a == 1]))
    return over, (f"{over * 1e3:.2f} ms per call: a one-row decode step of {name} measured "
                  f"on the {device} less its roofline time ({files[-1].name})")


def hardware_of(device: str) -> str | None:
    """The `roofline.HARDWARE` entry of a device kind ("NVIDIA H200" -> "h200")."""
    return next((k for k, h in rl.HARDWARE.items() if h.rates == "sustained"
                 and h.name.split()[0] in device), None)


def _steps(costs: sim.RooflineCosts, chunk: int, ctx: int) -> dict[str, tuple[str, float]]:
    """{the GPU check's key for a step: (its label, the model's time for it)}."""
    return {"prefill_s": (f"prefill {chunk}", costs.prefill_s(chunk, 0)),
            **{f"decode_b{b}_s": (f"decode B={b}", costs.decode_s(b, b * ctx, ctx))
               for b in (1, 32)}}


def validation(over: float, results: Path = GPU_RESULTS, table=None) -> list[dict]:
    """The study's step model (its rates + `over` per call, and the assumed 2 ms
    beside it) against whole-model step times measured on a GPU: a 512-token prefill
    and decode at B=1 and B=32 over 1024 tokens of context, bf16, tp 1."""
    path = results / "gpu_e2e_steps.json"
    if not path.exists():
        return []
    meas = json.loads(path.read_text())
    hw_name = hardware_of(meas["device"])
    if hw_name is None:
        return []
    table = table or hardware(results)[0]
    rows = []
    for name, m in meas["models"].items():
        cfg = get_preset(name)
        model = rl.Model.from_config(cfg, 2)
        ctx = m.get("context", 1024) + 1
        pred = {f"{o * 1e3:.2f}": _steps(sim.RooflineCosts(
            model, table[hw_name], 1, o, hidden=cfg.hidden_size, layers=cfg.num_layers),
            m["prefill_tokens"], ctx) for o in (over, ASSUMED_OVERHEAD_S)}
        for key, (step, _) in next(iter(pred.values())).items():
            rows.append({"model": name, "hardware": hw_name, "device": meas["device"],
                         "date": meas.get("date"), "step": step, "measured_s": m[key],
                         "predicted_s": {o: v[key][1] for o, v in pred.items()}})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one model, one GPU")
    args = p.parse_args()
    models, hws = (MODELS[:1], HARDWARE[:1]) if args.quick else (MODELS, HARDWARE)
    table, hw_text = hardware()
    over, over_text = overhead(table=table)
    checked = validation(over, table=table)
    search = planner.Search(overhead_s=over)
    rows = []
    for model in models:
        cfg = get_preset(model)
        for hw_name in hws:
            hw = table[hw_name]
            for kind, (prompt, out, ttft, tpots) in WORKLOADS.items():
                wl = bench.Workload(prompt=prompt, output=bench.Lengths("fixed", out), seed=0)
                for tpot in tpots:
                    found = planner.plan(cfg, hw, GPUS, wl, bench.SLO(ttft, tpot), search)
                    rows.append({"model": model, "hardware": hw_name, "workload": kind,
                                 "ttft_ms": ttft, "tpot_ms": tpot, "gain": found.gain,
                                 "seconds": found.seconds, "colocated": found.colocated,
                                 "disaggregated": found.disaggregated})
                    print(f"{model} {hw_name} {kind} TPOT {tpot} ms: gain "
                          f"{found.gain and round(found.gain, 2)} ({found.seconds:.0f} s)",
                          file=sys.stderr, flush=True)
    out = ROOT / "benchmarks" / "results" / "plan_study.json"
    out.write_text(json.dumps({"rows": rows, "overhead": over_text, "hardware": hw_text,
                               "gpus": GPUS,
                               "validation": checked,
                               "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    (ROOT / "benchmarks" / "plan_study.md").write_text(render(rows, over_text, checked, hw_text))
    print(f"wrote {out} and benchmarks/plan_study.md")
    return 0


def _unit(c: dict, d: dict) -> tuple[str, str]:
    col = (f"tp{c['tp']}, chunk {c['chunk']}, {c['slots']} slots" if c.get("tp") else "none")
    dis = (f"{d['prefill']}P(tp{d['prefill_tp']}, chunk {d['chunk']}) : "
           f"{d['decode']}D(tp{d['decode_tp']}, {d['slots']} slots)" if d.get("decode") else
           "none")
    return col, dis


def render(rows: list[dict], over_text: str, checked: list[dict], hw_text: str = "") -> str:
    lines = [
        "# What the simulator predicts on GPUs: xPyD plans for Llama-3-8B and Llama-2-7B",
        "",
        f"Generated by `python benchmarks/plan_study.py` on {time.strftime('%Y-%m-%d')}. "
        f"Each row is one `jaxdisagg simulate --plan` search for a {GPUS}-GPU cluster "
        "(P:D ratios, tp per pool and chunk sizes; see `jaxdisagg/planner.py`). Step "
        "times: the roofline at sustained matmul rates (bf16) and " + (hw_text or
        "the datasheets' memory bandwidth") + ", plus " + over_text + ". Goodput "
        "is the highest request rate with 90% of requests within both SLOs, per GPU.",
        "",
        "These are predictions, not measurements: no GPU ran these deployments. The step "
        "model they rest on is checked against step times measured on a GPU below; on the "
        "2-core CPU the same simulator, calibrated, is checked against measured serving "
        "runs (`benchmarks/disagg_vs_colocated.md`).",
        ""] + render_validation(checked) + [
        "## The plans", "",
        "| model | GPU | prompts | TTFT / TPOT SLO ms | colocated req/s/GPU | "
        "disaggregated req/s/GPU | gain | best colocated | best disaggregated unit | "
        "search s |", "|---" * 10 + "|"]
    for r in rows:
        c, d = r["colocated"], r["disaggregated"]
        col, dis = _unit(c, d)
        gain = "n/a" if r["gain"] is None else f"{r['gain']:.2f}x"
        lines.append(f"| {r['model']} | {r['hardware']} | {r['workload']} | {r['ttft_ms']} / "
                     f"{r['tpot_ms']} | {c['goodput_per_gpu']:.2f} | "
                     f"{d['goodput_per_gpu']:.2f} | {gain} | {col} | {dis} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", "## What it says", ""] + findings(rows)
    return "\n".join(lines) + "\n"


def render_validation(checked: list[dict]) -> list[str]:
    if not checked:
        return ["No GPU step times are recorded, so the step model is unchecked on a GPU.", ""]
    overs = list(checked[0]["predicted_s"])
    lines = [f"## The step model against a GPU ({checked[0]['device']}, "
             f"{checked[0]['date']})", "",
             "Whole-model steps of our served programs (random weights, bf16, Pallas "
             "kernels, calls back to back) measured by `benchmarks/gpu_e2e.py steps`, one "
             "run each, against the study's step model: the roofline at the study's "
             f"`{checked[0]['hardware']}` rates plus a per-call overhead. The "
             "overhead comes from a calibration on another model (Llama-3.2-1B), so these "
             "models are out of sample.", "",
             "| model | step | measured ms | " + " | ".join(
                 f"predicted, {o} ms per call (error)" for o in overs) + " |",
             "|---" * (3 + len(overs)) + "|"]
    for r in checked:
        cells = " | ".join(f"{p * 1e3:.2f} ({p / r['measured_s'] - 1:+.0%})"
                           for p in r["predicted_s"].values())
        lines.append(f"| {r['model']} | {r['step']} | {r['measured_s'] * 1e3:.2f} | {cells} |")
    return lines + [""]


def findings(rows: list[dict]) -> list[str]:
    """The anchors' qualitative results, checked on the rows (stated, not assumed)."""
    out = []
    for model in sorted({r["model"] for r in rows}):
        for hw in sorted({r["hardware"] for r in rows}):
            long = [r for r in rows if (r["model"], r["hardware"], r["workload"]) ==
                    (model, hw, "long") and r["gain"] is not None]
            short = [r for r in rows if (r["model"], r["hardware"], r["workload"]) ==
                     (model, hw, "short") and r["gain"] is not None]
            if not long or not short:
                continue
            by_tpot = sorted(long, key=lambda r: r["tpot_ms"])
            gains = ", ".join(f"{r['gain']:.2f}x at {r['tpot_ms']} ms" for r in by_tpot)
            pairs = zip(by_tpot, by_tpot[1:], strict=False)
            grows = all(a["gain"] >= b["gain"] - 0.02 for a, b in pairs)
            loose_short = max(short, key=lambda r: r["tpot_ms"])
            out.append(
                f"- {model} on {hw}: long prompts, gain {gains}: "
                f"{'grows' if grows else 'does not grow monotonically'} as the TPOT SLO "
                f"tightens. Short prompts with the loose SLO: {loose_short['gain']:.2f}x"
                f"{' (no real gain)' if loose_short['gain'] < 1.1 else ''}.")
    return out


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
