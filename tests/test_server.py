"""The gRPC server, as deployed: `jaxdisagg serve` in a subprocess, real clients.

Greedy tokens over the wire equal the reference generator's; health checking and
reflection answer through their standard stubs; every bad request gets the right
status and the server keeps serving; deadlines, client cancels and aborts free
every block; SIGTERM drains and exits.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.model.weights import load_model
from jaxdisagg.serve.client import Client, request
from jaxdisagg.serve.proto import jaxdisagg_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "jaxdisagg"
StatusCode = grpc.StatusCode


class ServerProcess:
    def __init__(self, *args):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        self.proc = subprocess.Popen(
            [str(SCRIPT), "serve", "--port", "0", "--metrics-port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**env, "JAX_PLATFORMS": "cpu"})
        line = self.proc.stdout.readline()  # bounded: the server prints READY or exits
        assert line.startswith("READY"), f"server did not start: {line!r}"
        parts = line.split()
        self.target = parts[1]
        self.metrics_url = parts[3] if len(parts) > 3 else None

    def stop(self, timeout=60) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--config", str(ROOT / "configs/cpu-1p1d.yaml"), "--max-requests", "6",
                        "--max-prompt-tokens", "900", "--max-new-tokens", "300",
                        "--stall-timeout", "2")
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model("tiny")
    return ReferenceGenerator(model), tok


def wait_drained(client, timeout=30):
    """Every request finished, every block of every pool back."""
    deadline = time.monotonic() + timeout
    while True:
        m = json.loads(client.info().metrics_json)
        used = {p: g["kv_blocks_used"] for p, g in m["pools"].items()}
        if m["in_flight"] == 0 and not any(used.values()):
            return m
        assert time.monotonic() < deadline, f"not drained: {m['in_flight']} in flight, {used}"
        time.sleep(0.05)


def test_stubs_are_generated_from_the_proto(tmp_path):
    from jaxdisagg.serve.proto import generate

    for path in generate.generate(tmp_path):
        committed = ROOT / "jaxdisagg/serve/proto" / path.name
        assert path.read_text() == committed.read_text(), (
            f"{committed.name} is stale: run `python -m jaxdisagg.serve.proto.generate`")


def test_greedy_tokens_over_the_wire_equal_the_reference(client, reference):
    gen, tok = reference
    for prompt in ("Hello, gRPC", [256, 5, 6, 7] + list(range(90))):
        got = client.generate(prompt, max_tokens=7)
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        want = gen.generate([ids], SamplingParams(max_tokens=7))[0]
        assert got["token_ids"] == want
        assert got["text"] == tok.decode(want)
        assert got["finish_reason"] in ("length", "stop")
        assert got["timings"].ttft_s > 0 and len(got["timings"].tbt_s) == len(want) - 1
    wait_drained(client)


def test_streaming_sends_tokens_one_response_at_a_time(client):
    responses = list(client.stream([256, 1, 2, 3], max_tokens=5, logprobs=True,
                                   ignore_eos=True))
    assert [len(r.token_ids) for r in responses[:-1]] == [1] * 5
    assert all(len(r.logprobs) == 1 for r in responses[:-1])
    assert responses[0].prompt_tokens == 4
    last = responses[-1]
    assert last.finish_reason == "length" and not last.token_ids
    assert {"arrival", "prefill_end", "decode_insert", "finish"} <= set(last.timings.timeline)


def test_health_and_reflection_through_standard_stubs(server, client):
    assert client.health() == "SERVING"
    assert client.health("jaxdisagg.v1.Generator") == "SERVING"
    with pytest.raises(grpc.RpcError) as e:
        client.health("no.such.Service")
    assert e.value.code() == StatusCode.NOT_FOUND
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]))
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"jaxdisagg.v1.Generator", "grpc.health.v1.Health"} <= names


def test_info_reports_model_config_and_pools(client):
    info = client.info()
    assert info.model == "tiny" and info.mode == "disaggregated"
    assert info.max_context == 1024 and info.vocab_size == 384
    assert json.loads(info.config_json)["decode"]["tp"] == 4
    assert set(json.loads(info.metrics_json)["pools"]) == {"prefill[0]", "decode[0]"}


BAD = [
    ("no prompt", pb.GenerateRequest(), StatusCode.INVALID_ARGUMENT, "prompt: set text"),
    ("empty text", request(""), StatusCode.INVALID_ARGUMENT, "prompt: must not be empty"),
    ("empty ids", request([]), StatusCode.INVALID_ARGUMENT, "prompt: must not be empty"),
    ("id past vocab", request([256, 384]), StatusCode.INVALID_ARGUMENT, "outside the vocab"),
    ("negative id", request([256, -3]), StatusCode.INVALID_ARGUMENT, "outside the vocab"),
    ("huge id", request([2**62]), StatusCode.INVALID_ARGUMENT, "outside the vocab"),
    ("prompt over limit", request([1] * 950), StatusCode.INVALID_ARGUMENT, "limit of 900"),
    ("text over limit", request("x" * 1000), StatusCode.INVALID_ARGUMENT, "limit of 900"),
    ("past the context", request([1] * 800, max_tokens=290), StatusCode.INVALID_ARGUMENT,
     "exceed the context"),
    ("max_tokens 0", request("a", max_tokens=0), StatusCode.INVALID_ARGUMENT,
     "sampling.max_tokens"),
    ("max_tokens negative", request("a", max_tokens=-5), StatusCode.INVALID_ARGUMENT,
     "sampling.max_tokens"),
    ("max_tokens absurd", request("a", max_tokens=10**9), StatusCode.INVALID_ARGUMENT,
     "limit of 300"),
    ("temperature negative", request("a", temperature=-1.0), StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    ("temperature nan", request("a", temperature=float("nan")), StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    ("top_p zero", request("a", top_p=0.0), StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    ("top_p above 1", request("a", top_p=1.5), StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    ("top_k negative", request("a", top_k=-1), StatusCode.INVALID_ARGUMENT, "sampling.top_k"),
    ("seed negative", request("a", seed=-1), StatusCode.INVALID_ARGUMENT, "sampling.seed"),
    ("empty stop string", request("a", stop=[""]), StatusCode.INVALID_ARGUMENT,
     "sampling.stop"),
    ("stop id past vocab", request("a", stop_token_ids=[5000]), StatusCode.INVALID_ARGUMENT,
     "stop_token_ids"),
    ("id too long", request("a", request_id="x" * 129), StatusCode.INVALID_ARGUMENT,
     "request_id: must be 1 to 128 characters"),
    ("id in the server namespace", request("a", request_id="jd-0123"),
     StatusCode.INVALID_ARGUMENT, "request_id: ids starting with 'jd-'"),
    ("id with odd characters", request("a", request_id="a\nb"), StatusCode.INVALID_ARGUMENT,
     "request_id: only letters"),
    ("stop strings too big", request("a", stop=["x" * 3000, "y" * 3000]),
     StatusCode.INVALID_ARGUMENT, "sampling.stop: 6000 bytes"),
    ("text over the byte cap", request("\u00e9" * 200_000), StatusCode.INVALID_ARGUMENT,
     "prompt: 400000 bytes exceed the limit of 262144"),
]


@pytest.mark.parametrize("name,req,code,message", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_the_right_status(client, name, req, code, message):
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(req, timeout=30))
    assert e.value.code() == code, e.value.details()
    assert message in e.value.details()


def test_garbage_bytes_unknown_abort_and_server_keeps_serving(client):
    raw = client.channel.unary_stream("/jaxdisagg.v1.Generator/Generate",
                                      request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
    for garbage in (b"\xff\xfe\xfd\x00garbage", b"\x0a\xff\xff\xff\xff\x0f"):
        with pytest.raises(grpc.RpcError) as e:
            list(raw(garbage, timeout=30))
        assert e.value.code() == StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        client.abort("no-such-request")
    assert e.value.code() == StatusCode.NOT_FOUND
    assert client.generate([256, 1], max_tokens=2)["finish_reason"]
    wait_drained(client)


def test_wide_seeds_and_huge_top_k_serve_beside_their_neighbours(server, client, reference):
    """seed in [2^31, 2^63) and top_k >= 2^31 used to overflow inside the prefill step and
    fail every request pending there (UNAVAILABLE) instead of being served."""
    gen, _ = reference
    neighbour = [256] + list(range(60))
    got = {}

    def run(key, **kw):
        with Client(server.target) as c:
            got[key] = c.generate(neighbour if key == "n" else [256, 7, 8], max_tokens=5,
                                  **kw)

    threads = [threading.Thread(target=run, args=("n",)),
               threading.Thread(target=run, args=("seed",),
                                kwargs=dict(temperature=0.9, seed=2**31 + 3)),
               threading.Thread(target=run, args=("seed63",),
                                kwargs=dict(temperature=0.9, seed=2**63 - 1)),
               threading.Thread(target=run, args=("top_k",),
                                kwargs=dict(temperature=0.9, top_k=2**31, seed=1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got["n"]["token_ids"] == gen.generate([neighbour], SamplingParams(max_tokens=5))[0]
    want = gen.generate([[256, 7, 8]], SamplingParams(temperature=0.9, seed=2**31 + 3,
                                                      max_tokens=5))[0]
    assert got["seed"]["token_ids"] == want
    assert all(len(g["token_ids"]) for g in got.values())
    wait_drained(client)


def test_abort_checks_the_id_and_echoes_nothing_large(client):
    with pytest.raises(grpc.RpcError) as e:
        client.abort("x" * 2**20)
    assert e.value.code() == StatusCode.INVALID_ARGUMENT
    assert len(e.value.details()) < 200
    with pytest.raises(grpc.RpcError) as e:
        client.abort("jd-" + "0" * 32)  # a well-formed id nobody holds
    assert e.value.code() == StatusCode.NOT_FOUND


def test_server_ids_are_unguessable(client):
    ids = {client.generate([256, 1], max_tokens=1)["request_id"] for _ in range(5)}
    assert len(ids) == 5 and all(re.fullmatch(r"jd-[0-9a-f]{32}", i) for i in ids)


def test_a_client_that_stops_reading_is_cut_off(server, client):
    """A raw HTTP/2 client that grants a 64-byte window and never reads more: the
    server's sends block once the window is full. After --stall-timeout (2 s here)
    the stream is cancelled and its blocks come back, though the client never reads."""
    import socket

    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    host, port = server.target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 64})
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", host),
                            (":path", "/jaxdisagg.v1.Generator/Generate"),
                            ("content-type", "application/grpc"), ("te", "trailers")])
    body = request([256, 4, 5], max_tokens=300, ignore_eos=True,
                   request_id="slow-reader").SerializeToString()
    conn.send_data(sid, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    sock.sendall(conn.data_to_send())
    try:
        reset, deadline, received, trailers = None, time.monotonic() + 60, 0, None
        while reset is None and time.monotonic() < deadline:
            data = sock.recv(65536)  # frames are parsed; no WINDOW_UPDATE is ever sent
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    received += len(event.data)
                if isinstance(event, h2.events.TrailersReceived):
                    trailers = dict(event.headers)
                if isinstance(event, (h2.events.StreamReset, h2.events.StreamEnded)) \
                        and event.stream_id == sid:
                    reset = event
            sock.sendall(conn.data_to_send())  # settings acks only
        assert received <= 64  # the window held: it never read more
        # Cut off: the stream ends CANCELLED (or is reset), long before 300 tokens.
        assert isinstance(reset, h2.events.StreamReset) or \
            (trailers or {}).get(b"grpc-status") == b"1", (reset, received, trailers)
        # The engine may well have finished all 300 tokens meanwhile (it never waits for a
        # reader); what the cut frees is the handler thread, and nothing is held.
        wait_drained(client)
    finally:
        sock.close()


def test_fuzz_the_wire(client, reference):
    """Random requests: each gets OK or INVALID_ARGUMENT naming the field; afterwards the
    server is healthy, holds nothing, and a known request gives the same tokens."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    fields = re.compile(r"(sampling\.\w+|prompt|request_id|stop_token_ids|request)\b")

    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
    @given(text=st.one_of(st.none(), st.text(max_size=30)),
           ids=st.lists(st.integers(-2**63, 2**63 - 1), max_size=5),
           max_tokens=st.one_of(st.none(), st.integers(-2**31, 4)),
           temperature=st.one_of(st.none(), st.floats(width=32)),
           top_k=st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
           top_p=st.one_of(st.none(), st.floats(width=32)),
           seed=st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
           stop=st.lists(st.text(max_size=5), max_size=3),
           stop_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=3),
           request_id=st.one_of(st.just(""), st.text(max_size=20)))
    def one(text, ids, max_tokens, temperature, top_k, top_p, seed, stop, stop_ids,
            request_id):
        req = request(text if text is not None else ids, max_tokens=max_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      stop=stop, stop_token_ids=stop_ids, request_id=request_id)
        try:
            responses = list(client.stub.Generate(req, timeout=60))
        except grpc.RpcError as e:
            assert e.code() == StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert fields.match(e.details()), e.details()
            return
        assert responses[-1].finish_reason in ("stop", "length")

    one()
    assert client.health() == "SERVING"
    wait_drained(client)
    gen, _ = reference
    prompt = [256] + list(range(40))
    assert client.generate(prompt, max_tokens=5)["token_ids"] == \
        gen.generate([prompt], SamplingParams(max_tokens=5))[0]


