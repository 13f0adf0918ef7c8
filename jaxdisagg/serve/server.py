"""The gRPC serving front end: `jaxdisagg serve --config FILE`.

One process holds an engine (disaggregated or colocated, in-process pools) and
serves `jaxdisagg.v1.Generator` (Generate streams, Abort, Info) next to the standard
health checking and reflection services, so stock tools (grpcurl,
grpc_health_probe) work. Prometheus metrics are served over HTTP on their own port.

Nothing from the wire is unpickled or evaluated: requests are protobuf messages,
checked by the engine's one request validation (`validation.py`) before any work.
Status codes: INVALID_ARGUMENT (bad request, field named), RESOURCE_EXHAUSTED
(the engine holds router.max_requests already), UNAVAILABLE (a pool failed, or the
server is shutting down), NOT_FOUND (abort of an unknown id); a client's deadline
or cancel ends the request and frees its blocks.

Resources per client are bounded: Generate streams hold at most router.max_requests
handler threads (a semaphore; beyond it RESOURCE_EXHAUSTED), so health checks,
Info and Abort always find a thread of their own; a stream whose client stops
reading is cancelled once its tokens have waited `stall_timeout_s`, and its blocks
are freed.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import queue
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxdisagg.mesh.control import authorized
from jaxdisagg.model.sampling import SamplingParams
from jaxdisagg.serve.engine import Engine, QueueFull, Result, UnknownRequestError
from jaxdisagg.serve.metrics import PrometheusExporter
from jaxdisagg.serve.proto import jaxdisagg_pb2 as pb
from jaxdisagg.serve.proto import jaxdisagg_pb2_grpc as pb_grpc
from jaxdisagg.serve.validation import check_request_id

SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What the server bounds beyond each request (requests: `RequestLimits`)."""

    max_message_bytes: int = 4 * 2**20
    stall_timeout_s: float = 30.0  # a client that reads nothing for this long is cut off


def sampling_params(s: pb.Sampling) -> tuple[SamplingParams, list[int] | None]:
    """The proto's sampling fields as SamplingParams (errors name `sampling.FIELD`)."""
    kwargs = {name: getattr(s, name) for name in
              ("temperature", "top_k", "top_p", "seed", "max_tokens") if s.HasField(name)}
    params = SamplingParams(**kwargs, logprobs=s.logprobs, stop=tuple(s.stop))
    stop_ids = list(s.stop_token_ids)
    return params, (stop_ids if s.ignore_eos or stop_ids else None)


def _wire_message(e: Exception) -> str:
    return str(e).replace("SamplingParams.", "sampling.")


