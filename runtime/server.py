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
import codecs
import collections
import contextlib
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
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
from .alignment import Releaser
from .channels import Splitter, merged, tool_close_token, wire_finish
from .engine import DuplicateRequest, Engine, EngineFailed, EngineStopped, QueueFull, UnknownRequest
from .errors import RequestError
from .openai_schema import (
    UTF8_GUARD_DEFAULTS,
    ApiError,
    ParsedRequest,
    channel_delta,
    chat_message,
    choice_body,
    choices_usage,
    chunk,
    compile_chat_template,
    completion_body,
    finish_fields,
    openai_usage,
    openapi,
    parse_completion,
    report_fields,
    terminal_error,
)
from .runner import RequestRun
from .stream import StreamEvent, StreamEventKind, StreamReader

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
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


def _sse(data: Any, *, seq: int | str | None = None, event: str | None = None) -> bytes:
    head = (f"id: {seq}\n" if seq is not None else "") + (f"event: {event}\n" if event else "")
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"{head}data: {body}\n\n".encode()


def splitter_for(parsed: ParsedRequest | None) -> Splitter | None:
    """The channel split of a chat answer whose server parses reasoning or tool calls (D45-D47)."""
    if parsed is None or not parsed.chat or not (parsed.reasoning or parsed.tools):
        return None
    return Splitter(reasoning=parsed.reasoning, tools=parsed.tools)


class _Renderer:
    """Turns one request's stream events into SSE frames (one renderer per HTTP response)."""

    def __init__(self, run: RequestRun, parsed: ParsedRequest | None, model: str, created: int, *,
                 cid: str | None = None, choice: bool = False) -> None:
        """`choice`: one choice of an n > 1 stream (D34): its frames carry `id: <index>.<seq>`, and
        the usage and [DONE] come once, after every choice has ended (_follow_choices)."""
        self.run, self.parsed, self.model, self.created = run, parsed, model, created
        self.cid = cid or f"cmpl-{run.request.request_id}"
        self.choice = choice
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.split = splitter_for(parsed)
        # Per-token entries (logprobs, token ids) go with the chunk whose text they spell (D59); a
        # chat delta the split holds back sends no chunk, and its entries wait for the next one.
        self.releaser = Releaser(run) if parsed is not None and parsed.reports_tokens else None
        self._pending: list[Any] = []

    def _report(self, entries: list[Any], seq: int | None = None) -> dict[str, Any] | None:
        """The chunk's per-token fields; for a delta (`seq`), also how many tokens the run had
        selected when it released it (`decodespec.selected`, the timeline hold-back is judged by)."""
        entries, self._pending = self._pending + entries, []
        if self.releaser is None:
            return None
        out = report_fields(self.parsed, entries, self.run.tokenizer)
        return out if seq is None else {**out, "decodespec": {"selected": self.releaser.selected(seq)}}

    def resumed(self) -> None:
        """A reader that resumes after Last-Event-ID begins mid-stream: it reports no per-token
        entries (the chunks before it, which it does not see, hold their share)."""
        self.releaser = None

    def call_id(self, index: int) -> str:
        return f"call_{self.run.request.request_id}_{index}"

    def _id(self, seq: int | None) -> int | str | None:
        return f"{self.parsed.index}.{seq}" if self.choice and seq is not None else seq

    def frames(self, ev: StreamEvent) -> list[bytes]:
        p = self.parsed
        if ev.kind is StreamEventKind.START:
            return [_sse(chunk(p, self.cid, self.created, self.model, role=True, text=None if p.chat else ""))]
        if ev.kind is StreamEventKind.DELTA:
            text = self._utf8.decode(ev.data)
            entries = self.releaser.delta(ev.data) if self.releaser is not None else []
            if self.split is not None:  # a chat answer in channels (D45-D47): a held tag prefix sends nothing yet
                delta = channel_delta(merged(self.split.push(text)), self.call_id)
                if not delta:
                    self._pending += entries
                    return []
                return [_sse(chunk(p, self.cid, self.created, self.model, delta=delta,
                                   report=self._report(entries, ev.seq)), seq=self._id(ev.seq))]
            return [_sse(chunk(p, self.cid, self.created, self.model, text=text, report=self._report(entries, ev.seq)),
                         seq=self._id(ev.seq))]
        if ev.kind is StreamEventKind.COMPLETED:
            tail = self._utf8.decode(b"", final=True)
            reason, detail = finish_fields(ev.finish_reason, self.run.result().stop)
            report = self._report(self.releaser.finish() if self.releaser is not None else [])
            if self.split is not None:
                parts = self.split.push(tail) + self.split.finish(ev.finish_reason is FinishReason.TOOL_CALLS)
                last = chunk(p, self.cid, self.created, self.model, delta=channel_delta(merged(parts), self.call_id),
                             finish=(wire_finish(reason, self.split), detail), report=report)
            else:
                last = chunk(p, self.cid, self.created, self.model, text=tail or None, finish=(reason, detail),
                             report=report)
            out = [_sse(last, seq=self._id(ev.seq))]
            if self.choice:
                return out
            if p.include_usage:
                out.append(_sse(chunk(p, self.cid, self.created, self.model, usage=openai_usage(ev.usage))))
            return out + [_sse("[DONE]")]
        err = terminal_error(ev.finish_reason, ev.error, self.run.request.request_id).body()
        err["error"]["decodespec"] = {"finish_reason": ev.finish_reason.value, "error": ev.error,
                                      "usage": ev.usage, "index": p.index}
        return [_sse(err, seq=self._id(ev.seq), event="error")]


