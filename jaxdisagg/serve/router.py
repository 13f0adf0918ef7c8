"""`jaxdisagg serve --role router`: the public front of decode processes.

It serves the same `jaxdisagg.v1.Generator` API and forwards each request to the
healthy decode process with the fewest requests in flight (each decode process
routes on to its prefill processes). Backends are health-checked every second with
the standard health service; one that is down gets no traffic until it answers
again. Streams are proxied response by response, deadlines and client cancels
travel on to the backend, and a backend's status code comes back unchanged.

The router names each request it forwards without an id (`jd-` + 128 random
bits, the server namespace) and proves to the decode process, with the
deployment secret, that it may; clients' own ids are checked as the decode
process would, before anything is forwarded.
"""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxdisagg.mesh.control import AUTH_KEY, load_secret
from jaxdisagg.serve.proto import jaxdisagg_pb2_grpc as pb_grpc
from jaxdisagg.serve.server import SERVICE, _handlers
from jaxdisagg.serve.validation import RequestLimits, check_request_id, new_request_id


class Backend:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False
        self.in_flight = 0

    def check(self, timeout: float) -> None:
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            self.healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            self.healthy = False


class RouterService:
    def __init__(self, backends: list[Backend], secret: str, max_streams: int = 1024):
        self.backends = backends
        self._slots = threading.BoundedSemaphore(max_streams)
        self.closing = threading.Event()
        self._owner: dict[str, Backend] = {}  # request id -> backend, while in flight
        self._lock = threading.Lock()
        self._metadata = ((AUTH_KEY, secret),)
        self._limits = RequestLimits()

    def _pick(self, context) -> Backend:
        with self._lock:
            alive = [b for b in self.backends if b.healthy]
            if self.closing.is_set() or not alive:
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              "the router is shutting down" if self.closing.is_set()
                              else "no decode pool is available")
            backend = min(alive, key=lambda b: b.in_flight)
            backend.in_flight += 1
            return backend

    def Generate(self, request, context):
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams open")
        try:
            yield from self._forward(request, context)
        finally:
            self._slots.release()

    def _forward(self, request, context):
        try:
            check_request_id(request.request_id or None, self._limits)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        backend = self._pick(context)
        if not request.request_id:  # ours, so that Abort can find the backend
            request.request_id = new_request_id()
        rid = request.request_id
        with self._lock:
            if rid in self._owner:
                backend.in_flight -= 1
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request_id: {rid!r} is already in use")
            self._owner[rid] = backend
        remaining = context.time_remaining()  # huge (or None) when the client set none
        timeout = remaining if remaining is not None and remaining < 1e6 else None
        call = backend.stub.Generate(request, timeout=timeout, metadata=self._metadata)
        context.add_callback(call.cancel)  # client cancel or deadline: the backend stops too
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or context.is_active():
                context.abort(e.code(), e.details() or "")
        finally:
            with self._lock:
                backend.in_flight -= 1
                self._owner.pop(rid, None)

    def Abort(self, request, context):
        try:
            check_request_id(request.request_id, self._limits, internal=True)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self._lock:
            backend = self._owner.get(request.request_id)
        if backend is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"request_id: no request {request.request_id!r} in flight")
        try:
            return backend.stub.Abort(request, timeout=10)
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or "")

    def Info(self, request, context):
        alive = [b for b in self.backends if b.healthy]
        if not alive:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no decode pool is available")
        info = alive[0].stub.Info(request, timeout=10)
        metrics = json.loads(info.metrics_json)
        metrics["router"] = {b.address: {"healthy": b.healthy, "in_flight": b.in_flight}
                             for b in self.backends}
        info.metrics_json = json.dumps(metrics)
        return info


class Router:
    def __init__(self, decode_addresses: list[str], host: str = "127.0.0.1", port: int = 0,
                 workers: int = 1040, health_every_s: float = 1.0, secret: str | None = None):
        if not decode_addresses:
            raise ValueError("--decode: give at least one decode process address")
        self.backends = [Backend(a) for a in decode_addresses]
        # Streams get all but 16 threads: health, Info and Abort always find one.
        self.service = RouterService(self.backends, secret or load_secret(), workers - 16)
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        self.grpc.add_generic_rpc_handlers((_handlers(self.service),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        self.host, self.port = host, self.grpc.add_insecure_port(f"{host}:{port}")
        self.metrics_port = None
        self._every = health_every_s
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="router-health")

    def _watch(self) -> None:
        while True:
            for b in self.backends:
                b.check(timeout=self._every)
            status = (health_pb2.HealthCheckResponse.SERVING
                      if any(b.healthy for b in self.backends) and not self._stop.is_set()
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", SERVICE):
                self.health.set(name, status)
            if self._stop.wait(self._every):
                return

    def start(self) -> Router:
        for b in self.backends:
            b.check(timeout=5)
        self._watcher.start()
        self.grpc.start()
        return self

    def stop(self, grace: float = 30.0) -> None:
        self.service.closing.set()
        self._stop.set()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.stop(grace).wait()
        for b in self.backends:
            b.channel.close()
