"""`jaxdisagg demo`: one workload through the disaggregated engine, then the colocated one.

Boots the engine on a config (by default the real SmolLM2-135M-Instruct, fetched on
first use, on 8 CPU devices; the tiny random preset when it cannot be had), submits
a batch of concurrent chat requests of mixed lengths, streams one answer to the
terminal while the rest run, and prints per-request latency, the KV each one moved
and the pools' peak utilisation; then runs the same workload through the colocated
engine on the same devices and prints the two side by side.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from jaxdisagg.model.sampling import SamplingParams
from jaxdisagg.serve.engine import Engine, Result

TEXT = ("Prefill is compute-bound and decode is bandwidth-bound, so one engine cannot be "
        "sized for both. ")


QUESTIONS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a GPU waiting for memory.",
    "What is 12 times 12?",
    "Give three tips for writing clear code.",
    "Summarize the following and say which phase is compute-bound: " + TEXT * 6,
    "Name the planets of the solar system in order.",
    "What does a chef do?",
    "Translate 'good morning' into French and Spanish.",
    "Why do we sleep? Answer briefly.",
    "Write one sentence about the ocean.",
    "What is the boiling point of water at sea level?",
]


def chat_workload(n: int, seed: int, template) -> list[str]:
    """n chat-formatted prompts (the checkpoint's own template), questions of mixed length."""
    rng = np.random.default_rng(seed)
    order = [0, *rng.permutation(np.arange(1, len(QUESTIONS)))]
    questions = [QUESTIONS[order[i % len(order)]] for i in range(n)]
    return [template.render([{"role": "user", "content": q}]) for q in questions]


def workload(n: int, seed: int, max_prompt: int) -> list[str]:
    """n prompts whose lengths spread log-uniformly from ~16 to `max_prompt` tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(16), np.log(max_prompt), n)).astype(int)
    lengths[0] = max_prompt // 2  # the streamed one: long enough to show the prefill
    return [(f"[{i}] " + TEXT * (1 + L // len(TEXT)))[:L] for i, L in enumerate(lengths)]


class PeakGauges:
    """Samples engine.metrics() in the background; keeps each pool's peaks."""

    def __init__(self, engine: Engine, every_s: float = 0.01):
        self.engine, self.every_s = engine, every_s
        self.peaks: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for pool, gauges in self.engine.metrics()["pools"].items():
                peak = self.peaks.setdefault(pool, {})
                for key in ("slots_used", "kv_blocks_used", "queued_requests",
                            "handoffs_waiting"):
                    if key in gauges:
                        peak[key] = max(peak.get(key, 0), gauges[key])
                peak["kv_blocks_total"] = gauges["kv_blocks_total"]
                if "slots_total" in gauges:
                    peak["slots_total"] = gauges["slots_total"]
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@dataclass
class RunSummary:
    label: str
    results: list[Result]
    wall_s: float
    peaks: dict

    def row(self) -> dict[str, float]:
        def ms(values, q):
            values = sorted(values)
            return 1e3 * values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

        ttft = [r.ttft_s for r in self.results if r.ttft_s is not None]
        tbt = [t for r in self.results for t in r.tbt_s]
        tokens = sum(len(r.token_ids) for r in self.results)
        return {"tok/s": tokens / self.wall_s, "TTFT p50 ms": ms(ttft, 0.5),
                "TTFT p99 ms": ms(ttft, 0.99), "TBT p50 ms": ms(tbt, 0.5),
                "TBT p99 ms": ms(tbt, 0.99), "TBT max ms": ms(tbt, 1.0),
                "E2E p50 ms": 1e3 * statistics.median(r.e2e_s for r in self.results),
                "wall s": self.wall_s}


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "\u00b7" for c in text)


def serve(engine: Engine, prompts: list[str], params: SamplingParams, label: str,
          stream_first: bool, out) -> RunSummary:
    with PeakGauges(engine) as gauges:
        t0 = time.perf_counter()
        rids = [engine.submit(p, params, request_id=f"demo-{i}")
                for i, p in enumerate(prompts[1:], 1)]
        if stream_first:
            print(f"\n{label}: streaming request 0 ({len(prompts[0])} prompt chars) while "
                  f"{len(rids)} others run:\n  ", end="", file=out, flush=True)
            stream = engine.stream(prompts[0], params, request_id="demo-0")
            while True:
                try:
                    _, delta = next(stream)
                except StopIteration as done:
                    first = [done.value]
                    break
                print(_printable(delta), end="", file=out, flush=True)
            print("\n", file=out)
        else:
            first = [engine.result(engine.submit(prompts[0], params, request_id="demo-0"))]
        results = [engine.result(rid) for rid in rids]
        wall = time.perf_counter() - t0
    return RunSummary(label, first + results, wall, gauges.peaks)


