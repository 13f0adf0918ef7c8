"""Pools in separate processes (configs/cpu-2proc.yaml), as `jaxdisagg launch` runs them.

Greedy tokens over the wire equal the reference generator's; the pools are pinned to
different cores; cancels and an abort storm leak nothing on either pool; and the
faults are bounded in time: a prefill process that dies turns into UNAVAILABLE, and
offers a decode process never pulls are freed when their lease ends.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from jaxdisagg.mesh.control import ControlClient
from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.model.weights import load_model
from jaxdisagg.serve.client import Client

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "cpu-2proc.yaml"


def start(*args, env=None, stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxdisagg.cli", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**base, "JAX_PLATFORMS": "cpu", **(env or {})})
    line = proc.stdout.readline()  # bounded: READY or the process exits
    assert line.startswith("READY"), f"{args[:3]} did not start: {line!r}"
    return proc, line


def stop(proc, timeout=90) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return out


def drained(client, timeout=30) -> dict:
    """Nothing in flight; no KV block used on the decode pool or (remotely) the prefill
    pool; no offer held by the prefill process."""
    deadline = time.monotonic() + timeout
    while True:
        m = json.loads(client.info().metrics_json)
        pre, dec = m["pools"]["prefill[0]"], m["pools"]["decode[0]"]
        if (m["in_flight"] == 0 and dec["kv_blocks_used"] == 0 and pre["kv_blocks_used"] == 0
                and pre["offers_held"] == 0 and not pre["queued_requests"]):
            return m
        assert time.monotonic() < deadline, f"not drained: {m}"
        time.sleep(0.1)


@contextlib.contextmanager
def roles(config=CONFIG, prefills=1, control_port=None, env=None,
          stderr=lambda: subprocess.DEVNULL):
    """Prefill process(es) and a decode process fronting them, killed at the end;
    `stderr()` gives each process's standard error.

    Yields a namespace: procs (every process started, tests append restarts),
    prefills, addresses, decode, decode_address, client.
    """
    procs = []
    try:
        addresses = []
        for _ in range(prefills):
            port = ["--control-port", control_port] if control_port else []
            proc, line = start("serve", "--config", config, "--role", "prefill", *port,
                               env=env, stderr=stderr())
            procs.append(proc)
            addresses.append(line.split()[1])
        decode, dline = start("serve", "--config", config, "--role", "decode", "--prefill",
                              ",".join(addresses), "--port", 0, env=env, stderr=stderr())
        procs.append(decode)
        with Client(dline.split()[1]) as client:
            yield SimpleNamespace(procs=procs, prefills=procs[:-1], addresses=addresses,
                                  decode=decode, decode_address=dline.split()[1],
                                  client=client)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def short_lease(tmp_path) -> Path:
    cfg = tmp_path / "short-lease.yaml"
    cfg.write_text(CONFIG.read_text().replace("lease_s: 30", "lease_s: 2"))
    return cfg


@pytest.fixture(scope="module")
def reference():
    model, _ = load_model("tiny")
    return ReferenceGenerator(model)


@pytest.fixture(scope="module")
def launched():
    proc, line = start("launch", "--config", CONFIG, "--port", 0)
    yield proc, line.split()[1], line
    if proc.poll() is None:  # a failed test left it running: its pools go with it
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(launched):
    with Client(launched[1]) as c:
        yield c


def test_greedy_tokens_across_processes_equal_the_reference(client, reference):
    prompts = [[256, 1, 2, 3], [256] + list(range(150)), [256] + list(range(40, 80))]
    for prompt in prompts:
        got = client.generate(prompt, max_tokens=6)
        assert got["token_ids"] == reference.generate([prompt], SamplingParams(max_tokens=6))[0]
        assert got["timings"].transfer_bytes > 0  # the KV crossed between the processes
    info = client.info()
    assert info.mode == "disaggregated" and json.loads(info.config_json)["transfer"][
        "kind"] == "cross_process"
    drained(client)


def test_nothing_compiles_after_ready_across_processes(tmp_path):
    """Each pool process compiles every program it serves with before it says READY,
    its half of the KV transfer included: requests of 1 to 10 pages (new page buckets
    each) then compile nothing, with JAX logging every program it lowers."""
    logs = []

    def log_file():
        logs.append(tmp_path / f"stderr{len(logs)}")
        return logs[-1].open("w")

    with roles(env={"JAX_LOG_COMPILES": "1"}, stderr=log_file) as r:
        at_ready = [len(p.read_text()) for p in logs]
        assert all("Compiling" in p.read_text() for p in logs)  # the log works
        for n in (3, 20, 40, 70, 150):
            r.client.generate([256] + list(range(n)), max_tokens=4)
        after = [p.read_text()[at:] for p, at in zip(logs, at_ready, strict=True)]
    compiled = [line for text in after for line in text.splitlines() if "Compiling" in line]
    assert compiled == [], compiled


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_launch_stops_while_its_pools_start():
    """SIGTERM while the first pool still compiles ends `launch` then, with status 143
    and its pool process gone; it used to wait for every pool to come up, print READY,
    and only then drain."""
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxdisagg.cli", "launch", "--config",
                             str(CONFIG), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env={**base, "JAX_PLATFORMS": "cpu"})
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 30
    while not children.read_text().split():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    pools = [int(p) for p in children.read_text().split()]
    time.sleep(1.0)  # the prefill process is importing JAX or compiling: far from READY
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and "READY" not in out
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pools):
        assert time.monotonic() < deadline, "a pool process outlived its launcher"
        time.sleep(0.1)


def test_pools_are_pinned_to_different_cores(launched):
    _, _, line = launched
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        assert "not pinned" in line
        return
    pids = [int(line.split(f"{role} pid ")[1].split()[0]) for role in ("prefill", "decode")]
    prefill, decode = (os.sched_getaffinity(pid) for pid in pids)
    # Two disjoint halves of this host's cores (one each on 2 cores).
    assert prefill and decode and not prefill & decode and prefill | decode == mine
    assert len(prefill) == len(mine) // 2


def test_pool_cores_halve_the_host():
    from jaxdisagg.cli import pool_cores

    assert pool_cores({5}) == ([5], [5])
    assert pool_cores({0, 1}) == ([0], [1])
    assert pool_cores({3, 0, 2}) == ([0], [2, 3])
    assert pool_cores(range(16)) == (list(range(8)), list(range(8, 16)))


def test_abort_storm_leaks_nothing(client, reference):
    rng = random.Random(0)
    calls = []
    for i in range(200):
        prompt = [256] + [rng.randrange(256) for _ in range(rng.randrange(1, 150))]
        calls.append(client.stream(prompt, max_tokens=rng.randrange(1, 60), ignore_eos=True,
                                   request_id=f"storm-{i}"))
        if rng.random() < 0.7:
            time.sleep(rng.random() * 0.02)
            if rng.random() < 0.5:
                calls[-1].cancel()  # the client walks away
            else:
                _abort(client, f"storm-{i}")
    for call in calls:
        try:
            list(call)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, (call, e.code(), e.details())
    drained(client, timeout=60)
    prompt = [256, 7, 7, 7]
    assert client.generate(prompt, max_tokens=4)["token_ids"] == reference.generate(
        [prompt], SamplingParams(max_tokens=4))[0]


def _abort(client, rid):
    try:
        client.abort(rid)
    except grpc.RpcError as e:  # it may not have reached the engine yet, or be done
        assert e.code() == grpc.StatusCode.NOT_FOUND


def test_launch_drains_on_sigterm(launched, client):
    proc = launched[0]
    stream = client.stream([256, 1, 2], max_tokens=30, ignore_eos=True)
    next(stream)
    out = stop(proc)
    assert proc.returncode == 0 and "draining" in out and "stopped" in out
    assert list(stream)[-1].finish_reason == "length"


def test_prefill_process_killed_gives_unavailable_not_a_hang():
    with roles() as r:
        client = r.client
        assert client.generate([256, 1, 2], max_tokens=3)["finish_reason"] == "length"
        r.prefills[0].kill()
        r.prefills[0].wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            client.generate([256] + list(range(100)), max_tokens=5, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill pool unavailable" in e.value.details()
        assert time.monotonic() - t0 < 20
        m = json.loads(client.info().metrics_json)
        assert m["in_flight"] == 0 and m["pools"]["decode[0]"]["kv_blocks_used"] == 0
        assert m["pools"]["prefill[0]"]["reachable"] == 0


def test_offers_never_pulled_are_freed_within_the_lease(tmp_path):
    prefill, line = start("serve", "--config", short_lease(tmp_path), "--role", "prefill")
    try:
        control = ControlClient(line.split()[1])
        reply = control.call("prefill", {
            "request_id": "orphan", "prompt": [256] + list(range(90)),
            "params": {"max_tokens": 8}, "stop_ids": []}, timeout=60)
        assert reply["offers"], reply  # offered, and the decode side "dies" before pulling
        # 91 tokens = 6 pages of 16, offered as runs of 4 + 2 pages: two offers
        assert len(reply["offers"]) == 2
        assert control.call("stats", {})["gauges"]["offers_held"] == 2
        t0 = time.monotonic()
        while control.call("stats", {})["gauges"]["offers_held"]:
            assert time.monotonic() - t0 < 6, "the lease did not free the offer"
            time.sleep(0.2)
        gauges = control.call("stats", {})["gauges"]
        assert gauges["kv_blocks_used"] == 0 and gauges["queued_requests"] == 0
        control.close()
    finally:
        stop(prefill)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prefill_pool_restarted_serves_again(reference):
    port = free_port()
    with roles(control_port=port) as r:
        client = r.client
        prompt = [256] + list(range(70))
        want = reference.generate([prompt], SamplingParams(max_tokens=4))[0]
        assert client.generate(prompt, max_tokens=4)["token_ids"] == want
        r.prefills[0].kill()
        r.prefills[0].wait(timeout=10)
        with pytest.raises(grpc.RpcError):
            client.generate(prompt, max_tokens=4, timeout=60)
        # Back on the same address: the channel reconnects by itself.
        r.procs.append(start("serve", "--config", CONFIG, "--role", "prefill",
                             "--control-port", port)[0])
        deadline = time.monotonic() + 30
        while True:
            try:
                got = client.generate(prompt, max_tokens=4, timeout=60)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() < deadline, "routing did not resume"
                time.sleep(0.5)
        assert got["token_ids"] == want
        assert json.loads(client.info().metrics_json)["pools"]["prefill[0]"]["reachable"]


def test_router_skips_a_prefill_process_that_is_down(reference):
    with roles(prefills=2) as r:
        client = r.client
        prompt = [256] + list(range(30))
        want = reference.generate([prompt], SamplingParams(max_tokens=3))[0]
        assert client.generate(prompt, max_tokens=3)["token_ids"] == want
        r.prefills[0].kill()
        r.prefills[0].wait(timeout=10)
        time.sleep(2.5)  # health checks run every second
        pools = json.loads(client.info().metrics_json)["pools"]
        assert pools["prefill[0]"]["reachable"] == 0 and pools["prefill[1]"]["reachable"]
        for _ in range(4):  # every request goes to the live one
            assert client.generate(prompt, max_tokens=3, timeout=60)["token_ids"] == want


def test_decode_process_killed_mid_stream(tmp_path):
    """The client gets UNAVAILABLE at once; the prefill process holds nothing after the lease."""
    with roles(short_lease(tmp_path)) as r:
        streams = [r.client.stream([256] + [7] * n, max_tokens=200, ignore_eos=True)
                   for n in (10, 300, 600)]
        next(streams[0])
        r.decode.kill()
        t0 = time.monotonic()
        for s in streams:
            with pytest.raises(grpc.RpcError) as e:
                list(s)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 10
        control = ControlClient(r.addresses[0])
        deadline = time.monotonic() + 15
        while True:
            gauges = control.call("stats", {})["gauges"]
            if not (gauges["offers_held"] or gauges["kv_blocks_used"]
                    or gauges["queued_requests"]):
                break
            assert time.monotonic() < deadline, f"prefill side still holds KV: {gauges}"
            time.sleep(0.2)
        control.close()


def test_pools_die_with_a_killed_launcher(tmp_path):
    """SIGKILL leaves the launcher no chance to clean up: its pools must end themselves
    (their parent-death signal), bounded by their drain watchdog even if a drain sticks."""
    log = (tmp_path / "stderr").open("w")
    proc, line = start("launch", "--config", CONFIG, "--port", 0, stderr=log)
    pids = {role: int(line.split(f"{role} pid ")[1].split()[0].rstrip(",):"))
            for role in ("prefill", "decode", "router")}
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 45  # orphan grace 3 s + watchdog margin 15 s, loaded CI
    for role, pid in pids.items():
        while Path(f"/proc/{pid}").exists() and "zombie" not in (
                state := Path(f"/proc/{pid}/status").read_text()).lower():
            assert time.monotonic() < deadline, (
                f"{role} process {pid} outlived the launcher: "
                f"{[x for x in state.splitlines() if x.startswith('State')]}; its stderr:\n"
                + (tmp_path / "stderr").read_text()[-6000:])
            time.sleep(0.2)
    assert "the launcher is gone: stopping" in (tmp_path / "stderr").read_text()


def test_router_health_follows_its_decode_pools(reference):
    with roles() as r:
        decode_address = r.decode_address
        router, line = start("serve", "--role", "router", "--decode", decode_address,
                             "--port", 0)
        r.procs.append(router)
        with Client(line.split()[1]) as client:
            assert client.health() == "SERVING"
            prompt = [256, 4, 5, 6]
            want = reference.generate([prompt], SamplingParams(max_tokens=3))[0]
            assert client.generate(prompt, max_tokens=3)["token_ids"] == want
            assert json.loads(client.info().metrics_json)["router"][decode_address]["healthy"]
            r.decode.kill()
            r.decode.wait(timeout=10)
            t0 = time.monotonic()
            while client.health() == "SERVING":
                assert time.monotonic() - t0 < 5, "the router did not notice"
                time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as e:
                client.generate(prompt, max_tokens=3, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no decode pool" in e.value.details()
        assert stop(router) and router.returncode == 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_process_dies_while_decode_pulls(tmp_path, reference, monkeypatch, policy):
    """The decode side's watchdog ends the pull in time; the request fails with
    UNAVAILABLE, or (`on_failure: recompute`) is prefilled on the decode pool and gives
    the reference tokens."""
    cfg = tmp_path / "pull.yaml"
    cfg.write_text(CONFIG.read_text().replace("pull_timeout_s: 10", "pull_timeout_s: 2")
                   .replace("lease_s: 30", f"lease_s: 30\n  on_failure: {policy}"))
    monkeypatch.setenv("JAXDISAGG_FAILPOINT", "die_after_offer")  # the prefill process's
    prefill, line = start("serve", "--config", cfg, "--role", "prefill")
    monkeypatch.delenv("JAXDISAGG_FAILPOINT")
    decode = None
    try:
        decode, dline = start("serve", "--config", cfg, "--role", "decode", "--prefill",
                              line.split()[1], "--port", 0)
        with Client(dline.split()[1]) as client:
            prompt = [256] + list(range(50))
            t0 = time.monotonic()
            if policy == "fail":
                with pytest.raises(grpc.RpcError) as e:
                    client.generate(prompt, max_tokens=4, timeout=60)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "KV transfer failed" in e.value.details()
            else:
                got = client.generate(prompt, max_tokens=4, timeout=60)
                want = reference.generate([prompt], SamplingParams(max_tokens=4))[0]
                assert got["token_ids"] == want and "transfer_failed" in got["timings"].timeline
            assert time.monotonic() - t0 < 15  # the 2 s watchdog, not a hang
            m = json.loads(client.info().metrics_json)
            assert m["in_flight"] == 0 and m["pools"]["decode[0]"]["kv_blocks_used"] == 0
            assert m["pools"]["prefill[0]"]["transfer_failures"] == 1
        assert prefill.wait(timeout=10) == 3  # it did die
    finally:
        for p in (decode, prefill):
            if p is not None and p.poll() is None:
                p.kill()


# ---------------------------------------------------------------- isolation


def test_chaos_across_processes_one_failing_request_fails_alone(reference):
    """Each failpoint armed for one request, in whichever process runs it, while other
    requests stream beside it: every victim fails with UNAVAILABLE naming the fault,
    every other request gets the reference tokens, and neither pool holds anything."""
    from jaxdisagg.serve import faults

    armed = {point: f"v{i}-" for i, point in enumerate(faults.POINTS)}
    env = {"JAXDISAGG_FAILPOINTS": ",".join(f"{p}={pre}" for p, pre in armed.items())}
    rng = random.Random(5)
    with roles(env=env) as r:
        jobs = [(f"{pre}victim", [256] + [rng.randrange(256) for _ in range(40 + 7 * i)])
                for i, pre in enumerate(armed.values())]
        jobs += [(f"ok-{i}", [256] + [rng.randrange(256) for _ in range(rng.randrange(20, 150))])
                 for i in range(8)]
        rng.shuffle(jobs)
        got = {}

        def run(rid, prompt):
            with Client(r.decode_address) as c:
                try:
                    got[rid] = c.generate(prompt, max_tokens=4, ignore_eos=True,
                                          request_id=rid, timeout=120)["token_ids"]
                except grpc.RpcError as e:
                    got[rid] = e

        import threading

        threads = [threading.Thread(target=run, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        for rid, prompt in jobs:
            if rid.startswith("ok"):
                want = reference.generate([prompt], SamplingParams(max_tokens=4),
                                          stop_token_ids=[])[0]
                assert got[rid] == want, (rid, got[rid])
            else:
                assert isinstance(got[rid], grpc.RpcError), (rid, got[rid])
                assert got[rid].code() == grpc.StatusCode.UNAVAILABLE
                assert "failpoint" in got[rid].details(), got[rid].details()
        drained(r.client)


def test_internal_channels_refuse_callers_without_the_secret(reference):
    """Another local process that finds the prefill process's control port (or the KV
    sender's release port) gets UNAUTHENTICATED for every method, and cannot cancel
    anyone's request; offer ids are random, so none can be guessed for a pull."""
    with roles() as r:
        address = r.addresses[0]
        intruders = [ControlClient(address, secret="not-the-secret-0123456789")]
        raw = grpc.insecure_channel(address)  # no credentials at all
        prompt = [256] + list(range(120))
        stream = r.client.stream(prompt, max_tokens=20, ignore_eos=True, request_id="victim")
        next(stream)
        for method, payload in [("stats", {}), ("cancel", {"request_id": "victim"}),
                                ("prefill", {"request_id": "x", "prompt": [1], "params": {},
                                             "stop_ids": []})]:
            for intruder in intruders:
                with pytest.raises(grpc.RpcError) as e:
                    intruder.call(method, payload)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert e.value.details() == "unauthenticated"  # nothing else is learned
            call = raw.unary_unary(f"/jaxdisagg.Control/{method}",
                                   request_serializer=lambda d: json.dumps(d).encode(),
                                   response_deserializer=json.loads)
            with pytest.raises(grpc.RpcError) as e:
                call(payload, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        tokens = [t for resp in stream for t in resp.token_ids]
        assert tokens == reference.generate([prompt], SamplingParams(max_tokens=20),
                                            stop_token_ids=[])[0][1:]  # not cancelled
        # With the secret: offers come back, their ids far apart (random, not a counter).
        control = ControlClient(address)
        uuids, release = [], None
        for i in range(3):
            reply = control.call("prefill", {"request_id": f"probe-{i}", "prompt": prompt,
                                             "params": {"max_tokens": 4}, "stop_ids": []},
                                 timeout=60)
            uuids += [o["uuid"] for o in reply["offers"]]
            release = reply["offers"][0]["control_address"]
        assert len(set(uuids)) == len(uuids)
        assert min(abs(a - b) for a in uuids for b in uuids if a != b) > 2**20
        with pytest.raises(grpc.RpcError) as e:
            intruders[0].__class__(release, secret="not-the-secret-0123456789").call(
                "release", {"uuid": uuids[0]})
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for u in uuids:
            ControlClient(release).call("release", {"uuid": u})
        control.close()
        raw.close()
        drained(r.client)


def test_a_pool_process_without_a_secret_refuses_to_start():
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAXDISAGG_SECRET", "JAXDISAGG_SECRET_FILE")}
    out = subprocess.run([sys.executable, "-m", "jaxdisagg.cli", "serve", "--config",
                          str(CONFIG), "--role", "prefill"], capture_output=True, text=True,
                         env={**env, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert out.returncode == 2 and "JAXDISAGG_SECRET" in out.stderr, out.stderr


def test_health_is_not_serving_while_the_prefill_process_is_stopped():
    with roles() as r:
        client = r.client
        assert client.health() == "SERVING"
        r.prefills[0].send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while client.health() == "SERVING":
                assert time.monotonic() - t0 < 10, "health did not follow the prefill pool"
                time.sleep(0.2)
        finally:
            r.prefills[0].send_signal(signal.SIGCONT)
        t0 = time.monotonic()
        while client.health() != "SERVING":
            assert time.monotonic() - t0 < 10, "health did not come back"
            time.sleep(0.2)
        assert client.generate([256, 1, 2], max_tokens=2)["finish_reason"] == "length"


def test_launch_exits_non_zero_when_a_pool_process_dies():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxdisagg.cli", "launch", "--config",
                             str(CONFIG), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**env, "JAX_PLATFORMS": "cpu"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        pid = int(line.split("prefill pid ")[1].split()[0].rstrip(",):"))
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert f"the prefill process (pid {pid}) exited unexpectedly" in err
        assert "BrokenPipeError" not in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