def test_abort_ends_the_stream_and_frees_blocks(client):
    stream = client.stream([256] + list(range(100)), max_tokens=300, ignore_eos=True,
                           request_id="to-abort")
    first = next(stream)
    assert first.request_id == "to-abort"
    client.abort("to-abort")
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled"
    wait_drained(client)


def test_deadline_and_client_cancel_free_blocks(client):
    with pytest.raises(grpc.RpcError) as e:
        list(client.stream([256] + list(range(200)), max_tokens=300, ignore_eos=True,
                           timeout=0.5))
    assert e.value.code() == StatusCode.DEADLINE_EXCEEDED
    wait_drained(client)
    call = client.stream([256, 9, 9], max_tokens=300, ignore_eos=True)
    next(call)
    call.cancel()  # the client walks away mid-stream
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == StatusCode.CANCELLED
    wait_drained(client)


def test_full_queue_is_resource_exhausted(client):
    """...while health and Info still answer at once: streams are capped below the thread
    pool (a single non-reading client once made health checks fail for everyone)."""
    calls = [client.stream([256, i], max_tokens=300, ignore_eos=True) for i in range(6)]
    firsts = [next(c) for c in calls]  # six in flight: router.max_requests from --max-requests
    assert len(firsts) == 6
    with pytest.raises(grpc.RpcError) as e:
        client.generate([256, 1], max_tokens=2)
    assert e.value.code() == StatusCode.RESOURCE_EXHAUSTED
    with Client(client.channel._channel.target().decode()) as other:
        t0 = time.monotonic()
        assert other.health() == "SERVING"
        assert other.info().model == "tiny"
        assert time.monotonic() - t0 < 5
    for c in calls:
        c.cancel()
    wait_drained(client)
    assert client.generate([256, 1], max_tokens=2)["finish_reason"]


