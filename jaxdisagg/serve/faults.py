"""Failpoints: named places on the request path where tests make one request fail.

Serving code calls `failpoint("decode.token", request_id)` at each point where a
request's own work could go wrong (its chunk, its sampling, its transfer, its
admission, its row of the decode batch). Normally that is a dictionary lookup
that finds nothing. A test arms points for requests whose id starts with a
prefix, in-process with `arm()` or in a server process through the environment:

    JAXDISAGG_FAILPOINTS="prefill.chunk=victim-,decode.token=victim-"

and the point raises `InjectedFault` for those requests only. The chaos tests
use this to show that the failure of one request fails that request alone and
leaves the block accounting exact.
"""

from __future__ import annotations

import os
import threading

POINTS = ("prefill.chunk", "prefill.sample", "prefill.handoff", "transfer.send",
          "transfer.insert", "decode.admit", "decode.row", "decode.token")


class InjectedFault(RuntimeError):
    """Raised by an armed failpoint."""


_lock = threading.Lock()
_armed: dict[str, tuple[str, ...]] = {}


def arm(point: str, prefix: str) -> None:
    if point not in POINTS:
        raise ValueError(f"failpoint: unknown point {point!r} (known: {', '.join(POINTS)})")
    with _lock:
        _armed[point] = (*_armed.get(point, ()), prefix)


def disarm() -> None:
    with _lock:
        _armed.clear()


def _from_env() -> None:
    spec = os.environ.get("JAXDISAGG_FAILPOINTS", "")
    for item in filter(None, (x.strip() for x in spec.split(","))):
        point, _, prefix = item.partition("=")
        arm(point, prefix)


def failpoint(point: str, request_id: str) -> None:
    prefixes = _armed.get(point)
    if prefixes and any(request_id.startswith(p) for p in prefixes):
        raise InjectedFault(f"failpoint {point} for {request_id}")


_from_env()
