"""A small OpenAI-compatible gateway for the tests: a pass-through in front of one worker (decodespec
serve), on 127.0.0.1 in this process, that can be told to misbehave the ways a router or proxy can.

`gateway_app(upstreams, fault)` forwards each request to the next of its `upstreams` (round robin)
and relays the answer, a stream event by event as it arrives, each event with the SSE id its worker
gave it, and a resume (GET /v1/requests/{X-Request-Id}/events, Last-Event-ID) to the worker that
runs the request (D42); `fault` (a key of FAULTS, or None for an honest gateway) names the one thing
it does wrong: re-streaming (events reordered, the finish chunk moved before the last text, empty
chunks added, the usage chunk, `[DONE]` or the SSE ids dropped), the request's name (X-Request-Id)
withheld, request fields dropped on the way in (the per-token reports: logprobs and vLLM's
return_token_ids), a worker's 4xx answered as a 200 or a 502, a client's disconnect not carried to
the worker (it reads the worker's stream to its end), or a stream its worker broke off ended as if
whole (a finish chunk and `[DONE]`, where an honest gateway sends an error event and no `[DONE]`).
`Mortal` wraps a worker's app so that a test can make it fail mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


@attrs.frozen
class Event:
    """One SSE event as the gateway relays it: its `data:` payload ([DONE] included) and the `id:` its
    worker gave it (None: none)."""

    data: str
    id: str | None = None

    @property
    def chunk(self) -> dict[str, Any] | None:
        return None if self.data == "[DONE]" else json.loads(self.data)

    def sse(self) -> str:
        return (f"id: {self.id}\n" if self.id is not None else "") + f"data: {self.data}\n\n"


Events = AsyncIterator[Event]


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
    held: Event | None = None
    swapped = False
    async for e in events:
        text = None if e.chunk is None else _text(e.chunk)
        if swapped or not text:
            if held is not None and e.chunk is None:
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
    held: Event | None = None
    async for e in events:
        chunk = e.chunk
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
        if e.chunk is not None and _text(e.chunk):
            yield Event(json.dumps(_with_text(e.chunk, "")))
        yield e


async def _without_usage(events: Events) -> Events:
    async for e in events:
        if e.chunk is None or e.chunk.get("choices") or not e.chunk.get("usage"):
            yield e


async def _without_done(events: Events) -> Events:
    async for e in events:
        if e.chunk is not None:
            yield e


async def _without_ids(events: Events) -> Events:
    async for e in events:
        yield attrs.evolve(e, id=None)


@attrs.frozen
class Fault:
    """One misbehaviour: a rewrite of the stream's events, a field dropped from the request, the
    request's name withheld, the status a worker's 4xx is answered with, the worker's stream read on
    after the client left, or a stream its worker broke off ended as if whole."""

    events: Callable[[Events], Events] | None = None
    drop: tuple[str, ...] = ()
    hides_request_id: bool = False
    error_status: int | None = None
    keeps_reading: bool = False
    finishes_broken: bool = False


FAULTS: dict[str, Fault] = {
    "reorder": Fault(events=_swap_first_two_texts),
    "finish_early": Fault(events=_finish_before_last_text),
    "empty_chunks": Fault(events=_empty_before_each_text),
    "drop_usage": Fault(events=_without_usage),
    "drop_done": Fault(events=_without_done),
    "drop_ids": Fault(events=_without_ids),
    "hide_request_id": Fault(hides_request_id=True),
    "drop_stop": Fault(drop=("stop",)),
    "drop_max_tokens": Fault(drop=("max_tokens",)),
    "drop_n": Fault(drop=("n",)),
    "drop_token_reports": Fault(drop=("logprobs", "return_token_ids")),
    "error_as_200": Fault(error_status=200),
    "error_as_502": Fault(error_status=502),
    "keeps_reading": Fault(keeps_reading=True),
    "finishes_broken": Fault(finishes_broken=True),
}
HONEST = Fault()
_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def _headers(r: httpx.Response, fault: Fault) -> dict[str, str]:
    hidden = _HOP | ({"x-request-id"} if fault.hides_request_id else set())
    return {k: v for k, v in r.headers.items() if k.lower() not in hidden}


async def _events(r: httpx.Response) -> Events:
    """The worker's SSE events, each with its id (an id line applies to the event it is in)."""
    sse_id: str | None = None
    async for line in r.aiter_lines():
        if line.startswith("id:"):
            sse_id = line[3:].strip()
        elif line.startswith("data:"):
            yield Event(line[5:].strip(), sse_id)
            sse_id = None


def _broken_off(last: dict[str, Any] | None) -> list[Event]:
    """What a gateway that hides a worker's failure sends in place of the rest: a finish chunk ('stop')
    shaped as the last chunk it relayed, then [DONE]."""
    chunk = last or {"object": "text_completion", "choices": [{"index": 0, "text": ""}]}
    empty = {"index": 0, "text": ""} if "text" in (chunk.get("choices") or [{"text": ""}])[0] else {"index": 0, "delta": {}}
    return [Event(json.dumps({**chunk, "choices": [{**empty, "finish_reason": "stop"}]})), Event("[DONE]")]


