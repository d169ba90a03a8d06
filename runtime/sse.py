"""The SSE side of the reference server (§4.7): one request's stream events as OpenAI chunks.

`Renderer` turns a run's stream events into SSE frames (each delta carries `id: <seq>`, so a
reconnect after Last-Event-ID resumes exactly after it), once for all the readers that start at
one point of a stream (`SharedFrames`, kept by `FrameShare`); `follow` and `follow_choices` read a
stream (or the n streams of an n > 1 request, D34) up to its terminal event; `collect` reads a
whole answer for a response that is not streamed. A reader that leaves early calls `on_gone`
(the client is gone: a disconnect, D5).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from ..spec import FinishReason
from .alignment import Releaser
from .channels import Splitter, merged, wire_finish
from .openai_schema import (
    ParsedRequest,
    channel_delta,
    choices_usage,
    chunk,
    finish_fields,
    openai_usage,
    report_fields,
    terminal_error,
)
from .readers import StreamReader
from .runner import RequestRun
from .stream_events import StreamEvent, StreamEventKind

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any, *, seq: int | str | None = None, event: str | None = None) -> bytes:
    """One SSE frame: `id:` and `event:` lines when given, then `data:` (JSON unless a string)."""
    head = (f"id: {seq}\n" if seq is not None else "") + (f"event: {event}\n" if event else "")
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"{head}data: {body}\n\n".encode()


def splitter_for(parsed: ParsedRequest) -> Splitter | None:
    """The channel split of a chat answer whose server parses reasoning or tool calls (D45-D47)."""
    if not parsed.chat or not (parsed.reasoning or parsed.tools):
        return None
    return Splitter(reasoning=parsed.reasoning, tools=parsed.tools)


class Renderer:
    """Turns one request's stream events into SSE frames (one renderer per HTTP response)."""

    def __init__(self, run: RequestRun, parsed: ParsedRequest, model: str, created: int, *,
                 cid: str | None = None, choice: bool = False) -> None:
        """`choice`: one choice of an n > 1 stream (D34): its frames carry `id: <index>.<seq>`, and
        the usage and [DONE] come once, after every choice has ended (follow_choices)."""
        self.run, self.parsed, self.model, self.created = run, parsed, model, created
        self.cid = cid or f"cmpl-{run.request.request_id}"
        self.choice = choice
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.split = splitter_for(parsed)
        # Per-token entries (logprobs, token ids) go with the chunk whose text they spell (D59); a
        # chat delta the split holds back sends no chunk, and its entries wait for the next one.
        self.releaser = Releaser(run) if parsed.reports_tokens else None
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
            return [sse(chunk(p, self.cid, self.created, self.model, role=True, text=None if p.chat else ""))]
        if ev.kind is StreamEventKind.DELTA:
            text = self._utf8.decode(ev.data)
            entries = self.releaser.delta(ev.data) if self.releaser is not None else []
            if self.split is not None:  # a chat answer in channels (D45-D47): a held tag prefix sends nothing yet
                delta = channel_delta(merged(self.split.push(text)), self.call_id)
                if not delta:
                    self._pending += entries
                    return []
                return [sse(chunk(p, self.cid, self.created, self.model, delta=delta,
                                  report=self._report(entries, ev.seq)), seq=self._id(ev.seq))]
            return [sse(chunk(p, self.cid, self.created, self.model, text=text, report=self._report(entries, ev.seq)),
                        seq=self._id(ev.seq))]
        ended = finish_reason(ev)
        if ev.kind is StreamEventKind.COMPLETED:
            tail = self._utf8.decode(b"", final=True)
            reason, detail = finish_fields(ended, self.run.result().stop)
            report = self._report(self.releaser.finish() if self.releaser is not None else [])
            if self.split is not None:
                parts = self.split.push(tail) + self.split.finish(ended is FinishReason.TOOL_CALLS)
                last = chunk(p, self.cid, self.created, self.model, delta=channel_delta(merged(parts), self.call_id),
                             finish=(wire_finish(reason, self.split), detail), report=report)
            else:
                last = chunk(p, self.cid, self.created, self.model, text=tail or None, finish=(reason, detail),
                             report=report)
            out = [sse(last, seq=self._id(ev.seq))]
            if self.choice:
                return out
            if p.include_usage:
                out.append(sse(chunk(p, self.cid, self.created, self.model, usage=openai_usage(ev.usage))))
            return out + [sse("[DONE]")]
        err = terminal_error(ended, ev.error, self.run.request.request_id).body()
        err["error"]["decodespec"] = {"finish_reason": ended.value, "error": ev.error,
                                      "usage": ev.usage, "index": p.index}
        return [sse(err, seq=self._id(ev.seq), event="error")]


