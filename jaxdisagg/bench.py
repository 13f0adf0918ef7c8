"""`jaxdisagg bench`: a load generator for the in-process engine or a running server.

Requests arrive all at once, or as a Poisson process (gamma inter-arrival times with
shape `burstiness`: 1 is Poisson, < 1 burstier) at a given rate; prompt and output
lengths are fixed, uniform or lognormal; prompts may share a prefix; everything is
drawn from one seed. Warm-up requests run first and are not counted.

Per request it records TTFT, TPOT ((E2E - TTFT) / (tokens - 1)), every inter-token
gap and E2E, and the lifecycle breakdown (queue, prefill, transfer, decode) from the
engine's timeline. A run reports percentiles, throughput, aborted/failed counts and
goodput under an SLO: requests meeting it per second. A rate sweep gives SLO
attainment against the request rate; the goodput rate is where attainment crosses 90%.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Lengths:
    kind: str  # fixed | uniform | lognormal
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, what: str) -> Lengths:
        """"fixed:N", "uniform:LO:HI" or "lognormal:MEAN:SIGMA" (MEAN in tokens)."""
        parts = text.split(":")
        try:
            kind, nums = parts[0], [float(x) for x in parts[1:]]
        except ValueError:
            raise ValueError(f"{what}: bad number in {text!r}") from None
        want = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if kind not in want or len(nums) != want[kind] or min(nums) <= 0:
            raise ValueError(f"{what}: expected fixed:N, uniform:LO:HI or lognormal:MEAN:SIGMA "
                             f"with positive numbers, got {text!r}")
        return cls(kind, *nums)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            out = np.full(n, self.a)
        elif self.kind == "uniform":
            out = rng.uniform(self.a, self.b, n)
        else:  # a lognormal whose mean is a
            sigma = self.b
            out = rng.lognormal(np.log(self.a) - sigma**2 / 2, sigma, n)
        return np.maximum(1, np.round(out)).astype(int)


@dataclass(frozen=True)
class Workload:
    requests: int = 32
    rate: float | None = None  # requests/s; None: all at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times (1: Poisson)
    prompt: Lengths = Lengths("fixed", 256)
    output: Lengths = Lengths("fixed", 32)
    shared_prefix: int = 0  # tokens every prompt starts with
    seed: int = 0
    warmup: int = 2

    def build(self, vocab: int, first_id: int = 3) -> list[tuple[float, list[int], int]]:
        """(arrival time in s, prompt ids, max tokens) per request, warm-up ones first."""
        rng = np.random.default_rng(self.seed)
        n = self.requests + self.warmup
        prefix = rng.integers(first_id, vocab, self.shared_prefix).tolist()
        prompts = [prefix + rng.integers(first_id, vocab, int(k)).tolist()
                   for k in self.prompt.draw(rng, n)]
        outputs = self.output.draw(rng, n)
        if self.rate is None:
            gaps = np.zeros(n)
        else:
            gaps = rng.gamma(self.burstiness, 1 / (self.rate * self.burstiness), n)
        arrivals = np.concatenate([np.zeros(self.warmup), np.cumsum(gaps[self.warmup:])
                                   - gaps[self.warmup]])
        return [(float(t), p, int(o)) for t, p, o in zip(arrivals, prompts, outputs,
                                                         strict=True)]


@dataclass
class Record:
    prompt_tokens: int
    arrival: float
    status: str = "ok"  # ok | aborted | failed: <why>
    tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    # queue, prefill, transfer (of which pull: on the decode thread), decode
    stages: dict[str, float] = field(default_factory=dict)
    # the server's own marks (`engine.STAGES`, on its clock), the stages' source
    timeline: dict[str, float] = field(default_factory=dict)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


def stages(timeline: dict[str, float]) -> dict[str, float]:
    t = timeline
    out = {}
    if "prefill_start" in t:
        out["queue"] = t["prefill_start"] - t.get("arrival", 0.0)
    if "prefill_start" in t and "prefill_end" in t:
        out["prefill"] = t["prefill_end"] - t["prefill_start"]
    if "prefill_end" in t and "decode_insert" in t:
        out["transfer"] = t["decode_insert"] - t["prefill_end"]  # + waiting for a slot
    if "pull_start" in t and "transfer_end" in t:  # the decode thread's own share of it
        out["pull"] = t["transfer_end"] - t["pull_start"]
    if "decode_insert" in t and "finish" in t:
        out["decode"] = t["finish"] - t["decode_insert"]
    return out


class EngineTarget:
    """Drives an in-process Engine."""

    def __init__(self, engine):
        self.engine = engine
        self.vocab = engine.vocab_size

    def run_one(self, prompt, max_tokens, rec: Record) -> None:
        from jaxdisagg.model.sampling import SamplingParams

        try:
            rid = self.engine.submit(prompt, SamplingParams(max_tokens=max_tokens),
                                     stop_token_ids=[])
        except Exception as e:  # noqa: BLE001 - a refused request is a failed one
            rec.status = f"failed: {type(e).__name__}: {e}"
            return
        r = self.engine.result(rid)
        rec.tokens, rec.ttft, rec.itl, rec.e2e = len(r.token_ids), r.ttft_s, r.tbt_s, r.e2e_s
        rec.timeline = dict(r.timeline)
        rec.stages = stages(rec.timeline)
        if r.finish_reason == "cancelled":
            rec.status = "aborted"
        elif r.finish_reason.startswith("error"):
            rec.status = f"failed: {r.finish_reason}"


class ServerTarget:
    """Drives a running `jaxdisagg serve` (or `launch`) over gRPC; times on the client."""

    def __init__(self, address: str):
        from jaxdisagg.serve.client import Client

        self.client = Client(address)
        self.vocab = int(self.client.info().vocab_size)

    def run_one(self, prompt, max_tokens, rec: Record) -> None:
        import grpc

        start = time.perf_counter()
        times, last = [], None
        try:
            for r in self.client.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
                now = time.perf_counter()
                times += [now] * len(r.token_ids)
                last = r
        except grpc.RpcError as e:
            rec.status = ("aborted" if e.code() == grpc.StatusCode.CANCELLED
                          else f"failed: {e.code().name}")
            return
        rec.tokens = len(times)
        rec.ttft = times[0] - start if times else None
        rec.itl = list(np.diff(times))
        rec.e2e = time.perf_counter() - start
        rec.timeline = dict(last.timings.timeline) if last else {}
        rec.stages = stages(rec.timeline)


class OpenAITarget:
    """Drives any OpenAI-compatible server (ours, llama.cpp's, vLLM's) through
    `/v1/completions` with token-id prompts, streamed; every time is taken on the client
    from the SSE chunks, so servers are compared on equal terms."""

    def __init__(self, url: str, model: str | None = None, vocab: int | None = None,
                 extra: dict | None = None, detokenize=None):
        import httpx

        # Servers that take text only get the workload's ids as text (`detokenize`),
        # so every server compared is sent the same string.
        self.detokenize = detokenize
        # Fields to add to every request. Ours and vLLM take `ignore_eos`; servers
        # without it can ban EOS with a standard `logit_bias` instead.
        self.extra = {"ignore_eos": True} if extra is None else extra
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.http = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0),
                                 limits=httpx.Limits(max_connections=1024))
        models = self.http.get(self.url + "/models").json().get("data", [])
        if not models and model is None:
            raise ValueError(f"--url: {self.url}/models lists no model; pass --model")
        self.model = model or models[0]["id"]
        entry = next((m for m in models if m.get("id") == self.model), {})
        # Our servers say their vocabulary; others need --vocab (ids stay below it).
        self.vocab = vocab or entry.get("vocab_size") or 32000

    def run_one(self, prompt, max_tokens, rec: Record) -> None:
        import json

        if self.detokenize is not None:
            prompt = self.detokenize(prompt)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                **self.extra}
        start = time.perf_counter()
        times, usage, timeline = [], None, {}
        try:
            with self.http.stream("POST", self.url + "/completions", json=body) as r:
                if r.status_code != 200:
                    rec.status = f"failed: HTTP {r.status_code}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.status = f"failed: {chunk['error'].get('message')}"
                        return
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices", []):
                        # One chunk per token (its text may be empty: a character
                        # still incomplete); the finishing chunk carries no token.
                        if choice.get("finish_reason") is None:
                            times.append(time.perf_counter())
                        timeline = (choice.get("jaxdisagg") or {}).get("timeline", timeline)
        except Exception as e:  # noqa: BLE001 - a dropped connection is a failed request
            rec.status = f"failed: {type(e).__name__}"
            return
        rec.tokens = (usage or {}).get("completion_tokens", len(times))
        rec.ttft = times[0] - start if times else None
        rec.itl = list(np.diff(times))
        rec.e2e = time.perf_counter() - start
        rec.timeline = dict(timeline)
        rec.stages = stages(rec.timeline)


def run(target, workload: Workload) -> list[Record]:
    """Submits every request at its arrival time (one thread each); returns the measured
    records (warm-up excluded)."""
    plan = workload.build(target.vocab)
    warm, measured = plan[:workload.warmup], plan[workload.warmup:]
    for _, prompt, out in warm:
        target.run_one(prompt, out, Record(len(prompt), 0.0))
    records = [Record(len(p), t) for t, p, _ in measured]
    threads = []
    t0 = time.perf_counter()
    for (arrival, prompt, out), rec in zip(measured, records, strict=True):
        delay = t0 + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=target.run_one, args=(prompt, out, rec), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return records


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        kwargs = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if key not in ("ttft_ms", "tpot_ms"):
                raise ValueError(f"--slo: unknown key {key!r}; use ttft_ms=..., tpot_ms=...")
            try:
                kwargs[key] = float(value)
            except ValueError:
                raise ValueError(f"--slo: {key} needs a number, got {value!r}") from None
        return cls(**kwargs)

    def met(self, r: Record) -> bool:
        if r.status != "ok":
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1e3 > self.ttft_ms):
            return False
        return self.tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= self.tpot_ms

    def use(self, ttft: float | None, tpot: float | None, ok: bool = True) -> float:
        """How much of its tighter budget a request used (1.0 = exactly at the SLO;
        inf when it failed): the headroom that tells apart two systems that both
        attain every request."""
        if not ok:
            return float("inf")
        parts = [0.0]
        if self.ttft_ms is not None:
            parts.append(float("inf") if ttft is None else ttft * 1e3 / self.ttft_ms)
        if self.tpot_ms is not None and tpot is not None:
            parts.append(tpot * 1e3 / self.tpot_ms)
        return max(parts)


def _pct(values, q):
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else None


def summarize(records: list[Record], slo: SLO) -> dict:
    ok = [r for r in records if r.status == "ok"]
    start = min(r.arrival for r in records)
    span = max((r.arrival + (r.e2e or 0)) for r in records) - start
    out = {"requests": len(records), "completed": len(ok),
           "aborted": sum(r.status == "aborted" for r in records),
           "failed": sum(r.status.startswith("failed") for r in records),
           "duration_s": span, "throughput_tok_s": sum(r.tokens for r in ok) / span,
           "slo": asdict(slo), "slo_attainment": sum(slo.met(r) for r in records) / len(records),
           "goodput_req_s": sum(slo.met(r) for r in records) / span}
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", [r.tpot for r in ok]),
                         ("itl", [g for r in ok for g in r.itl]), ("e2e", [r.e2e for r in ok])):
        values = sorted(v for v in values if v is not None)  # once, not per percentile
        for q in (50, 90, 99):
            v = _pct(values, q)
            out[f"{name}_p{q}_ms"] = None if v is None else v * 1e3
    for stage in ("queue", "prefill", "transfer", "decode"):
        values = [r.stages[stage] for r in ok if stage in r.stages]
        out[f"{stage}_median_ms"] = statistics.median(values) * 1e3 if values else None
    return out


def goodput_rate(sweep: list[tuple[float, float]], target: float = 0.9) -> float | None:
    """The request rate where attainment falls through `target` (linear between points)."""
    sweep = sorted(sweep)
    if not sweep or sweep[0][1] < target:
        return None
    for (r0, a0), (r1, a1) in zip(sweep, sweep[1:], strict=False):
        if a1 < target <= a0:
            return r0 + (a0 - target) / (a0 - a1) * (r1 - r0)
    return sweep[-1][0]  # attained at every rate tried


def plot_sweep(curves: dict[str, list[tuple[float, float]]], path: str, slo: SLO) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, sweep in curves.items():
        sweep = sorted(sweep)
        ax.plot([r for r, _ in sweep], [100 * a for _, a in sweep], "o-", label=label)
    ax.axhline(90, color="grey", ls=":", label="90%")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(f"SLO: TTFT <= {slo.ttft_ms} ms, TPOT <= {slo.tpot_ms} ms")
    ax.set_ylim(0, 105)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


COLUMNS = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
           "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "slo_attainment", "goodput_req_s",
           "aborted", "failed", "queue_median_ms", "prefill_median_ms", "transfer_median_ms",
           "decode_median_ms")


def table(results: dict[str, dict]) -> str:
    names = list(results)
    width = max(14, *(len(n) + 2 for n in names))
    lines = [f"{'':<20}" + "".join(f"{n:>{width}}" for n in names)]
    for col in COLUMNS:
        cells = []
        for n in names:
            v = results[n].get(col)
            cells.append(f"{'-':>{width}}" if v is None else f"{v:>{width}.2f}"
                         if isinstance(v, float) else f"{v:>{width}}")
        lines.append(f"{col:<20}" + "".join(cells))
    return "\n".join(lines)