# A gateway that reads on after its client left drains the worker at this pace per event: the
# worker's request then stays running (§4.8: its stream pauses on a full buffer) for as long as a
# real model would take, whatever the machine's load, so the gauges show the work going on (§4.9).
DRAIN_PACE_S = 0.02
_UPSTREAM_GONE = json.dumps({"error": {"message": "the worker's stream broke off", "type": "upstream_error",
                                       "code": 502}})


class Mortal:
    """A worker's ASGI app that can be made to fail (`kill`, from any thread): every response in
    progress breaks off mid-body (its connection drops, no terminal event), and every later request
    fails before an answer."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.dead = threading.Event()

    def kill(self) -> None:
        self.dead.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.dead.is_set():
            raise ConnectionAbortedError("the worker was stopped")

        async def guarded(message: dict[str, Any]) -> None:
            if scope["type"] == "http" and self.dead.is_set():
                raise ConnectionAbortedError("the worker was stopped mid-answer")
            await send(message)

        await self.app(scope, receive, guarded)


def gateway_app(upstreams: str | Sequence[str], fault: str | None = None) -> Starlette:
    """The gateway in front of `upstreams` (base URLs, taken in turn), doing FAULTS[fault] wrong
    (None: nothing)."""
    f = HONEST if fault is None else FAULTS[fault]
    urls = [upstreams] if isinstance(upstreams, str) else list(upstreams)
    clients = [httpx.AsyncClient(base_url=u, timeout=httpx.Timeout(120.0)) for u in urls]
    turn = itertools.cycle(clients)
    runs: dict[str, httpx.AsyncClient] = {}  # X-Request-Id -> the worker that runs it (a resume goes there)
    drains: set[asyncio.Task[None]] = set()

    async def metrics(request: Request) -> Response:
        """Every worker's gauges, one after the other (a client sums samples of the same name)."""
        texts = []
        for client in clients:
            with contextlib.suppress(httpx.HTTPError):
                r = await client.get(request.url.path)
                if r.status_code == 200:
                    texts.append(r.text)
        return Response("".join(texts), 200 if texts else 502, media_type="text/plain")

    async def forward(request: Request) -> Response:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("last-event-id", "authorization")}
        if request.method == "GET" and "request_id" in request.path_params:
            client = runs.get(request.path_params["request_id"])
            if client is None:
                return Response(json.dumps({"error": {"message": "no such request", "code": 404}}), 404)
            r = await client.send(client.build_request("GET", path, headers=headers), stream=True)
            return await answer(request, r, {"stream": True})
        client = next(turn)
        if request.method == "GET":
            r = await client.get(path)
            return Response(r.content, r.status_code, _headers(r, f))
        body = json.loads(await request.body() or b"{}")
        for field in f.drop:
            body.pop(field, None)
        try:
            r = await client.send(client.build_request("POST", path, json=body, headers=headers), stream=True)
        except httpx.HTTPError as exc:
            return Response(json.dumps({"error": {"message": f"the worker failed: {exc}", "code": 502}}), 502)
        if rid := r.headers.get("x-request-id"):
            runs[rid] = client
        return await answer(request, r, body)

    async def answer(request: Request, r: httpx.Response, body: dict[str, Any]) -> Response:
        if r.status_code >= 400 or not body.get("stream"):
            try:
                content = await r.aread()
            except httpx.HTTPError as exc:
                return Response(json.dumps({"error": {"message": f"the worker failed: {exc}", "code": 502}}), 502)
            finally:
                await r.aclose()
            status = f.error_status if (f.error_status is not None and 400 <= r.status_code < 500) else r.status_code
            return Response(content, status, _headers(r, f))
        return StreamingResponse(relay(request, r), r.status_code, _headers(r, f))

    async def relay(request: Request, r: httpx.Response) -> AsyncIterator[str]:
        """The worker's stream, event by event; the client's disconnect (its ASGI message, watched
        apart: a send to a gone client need not fail) ends the worker's stream, or, keeping reading,
        does not. A stream the worker breaks off ends with an error event and no [DONE] (or, hiding
        the failure, with a finish chunk and [DONE])."""
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        gone = asyncio.Event()  # the client disconnected

        async def pump() -> None:
            last: dict[str, Any] | None = None
            try:
                async for e in (f.events or (lambda x: x))(_events(r)):
                    last = e.chunk or last
                    await queue.put(e)
                    if gone.is_set():  # reading on for nobody, at a slow reader's pace
                        await asyncio.sleep(DRAIN_PACE_S)
            except httpx.HTTPError:
                for e in _broken_off(last) if f.finishes_broken else [Event(_UPSTREAM_GONE)]:
                    await queue.put(e)
            finally:
                await r.aclose()
                await queue.put(None)

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone.set()
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
                yield e.sse()
        finally:
            watcher.cancel()

    # what gateways serve: the two generation endpoints, a request's resume (D42), the model list,
    # the workers' gauges; no cancel path (a client that leaves can only disconnect)
    routes = [Route(p, forward, methods=["POST"]) for p in ("/v1/completions", "/v1/chat/completions")]
    routes += [Route("/v1/requests/{request_id}/events", forward, methods=["GET"])]
    routes += [Route(p, forward, methods=["GET"]) for p in ("/v1/models", "/health")]
    routes += [Route("/metrics", metrics, methods=["GET"])]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        for client in clients:
            await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)