class SharedFrames:
    """The SSE bytes of one request's events for every reader that starts at the same point of its
    stream: each event rendered once, by the first of them to reach it, however many readers it has.
    Readers from one point get the same events in the same order (§4.7), so the one that reaches
    event `position` first has had every event before it rendered already (by itself or another)."""

    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer
        self._frames: list[bytes] = []  # the bytes of each event from the start point, in order
        self.readers = 0

    def frames(self, position: int, ev: StreamEvent) -> bytes:
        """The bytes of `ev`, the `position`-th event from the start point (b"": nothing to send yet)."""
        done = len(self._frames)
        if position == done:
            self._frames.append(b"".join(self.renderer.frames(ev)))
        elif position > done:
            raise RuntimeError(f"a reader of request {ev.request_id} reached event {position} of its start point "
                               f"with {done} rendered: readers from one point read the same events in order")
        return self._frames[position]


class FrameShare:
    """The SharedFrames of the readers now open, by their request and start point: made for the
    first reader of a (run, start point), dropped when its last reader leaves."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, int | None], SharedFrames] = {}

    @contextlib.contextmanager
    def joined(self, run: RequestRun, after: int | None, renderer: Callable[[], Renderer], *,
               share: bool = True) -> Iterator[SharedFrames]:
        """The frames of `run`'s readers that start after seq `after` (None: from its start) while the
        caller reads; `renderer()` makes their renderer when no such reader is open. `share=False`:
        frames of the caller's own (a reader whose renderer differs from the others')."""
        key = (id(run), after)  # the run is held (by the renderer) while its key is in use
        shared = self._open.get(key) if share else None
        if shared is None:
            shared = SharedFrames(renderer())
            if share:
                self._open[key] = shared
        shared.readers += 1
        try:
            yield shared
        finally:
            shared.readers -= 1
            if not shared.readers and self._open.get(key) is shared:
                del self._open[key]


def whole_report(run: RequestRun, parsed: ParsedRequest, output: bytes) -> dict[str, Any] | None:
    """A non-stream choice's per-token fields: every selected token, in order (D59)."""
    if not parsed.reports_tokens:
        return None
    releaser = Releaser(run)
    return report_fields(parsed, releaser.delta(output) + releaser.finish(), run.tokenizer)


def finish_reason(ev: StreamEvent) -> FinishReason:
    """A terminal event's finish reason (§4.10: each terminal event carries one)."""
    if ev.finish_reason is None:
        raise ValueError(f"a {ev.kind} stream event without a finish reason (request {ev.request_id})")
    return ev.finish_reason


async def collect(run: RequestRun) -> tuple[bytes, StreamEvent]:
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
    if last is None or not last.terminal:  # §4.7: a stream ends with exactly one terminal event
        raise RuntimeError(f"the stream of request {run.request.request_id} ended without a terminal event")
    return bytes(text), last


async def follow_choices(runs: list[RequestRun], renderers: list[Renderer], parsed: ParsedRequest, *,
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
                yield sse(chunk(parsed, renderers[0].cid, renderers[0].created, renderers[0].model, usage=usage))
            yield sse("[DONE]")
    finally:
        for t in tasks:
            t.cancel()
        for i, (run, reader) in enumerate(zip(runs, readers)):  # each reader leaves, as in follow
            if reader.close() and i not in ends and not run.stream.closed:
                on_gone(run)


async def follow(run: RequestRun, frames: AbstractContextManager[SharedFrames], open_reader: Callable[[], StreamReader],
                 *, skip_start: bool = False, on_gone: Callable[[RequestRun], None]) -> AsyncIterator[bytes]:
    """The SSE bytes of every event the reader that `open_reader()` makes gets, up to the terminal
    one, from the frames its start point shares (`frames`, FrameShare.joined, entered once the
    response is sent; `skip_start`: the client already has the start frame), the events it can
    take at once in one write (a reader behind costs one wake-up and one write). The reader closes when
    the response ends; leaving early while it holds the primary role and no other reader is left
    to take it calls `on_gone` (the client is gone: a disconnect, D5)."""
    with frames as shared:
        reader = open_reader()
        ended, position = False, 0
        try:
            while not ended and (events := await reader.aready()):
                ended = events[-1].terminal
                if skip_start:
                    events = [ev for ev in events if ev.kind is not StreamEventKind.START]
                data = b"".join(shared.frames(position + i, ev) for i, ev in enumerate(events))
                position += len(events)
                if data:
                    yield data
        finally:
            if reader.close() and not ended:
                on_gone(run)