def create_app(engine: Engine, *, model_name: str | None = None, policy: str = "pause",
               max_buffer_events: int = 256, manage_engine: bool = True, api_key: str | None = None,
               allowed_origins: frozenset[str] = frozenset(), max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = 30.0, on_disconnect: str = "continue", utf8_guard: str = "sampled",
               watchdog_s: float | None = 60.0, strict: bool = False, max_readers: int = 8,
               reasoning_parser: bool = False, tool_parser: bool = False) -> Starlette:
    """The ASGI app. With `manage_engine` the app starts the engine thread at startup and stops it
    (every live request cancelled) at shutdown. `api_key`, `allowed_origins`, `max_body_bytes`: see
    the module docstring. `body_timeout_s`: a body not fully received by then is a 408.
    `on_disconnect` ("continue", DECISIONS D5's default, or "cancel"): what a streaming request's
    disconnect does, and a non-streamed one's whose client chose its X-Request-Id; any other
    non-streamed request whose client leaves is cancelled (nobody can ever read its answer). `utf8_guard`: which requests that
    do not say get the UTF-8 guard, a key of UTF8_GUARD_DEFAULTS (DECISIONS D16). `watchdog_s`: /health
    answers 503 "stalled" while one engine step has run longer (None: never; DECISIONS D21). `strict`:
    only the strict request set (openai_schema.STRICT_FIELDS, n = 1; D30). `max_readers`:
    open readers one request may have (the first stream and each /events resume; 429 past it, D5).
    `reasoning_parser`: chat answers split `<think>` sections into reasoning_content (D45);
    `tool_parser`: chat requests with tools get Hermes `<tool_call>` calls as tool_calls (D47)."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("api_key must be None (no authentication) or a non-empty string")
    if isinstance(max_readers, bool) or not isinstance(max_readers, int) or max_readers < 1:
        raise ValueError(f"max_readers must be an int >= 1, got {max_readers!r}")
    if on_disconnect not in ("continue", "cancel"):
        raise ValueError(f"on_disconnect must be 'continue' or 'cancel', got {on_disconnect!r}")
    if utf8_guard not in UTF8_GUARD_DEFAULTS:
        raise ValueError(f"utf8_guard must be one of {', '.join(UTF8_GUARD_DEFAULTS)}, got {utf8_guard!r}")
    name = model_name or engine.model_name
    vocab_size = engine.model.vocab_size
    schema = openapi(name)
    chat_template = compile_chat_template(getattr(engine.tokenizer, "chat_template", None),
                                          getattr(engine.tokenizer, "template_tokens", {}))
    tool_close = tool_close_token(engine.tokenizer, vocab_size) if tool_parser else None
    views: collections.OrderedDict[str, ParsedRequest] = collections.OrderedDict()  # reconnect shape
    groups: collections.OrderedDict[str, list[str]] = collections.OrderedDict()  # n > 1: the choices' ids (D34)

    def parse(raw: bytes, chat: bool, request_id: str | None) -> ParsedRequest:
        return parse_completion(raw, chat=chat, model_name=name, context_limit=engine.context_limit,
                                vocab_size=vocab_size, tokenizer=engine.tokenizer, policy=policy,
                                max_buffer_events=max_buffer_events, chat_template=chat_template,
                                utf8_guard=utf8_guard, request_id=request_id, strict=strict,
                                reasoning=reasoning_parser, tool_parser=tool_parser, tool_close_id=tool_close)

    def recorded(run: RequestRun) -> None:
        """A streaming client left: recorded (D5), and the request runs on."""
        run.disconnect()

    gone = _cancelled(engine) if on_disconnect == "cancel" else recorded

    def guard(request: HttpRequest) -> None:
        """Auth, then origin and content type: a refusal names what is wrong (_Refused)."""
        if api_key is not None and request.url.path not in _OPEN_PATHS:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            # The scheme is case-insensitive (RFC 9110 §11.1); the key is compared in constant time.
            if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())):
                raise _Refused(ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                                        code="invalid_api_key", type="authentication_error"),
                               {"WWW-Authenticate": "Bearer"})
        if "content-length" in request.headers and "transfer-encoding" in request.headers:
            # RFC 9112 §6.1: a message with both may be an attempt at request smuggling; refused and closed.
            raise _Refused(ApiError(400, "a request may not carry both Content-Length and Transfer-Encoding",
                                    code="invalid_framing"), {"Connection": "close"})
        origin = request.headers.get("origin")
        if origin is not None and origin not in allowed_origins:
            raise _Refused(ApiError(403, f"Origin {origin[:80]!r} is not allowed (this server serves no browser "
                                         "pages; start it with allowed origins to permit one)", code="origin_refused"))
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if request.method == "POST" and ctype in _BROWSER_TYPES:
            raise _Refused(ApiError(415, f"Content-Type {ctype} is refused; send application/json",
                                    code="unsupported_media_type"))

    async def completions(request: HttpRequest, chat: bool) -> Response:
        try:
            raw = await asyncio.wait_for(_read_body(request, max_body_bytes), body_timeout_s)
        except ClientDisconnect:  # the client left while sending: nothing to answer, nothing to log
            return Response(status_code=400)
        except TimeoutError:
            return _error(ApiError(408, f"the body was not received within {body_timeout_s:g} s", code="body_timeout"))
        try:
            # Tokenizing a long prompt never blocks the loop.
            parsed = await run_in_threadpool(parse, raw, chat, request.headers.get("x-request-id"))
        except ApiError as exc:
            return _error(exc)
        if parsed.ignored:
            _LOG.info("request %s: %s accepted and not acted on (%s)", parsed.request.request_id,
                      ", ".join(parsed.ignored), IGNORED_HEADER)
        if parsed.best_of > 1:
            return await choices(request, parsed)
        try:
            run = engine.submit(parsed.request)
        except QueueFull as exc:
            return JSONResponse(ApiError(429, str(exc), code="queue_full", type="rate_limit_error").body(),
                                status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})
        except EngineStopped as exc:
            code = "engine_failed" if isinstance(exc, EngineFailed) else "shutting_down"
            return _error(ApiError(503, str(exc), code=code, type="server_error"))
        except RequestError as exc:  # a prompt id the tokenizer cannot decode, say (D20)
            return _error(ApiError(400, str(exc), param=exc.field, code="invalid_value"))
        except DuplicateRequest as exc:
            return _error(ApiError(409, str(exc), param="X-Request-Id", code="request_id_in_use"))
        rid = parsed.request.request_id
        retain(rid, parsed)
        renderer = _Renderer(run, parsed, name, int(time.time()))
        headers = {"X-Request-Id": rid, **_ignored(parsed)}
        if parsed.stream:
            return StreamingResponse(_follow(run, renderer, run.stream.reader, on_gone=gone),
                                     media_type="text/event-stream", headers=headers | _SSE_HEADERS)
        # A client that named its id can come back for the answer (/events): its disconnect follows
        # on_disconnect like a stream's. Nobody else can ever read this answer: it is cancelled.
        named = "x-request-id" in request.headers
        watch = asyncio.ensure_future(_watch_disconnect(request, [run], gone if named else _cancelled(engine)))
        try:
            text, last = await _collect(run)
        finally:
            watch.cancel()
        if last is None or last.kind is not StreamEventKind.COMPLETED:
            return _error(terminal_error(last.finish_reason, last.error, rid), rid)
        answer = text.decode("utf-8", "replace")
        reason, detail = finish_fields(last.finish_reason, run.result().stop)
        message = None
        if renderer.split is not None:  # the chat answer's channels (D45-D47)
            parts = renderer.split.push(answer) + renderer.split.finish(last.finish_reason is FinishReason.TOOL_CALLS)
            message = chat_message(merged(parts), renderer.call_id, reasoning=parsed.reasoning)
            reason = wire_finish(reason, renderer.split)
        body = completion_body(parsed, renderer.cid, renderer.created, name, answer, (reason, detail),
                               openai_usage(last.usage), message=message, report=whole_report(run, parsed, text))
        return JSONResponse(body, headers=headers)

    def retain(rid: str, parsed: ParsedRequest) -> None:
        views[rid] = parsed
        while len(views) > engine.max_retained + engine.max_queue + engine.max_batch:
            views.popitem(last=False)

    async def choices(request: HttpRequest, parsed: ParsedRequest) -> Response:
        """n choices, or the best n of best_of candidates (D34): one engine request each, with its
        own lifecycle, stream and finish reason; the answer is complete when every one has ended."""
        rid = parsed.request.request_id
        runs: list[RequestRun] = []
        try:
            for i in range(parsed.best_of):
                runs.append(engine.submit(parsed.choice(i)))
        except (QueueFull, EngineStopped, DuplicateRequest) as exc:
            for run in runs:
                with contextlib.suppress(UnknownRequest):
                    engine.cancel(run.request.request_id, source="refused")
            if isinstance(exc, QueueFull):
                return JSONResponse(ApiError(429, str(exc), code="queue_full", type="rate_limit_error").body(),
                                    status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})
            if isinstance(exc, EngineStopped):
                return _error(ApiError(503, str(exc), code="shutting_down", type="server_error"))
            return _error(ApiError(409, str(exc), param="X-Request-Id", code="request_id_in_use"))
        groups[rid] = [run.request.request_id for run in runs]
        while len(groups) > engine.max_retained + engine.max_queue + engine.max_batch:
            groups.popitem(last=False)
        shapes = [attrs.evolve(parsed, index=i) for i in range(len(runs))]
        for run, shape in zip(runs, shapes):
            retain(run.request.request_id, shape)
        created, cid = int(time.time()), f"cmpl-{rid}"
        headers = {"X-Request-Id": rid, **_ignored(parsed)}
        if parsed.stream:
            renderers = [_Renderer(run, shape, name, created, cid=cid, choice=True) for run, shape in zip(runs, shapes)]
            return StreamingResponse(_follow_choices(runs, renderers, parsed, on_gone=gone),
                                     media_type="text/event-stream", headers=headers | _SSE_HEADERS)
        named = "x-request-id" in request.headers
        watch = asyncio.ensure_future(_watch_disconnect(request, runs, gone if named else _cancelled(engine)))
        try:
            answers = await asyncio.gather(*(_collect(run) for run in runs))
        finally:
            watch.cancel()
        for run, (_, last) in zip(runs, answers):
            if last is None or last.kind is not StreamEventKind.COMPLETED:
                return _error(terminal_error(last.finish_reason, last.error, run.request.request_id), rid)
        order = sorted(range(len(runs)), key=lambda i: -runs[i].sampler.logprob_sum)[: parsed.n] \
            if parsed.best_of > parsed.n else list(range(parsed.n))
        done = [(answers[i][0].decode("utf-8", "replace"), finish_fields(answers[i][1].finish_reason,
                                                                         runs[i].result().stop)) for i in order]
        reports = [whole_report(runs[i], parsed, answers[i][0]) for i in order]
        usage = choices_usage([last.usage for _, last in answers])
        more = tuple(choice_body(parsed, k, text, finish, report=reports[k]) for k, (text, finish) in enumerate(done) if k)
        return JSONResponse(completion_body(parsed, cid, created, name, *done[0], usage, more=more, report=reports[0]),
                            headers=headers)

    async def events(request: HttpRequest) -> Response:
        rid = request.path_params["request_id"]
        if rid in groups:
            return _error(ApiError(409, f"request {rid} has {len(groups[rid])} choices, each its own stream: resume "
                                        f"one at /v1/requests/{rid}.<index>/events", param="request_id",
                                   code="request_has_choices"))
        try:
            run = engine.get(rid)
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
        if run.stream.open_readers >= max_readers:
            return JSONResponse(ApiError(429, f"request {rid} already has {max_readers} readers (the most one request "
                                              "may have); close one first", code="too_many_readers",
                                         type="rate_limit_error").body(),
                                status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})
        parsed = views.get(rid) or ParsedRequest(request=run.request, chat=False, stream=True, include_usage=True)

        def resume() -> StreamReader:
            # Made once the body is sent (a HEAD never makes one): this connection reads through
            # its own cursor and becomes the one backpressure follows; a connection still open
            # keeps its own view to the end and gets the role back when this one leaves (D5).
            run.stream.reconnect()
            return run.stream.reader(after, resume=True)

        renderer = _Renderer(run, parsed, name, int(time.time()))
        if after is not None:
            renderer.resumed()
        return StreamingResponse(_follow(run, renderer, resume, skip_start=after is not None, on_gone=gone),
                                 media_type="text/event-stream", headers={"X-Request-Id": rid} | _SSE_HEADERS)

    async def cancel(request: HttpRequest) -> Response:
        rid = request.path_params["request_id"]
        if rid in groups:  # every choice of an n > 1 request (D34)
            accepted = [engine.cancel(c) for c in groups[rid]]
            states = [engine.get(c).state for c in groups[rid]]
            return JSONResponse({"id": rid, "cancelled": any(accepted), "state": states})
        try:
            accepted = engine.cancel(rid)
            run = engine.get(rid)
        except UnknownRequest as exc:
            return _error(ApiError(404, str(exc), param="request_id", code="request_not_found"))
        return JSONResponse({"id": rid, "cancelled": accepted, "state": run.state})

    async def models(request: HttpRequest) -> Response:
        # max_model_len: the context the model runs with (§4.3, D10), named as vLLM names it
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "decodespec",
                                                         "max_model_len": engine.context_limit}]})

    async def metrics(request: HttpRequest) -> Response:
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    async def health(request: HttpRequest) -> Response:
        if engine.failure is not None:
            return JSONResponse({"status": "failed", "error": repr(engine.failure)}, status_code=503)
        running = engine.step_running_s
        if watchdog_s is not None and running > watchdog_s:  # a step that does not return (D21)
            return JSONResponse({"status": "stalled", "step_running_s": round(running, 3),
                                 "error": f"the engine's step has run for {running:.1f} s (bound {watchdog_s:g} s)"},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": name, "step_running_s": round(running, 3)})

    async def openapi_json(request: HttpRequest) -> Response:
        return JSONResponse(schema)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                engine.stop()

    async def text_completions(request: HttpRequest) -> Response:
        return await completions(request, chat=False)

    async def chat_completions(request: HttpRequest) -> Response:
        return await completions(request, chat=True)

    endpoints = [
        ("/v1/completions", text_completions, ["POST"]),
        ("/v1/chat/completions", chat_completions, ["POST"]),
        ("/v1/requests/{request_id}/events", events, ["GET"]),
        ("/v1/requests/{request_id}/cancel", cancel, ["POST"]),
        ("/v1/models", models, ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/health", health, ["GET"]),
        ("/openapi.json", openapi_json, ["GET"]),
    ]
    routes = [Route(path, _guarded(handler, guard), methods=methods) for path, handler, methods in endpoints]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.engine = engine
    return app


def whole_report(run: RequestRun, parsed: ParsedRequest, output: bytes) -> dict[str, Any] | None:
    """A non-stream choice's per-token fields: every selected token, in order (D59)."""
    if not parsed.reports_tokens:
        return None
    releaser = Releaser(run)
    return report_fields(parsed, releaser.delta(output) + releaser.finish(), run.tokenizer)