def test_concurrent_clients_get_their_own_tokens(server, reference):
    gen, _ = reference
    prompts = [[256] + list(range(i, i + 5 + 9 * i)) for i in range(5)]
    want = gen.generate(prompts, SamplingParams(max_tokens=6))
    got = [None] * len(prompts)

    def run(i):
        with Client(server.target) as c:
            got[i] = c.generate(prompts[i], max_tokens=6)["token_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == want


def test_prometheus_metrics(server, client):
    client.generate([256] + list(range(70)), max_tokens=4)
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    for name in ("jaxdisagg_ttft_seconds_count", "jaxdisagg_inter_token_seconds_bucket",
                 "jaxdisagg_e2e_seconds_sum", 'jaxdisagg_requests_total{finish_reason="length"}',
                 'jaxdisagg_pool_kv_blocks_used{pool="decode[0]"}',
                 'jaxdisagg_pool_slots_used{pool="decode[0]"}',
                 'jaxdisagg_pool_queued_requests{pool="prefill[0]"}',
                 'jaxdisagg_pool_prefix_hit_rate{pool="prefill[0]"}',
                 "jaxdisagg_transfer_bytes_total", "jaxdisagg_requests_in_flight",
                 "jaxdisagg_transfer_seconds_count", "jaxdisagg_transfer_failures_total"):
        assert name in text, name
    moved = [ln for ln in text.splitlines() if ln.startswith("jaxdisagg_transfer_bytes_total")]
    assert float(moved[0].split()[-1]) > 0


def test_sigterm_drains_and_exits(server, client):
    """Last: a request in flight finishes, then the server stops."""
    stream = client.stream([256, 3, 4], max_tokens=40, ignore_eos=True)
    next(stream)
    code, out = server.stop()
    assert code == 0 and "draining" in out and "stopped" in out
    assert list(stream)[-1].finish_reason == "length"  # drained, not cut


def test_a_drain_that_hangs_is_dumped_and_ended():
    """The stop watchdog: a process whose drain never ends still exits, once its grace
    and margin are spent, and its stderr says where every thread was stuck."""
    code = ("import os, signal, threading, time\n"
            "from jaxdisagg.serve.server import StopSignals\n"
            "stop = StopSignals(grace=0.5, margin_s=1.0)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "stop.wait()\n"
            "threading.Event().wait()  # a drain stuck for good\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60
    assert "Timeout (0:00:01" in proc.stderr and "Thread" in proc.stderr, proc.stderr
    assert "threading.py" in proc.stderr  # the stuck wait, in the dump
