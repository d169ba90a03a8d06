"""A small OpenAI-compatible gateway for the tests: a pass-through in front of one worker (decodespec
serve), on 127.0.0.1 in this process, that can be told to misbehave the ways a router or proxy can.

`gateway_app(upstream, fault)` forwards every request to `upstream` and relays the answer, a stream
event by event as it arrives; `fault` (a key of FAULTS, or None for an honest gateway) names the one
thing it does wrong: re-streaming (events reordered, the finish chunk moved before the last text,
empty chunks added, the usage chunk or `[DONE]` dropped), request fields dropped on the way in (the
per-token reports: logprobs and vLLM's return_token_ids), a
worker's 4xx answered as a 200 or a 502, or a client's disconnect not carried to the worker (it
reads the worker's stream to its end).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

Events = AsyncIterator[str]  # the `data:` payloads of a stream, [DONE] included


def _text(chunk: dict[str, Any]) -> str | None:
    """A chunk's text (completions' text, chat's delta content); None where it has no choice."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    return c.get("text") if "text" in c else (c.get("delta") or {}).get("content")


def _with_text(chunk: dict[str, Any], text: str) -> dict[str, Any]:
    c = dict(chunk["choices"][0])
    if "text" in c:
        c["text"] = text
    else:
        c["delta"] = {**(c.get("delta") or {}), "content": text}
    return {**chunk, "choices": [c, *chunk["choices"][1:]]}


def _finish(chunk: dict[str, Any]) -> bool:
    return any(c.get("finish_reason") for c in chunk.get("choices") or [])


async def _swap_first_two_texts(events: Events) -> Events:
    held: str | None = None
    swapped = False
    async for e in events:
        text = None if e == "[DONE]" else _text(json.loads(e))
        if swapped or not text:
            if held is not None and e == "[DONE]":
                yield held
                held = None
            yield e
        elif held is None:
            held = e
        else:
            yield e
            yield held
            held, swapped = None, True


async def _finish_before_last_text(events: Events) -> Events:
    held: str | None = None
    async for e in events:
        chunk = None if e == "[DONE]" else json.loads(e)
        if chunk is not None and _finish(chunk) and not _text(chunk) and held is not None:
            yield e
            yield held
            held = None
            continue
        if held is not None:
            yield held
            held = None
        if chunk is not None and _text(chunk) and not _finish(chunk):
            held = e
        else:
            yield e
    if held is not None:
        yield held


async def _empty_before_each_text(events: Events) -> Events:
    async for e in events:
        chunk = None if e == "[DONE]" else json.loads(e)
        if chunk is not None and _text(chunk):
            yield json.dumps(_with_text(chunk, ""))
        yield e


async def _without_usage(events: Events) -> Events:
    async for e in events:
        if e == "[DONE]" or json.loads(e).get("choices") or not json.loads(e).get("usage"):
            yield e


async def _without_done(events: Events) -> Events:
    async for e in events:
        if e != "[DONE]":
            yield e


@attrs.frozen
class Fault:
    """One misbehaviour: a rewrite of the stream's events, a field dropped from the request, the
    status a worker's 4xx is answered with, or the worker's stream read on after the client left."""

    events: Callable[[Events], Events] | None = None
    drop: tuple[str, ...] = ()
    error_status: int | None = None
    keeps_reading: bool = False


FAULTS: dict[str, Fault] = {
    "reorder": Fault(events=_swap_first_two_texts),
    "finish_early": Fault(events=_finish_before_last_text),
    "empty_chunks": Fault(events=_empty_before_each_text),
    "drop_usage": Fault(events=_without_usage),
    "drop_done": Fault(events=_without_done),
    "drop_stop": Fault(drop=("stop",)),
    "drop_max_tokens": Fault(drop=("max_tokens",)),
    "drop_n": Fault(drop=("n",)),
    "drop_token_reports": Fault(drop=("logprobs", "return_token_ids")),
    "error_as_200": Fault(error_status=200),
    "error_as_502": Fault(error_status=502),
    "keeps_reading": Fault(keeps_reading=True),
}
HONEST = Fault()
_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def _headers(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower() not in _HOP and k.lower() != "x-request-id"}


async def _lines(r: httpx.Response) -> Events:
    async for line in r.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


def gateway_app(upstream: str, fault: str | None = None) -> Starlette:
    """The gateway in front of `upstream` (its base URL), doing FAULTS[fault] wrong (None: nothing)."""
    f = HONEST if fault is None else FAULTS[fault]
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(120.0))
    drains: set[asyncio.Task[None]] = set()

    async def forward(request: Request) -> Response:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if request.method == "GET":
            r = await client.get(path)
            return Response(r.content, r.status_code, _headers(r))
        body = json.loads(await request.body() or b"{}")
        for field in f.drop:
            body.pop(field, None)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("last-event-id", "authorization")}
        r = await client.send(client.build_request("POST", path, json=body, headers=headers), stream=True)
        if r.status_code >= 400 or not body.get("stream"):
            content = await r.aread()
            await r.aclose()
            status = f.error_status if (f.error_status is not None and 400 <= r.status_code < 500) else r.status_code
            return Response(content, status, _headers(r))
        return StreamingResponse(relay(request, r), r.status_code, _headers(r))

    async def relay(request: Request, r: httpx.Response) -> AsyncIterator[str]:
        """The worker's stream, event by event; the client's disconnect (its ASGI message, watched
        apart: a send to a gone client need not fail) ends the worker's stream, or, keeping reading,
        does not."""
        queue: asyncio.Queue[str | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for e in (f.events or (lambda x: x))(_lines(r)):
                    await queue.put(e)
            finally:
                await r.aclose()
                await queue.put(None)

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            if f.keeps_reading:  # the client left: read the worker's stream on to its end
                drains.add(task)
                task.add_done_callback(drains.discard)
            else:
                task.cancel()
            await queue.put(None)

        task = asyncio.create_task(pump())
        watcher = asyncio.create_task(watch())
        try:
            while (e := await queue.get()) is not None:
                yield f"data: {e}\n\n"
        finally:
            watcher.cancel()

    # what gateways serve: the two generation endpoints, the model list, the worker's gauges; no
    # per-request path (a cancel by X-Request-Id), so a client that leaves can only disconnect
    routes = [Route(p, forward, methods=["POST"]) for p in ("/v1/completions", "/v1/chat/completions")]
    routes += [Route(p, forward, methods=["GET"]) for p in ("/v1/models", "/metrics", "/health")]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)