def _ignored(parsed: ParsedRequest) -> dict[str, str]:
    """The X-Decodespec-Ignored header: the request's fields accepted and not acted on (D30)."""
    return {IGNORED_HEADER: ", ".join(parsed.ignored)} if parsed.ignored else {}


async def _collect(run: RequestRun) -> tuple[bytes, StreamEvent | None]:
    """A whole answer (a response that is not streamed): its bytes and its terminal event, read
    in batches (StreamReader.abatch, D61); the reader is closed however the read ends."""
    text, last = bytearray(), None
    reader = run.stream.reader()
    try:
        while events := await reader.abatch():
            for ev in events:
                if ev.kind is StreamEventKind.DELTA:
                    text += ev.data
            last = events[-1]
    finally:
        reader.close()
    return bytes(text), last


async def _follow_choices(runs: list[RequestRun], renderers: list[_Renderer], parsed: ParsedRequest, *,
                          on_gone: Callable[[RequestRun], None]) -> AsyncIterator[bytes]:
    """The SSE frames of n choices as they come (D34): each choice's frames in its own order, with
    its own finish chunk or error event; once all have ended, the usage (include_usage) and [DONE]
    when every choice completed. A client that leaves early leaves every choice (on_gone)."""
    queue: asyncio.Queue[tuple[int, list[bytes] | None]] = asyncio.Queue()
    readers = [run.stream.reader() for run in runs]
    ends: dict[int, StreamEvent] = {}

    async def pump(i: int) -> None:
        while (ev := await readers[i].aget()) is not None:
            await queue.put((i, renderers[i].frames(ev)))
            if ev.terminal:
                ends[i] = ev
                break
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(runs))]
    open_ = len(runs)
    try:
        while open_:
            i, frames = await queue.get()
            if frames is None:
                open_ -= 1
                continue
            for frame in frames:
                yield frame
        if len(ends) == len(runs) and all(e.kind is StreamEventKind.COMPLETED for e in ends.values()):
            if parsed.include_usage:
                usage = choices_usage([ends[i].usage for i in range(len(runs))])
                yield _sse(chunk(parsed, renderers[0].cid, renderers[0].created, renderers[0].model, usage=usage))
            yield _sse("[DONE]")
    finally:
        for t in tasks:
            t.cancel()
        for i, (run, reader) in enumerate(zip(runs, readers)):  # each reader leaves, as in _follow
            if reader.close() and i not in ends and not run.stream.closed:
                on_gone(run)


