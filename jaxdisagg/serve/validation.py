"""One validation of requests, shared by every edge into the engine.

The Python API (`Engine.submit`), the gRPC front end and the prefill process's
control channel all check a request here, before any work is done for it, so a
value that passes can never fail inside a serving step, and a bad one is refused
with a `ValueError` naming the field. Sizes are checked before the expensive part:
a text prompt's bytes before tokenizing, a list's length before converting it.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from jaxdisagg.model.sampling import SamplingParams

# Ids the server hands out: 128 random bits, so nobody can guess another request's
# id (to abort it, or to take it first). Clients may pick their own ids, but never
# in this namespace, so the two can never collide.
SERVER_ID_PREFIX = "jd-"
_ID_CHARS = re.compile(r"[A-Za-z0-9._:@/+=-]+")


def new_request_id() -> str:
    return SERVER_ID_PREFIX + secrets.token_hex(16)


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds; the defaults are what `jaxdisagg serve` runs with."""

    max_prompt_tokens: int | None = None  # None: whatever fits the deployment's context
    max_prompt_bytes: int = 256 * 1024  # a text prompt, checked before tokenizing
    max_new_tokens: int | None = None  # None: whatever fits the context
    max_stop_strings: int = 16
    max_stop_bytes: int = 4096  # all stop strings together, UTF-8
    max_stop_token_ids: int = 1024
    max_request_id_chars: int = 128

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_prompt_bytes", "max_new_tokens",
                     "max_stop_strings", "max_stop_bytes", "max_stop_token_ids",
                     "max_request_id_chars"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"RequestLimits.{name}: must be an int >= 0, got {v!r}")


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_request_id(request_id, limits: RequestLimits, *, internal: bool = False) -> None:
    """A client's own id: short, plain characters, outside the server's namespace
    (`internal` callers, such as the router, may pass ids the server made)."""
    if request_id is None:
        return
    if not isinstance(request_id, str):
        raise ValueError(f"request_id: expected a string, got {type(request_id).__name__}")
    if not 0 < len(request_id) <= limits.max_request_id_chars:
        raise ValueError(f"request_id: must be 1 to {limits.max_request_id_chars} "
                         f"characters, got {len(request_id)}")
    if not _ID_CHARS.fullmatch(request_id):
        raise ValueError("request_id: only letters, digits and ._:@/+=- are allowed")
    if request_id.startswith(SERVER_ID_PREFIX) and not internal:
        raise ValueError(f"request_id: ids starting with {SERVER_ID_PREFIX!r} are the "
                         "server's own; leave request_id empty to get one")


def check_prompt_size(prompt, limits: RequestLimits) -> None:
    """The cheap checks on a prompt, before it is tokenized or converted."""
    if isinstance(prompt, str):
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > limits.max_prompt_bytes:
            raise ValueError(f"prompt: {size} bytes exceed the limit of "
                             f"{limits.max_prompt_bytes}")
    elif isinstance(prompt, (bytes, bytearray)):
        raise ValueError("prompt: expected text or a list of token ids, got bytes")
    else:
        try:
            n = len(prompt)
        except TypeError:
            raise ValueError("prompt: expected text or a list of token ids, got "
                             f"{type(prompt).__name__}") from None
        cap = limits.max_prompt_tokens
        if cap is not None and n > cap:
            raise ValueError(f"prompt: {n} tokens exceed the limit of {cap}")


def check_token_ids(ids: Sequence, vocab_size: int, field: str = "prompt") -> list[int]:
    """Ints in [0, vocab_size), as a list of Python ints."""
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            try:
                if isinstance(t, (str, bytes, float, bool)):
                    raise TypeError
                t = int(t.__index__())  # numpy ints and other exact integers
            except (TypeError, AttributeError):
                what = "text or a list of token ids" if field == "prompt" else "token ids"
                raise ValueError(f"{field}: expected {what} (ints), got {_short(t)}") from None
        if not 0 <= t < vocab_size:
            raise ValueError(f"{field}: token ids outside the vocabulary [0, {vocab_size}): "
                             f"{_short(t)}")
        out.append(t)
    return out


def check_tokens(ids: list[int], limits: RequestLimits, params: SamplingParams,
                 context: int) -> None:
    """A tokenized prompt against the token caps and the context it must fit."""
    if not ids:
        raise ValueError("prompt: must not be empty")
    cap = limits.max_prompt_tokens
    if cap is not None and len(ids) > cap:
        raise ValueError(f"prompt: {len(ids)} tokens exceed the limit of {cap}")
    if len(ids) + params.max_tokens > context:
        raise ValueError(f"prompt: {len(ids)} tokens + max_tokens {params.max_tokens} "
                         f"exceed the context of {context} tokens")


def check_params(params, limits: RequestLimits) -> SamplingParams:
    """The request's sampling parameters against the per-request bounds."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
    if limits.max_new_tokens is not None and params.max_tokens > limits.max_new_tokens:
        raise ValueError(f"SamplingParams.max_tokens: {params.max_tokens} exceeds the limit "
                         f"of {limits.max_new_tokens}")
    if len(params.stop) > limits.max_stop_strings:
        raise ValueError(f"SamplingParams.stop: at most {limits.max_stop_strings} stop "
                         f"strings, got {len(params.stop)}")
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in params.stop)
    if size > limits.max_stop_bytes:
        raise ValueError(f"SamplingParams.stop: {size} bytes of stop strings exceed the "
                         f"limit of {limits.max_stop_bytes}")
    return params


def check_stop_token_ids(ids, vocab_size: int, limits: RequestLimits) -> list[int] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise ValueError("stop_token_ids: expected a list of token ids")
    if len(ids) > limits.max_stop_token_ids:
        raise ValueError(f"stop_token_ids: at most {limits.max_stop_token_ids}, "
                         f"got {len(ids)}")
    return check_token_ids(ids, vocab_size, "stop_token_ids")
