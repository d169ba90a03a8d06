"""The OpenAI-compatible reference server: a Starlette ASGI app over an Engine (§4.7-§4.10).

Endpoints (the OpenAPI document at /openapi.json lists them): POST /v1/completions and
/v1/chat/completions (JSON or SSE), GET /v1/requests/{id}/events (reconnect: replay after
Last-Event-ID, then follow), POST /v1/requests/{id}/cancel, GET /v1/models, /metrics, /health.

The SSE stream is the request's OrderedStream (§4.7): each delta chunk carries `id: <seq>`, so a
client that reconnects with `Last-Event-ID: <seq>` gets exactly the events after it (rule 4, no
duplicate). A completed request sends its finish chunk (OpenAI finish_reason plus the precise §4.10
reason), the usage chunk when `stream_options.include_usage`, then `data: [DONE]` once. A cancelled
or failed request sends `event: error` with the reason and no [DONE]: never a fake stop.

A client that goes away is a transport fact (DECISIONS D5): `run.disconnect()`, recorded, not EOS and
not a cancel; the request runs on, bounded by its stream policy, and a paused one fails with
transport_error after the engine's `detach_timeout_s` unless a reader reconnects.

Hostile and unlucky clients: a request body is read up to `max_body_bytes` (413 past it,
before any parsing), parsed and tokenized on a worker thread so the event loop keeps serving;
browser-shaped requests (a CORS-safelisted content type such as text/plain, or an Origin not in
`allowed_origins`) are refused, so a web page cannot drive the server; with `api_key` every route
but /health needs `Authorization: Bearer KEY`. Request ids are unguessable (the id is the
capability to cancel or replay). A 429 says when to retry; a client that leaves while its body is
read is dropped quietly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..spec import FinishReason
from .channels import merged, tool_close_token, wire_finish
from .engine import DuplicateRequest, Engine, EngineFailed, EngineStopped, QueueFull, UnknownRequest
from .errors import RequestError
from .openai_schema import (
    UTF8_GUARD_DEFAULTS,
    ApiError,
    ParsedRequest,
    chat_message,
    choice_body,
    choices_usage,
    compile_chat_template,
    completion_body,
    finish_fields,
    openai_usage,
    openapi,
    parse_completion,
    terminal_error,
)
from .readers import StreamReader
from .runner import RequestRun
from .sse import (
    SSE_HEADERS,
    FrameShare,
    Renderer,
    SharedFrames,
    collect,
    finish_reason,
    follow,
    follow_choices,
    whole_report,
)
from .stream_events import StreamEvent, StreamEventKind

_SEQ = re.compile(r"[0-9]{1,18}")
MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt that fits a context, far below a memory problem
RETRY_AFTER_S = 1  # what a 429 (queue full) tells the client to wait
# Content types a browser may send cross-origin without a preflight (CORS "simple" requests).
_BROWSER_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
_OPEN_PATHS = frozenset({"/health"})
_LOG = logging.getLogger("decodespec.serve")
IGNORED_HEADER = "X-Decodespec-Ignored"  # the fields accepted and not acted on (D30)


class _Refused(Exception):
    """A request refused before its handler runs (auth, origin, content type, size)."""

    def __init__(self, error: ApiError, headers: dict[str, str] | None = None) -> None:
        self.error, self.headers = error, headers or {}


async def _read_body(request: HttpRequest, limit: int) -> bytes:
    """The body, read in chunks up to `limit` bytes (413 past it, from Content-Length or as read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _Refused(ApiError(413, f"the body is {declared} bytes; this server takes at most {limit}",
                                code="body_too_large"))
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > limit:
            raise _Refused(ApiError(413, f"the body exceeds {limit} bytes", code="body_too_large"))
    return bytes(buf)


def _error(exc: ApiError, request_id: str | None = None) -> JSONResponse:
    headers = {"X-Request-Id": request_id} if request_id else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _rate_limited(message: str, code: str) -> JSONResponse:
    """A 429 that says when to retry."""
    return JSONResponse(ApiError(429, message, code=code, type="rate_limit_error").body(), status_code=429,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def _event_stream(frames: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(frames, media_type="text/event-stream", headers=headers | SSE_HEADERS)


def _api_key(instance: Any, attribute: Any, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError("api_key must be None (no authentication) or a non-empty string")


def _max_readers(instance: Any, attribute: Any, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_readers must be an int >= 1, got {value!r}")


def _on_disconnect(instance: Any, attribute: Any, value: str) -> None:
    if value not in _ON_DISCONNECT:
        raise ValueError(f"on_disconnect must be 'continue' or 'cancel', got {value!r}")


def _utf8_guard(instance: Any, attribute: Any, value: str) -> None:
    if value not in UTF8_GUARD_DEFAULTS:
        raise ValueError(f"utf8_guard must be one of {', '.join(UTF8_GUARD_DEFAULTS)}, got {value!r}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    """How the app serves its engine (`decodespec serve`'s flags); a bad value is a ValueError
    naming it. The module docstring says what the refusals (`api_key`, `allowed_origins`,
    `max_body_bytes`) do."""

    model_name: str | None = None  # the model's name in answers and /v1/models (None: the engine's)
    policy: str = "pause"  # the stream policy of a request that names none (§4.8)
    max_buffer_events: int = 256  # the stream's buffer, in events (§4.8)
    manage_engine: bool = True  # the app starts the engine thread, and stops it (every live request cancelled)
    api_key: str | None = attrs.field(default=None, validator=_api_key)
    allowed_origins: frozenset[str] = frozenset()
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 30.0  # a body not fully received by then is a 408
    # What a streaming request's disconnect does, and a non-streamed one's whose client chose its
    # X-Request-Id: "continue" (D5's default: recorded, the request runs on) or "cancel". Any other
    # non-streamed request whose client leaves is cancelled (nobody can ever read its answer).
    on_disconnect: str = attrs.field(default="continue", validator=_on_disconnect)
    # Which requests that do not say get the UTF-8 guard: a key of UTF8_GUARD_DEFAULTS (D16).
    utf8_guard: str = attrs.field(default="sampled", validator=_utf8_guard)
    # /health answers 503 "stalled" while one engine step has run longer (None: never; D21).
    watchdog_s: float | None = 60.0
    strict: bool = False  # only the strict request set (openai_schema.STRICT_FIELDS, n = 1; D30)
    # Open readers one request may have (the first stream and each /events resume; 429 past it, D5).
    max_readers: int = attrs.field(default=8, validator=_max_readers)
    reasoning_parser: bool = False  # chat answers split `<think>` sections into reasoning_content (D45)
    tool_parser: bool = False  # chat requests with tools get Hermes `<tool_call>` calls as tool_calls (D47)


def _guard(config: ServerConfig, request: HttpRequest) -> None:
    """Auth, then framing, origin and content type: a refusal names what is wrong (_Refused)."""
    if config.api_key is not None and request.url.path not in _OPEN_PATHS:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # The scheme is case-insensitive (RFC 9110 §11.1); the key is compared in constant time.
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), config.api_key.encode())):
            raise _Refused(ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                                    code="invalid_api_key", type="authentication_error"),
                           {"WWW-Authenticate": "Bearer"})
    if "content-length" in request.headers and "transfer-encoding" in request.headers:
        # RFC 9112 §6.1: a message with both may be an attempt at request smuggling; refused and closed.
        raise _Refused(ApiError(400, "a request may not carry both Content-Length and Transfer-Encoding",
                                code="invalid_framing"), {"Connection": "close"})
    origin = request.headers.get("origin")
    if origin is not None and origin not in config.allowed_origins:
        raise _Refused(ApiError(403, f"Origin {origin[:80]!r} is not allowed (this server serves no browser "
                                     "pages; start it with allowed origins to permit one)", code="origin_refused"))
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.method == "POST" and ctype in _BROWSER_TYPES:
        raise _Refused(ApiError(415, f"Content-Type {ctype} is refused; send application/json",
                                code="unsupported_media_type"))


Handler = Callable[[HttpRequest], Awaitable[Response]]


class _Api:
    """The routes' handlers over one engine: what they share is the configuration, the shape of
    each retained request (a reconnect renders as the request asked) and the choices' ids of each
    n > 1 request (D34)."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.name: str = config.model_name or engine.model_name
        self.schema = openapi(self.name)
        self.chat_template = compile_chat_template(getattr(engine.tokenizer, "chat_template", None),
                                                   getattr(engine.tokenizer, "template_tokens", {}))
        vocab_size = engine.model.vocab_size
        self.parse_options = dict(
            model_name=self.name, context_limit=engine.context_limit, vocab_size=vocab_size,
            tokenizer=engine.tokenizer, policy=config.policy, max_buffer_events=config.max_buffer_events,
            chat_template=self.chat_template, utf8_guard=config.utf8_guard, strict=config.strict,
            reasoning=config.reasoning_parser, tool_parser=config.tool_parser,
            tool_close_id=tool_close_token(engine.tokenizer, vocab_size) if config.tool_parser else None)
        self.views: collections.OrderedDict[str, ParsedRequest] = collections.OrderedDict()
        self.share = FrameShare()
        self.groups: collections.OrderedDict[str, list[str]] = collections.OrderedDict()

    def routes(self) -> list[Route]:
        endpoints: list[tuple[str, Handler, list[str]]] = [
            ("/v1/completions", self.text_completions, ["POST"]),
            ("/v1/chat/completions", self.chat_completions, ["POST"]),
            ("/v1/requests/{request_id}/events", self.events, ["GET"]),
            ("/v1/requests/{request_id}/cancel", self.cancel, ["POST"]),
            ("/v1/models", self.models, ["GET"]),
            ("/metrics", self.metrics, ["GET"]),
            ("/health", self.health, ["GET"]),
            ("/openapi.json", self.openapi_json, ["GET"]),
        ]
        return [Route(path, self.guarded(handler), methods=methods) for path, handler, methods in endpoints]

    def guarded(self, handler: Handler) -> Handler:
        async def run(request: HttpRequest) -> Response:
            try:
                _guard(self.config, request)
                return await handler(request)
            except _Refused as exc:
                return JSONResponse(exc.error.body(), status_code=exc.error.status, headers=exc.headers)

        return run

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.config.manage_engine:
            self.engine.start()
        try:
            yield
        finally:
            if self.config.manage_engine:
                self.engine.stop()

    # ---- what a client leaving does (D5) --------------------------------------------------

    def gone(self, run: RequestRun) -> None:
        """The client of a stream, or of an answer it named, left: as `on_disconnect` says."""
        _ON_DISCONNECT[self.config.on_disconnect](self, run)

    def recorded(self, run: RequestRun) -> None:
        """A streaming client left: recorded (D5), and the request runs on."""
        run.disconnect()

    def abandoned(self, run: RequestRun) -> None:
        """A disconnect that also cancels: the answer can never be delivered (D5)."""
        run.disconnect()
        with contextlib.suppress(UnknownRequest):
            self.engine.cancel(run.request.request_id, source="disconnect")

    # ---- completions ---------------------------------------------------------------------

    async def text_completions(self, request: HttpRequest) -> Response:
        return await self.completions(request, chat=False)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self.completions(request, chat=True)

    async def read_request(self, request: HttpRequest, chat: bool) -> ParsedRequest | Response:
        """The body read (bounded in size and time) and parsed on a worker thread (tokenizing a long
        prompt never blocks the loop), or the response that refuses it."""
        config = self.config
        try:
            raw = await asyncio.wait_for(_read_body(request, config.max_body_bytes), config.body_timeout_s)
        except ClientDisconnect:  # the client left while sending: nothing to answer, nothing to log
            return Response(status_code=400)
        except TimeoutError:
            return _error(ApiError(408, f"the body was not received within {config.body_timeout_s:g} s",
                                   code="body_timeout"))
        try:
            parsed = await run_in_threadpool(self.parse, raw, chat, request.headers.get("x-request-id"))
        except ApiError as exc:
            return _error(exc)
        if parsed.ignored:
            _LOG.info("request %s: %s accepted and not acted on (%s)", parsed.request.request_id,
                      ", ".join(parsed.ignored), IGNORED_HEADER)
        return parsed

    def parse(self, raw: bytes, chat: bool, request_id: str | None) -> ParsedRequest:
        return parse_completion(raw, chat=chat, request_id=request_id, **self.parse_options)

    async def completions(self, request: HttpRequest, chat: bool) -> Response:
        parsed = await self.read_request(request, chat)
        if isinstance(parsed, Response):
            return parsed
        if parsed.best_of > 1:
            return await self.choices(request, parsed)
        try:
            run = self.engine.submit(parsed.request)
        except _SUBMIT_REFUSALS as exc:
            return _submit_refused(exc)
        rid = parsed.request.request_id
        self.retain(rid, parsed)
        headers = {"X-Request-Id": rid, **_ignored(parsed)}
        if parsed.stream:
            return _event_stream(follow(run, self.frames(run, parsed, None), run.stream.reader, on_gone=self.gone),
                                 headers)
        renderer = Renderer(run, parsed, self.name, int(time.time()))
        ((text, last),) = await self.answers(request, [run])
        ended = finish_reason(last)
        if last.kind is not StreamEventKind.COMPLETED:
            return _error(terminal_error(ended, last.error, rid), rid)
        answer = text.decode("utf-8", "replace")
        reason, detail = finish_fields(ended, run.result().stop)
        message = None
        if renderer.split is not None:  # the chat answer's channels (D45-D47)
            parts = renderer.split.push(answer) + renderer.split.finish(ended is FinishReason.TOOL_CALLS)
            message = chat_message(merged(parts), renderer.call_id, reasoning=parsed.reasoning)
            reason = wire_finish(reason, renderer.split)
        body = completion_body(parsed, renderer.cid, renderer.created, self.name, answer, (reason, detail),
                               openai_usage(last.usage), message=message, report=whole_report(run, parsed, text))
        return JSONResponse(body, headers=headers)

    async def answers(self, request: HttpRequest, runs: list[RequestRun]) -> list[tuple[bytes, StreamEvent]]:
        """The whole answers of a response that is not streamed. A client that named its id can come
        back for the answer (/events): its disconnect follows on_disconnect like a stream's. Nobody
        else can ever read this answer: it is cancelled."""
        on_gone = self.gone if "x-request-id" in request.headers else self.abandoned
        watch = asyncio.ensure_future(_watch_disconnect(request, runs, on_gone))
        try:
            return list(await asyncio.gather(*(collect(run) for run in runs)))
        finally:
            watch.cancel()

    def retain(self, rid: str, parsed: ParsedRequest) -> None:
        self.views[rid] = parsed
        while len(self.views) > self.retained_max:
            self.views.popitem(last=False)

    @property
    def retained_max(self) -> int:
        """Requests whose shape (views) or choices (groups) are kept: as many as the engine keeps."""
        engine = self.engine
        return engine.max_retained + engine.max_queue + engine.max_batch

    async def choices(self, request: HttpRequest, parsed: ParsedRequest) -> Response:
        """n choices, or the best n of best_of candidates (D34): one engine request each, with its
        own lifecycle, stream and finish reason; the answer is complete when every one has ended."""
        engine = self.engine
        rid = parsed.request.request_id
        runs: list[RequestRun] = []
        try:
            for i in range(parsed.best_of):
                runs.append(engine.submit(parsed.choice(i)))
        except _SUBMIT_REFUSALS as exc:  # the choices already submitted are cancelled
            for run in runs:
                with contextlib.suppress(UnknownRequest):
                    engine.cancel(run.request.request_id, source="refused")
            return _submit_refused(exc)
        self.groups[rid] = [run.request.request_id for run in runs]
        while len(self.groups) > self.retained_max:
            self.groups.popitem(last=False)
        shapes = [attrs.evolve(parsed, index=i) for i in range(len(runs))]
        for run, shape in zip(runs, shapes):
            self.retain(run.request.request_id, shape)
        created, cid = int(time.time()), f"cmpl-{rid}"
        headers = {"X-Request-Id": rid, **_ignored(parsed)}
        if parsed.stream:
            renderers = [Renderer(run, shape, self.name, created, cid=cid, choice=True)
                         for run, shape in zip(runs, shapes)]
            return _event_stream(follow_choices(runs, renderers, parsed, on_gone=self.gone), headers)
        answers = await self.answers(request, runs)
        for run, (_, last) in zip(runs, answers):
            if last.kind is not StreamEventKind.COMPLETED:
                return _error(terminal_error(finish_reason(last), last.error, run.request.request_id), rid)
        order = sorted(range(len(runs)), key=lambda i: -runs[i].sampler.logprob_sum)[: parsed.n] \
            if parsed.best_of > parsed.n else list(range(parsed.n))
        done = [(answers[i][0].decode("utf-8", "replace"), finish_fields(finish_reason(answers[i][1]),
                                                                         runs[i].result().stop)) for i in order]
        reports = [whole_report(runs[i], parsed, answers[i][0]) for i in order]
        usage = choices_usage([last.usage for _, last in answers])
        more = tuple(choice_body(parsed, k, text, finish, report=reports[k]) for k, (text, finish) in enumerate(done) if k)
        return JSONResponse(completion_body(parsed, cid, created, self.name, *done[0], usage, more=more,
                                            report=reports[0]), headers=headers)

    # ---- one request: resume and cancel (D5) ----------------------------------------------

    async def events(self, request: HttpRequest) -> Response:
        rid = request.path_params["request_id"]
        if rid in self.groups:
            return _error(ApiError(409, f"request {rid} has {len(self.groups[rid])} choices, each its own stream: "
                                        f"resume one at /v1/requests/{rid}.<index>/events", param="request_id",
                                   code="request_has_choices"))
        try:
            run = self.engine.get(rid)
        except UnknownRequest as exc:
            return _error(ApiError(404, str(exc), param="request_id", code="request_not_found"))
        last = request.headers.get("last-event-id")
        after: int | None = None
        if last is not None:
            if not _SEQ.fullmatch(last):  # int() would take "+3", " 3" and "3_0"
                return _error(ApiError(400, f"Last-Event-ID must be a seq (digits only), got {last[:40]!r}",
                                       param="Last-Event-ID", code="invalid_value"))
            after = int(last)
        refusal = run.stream.resume_refusal(after)
        if refusal is not None:  # an id this server never sent cannot be the client's last (D5)
            return _error(ApiError(400, f"Last-Event-ID {after} for request {rid}: {refusal}", param="Last-Event-ID",
                                   code="invalid_value"))
        max_readers = self.config.max_readers
        if run.stream.open_readers >= max_readers:
            return _rate_limited(f"request {rid} already has {max_readers} readers (the most one request may "
                                 "have); close one first", "too_many_readers")
        parsed = self.views.get(rid)
        shared = parsed is not None  # a view not kept renders as a plain stream of its own
        if parsed is None:
            parsed = ParsedRequest(request=run.request, chat=False, stream=True, include_usage=True)

        def resume() -> StreamReader:
            # Made once the body is sent (a HEAD never makes one): this connection reads through
            # its own cursor and becomes the one backpressure follows; a connection still open
            # keeps its own view to the end and gets the role back when this one leaves (D5).
            run.stream.reconnect()
            return run.stream.reader(after, resume=True)

        return _event_stream(follow(run, self.frames(run, parsed, after, share=shared), resume,
                                    skip_start=after is not None, on_gone=self.gone), {"X-Request-Id": rid})

    def frames(self, run: RequestRun, parsed: ParsedRequest, after: int | None, *, share: bool = True
               ) -> AbstractContextManager[SharedFrames]:
        """The frames of `run`'s readers that start after seq `after` (None: from its start), each
        event rendered once for all of them (FrameShare); a resumed reader's report no per-token
        entries (Renderer.resumed)."""
        def renderer() -> Renderer:
            made = Renderer(run, parsed, self.name, int(time.time()))
            if after is not None:
                made.resumed()
            return made

        return self.share.joined(run, after, renderer, share=share)

    async def cancel(self, request: HttpRequest) -> Response:
        engine = self.engine
        rid = request.path_params["request_id"]
        if rid in self.groups:  # every choice of an n > 1 request (D34)
            accepted = [engine.cancel(c) for c in self.groups[rid]]
            states = [engine.get(c).state for c in self.groups[rid]]
            return JSONResponse({"id": rid, "cancelled": any(accepted), "state": states})
        try:
            one = engine.cancel(rid)
            run = engine.get(rid)
        except UnknownRequest as exc:
            return _error(ApiError(404, str(exc), param="request_id", code="request_not_found"))
        return JSONResponse({"id": rid, "cancelled": one, "state": run.state})

    # ---- the server ----------------------------------------------------------------------

    async def models(self, request: HttpRequest) -> Response:
        # max_model_len: the context the model runs with (§4.3, D10), named as vLLM names it
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "decodespec",
                                                         "max_model_len": self.engine.context_limit}]})

    async def metrics(self, request: HttpRequest) -> Response:
        return PlainTextResponse(prometheus_text(self.engine), media_type="text/plain; version=0.0.4")

    async def health(self, request: HttpRequest) -> Response:
        engine, watchdog_s = self.engine, self.config.watchdog_s
        if engine.failure is not None:
            return JSONResponse({"status": "failed", "error": repr(engine.failure)}, status_code=503)
        running = engine.step_running_s
        if watchdog_s is not None and running > watchdog_s:  # a step that does not return (D21)
            return JSONResponse({"status": "stalled", "step_running_s": round(running, 3),
                                 "error": f"the engine's step has run for {running:.1f} s (bound {watchdog_s:g} s)"},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": self.name, "step_running_s": round(running, 3)})

    async def openapi_json(self, request: HttpRequest) -> Response:
        return JSONResponse(self.schema)


# What a client leaving does, by ServerConfig.on_disconnect (D5).
_ON_DISCONNECT: dict[str, Callable[[_Api, RequestRun], None]] = {"continue": _Api.recorded, "cancel": _Api.abandoned}


_SUBMIT_REFUSALS = (QueueFull, EngineStopped, RequestError, DuplicateRequest)


def _submit_refused(exc: Exception) -> JSONResponse:
    """The answer to a request the engine refused at submit (one of _SUBMIT_REFUSALS)."""
    if isinstance(exc, QueueFull):
        return _rate_limited(str(exc), "queue_full")
    if isinstance(exc, EngineStopped):
        code = "engine_failed" if isinstance(exc, EngineFailed) else "shutting_down"
        return _error(ApiError(503, str(exc), code=code, type="server_error"))
    if isinstance(exc, RequestError):  # a prompt id the tokenizer cannot decode, say (D20)
        return _error(ApiError(400, str(exc), param=exc.field, code="invalid_value"))
    return _error(ApiError(409, str(exc), param="X-Request-Id", code="request_id_in_use"))


def create_app(engine: Engine, config: ServerConfig | None = None, **options: Any) -> Starlette:
    """The ASGI app over `engine`, configured by `config` or by ServerConfig's fields as keywords.
    With `manage_engine` the app starts the engine thread at startup and stops it (every live
    request cancelled) at shutdown."""
    if config is not None and options:
        raise TypeError(f"create_app takes a ServerConfig or its fields as keywords, not both ({sorted(options)})")
    api = _Api(engine, config or ServerConfig(**options))
    app = Starlette(routes=api.routes(), lifespan=api.lifespan, exception_handlers={HTTPException: _http_error})
    app.state.engine = engine
    return app


def _ignored(parsed: ParsedRequest) -> dict[str, str]:
    """The X-Decodespec-Ignored header: the request's fields accepted and not acted on (D30)."""
    return {IGNORED_HEADER: ", ".join(parsed.ignored)} if parsed.ignored else {}


async def _http_error(request: HttpRequest, exc: Exception) -> Response:
    """Routing errors (unknown path, wrong method) in the same JSON error shape."""
    status = getattr(exc, "status_code", 500)
    return _error(ApiError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}",
                           code="not_found" if status == 404 else "invalid_request"))


async def _watch_disconnect(request: HttpRequest, runs: Sequence[RequestRun], on_gone: Callable[[RequestRun], None]
                            ) -> None:
    """For a non-streamed request: when its client goes away before the answer, `on_gone(run)`
    for each of its runs not yet done.

    Its body has been read, so the next ASGI message is the disconnect: the watcher waits for it
    and costs nothing until then (a poll of `is_disconnected` five times a second cost 64 waiting
    requests a tenth of the event loop's core, taken from the model's threads). The caller cancels
    it once the answer is in."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for run in runs:
        if not run.done:
            on_gone(run)


HEADER_TIMEOUT_S = 10.0  # a connection must complete each request's headers this soon (slowloris)
# A lingering close reads on for at most this long and this many bytes (nginx's lingering_time is 30 s).
LINGER_S = 5.0
LINGER_BYTES = 64 << 20


class _LingeringTransport:
    """A connection's transport as uvicorn's protocol sees it: `close()` asks the protocol, which
    closes at once or lingers (`TimedH11Protocol.close`); everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, close: Callable[[], None], closing: Callable[[], bool]) -> None:
        self._transport, self.close, self.is_closing = transport, close, closing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _timed_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a header read timeout: a connection that has not completed a
    request's headers `header_timeout_s` after it opened (or after its last response) is answered
    408 and closed. uvicorn bounds only idle keep-alive, and any byte resets that bound. A response
    sent before the request's body arrived closes the connection.

    A close while the client may still be sending its request (an answer before its body, a 408 on
    its headers, a 400 on bad ones) lingers, as nginx's lingering close: the answer is sent and the
    connection half-closed, then what the client still sends is read and discarded until it
    closes, for at most LINGER_S and LINGER_BYTES. Closed with unread input, the connection would
    be reset, and a client that sends its whole body before reading (urllib, requests) would get
    `Connection reset by peer` instead of the answer."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _raw: asyncio.Transport
        _linger_timer: asyncio.TimerHandle | None = None
        _linger_left = -1  # bytes a lingering connection may still discard (-1: not lingering)

        def _client_sending(self) -> bool:
            """Whether the client may still be sending this request: its body, or headers begun."""
            state = self.conn.their_state
            return state is h11.SEND_BODY or state is h11.ERROR or (
                state is h11.IDLE and bool(self.conn.trailing_data[0]))

        def close(self) -> None:
            """Close the connection: at once, or lingering while the client may still be sending."""
            raw = self._raw
            if self._linger_left >= 0 or raw.is_closing():
                return
            if not (raw.can_write_eof() and self._client_sending()):
                raw.close()
                return
            self._linger_left = LINGER_BYTES
            self._disarm()
            self._unset_keepalive_if_required()
            raw.write_eof()  # once what is written is sent: the answer, then FIN
            raw.resume_reading()
            self._linger_timer = self.loop.call_later(LINGER_S, raw.close)

        def closing(self) -> bool:
            return self._linger_left >= 0 or self._raw.is_closing()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and (
                    self.cycle is None or self.cycle.response_complete):
                body = json.dumps(ApiError(408, f"the request headers did not arrive within {header_timeout_s:g} s",
                                           code="header_timeout").body()).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._raw = transport
            super().connection_made(_LingeringTransport(transport, self.close, self.closing))  # type: ignore[arg-type]
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._linger_left < 0:
                super().data_received(data)
                return
            self._linger_left -= len(data)  # lingering: read and discarded
            if self._linger_left < 0:
                self._raw.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are complete: its handler runs
                self._disarm()

        def on_response_complete(self) -> None:
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                # Answered before the body arrived (a 401, 408, 413, 415): its rest would be read
                # as the next request, so the connection closes (RFC 9112 §9.6).
                self.transport.close()
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

    return TimedH11Protocol


def uvicorn_config(app: Starlette, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                   header_timeout_s: float = HEADER_TIMEOUT_S, **kw: Any) -> Any:
    """The one uvicorn configuration of the server (the CLI and the tests): the h11 protocol with
    its header read timeout; the body's own timeout is the app's (`body_timeout_s`)."""
    import uvicorn

    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _NoQuery) for f in access.filters):
        access.addFilter(_NoQuery())
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=_timed_protocol(header_timeout_s),
                          **kw)


