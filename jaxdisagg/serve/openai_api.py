"""The OpenAI-compatible HTTP API: `jaxdisagg serve --http-port N`.

FastAPI on uvicorn, pydantic schemas, the same engine and the same request
validation as the gRPC front end (`validation.py` decides what a valid request is).

    POST /v1/completions        prompt: text, texts, token ids or lists of them
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template
    GET  /v1/models  GET /health  GET /metrics  POST /tokenize  POST /detokenize

Streams are server-sent events as OpenAI sends them (`data: {...}` chunks, the
assistant role first for chat, `data: [DONE]` last). Errors have OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`): 400 for a bad field (named;
unknown fields are refused, not ignored), 404 for an unknown model or route, 413
for a body over the limit, 429 when the engine is full, 503 while draining. A
client that disconnects cancels its requests and their blocks are freed. Each
response carries our lifecycle timings under `jaxdisagg`.

Supported subset, said plainly: `logprobs` gives the sampled tokens'
log-probabilities (completions: `logprobs: 0`; chat: `logprobs: true`,
`top_logprobs: 0`); alternatives are not computed, so larger values are refused.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import socket
import threading
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxdisagg.model.chat import ChatTemplateError
from jaxdisagg.model.sampling import SamplingParams
from jaxdisagg.serve.engine import Engine, QueueFull, Result

MAX_N = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    temperature: float | None = None  # OpenAI's default is 1.0
    top_p: float | None = None
    top_k: int | None = None  # an extension, as vLLM has it; -1 or 0 is off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI documents it
    ignore_eos: bool = False  # an extension, as vLLM has it: run to max_tokens (benchmarks)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]]
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param,
            "code": self.code}})


_FIELD = re.compile(r"^(?:SamplingParams\.)?([A-Za-z_][\w.\[\]]*)\b")


def _bad_request(e: ValueError) -> APIError:
    """Our validation names the field first ("SamplingParams.top_p must ...")."""
    message = str(e).replace("SamplingParams.", "")
    m = _FIELD.match(message)
    code = "context_length_exceeded" if "exceed the context" in message else None
    return APIError(400, message, m.group(1) if m else None, code=code)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class OpenAIFrontEnd:
    """Builds the FastAPI app over one engine."""

    def __init__(self, engine: Engine, model_name: str | None = None,
                 max_body_bytes: int = 4 * 2**20, exporter=None):
        self.engine = engine
        self.model_name = model_name or engine.config.model.name
        self.max_body_bytes = max_body_bytes
        self.exporter = exporter
        self.closing = threading.Event()
        self.app = self._build()

    # ------------------------------------------------------------ helpers

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model: {name!r} is not served here (this server serves "
                                f"{self.model_name!r})", "model", code="model_not_found")

    def _params(self, req, max_tokens: int | None) -> SamplingParams:
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, "max_tokens: must be a positive int", "max_tokens")
        top_k = req.top_k
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if top_k is None or top_k == -1 else top_k,
                seed=secrets.randbits(63) if req.seed is None else req.seed,
                max_tokens=max_tokens or 16, stop=tuple(stop))
        except ValueError as e:
            raise _bad_request(e) from None

    def _default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.engine.max_context - prompt_len)

    @staticmethod
    def _usage(prompt_lens: list[int], results: list[Result]) -> dict:
        prompt = sum(prompt_lens)
        completion = sum(len(r.token_ids) for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens
                                                               for r in results)}}

    @staticmethod
    def _timings(r: Result) -> dict:
        return {"request_id": r.request_id, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                "transfer_bytes": r.transfer_bytes, "cached_tokens": r.cached_tokens,
                "timeline": r.timeline, "route": r.route}

    @staticmethod
    def _finish(r: Result) -> str:
        if r.finish_reason.startswith("error"):
            raise APIError(503, r.finish_reason, kind="server_error", code="pool_failure")
        return "length" if r.finish_reason == "length" else "stop"

    def _submit_all(self, prompts, params, ignore_eos: bool = False
                    ) -> tuple[asyncio.Queue, list[str]]:
        """Submits every choice now (so a refusal is an HTTP error, not a broken stream);
        their events arrive on one queue as (choice index, event)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                rids.append(self.engine.submit(
                    p, sp, stop_token_ids=[] if ignore_eos else None,
                    _sink=lambda event, i=i: loop.call_soon_threadsafe(queue.put_nowait,
                                                                       (i, event))))
        except BaseException:
            self._cancel(rids)
            raise
        return queue, rids

    def _cancel(self, rids) -> None:
        for rid in rids:
            try:
                self.engine.cancel(rid)
            except KeyError:
                pass  # finished meanwhile

    async def _run(self, prompts: list[list[int]], params: list[SamplingParams],
                   request: Request, ignore_eos: bool = False) -> list[Result]:
        """Every choice, awaited together; a client that goes away cancels them all."""
        queue, rids = self._submit_all(prompts, params, ignore_eos)
        results: list[Result | None] = [None] * len(prompts)
        left = len(prompts)
        try:
            while left:
                try:
                    i, event = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                    continue
                if event[0] == "done":
                    results[i] = event[1]
                    left -= 1
            return results
        finally:
            if left:
                self._cancel(rids)

    def _choices(self, prompts, params, n: int) -> tuple[list, list]:
        """n choices per prompt: choice k draws with seed + k (reproducible, distinct)."""
        all_prompts, all_params = [], []
        for p, sp in zip(prompts, params, strict=True):
            for k in range(n):
                all_prompts.append(p)
                all_params.append(sp if k == 0 else SamplingParams(
                    **{**sp.__dict__, "seed": (sp.seed + k) % 2**64}))
        return all_prompts, all_params

    # ------------------------------------------------------------ completions

    def _encode_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        try:
            return [self.engine.encode(p) for p in prompt]
        except ValueError as e:
            raise _bad_request(e) from None

    async def completions(self, req: CompletionRequest, request: Request):
        self._check_model(req.model)
        if req.logprobs not in (None, 0):
            raise APIError(400, "logprobs: only 0 is supported (the sampled tokens' "
                                "log-probabilities); top alternatives are not computed",
                           "logprobs")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo: prompt log-probabilities are not computed; "
                                "use echo without logprobs", "echo")
        prompts = self._encode_prompts(req.prompt)
        params = [self._params(req, req.max_tokens) for _ in prompts]
        params = [SamplingParams(**{**sp.__dict__, "logprobs": req.logprobs is not None})
                  for sp in params]
        prompts, params = self._choices(prompts, params, req.n)
        texts = [self.engine.tokenizer.decode(p) if req.echo and self.engine.tokenizer
                 else "" for p in prompts]
        cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created,
                "model": self.model_name}
        if req.stream:
            return self._stream(prompts, params, req, head, chat=False, echo=texts)
        results = await self._run(prompts, params, request, req.ignore_eos)
        choices = []
        for i, r in enumerate(results):
            choices.append({"index": i, "text": texts[i] + (r.text or ""),
                            "logprobs": self._completion_logprobs(r)
                            if req.logprobs is not None else None,
                            "finish_reason": self._finish(r),
                            "jaxdisagg": self._timings(r)})
        return {**head, "choices": choices,
                "usage": self._usage([len(p) for p in prompts], results)}

    def _completion_logprobs(self, r: Result) -> dict:
        tok = self.engine.tokenizer
        pieces = [tok.decode([t]) if tok else str(t) for t in r.token_ids]
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": list(r.logprobs or []),
                "top_logprobs": None, "text_offset": offsets}

    # ------------------------------------------------------------ chat

    def _render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        template = getattr(self.engine.tokenizer, "chat_template", None)
        if template is None:
            raise APIError(400, f"messages: the model {self.model_name!r} has no chat "
                                "template; use /v1/completions", "messages")
        try:
            return template.render([m.model_dump(exclude_none=True) for m in messages],
                                   add_generation_prompt)
        except ChatTemplateError as e:
            raise _bad_request(e) from None

    async def chat(self, req: ChatRequest, request: Request):
        self._check_model(req.model)
        if req.top_logprobs not in (None, 0):
            raise APIError(400, "top_logprobs: only 0 is supported; alternatives are not "
                                "computed", "top_logprobs")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise APIError(400, "max_completion_tokens: give it or max_tokens, not both",
                           "max_completion_tokens")
        text = self._render(req.messages)
        try:
            ids = self.engine.encode(text)
        except ValueError as e:
            raise _bad_request(e) from None
        limit = req.max_completion_tokens or req.max_tokens or self._default_max_tokens(
            len(ids))
        params = self._params(req, limit)
        params = SamplingParams(**{**params.__dict__, "logprobs": req.logprobs})
        prompts, all_params = self._choices([ids], [params], req.n)
        cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        head = {"id": cid, "object": "chat.completion", "created": created,
                "model": self.model_name}
        if req.stream:
            return self._stream(prompts, all_params, req,
                                {**head, "object": "chat.completion.chunk"}, chat=True)
        results = await self._run(prompts, all_params, request, req.ignore_eos)
        choices = [{"index": i, "message": {"role": "assistant", "content": r.text or ""},
                    "logprobs": self._chat_logprobs(r) if req.logprobs else None,
                    "finish_reason": self._finish(r), "jaxdisagg": self._timings(r)}
                   for i, r in enumerate(results)]
        return {**head, "choices": choices,
                "usage": self._usage([len(p) for p in prompts], results)}

    def _chat_token(self, token: int, logprob: float) -> dict:
        tok = self.engine.tokenizer
        piece = tok.decode([token]) if tok else str(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode()),
                "top_logprobs": []}

    def _chat_logprobs(self, r: Result) -> dict:
        return {"content": [self._chat_token(t, lp) for t, lp in
                            zip(r.token_ids, r.logprobs or [], strict=False)]}

    # ------------------------------------------------------------ streaming

    def _stream(self, prompts, params, req, head: dict, chat: bool, echo=None):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        queue, rids = self._submit_all(prompts, params, req.ignore_eos)

        async def body():
            results: list[Result | None] = [None] * len(prompts)
            left = len(prompts)
            try:
                for i in range(len(prompts)):
                    if chat:
                        yield _sse({**head, "choices": [{"index": i, "delta": {
                            "role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}]})
                    elif echo and echo[i]:
                        yield _sse({**head, "choices": [{"index": i, "text": echo[i],
                                                         "logprobs": None,
                                                         "finish_reason": None}]})
                while left:
                    i, event = await queue.get()
                    if event[0] == "done":
                        r = results[i] = event[1]
                        left -= 1
                        if r.finish_reason.startswith("error"):
                            yield _sse({"error": {"message": r.finish_reason,
                                                  "type": "server_error", "param": None,
                                                  "code": "pool_failure"}})
                            continue
                        reason = "length" if r.finish_reason == "length" else "stop"
                        final = ({"index": i, "delta": {}, "logprobs": None,
                                  "finish_reason": reason} if chat else
                                 {"index": i, "text": "", "logprobs": None,
                                  "finish_reason": reason})
                        yield _sse({**head, "choices": [{**final,
                                                         "jaxdisagg": self._timings(r)}]})
                        continue
                    _, token, delta, logprob = event
                    if not delta and token is None:
                        continue
                    if chat:
                        lp = None
                        if req.logprobs and token is not None:
                            lp = {"content": [self._chat_token(token, logprob)]}
                        yield _sse({**head, "choices": [{"index": i, "delta": {
                            "content": delta}, "logprobs": lp, "finish_reason": None}]})
                    else:
                        lp = None
                        if req.logprobs is not None and token is not None:
                            lp = {"tokens": [self.engine.tokenizer.decode([token])],
                                  "token_logprobs": [logprob], "top_logprobs": None,
                                  "text_offset": [0]}
                        yield _sse({**head, "choices": [{"index": i, "text": delta,
                                                         "logprobs": lp,
                                                         "finish_reason": None}]})
                if include_usage:
                    done = [r for r in results if r is not None]
                    yield _sse({**head, "choices": [], "usage": self._usage(
                        [len(p) for p in prompts], done)})
                yield b"data: [DONE]\n\n"
            finally:  # a client that went away: every choice is cancelled
                if left:
                    self._cancel(rids)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------ the app

    def _build(self) -> FastAPI:
        app = FastAPI(title="jaxdisagg", docs_url=None, redoc_url=None)
        front = self

        @app.exception_handler(APIError)
        async def api_error(request, exc: APIError):
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def validation_error(request, exc: RequestValidationError):
            err = exc.errors()[0] if exc.errors() else {}
            loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
            param = ".".join(loc) or None
            message = err.get("msg", "invalid request")
            if err.get("type") == "extra_forbidden":
                message = "unsupported field (refused rather than ignored)"
            elif err.get("type") == "json_invalid":
                param, message = None, "the body is not valid JSON"
            return APIError(400, f"{param}: {message}" if param else message, param).response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc: StarletteHTTPException):
            return APIError(exc.status_code, str(exc.detail),
                            kind="invalid_request_error" if exc.status_code < 500
                            else "server_error").response()

        @app.middleware("http")
        async def guard(request: Request, call_next):
            if front.closing.is_set() and request.url.path.startswith("/v1/"):
                return APIError(503, "the server is shutting down", kind="server_error",
                                code="draining").response()
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > front.max_body_bytes:
                return APIError(413, f"the body is {size} bytes, over the limit of "
                                     f"{front.max_body_bytes}", code="too_large").response()
            return await call_next(request)

        @app.post("/v1/completions")
        async def completions(req: CompletionRequest, request: Request):
            return await front._guarded(front.completions(req, request))

        @app.post("/v1/chat/completions")
        async def chat(req: ChatRequest, request: Request):
            return await front._guarded(front.chat(req, request))

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": front.model_name, "object": "model", "created": 0,
                "owned_by": "jaxdisagg", "max_model_len": front.engine.max_context,
                "vocab_size": front.engine.vocab_size}]}

        @app.get("/health")
        async def health():
            if front.closing.is_set() or not front.engine.healthy():
                return APIError(503, "not serving", kind="server_error").response()
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            if front.exporter is None:
                raise APIError(404, "metrics are not exported by this server")
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return PlainTextResponse(generate_latest(front.exporter.registry),
                                     media_type=CONTENT_TYPE_LATEST)

        @app.post("/tokenize")
        async def tokenize(req: TokenizeRequest):
            front._check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise APIError(400, "prompt: give prompt or messages", "prompt")
            text = req.prompt if req.prompt is not None else front._render(
                req.messages, req.add_generation_prompt)
            try:
                ids = front.engine.encode(text)
            except ValueError as e:
                raise _bad_request(e) from None
            return {"tokens": ids, "count": len(ids), "max_model_len": front.engine.max_context}

        @app.post("/detokenize")
        async def detokenize(req: DetokenizeRequest):
            front._check_model(req.model)
            bad = [t for t in req.tokens if not 0 <= t < front.engine.vocab_size]
            if bad:
                raise APIError(400, f"tokens: ids outside the vocabulary: {bad[:5]}", "tokens")
            tok = front.engine.tokenizer
            return {"prompt": tok.decode(req.tokens) if tok else ""}

        return app

    async def _guarded(self, coro):
        """The engine's refusals as OpenAI errors, in one place."""
        try:
            return await coro
        except QueueFull as e:  # (a RuntimeError too: before the generic case)
            raise APIError(429, str(e), kind="rate_limit_error", code="engine_full") from None
        except ValueError as e:
            raise _bad_request(e) from None
        except RuntimeError as e:  # the engine is closed
            raise APIError(503, str(e), kind="server_error") from None


class HTTPServer:
    """uvicorn serving the app on its own thread and event loop."""

    def __init__(self, front: OpenAIFrontEnd, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.front = front
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(front.app, log_level="warning",
                                                     timeout_graceful_shutdown=30))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True,
                                        name="http")

    def start(self) -> HTTPServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def stop(self, grace: float = 30.0) -> None:
        """Refuses new requests (503) and gives the streams in flight `grace` seconds."""
        self.front.closing.set()
        self._server.config.timeout_graceful_shutdown = grace
        self._server.should_exit = True
        self._thread.join(timeout=grace + 10)