def print_requests(summary: RunSummary, out) -> None:
    print(f"{summary.label}: per request", file=out)
    head = (f"  {'req':>6} {'prompt':>6} {'new':>4} {'TTFT ms':>8} {'TBT p50':>8} "
            f"{'TBT max':>8} {'KV moved':>9} {'prefill on':>12} {'decode on':>11}")
    print(head, file=out)
    for r in summary.results:
        tbt = sorted(r.tbt_s)
        print(f"  {r.request_id:>6} {len(r.prompt_ids):>6} {len(r.token_ids):>4} "
              f"{1e3 * (r.ttft_s or 0):>8.1f} "
              f"{1e3 * (tbt[len(tbt) // 2] if tbt else 0):>8.1f} "
              f"{1e3 * (tbt[-1] if tbt else 0):>8.1f} "
              f"{r.transfer_bytes / 1024:>7.0f}KB {r.route.get('prefill', '-'):>12} "
              f"{r.route.get('decode', '-'):>11}", file=out)
    moved = sum(r.transfer_bytes for r in summary.results)
    xfer = [r.timeline["transfer_end"] - r.timeline["transfer_start"]
            for r in summary.results if "transfer_end" in r.timeline]
    if xfer:
        print(f"  KV moved: {moved / 2**20:.1f} MiB in {len(xfer)} transfers, "
              f"first layer out -> all landed: median {1e3 * statistics.median(xfer):.1f} ms",
              file=out)
    print("  pool peaks: " + "; ".join(
        f"{pool} slots {p.get('slots_used', 0):.0f}/{p.get('slots_total', 0):.0f}, "
        f"KV blocks {p['kv_blocks_used']:.0f}/{p['kv_blocks_total']:.0f}"
        if "slots_total" in p else
        f"{pool} queue {p.get('queued_requests', 0):.0f}, "
        f"KV blocks {p['kv_blocks_used']:.0f}/{p['kv_blocks_total']:.0f}"
        for pool, p in summary.peaks.items()), file=out)


def print_side_by_side(runs: list[RunSummary], out) -> None:
    rows = [r.row() for r in runs]
    width = max(len(r.label) for r in runs) + 2
    print("\nsame workload, side by side:", file=out)
    print("  " + " " * 12 + "".join(f"{r.label:>{width}}" for r in runs), file=out)
    for key in rows[0]:
        print(f"  {key:<12}" + "".join(f"{row[key]:>{width}.1f}" for row in rows), file=out)


def print_answers(summary: RunSummary, prompts: list[str], out, width: int = 100) -> None:
    print(f"{summary.label}: answers", file=out)
    for r, prompt in zip(summary.results, prompts, strict=True):
        question = prompt.split("user\n", 1)[-1].split("<|im_end|>", 1)[0]
        answer = " ".join((r.text or "").split())
        print(f"  {r.request_id:>7} Q: {question[:width - 12]}", file=out)
        print(f"  {'':>7} A: {answer[:width - 12]}{'...' if len(answer) > width - 12 else ''}",
              file=out)


def run_demo(config, colocated_config, requests: int, max_tokens: int,
             max_prompt: int, seed: int, out) -> list[RunSummary]:
    """Configs are paths or DeploymentConfigs. A model with a chat template gets questions
    in its own chat format; one without (random presets) gets plain text."""
    params = SamplingParams(max_tokens=max_tokens)
    runs, prompts, chat_template = [], None, None
    for i, (label, cfg) in enumerate([("disaggregated", config),
                                      ("colocated", colocated_config)]):
        if cfg is None:
            continue
        where = cfg if isinstance(cfg, str) else f"{cfg.model.name} on its {cfg.mode} layout"
        print(f"booting the {label} engine from {where} (compiling every program once)",
              file=out, flush=True)
        with Engine.from_config(cfg, progress=True) as engine:
            if prompts is None:
                chat_template = getattr(engine.tokenizer, "chat_template", None)
                prompts = (chat_workload(requests, seed, chat_template) if chat_template
                           else workload(requests, seed, max_prompt))
            warm = engine.generate([prompts[0]], SamplingParams(max_tokens=2))  # first calls
            del warm
            summary = serve(engine, prompts, params, label, stream_first=i == 0, out=out)
        print_requests(summary, out)
        if chat_template is not None:
            print_answers(summary, prompts, out)
        runs.append(summary)
    if len(runs) > 1:
        print_side_by_side(runs, out)
    if chat_template is None:
        print("\n(This model has random weights: the text is noise; the timings are real.)",
              file=out)
    return runs
