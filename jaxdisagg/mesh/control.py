"""A small JSON-over-gRPC control channel between pool processes.

Control messages are few and small (offers, acknowledgements), so they travel as
JSON documents through unary gRPC calls on one generic service: no pickle, no
eval, nothing but `json.loads` on what arrives. Each side registers handlers
`name -> fn(dict) -> dict`; a handler's ValueError becomes INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent import futures

import grpc

SERVICE = "jaxdisagg.Control"
MAX_MESSAGE = 4 * 1024 * 1024

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
                 workers: int = 4):
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

    @staticmethod
    def _wrap(fn: Handler):
        def call(request: dict, context: grpc.ServicerContext) -> dict:
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
    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", MAX_MESSAGE)])

    def call(self, method: str, payload: dict, timeout: float = 10.0) -> dict:
        stub = self._channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_dumps,
                                         response_deserializer=_loads)
        return stub(payload, timeout=timeout)

    def close(self) -> None:
        self._channel.close()
