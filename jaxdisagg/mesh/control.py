"""A small JSON-over-gRPC control channel between pool processes.

Control messages are few and small (offers, acknowledgements), so they travel as
JSON documents through unary gRPC calls on one generic service: no pickle, no
eval, nothing but `json.loads` on what arrives. Each side registers handlers
`name -> fn(dict) -> dict`; a handler's ValueError becomes INVALID_ARGUMENT.

Every call carries the deployment's secret (gRPC metadata, compared in constant
time); a caller without it gets UNAUTHENTICATED before any handler runs, so a
local process that finds the port can neither call a method nor learn anything
from the answer. The secret comes from `JAXDISAGG_SECRET`, or a file named by
`JAXDISAGG_SECRET_FILE` (`jaxdisagg launch` makes a fresh one per deployment and
hands it to its processes through the environment).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures

import grpc

SERVICE = "jaxdisagg.Control"
MAX_MESSAGE = 4 * 1024 * 1024
AUTH_KEY = "x-jaxdisagg-auth"  # gRPC metadata key (lower case, as gRPC requires)
MIN_SECRET_BYTES = 16

log = logging.getLogger(__name__)


class SecretError(ValueError):
    """The deployment secret is missing or too weak."""


def load_secret() -> str:
    """The deployment's shared secret, from JAXDISAGG_SECRET or JAXDISAGG_SECRET_FILE."""
    secret = os.environ.get("JAXDISAGG_SECRET", "")
    path = os.environ.get("JAXDISAGG_SECRET_FILE", "")
    if not secret and path:
        try:
            with open(path, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as e:
            raise SecretError(f"JAXDISAGG_SECRET_FILE: cannot read {path}: {e}") from None
    if not secret:
        raise SecretError("the internal channels need a shared secret: set JAXDISAGG_SECRET "
                          "(or JAXDISAGG_SECRET_FILE, or --secret-file) to the same value "
                          "in every process of the deployment; `jaxdisagg launch` makes one")
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise SecretError(f"the deployment secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def authorized(context: grpc.ServicerContext, secret: str) -> bool:
    """Whether the call carries `secret` (constant-time comparison)."""
    for key, value in context.invocation_metadata() or ():
        if key == AUTH_KEY:
            return hmac.compare_digest(str(value).encode(), secret.encode())
    return False

Handler = Callable[[dict], dict]


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def _loads(data: bytes) -> dict:
    obj = json.loads(data.decode())
    if not isinstance(obj, dict):
        raise ValueError("a control message must be a JSON object")
    return obj


class ControlServer:
    """Serves the given handlers on host:port (port 0 picks a free one)."""

    def __init__(self, handlers: dict[str, Handler], host: str = "127.0.0.1", port: int = 0,
                 workers: int = 4, secret: str | None = None):
        self._secret = secret or load_secret()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                                   options=[("grpc.max_receive_message_length", MAX_MESSAGE)])
        methods = {name: grpc.unary_unary_rpc_method_handler(
            self._wrap(fn), request_deserializer=_loads, response_serializer=_dumps)
            for name, fn in handlers.items()}
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, methods),))
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.address = f"{host}:{self.port}"
        self._server.start()

    def _wrap(self, fn: Handler):
        def call(request: dict, context: grpc.ServicerContext) -> dict:
            if not authorized(context, self._secret):
                log.warning("control call from %s refused: no valid secret", context.peer())
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")
            try:
                return fn(request)
            except (ValueError, KeyError, TypeError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")
            except TimeoutError as e:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
            except Exception as e:  # noqa: BLE001 - the peer gets the message, we keep serving
                context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

        return call

    def stop(self, grace: float = 1.0) -> None:
        self._server.stop(grace).wait()


class ControlClient:
    def __init__(self, address: str, secret: str | None = None):
        self.address = address
        self._metadata = ((AUTH_KEY, secret or load_secret()),)
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", MAX_MESSAGE)])

    def call(self, method: str, payload: dict, timeout: float = 10.0) -> dict:
        stub = self._channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_dumps,
                                         response_deserializer=_loads)
        return stub(payload, timeout=timeout, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()


class ControlClients:
    """One client (one gRPC channel) per peer, reused for every call, all closed together."""

    def __init__(self, secret: str | None = None):
        self._secret = secret or load_secret()
        self._clients: dict[str, ControlClient] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> ControlClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = ControlClient(address, self._secret)
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
