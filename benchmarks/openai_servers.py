"""One workload through the OpenAI API: our two deployments of SmolLM2 against llama.cpp.

    python benchmarks/openai_servers.py [--rounds 3 --requests 8 --rate 1 \
        --prompt 128 --new 32 --llama-python /path/to/venv/bin/python]

Every server runs SmolLM2-135M-Instruct from the same GGUF file (`jaxdisagg fetch
smollm2`) and is started once, all at the same time: jaxdisagg disaggregated
(configs/cpu-smollm2.yaml), jaxdisagg colocated (configs/cpu-smollm2-colocated.yaml)
and, when `--llama-python` names a Python with `llama-cpp-python[server]`, llama.cpp's
OpenAI server (2 threads). Then the same seeded workload (Poisson arrivals, random
token-id prompts, every request generating exactly `--new` tokens) is driven through
`/v1/completions` by `jaxdisagg bench`'s OpenAI target (prompts sent as text, since
llama-cpp-python's server takes no token ids: every server gets the same strings),
round by round with the order of the servers rotated, and every time is taken on the
client from the SSE stream. llama-cpp-python's server runs one request at a time.
Prints medians and ranges over rounds and writes benchmarks/results/openai_servers.json.

What differs: we compute in fp32 on the dequantized weights; llama.cpp computes on the
Q4_1 blocks themselves. Idle servers share the machine's two cores with the one being
measured.
"""

import argparse
import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from common import write_result

from jaxdisagg import bench
from jaxdisagg.model import gguf as gguf_io
from jaxdisagg.model.fetch import fetch
from jaxdisagg.model.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[1]
EOS = 2  # <|im_end|>


def start_ours(config: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "jaxdisagg.cli", "serve", "--config",
                             str(ROOT / "configs" / config), "--port", "0", "--http-port",
                             "0", "--max-requests", "64"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    words = proc.stdout.readline().split()
    if not words or words[0] != "READY":
        raise RuntimeError(f"{config}: the server did not start")
    return proc, words[words.index("openai") + 1]


def start_llama(python: str, gguf: Path, port: int = 8765) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([python, "-m", "llama_cpp.server", "--model", str(gguf),
                             "--port", str(port), "--n_ctx", "2048", "--n_threads", "2",
                             "--model_alias", "smollm2",
                             # Queue requests: by default a new one cuts off the stream
                             # in progress (one request at a time either way).
                             "--interrupt_requests", "False"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(300):
        try:
            if httpx.get(url + "/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama.cpp's server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="new tokens per request")
    ap.add_argument("--llama-python", default=None,
                    help="a Python with llama-cpp-python[server] installed")
    ap.add_argument("--slo", default="ttft_ms=2000,tpot_ms=300")
    args = ap.parse_args()
    gguf = fetch("smollm2")
    reader = gguf_io._reader(gguf)
    tok = HFTokenizer.from_gguf(gguf_io.tokenizer_spec(reader, gguf),
                                gguf_io.config_from_gguf(reader, gguf))
    servers, procs = {}, []
    try:
        for label, config in (("jaxdisagg disaggregated", "cpu-smollm2.yaml"),
                              ("jaxdisagg colocated", "cpu-smollm2-colocated.yaml")):
            proc, url = start_ours(config)
            procs.append(proc)
            servers[label] = bench.OpenAITarget(url, "smollm2", detokenize=tok.decode)
        if args.llama_python:
            proc, url = start_llama(args.llama_python, gguf)
            procs.append(proc)
            servers["llama.cpp (Q4_1)"] = bench.OpenAITarget(
                url, "smollm2", vocab=49152, extra={"logit_bias": {str(EOS): -100}},
                detokenize=tok.decode)
        work = bench.Workload(requests=args.requests, rate=args.rate,
                              prompt=bench.Lengths("fixed", args.prompt),
                              output=bench.Lengths("fixed", args.new), warmup=1)
        slo = bench.SLO.parse(args.slo)
        runs: dict[str, list[dict]] = {k: [] for k in servers}
        labels = list(servers)
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                # New prompts each round (the same for every server within it): each
                # server's prefix cache would otherwise serve rounds 2 on from memory.
                records = bench.run(servers[label], dataclasses.replace(work, seed=r))
                summary = bench.summarize(records, slo)
                runs[label].append(summary)
                if not summary["completed"]:
                    failed = {r.status for r in records}
                    raise RuntimeError(f"{label}: every request failed: {failed}")
                print(f"round {r + 1} {label}: {summary['throughput_tok_s']:.1f} tok/s, "
                      f"TTFT p50 {summary['ttft_p50_ms']:.0f} ms, TPOT p50 "
                      f"{summary['tpot_p50_ms']:.0f} ms, completed {summary['completed']}",
                      file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    keys = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
            "slo_attainment")
    table = {}
    print(f"\n{'metric':<18}" + "".join(f"{k:>34}" for k in runs))
    for key in keys:
        row = []
        for label, summaries in runs.items():
            vals = [s[key] for s in summaries if s.get(key) is not None]
            med = statistics.median(vals) if vals else float("nan")
            table.setdefault(label, {})[key] = {"median": med, "min": min(vals, default=None),
                                                "max": max(vals, default=None)}
            row.append(f"{med:.2f} [{min(vals, default=0):.2f}-{max(vals, default=0):.2f}]")
        print(f"{key:<18}" + "".join(f"{c:>34}" for c in row))
    write_result(str(Path(__file__).parent / "results" / "openai_servers.json"), {
        "args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"), "summary": table, "rounds": runs})


if __name__ == "__main__":
    main()