class _NoQuery(logging.Filter):
    """The access log shows a request's path, never its query string: a client may put a key there
    (refused, but it must not reach a log line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?...", *args[3:])
        return True


def reference_server(config: Any, engine: Engine, shutdown_timeout_s: float) -> Any:
    """The uvicorn Server of `decodespec serve` (`.run()` until SIGINT/SIGTERM), whose shutdown
    stays within `shutdown_timeout_s` (D5): new connections are refused at once; live requests get
    half the bound to finish; the rest are cancelled, so every open stream still receives its
    terminal event before its connection closes; past the bound uvicorn closes what is left. An
    engine that fails (D21) shuts the server down the same way (the CLI then exits 1)."""
    import uvicorn

    class ReferenceServer(uvicorn.Server):
        async def on_tick(self, counter: int) -> bool:
            if engine.failure is not None and not self.should_exit:  # the engine cannot go on (D21)
                logging.getLogger("decodespec.server").critical(
                    "the engine failed (%s); the server shuts down", engine.failure)
                self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets: list | None = None) -> None:
            for server in self.servers:
                server.close()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + shutdown_timeout_s / 2
            while not engine.idle and loop.time() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            await loop.run_in_executor(None, engine.stop)  # the rest: cancelled, terminal events sent
            await super().shutdown(sockets)

    config.timeout_graceful_shutdown = shutdown_timeout_s / 2
    return ReferenceServer(config)


def prometheus_text(engine: Engine) -> str:
    """The Engine's counters in the Prometheus text exposition format."""
    s = engine.stats()
    gauges = {
        "queue_depth": (s.queue_depth, "requests waiting for admission"),
        "active_slots": (s.active_slots, "sequences resident in the batch"),
        "parked_requests": (s.parked, "resident sequences held back by a slow reader (§4.8)"),
        "parked_longest_seconds": (round(s.parked_longest_s, 3), "how long the longest-parked sequence has waited"),
        "swapped_requests": (s.swapped, "preempted sequences waiting to resume (§4.8)"),
        "cache_tokens_in_use": (s.cache_tokens_in_use, "KV cache tokens held on the device"),
        "cache_bytes_in_use": (s.cache_bytes_in_use, "KV cache bytes held on the device"),
        "swapped_bytes": (s.swapped_bytes, "KV cache bytes swapped out to host memory"),
        "live_requests": (s.live_requests, "requests not yet in a terminal state"),
        "engine_step_seconds": (round(s.step_running_s, 3), "how long the engine step now running has run (watchdog)"),
    }
    lines = []
    for key, (value, help_text) in gauges.items():
        lines += [f"# HELP decodespec_{key} {help_text}", f"# TYPE decodespec_{key} gauge", f"decodespec_{key} {value}"]
    lines += ["# HELP decodespec_requests_total requests by terminal state and finish reason (§4.10)",
              "# TYPE decodespec_requests_total counter"]
    for (state, reason), n in sorted(s.requests_total.items()):
        lines.append(f'decodespec_requests_total{{state="{state}",finish_reason="{reason}"}} {n}')
    for key, value, help_text in (("preemptions_total", s.preemptions_total, "sequences preempted (§4.8)"),
                                  ("decode_tokens_total", s.decode_tokens_total, "tokens written by decode steps"),
                                  ("steps_total", s.steps_total, "scheduler iterations of the engine")):
        lines += [f"# HELP decodespec_{key} {help_text}", f"# TYPE decodespec_{key} counter",
                  f"decodespec_{key} {value}"]
    return "\n".join(lines) + "\n"