@dataclass(eq=False)
class _Stream:
    context: grpc.ServicerContext
    events: queue.Queue
    sent_at: float = dataclasses.field(default_factory=time.monotonic)
    stalled: bool = False


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, engine: Engine, limits: ServerLimits, secret: str | None = None):
        self.engine, self.limits, self.secret = engine, limits, secret
        self.closing = threading.Event()
        self._slots = threading.BoundedSemaphore(engine.router.max_requests)
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ RPCs

    def _submit(self, request, context, events) -> tuple[str, int, SamplingParams]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("prompt: set text or token_ids")
        prompt = self.engine.encode(request.text if kind == "text"
                                    else request.token_ids.ids)
        params, stop_ids = sampling_params(request.sampling)
        # The router passes ids the server namespace made; only it holds the secret.
        internal = self.secret is not None and authorized(context, self.secret)
        rid = self.engine.submit(prompt, params, request_id=request.request_id or None,
                                 stop_token_ids=stop_ids, _sink=events.put,
                                 _internal=internal)
        return rid, len(prompt), params

    def Generate(self, request, context):
        if self.closing.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.engine.router.max_requests} streams open "
                          "(router.max_requests)")
        try:
            yield from self._generate(request, context)
        finally:
            self._slots.release()

    def _generate(self, request, context):
        events: queue.Queue = queue.Queue()
        try:
            rid, n_prompt, params = self._submit(request, context, events)
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:  # UnknownRequestError is one too, but submit never raises it
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _wire_message(e))
        except RuntimeError as e:  # the engine is closed
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        stream = _Stream(context, events)
        with self._lock:
            self._streams[rid] = stream
        done = threading.Event()
        # Deadline, client cancel or disconnect: the request ends and frees its blocks.
        context.add_callback(lambda: None if done.is_set() else self._cancel(rid))
        try:
            yield from self._responses(rid, n_prompt, params, stream, done)
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not done.is_set():
                self._cancel(rid)

    def _responses(self, rid, n_prompt, params, stream: _Stream, done: threading.Event):
        context, first = stream.context, True
        while True:
            try:
                event = stream.events.get(timeout=0.25)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if event[0] == "done":
                done.set()
                result: Result = event[1]
                if result.finish_reason.startswith("error"):
                    context.abort(grpc.StatusCode.UNAVAILABLE, result.finish_reason)
                yield pb.GenerateResponse(request_id=rid, finish_reason=result.finish_reason,
                                          timings=_timings(result))
                return
            _, token, text, logprob = event
            yield pb.GenerateResponse(
                request_id=rid, token_ids=[] if token is None else [token], text=text,
                logprobs=[logprob] if params.logprobs and logprob is not None else [],
                prompt_tokens=n_prompt if first else 0)
            stream.sent_at = time.monotonic()  # the client took it (flow control)
            first = False

    def cut_stalled(self) -> int:
        """Cancels streams whose client has read nothing for stall_timeout_s while
        tokens wait: the RPC ends (its handler thread returns) and the request's
        blocks are freed. Called periodically by the server."""
        now, cut = time.monotonic(), 0
        with self._lock:
            streams = list(self._streams.items())
        for rid, st in streams:
            if (not st.stalled and not st.events.empty()
                    and now - st.sent_at > self.limits.stall_timeout_s):
                st.stalled = True
                log.warning("%s: client read nothing for %.0f s; cancelling", rid,
                            now - st.sent_at)
                self._cancel(rid)
                st.context.cancel()
                cut += 1
        return cut

    def _cancel(self, rid: str) -> None:
        try:
            self.engine.cancel(rid)
        except UnknownRequestError:
            pass  # it finished meanwhile

    def Abort(self, request, context):
        try:
            check_request_id(request.request_id, self.engine.limits, internal=True)
            self.engine.cancel(request.request_id)
        except UnknownRequestError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.AbortResponse()

    def Info(self, request, context):
        engine = self.engine
        return pb.InfoResponse(
            model=engine.deployment.model.config.name, mode=engine.config.mode,
            config_json=json.dumps(dataclasses.asdict(engine.config)),
            metrics_json=json.dumps(engine.metrics()), max_context=engine.max_context,
            vocab_size=engine.vocab_size)


