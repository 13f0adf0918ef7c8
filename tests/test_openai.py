"""The OpenAI-compatible HTTP API, as deployed: `jaxdisagg serve --http-port`, driven by
the official `openai` client (sync, async, streaming) and by raw HTTP.

Greedy text equals the reference generator's; seeded sampling is reproducible; stop
strings, n, logprobs and usage are right; the SSE framing is checked byte for byte;
every error has OpenAI's shape and status; a client that disconnects frees its blocks.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.model.weights import load_model
from jaxdisagg.serve.client import Client

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdisagg.cli", "serve", "--config",
         str(ROOT / "configs/cpu-1p1d.yaml"), "--port", "0", "--http-port", "0",
         "--metrics-port", "0", "--max-requests", "4", "--max-message-bytes", str(2**20)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**env, "JAX_PLATFORMS": "cpu"})
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    words = line.split()
    yield {"grpc": words[1], "url": words[words.index("openai") + 1], "proc": proc}
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"], api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model("tiny")
    return ReferenceGenerator(model), tok


def drained(server, timeout=30):
    with Client(server["grpc"]) as c:
        deadline = time.monotonic() + timeout
        while True:
            m = json.loads(c.info().metrics_json)
            used = {p: g["kv_blocks_used"] for p, g in m["pools"].items()}
            if m["in_flight"] == 0 and not any(used.values()):
                return m
            assert time.monotonic() < deadline, f"not drained: {m['in_flight']}, {used}"
            time.sleep(0.05)


def test_greedy_text_equals_the_reference(client, reference):
    gen, tok = reference
    for prompt in ("Hello, OpenAI", "The roofline says that prefill is compute-bound"):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                      temperature=0)
        want = gen.generate([tok.encode(prompt)], SamplingParams(max_tokens=8))[0]
        assert r.choices[0].text == tok.decode(want)
        assert r.usage.prompt_tokens == len(tok.encode(prompt))
        assert r.usage.completion_tokens == len(want)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.model == "tiny" and r.object == "text_completion"
        extra = r.choices[0].model_extra["jaxdisagg"]
        assert extra["ttft_s"] > 0 and extra["transfer_bytes"] >= 0


def test_token_id_prompts_n_and_seeds(client, reference):
    gen, _ = reference
    prompts = [[256, 1, 2, 3], [256, 40, 41]]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0.9,
                                  seed=5, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    again = client.completions.create(model="tiny", prompt=prompts, max_tokens=6,
                                      temperature=0.9, seed=5, n=2)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # reproducible
    # Choice k of a prompt draws with seed + k: the reference's draw with that seed.
    _, tok = reference
    for j, k in ((0, 0), (1, 1), (2, 0)):
        want = gen.generate([prompts[j // 2]], SamplingParams(temperature=0.9, seed=5 + k,
                                                              max_tokens=6))[0]
        assert r.choices[j].text == tok.decode(want)


def test_stop_strings_echo_and_logprobs(client, reference):
    gen, tok = reference
    prompt = "Hello, OpenAI"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                     temperature=0, logprobs=0)
    text = full.choices[0].text
    lp = full.choices[0].logprobs
    assert len(lp.token_logprobs) == full.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable())
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    echo = client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                     temperature=0, echo=True)
    assert echo.choices[0].text.startswith(prompt)


def _sse_events(raw: bytes) -> list[str]:
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-60:]
    events = raw.decode().split("\n\n")
    assert events[-1] == ""
    for e in events[:-1]:
        assert e.startswith("data: ") and "\n" not in e, e  # one data line per event
    return [e[len("data: "):] for e in events[:-1]]


def test_sse_framing_byte_for_byte(server, reference):
    gen, tok = reference
    body = {"model": "tiny", "prompt": [256, 7, 8], "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server["url"] + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    events = _sse_events(raw)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == tok.decode(gen.generate([[256, 7, 8]], SamplingParams(max_tokens=5))[0])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert len({c["id"] for c in chunks}) == 1


def test_async_client_streams(server, reference):
    gen, tok = reference

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server["url"], api_key="x", max_retries=0)
        pieces = []
        stream = await aclient.completions.create(model="tiny", prompt="async", max_tokens=6,
                                                  temperature=0, stream=True)
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
        await aclient.close()
        return "".join(pieces)

    got = asyncio.run(run())
    assert got == tok.decode(gen.generate([tok.encode("async")],
                                          SamplingParams(max_tokens=6))[0])


@pytest.mark.parametrize("body,status,param", [
    ({"model": "tiny", "prompt": "x", "top_p": 3}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": [256, 999]}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1] * 1020, "max_tokens": 10}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
])
def test_errors_have_the_openai_shape(server, body, status, param):
    r = httpx.post(server["url"] + "/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert err["message"]


def test_other_errors_and_routes(server, client):
    base = server["url"]
    r = httpx.post(base + "/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(base + "/nope", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(base + "/completions", json={"model": "tiny", "prompt": "x" * 2**21},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                "content": "hi"}])
    assert "no chat template" in e.value.body["message"]
    models = client.models.list().data
    assert models[0].id == "tiny" and models[0].model_extra["max_model_len"] == 1024
    root = base.removesuffix("/v1")
    assert httpx.get(root + "/health").json() == {"status": "ok"}
    assert "jaxdisagg_ttft_seconds" in httpx.get(root + "/metrics").text
    ids = httpx.post(root + "/tokenize", json={"prompt": "hi"}).json()["tokens"]
    assert ids == [256, 104, 105]
    assert httpx.post(root + "/detokenize", json={"tokens": ids}).json()["prompt"] == "hi"


def test_full_engine_is_429_and_disconnects_free_blocks(server, client):
    body = {"model": "tiny", "prompt": [256, 3, 4], "max_tokens": 1015, "temperature": 0,
            "stream": True, "ignore_eos": True}
    streams = []
    try:
        for _ in range(4):  # --max-requests 4
            s = httpx.stream("POST", server["url"] + "/completions", json=body, timeout=60)
            chunks = s.__enter__().iter_raw()
            next(chunks)
            streams.append((s, chunks))  # (a dropped iterator would close the stream)
        with Client(server["grpc"]) as c:
            assert json.loads(c.info().metrics_json)["in_flight"] == 4
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.status_code == 429
    finally:
        for s, _ in streams:
            s.__exit__(None, None, None)  # the clients walk away mid-stream
    drained(server)
    # A non-streamed request whose client times out is cancelled too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["url"] + "/completions", timeout=1.0,
                   json={**body, "stream": False})
    drained(server)
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


def test_bench_drives_an_openai_server(server):
    """`jaxdisagg bench --url`: client-side TTFT/ITL from the SSE stream, every token
    counted, our lifecycle breakdown kept."""
    from jaxdisagg import bench

    target = bench.OpenAITarget(server["url"])
    assert target.model == "tiny" and target.vocab == 384
    work = bench.Workload(requests=4, prompt=bench.Lengths("fixed", 20),
                          output=bench.Lengths("fixed", 5), warmup=1)
    records = bench.run(target, work)
    assert all(r.status == "ok" and r.tokens == 5 and r.ttft > 0 for r in records), records
    assert all(len(r.itl) >= 3 and "prefill" in r.stages for r in records)
    summary = bench.summarize(records, bench.SLO.parse("ttft_ms=60000,tpot_ms=60000"))
    assert summary["slo_attainment"] == 1.0


def test_sigterm_drains_http_too(server, client):
    """Last: health and new requests turn away while the process drains and exits."""
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "stopped" in out