def _guarded(handler, guard):
    async def run(request: HttpRequest) -> Response:
        try:
            guard(request)
            return await handler(request)
        except _Refused as exc:
            return JSONResponse(exc.error.body(), status_code=exc.error.status, headers=exc.headers)

    return run


async def _http_error(request: HttpRequest, exc: Exception) -> Response:
    """Routing errors (unknown path, wrong method) in the same JSON error shape."""
    status = getattr(exc, "status_code", 500)
    return _error(ApiError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}",
                           code="not_found" if status == 404 else "invalid_request"))


async def _follow(run: RequestRun, renderer: _Renderer, open_reader: Callable[[], StreamReader], *,
                  skip_start: bool = False, on_gone: Callable[[RequestRun], None]) -> AsyncIterator[bytes]:
    """SSE frames of every event the reader `open_reader()` makes gets, up to the terminal one
    (`skip_start`: the client already has the start frame). The reader closes when the response
    ends; leaving early while it holds the primary role and no other reader is left to take it
    calls `on_gone` (the client is gone: a disconnect, D5)."""
    reader = open_reader()
    ended = False
    try:
        while not ended and (ev := await reader.aget()) is not None:
            ended = ev.terminal
            if skip_start and ev.kind is StreamEventKind.START:
                continue
            for frame in renderer.frames(ev):
                yield frame
    finally:
        if reader.close() and not ended:
            on_gone(run)


def _cancelled(engine: Engine) -> Callable[[RequestRun], None]:
    """A disconnect that also cancels: the answer can never be delivered (D5)."""
    def gone(run: RequestRun) -> None:
        run.disconnect()
        with contextlib.suppress(UnknownRequest):
            engine.cancel(run.request.request_id, source="disconnect")

    return gone


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


def _timed_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a header read timeout: a connection that has not completed a
    request's headers `header_timeout_s` after it opened (or after its last response) is answered
    408 and closed. uvicorn bounds only idle keep-alive, and any byte resets that bound. A response
    sent before the request's body arrived closes the connection."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

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
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

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