class _Garbled:
    """A request body that did not parse: the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: str):
        self.error = error


def _parser(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            return _Garbled(f"request: not a valid {message_cls.DESCRIPTOR.name} ({e})")
    return parse


def _checked(method):
    """Garbled bytes get INVALID_ARGUMENT (grpc's own deserializer failure is INTERNAL)."""
    def handler(request, context):
        if isinstance(request, _Garbled):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return method(request, context)
    return handler


def _handlers(service: GeneratorService) -> grpc.GenericRpcHandler:
    def stream_handler(request, context):
        if isinstance(request, _Garbled):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        yield from service.Generate(request, context)

    unary = {"Abort": (pb.AbortRequest, pb.AbortResponse),
             "Info": (pb.InfoRequest, pb.InfoResponse)}
    methods = {name: grpc.unary_unary_rpc_method_handler(
        _checked(getattr(service, name)), request_deserializer=_parser(req),
        response_serializer=resp.SerializeToString) for name, (req, resp) in unary.items()}
    methods["Generate"] = grpc.unary_stream_rpc_method_handler(
        stream_handler, request_deserializer=_parser(pb.GenerateRequest),
        response_serializer=pb.GenerateResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def _timings(r: Result) -> pb.Timings:
    return pb.Timings(ttft_s=r.ttft_s or 0.0, e2e_s=r.e2e_s or 0.0, tbt_s=r.tbt_s,
                      timeline=r.timeline, transfer_bytes=r.transfer_bytes,
                      cached_tokens=r.cached_tokens, preemptions=r.preemptions)


class Server:
    """An engine behind a gRPC server (plus health, reflection and Prometheus)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0,
                 limits: ServerLimits | None = None, metrics_port: int | None = None,
                 secret: str | None = None):
        self.engine = engine
        # A stream holds a thread while it lasts; streams are capped at
        # router.max_requests, so the rest are always free for Abort, Info and health.
        workers = engine.router.max_requests + 16
        self.limits = limits or ServerLimits()
        opts = [("grpc.max_receive_message_length", self.limits.max_message_bytes),
                ("grpc.max_send_message_length", self.limits.max_message_bytes)]
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=opts)
        self.service = GeneratorService(engine, self.limits, secret)
        self.grpc.add_generic_rpc_handlers((_handlers(self.service),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        self.port = self.grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.host = host
        self.exporter = PrometheusExporter(engine)
        self.metrics_port = (self.exporter.serve(host, metrics_port)
                             if metrics_port is not None else None)
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="server-watch")
        self.http = None  # the OpenAI-compatible front end, when serve_http() was called

    def serve_http(self, port: int, model_name: str | None = None) -> None:
        """The OpenAI-compatible HTTP API beside the gRPC one, on the same engine."""
        from jaxdisagg.serve.openai_api import HTTPServer, OpenAIFrontEnd

        front = OpenAIFrontEnd(self.engine, model_name, self.limits.max_message_bytes,
                               exporter=self.exporter)
        self.http = HTTPServer(front, self.host, port)

    def _set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE):
            self.health.set(name, status)

    def _watch(self) -> None:
        """Health follows the pools (NOT_SERVING while a needed pool is unreachable);
        streams whose clients stopped reading are cut off."""
        serving = True
        while not self._stop.wait(1.0):
            now = self.engine.healthy() and not self.service.closing.is_set()
            if now != serving:
                log.warning("health: %s", "SERVING" if now else "NOT_SERVING")
                self._set_health(now)
                serving = now
            self.service.cut_stalled()

    def start(self) -> Server:
        self.grpc.start()
        if self.http is not None:
            self.http.start()
        self._set_health(True)
        self._watcher.start()
        return self

    def stop(self, grace: float = 30.0) -> None:
        """Drain: refuse new requests, let those in flight finish (up to `grace`), then
        close the engine (cancelling whatever is left) and the servers."""
        self.service.closing.set()
        self._stop.set()
        self._set_health(False)
        if self.http is not None:
            self.http.stop(grace)  # new requests get 503; streams in flight finish
        self.grpc.stop(grace).wait()
        self.engine.close()
        self.exporter.close()


class StopSignals:
    """How a serving process is asked to stop, and a bound on how long stopping takes.

    SIGTERM / SIGINT drain: new requests are refused and those in flight get `grace`
    seconds. SIGHUP means the launcher is gone (it is the parent-death signal `launch`
    sets, and a closed terminal's): nobody upstream is left to drain for, so the
    grace is `orphan_grace`. Either way a watchdog (faulthandler's, a C thread that
    needs no GIL) dumps every thread's stack to stderr and exits if the drain has not
    ended `margin_s` after its grace: a stop never hangs, and a stuck one says where.
    """

    def __init__(self, grace: float = 30.0, orphan_grace: float = 3.0, margin_s: float = 15.0):
        self.event = threading.Event()
        self.grace, self.margin_s = grace, margin_s
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._request(grace))
        signal.signal(signal.SIGHUP, lambda *_: self._request(orphan_grace, "the launcher is gone"))

    def _request(self, grace: float, why: str | None = None) -> None:
        self.grace = min(grace, self.grace) if self.event.is_set() else grace
        faulthandler.dump_traceback_later(self.grace + self.margin_s, exit=True)
        if why:
            log.warning("%s: stopping (drain grace %.0f s)", why, self.grace)
        self.event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.event.wait(timeout)


def serve_forever(server: Server, out=sys.stdout) -> None:
    """Starts the server, prints READY, and drains on a stop signal (`StopSignals`)."""
    stop = StopSignals()
    server.start()
    metrics = f" metrics http://{server.host}:{server.metrics_port}/metrics" \
        if server.metrics_port else ""
    if getattr(server, "http", None) is not None:  # the router serves gRPC only
        metrics += f" openai http://{server.http.host}:{server.http.port}/v1"
    say(f"READY {server.host}:{server.port}{metrics}", out)
    stop.wait()
    say("draining", out)
    server.stop(stop.grace)
    say("stopped", out)


def say(line: str, out=None) -> None:
    """A status line for whoever started us; a launcher that died is no error."""
    try:
        print(line, file=out or sys.stdout, flush=True)
    except (BrokenPipeError, ValueError):
        pass
