"""The readers of a stream (§4.7 rules 1-4, §4.8, DECISIONS D5): each HTTP connection of a
request reads through its own cursor over the stream's log, so a reconnect never steals events
from, nor loses events to, a connection that is still open.

A reader reads through `ReadSource`, the surface its stream offers (runtime/stream.OrderedStream
has it): the event at a log index, whether the log has ended there, the stream's lock and its
asyncio wait. `Readers` numbers a stream's readers and holds the primary role: the newest reader
still open is the one whose reads backpressure counts. Nothing here imports the stream.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from .events import EventKind, Trace
from .stream_events import StreamEvent

T = TypeVar("T")


class ReadSource(Protocol):
    """What a reader reads through (its stream); every call but `wait_for` is made with `lock` held."""

    @property
    def lock(self) -> threading.Condition: ...

    @property
    def trace(self) -> Trace | None: ...

    def read_at(self, index: int, counted: bool) -> StreamEvent | None:
        """The event at log `index` (None past the end); a `counted` read is the stream's own (§4.8)."""

    def ended_at(self, index: int) -> bool:
        """The stream has ended and its log holds nothing at `index` or after."""

    def seq_at(self, index: int) -> int | None:
        """The seq of the event at log `index`, or the next seq past the end."""

    def bulk_ready(self) -> bool:
        """A whole-answer reader should read now (the stream left its open state or is half full)."""

    async def wait_for(self, step: Callable[[], tuple[T | None, bool]], bulk: bool = False) -> T | None:
        """Call `step` until it gives something or says it is done, waiting for the producer between calls."""


class StreamReader:
    """One reader's cursor over its stream's log (`OrderedStream.reader`). Each reader is numbered
    (`number`, 0 the first) and, on a traced stream, records `stream.reader_opened` and one
    `stream.delivered` per run of events handed out: the per-reader delivery trace the §4.7 monitor
    `reader_delivery_complete` checks."""

    __slots__ = ("stream", "index", "number", "_readers", "_run", "_trace")

    def __init__(self, stream: ReadSource, readers: Readers, index: int, number: int, after_seq: int | None,
                 resume: bool) -> None:
        self.stream, self.index, self.number = stream, index, number
        self._readers = readers
        self._run: list[Any] | None = None  # [first seq, last seq, count] handed out since the last record
        self._trace = stream.trace
        if self._trace is not None:
            self._trace.emit(EventKind.READER_OPENED, reader=number, after=after_seq, resume=resume,
                             first=stream.seq_at(index))

    @property
    def primary(self) -> bool:
        return self._readers.primary is self

    def _next(self) -> tuple[StreamEvent | None, bool]:
        """The next event for this reader and whether it is done (lock held); the primary reader's
        reads count as the stream's."""
        st = self.stream
        ev = st.read_at(self.index, self._readers.primary is self)
        if ev is None:
            return None, st.ended_at(self.index)
        self.index += 1
        if self._trace is not None:
            run = self._run
            if run is None:
                self._run = [ev.seq, ev.seq, 1]
            else:
                run[1] = ev.seq
                run[2] += 1
        if ev.terminal:  # done: it leaves the readers that may hold the primary role
            if self._trace is not None:
                self._record(terminal=True)
            self._readers.leave(self)
        return ev, False

    def _record(self, *, terminal: bool = False, closed: bool = False) -> None:
        """One stream.delivered entry for the events handed out since the last one (first, last,
        count): a reader's deliveries cost one trace entry, not one per event (D5)."""
        run, self._run = self._run, None
        if run is not None or closed:
            first, last, count = run or (None, None, 0)
            assert self._trace is not None, "a reader records its deliveries only on a traced stream"
            self._trace.emit(EventKind.DELIVERED, reader=self.number, first=first, seq=last, count=count,
                             terminal=terminal, closed=closed)

    def close(self) -> bool:
        """This reader leaves (its connection closed). True when it held the primary role and no
        reader is left to take it: the client is gone (D5). Closing twice changes nothing."""
        with self.stream.lock:
            if self not in self._readers.open:
                return False
            if self._trace is not None:
                self._record(closed=True)
            return self._readers.leave(self)

    async def aget(self) -> StreamEvent | None:
        """The next event for this reader (None once it has had the terminal one); never blocks the loop."""
        return await self.stream.wait_for(self._next)

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        while (ev := await self.aget()) is not None:
            yield ev
            if ev.terminal:
                return

    def _take_all(self) -> tuple[list[StreamEvent] | None, bool]:
        """Every event this reader can take now, up to the terminal one (None: none), and whether
        it is done (lock held)."""
        got: list[StreamEvent] = []
        while True:
            ev, done = self._next()
            if ev is None:
                return got or None, done
            got.append(ev)
            if ev.terminal:
                return got, True

    async def aready(self) -> list[StreamEvent]:
        """Every event this reader can take, once there is one: a reader behind the stream takes
        what it missed in one wake-up, not one per event; empty once it had the terminal event."""
        return await self.stream.wait_for(self._take_all) or []

    async def abatch(self) -> list[StreamEvent]:
        """For a reader of the whole answer (a response that is not streamed): every event this
        reader can take, once the stream has ended or its unread deltas reach half a cap; empty
        once the terminal event was had. Its task is woken a few times per request, not once per
        token (D61); the producer still never waits for it before a cap (§4.8)."""
        st = self.stream

        def ready() -> tuple[list[StreamEvent] | None, bool]:
            return self._take_all() if st.bulk_ready() else (None, False)

        return await st.wait_for(ready, bulk=True) or []


class Readers:
    """The readers of one stream (D5): how many were made (each one's number), the ones still
    open, oldest first, and the primary one, whose reads are what backpressure counts (§4.8).
    The newest reader takes the role; when the primary one leaves, the newest reader still open
    takes it. Called with the stream's lock held."""

    __slots__ = ("made", "open", "primary")

    def __init__(self) -> None:
        self.made = 0
        self.open: list[StreamReader] = []
        self.primary: StreamReader | None = None

    def add(self, stream: ReadSource, index: int, after_seq: int | None, resume: bool) -> StreamReader:
        """A new reader of `stream` from log `index`; it takes the primary role."""
        r = StreamReader(stream, self, index, self.made, after_seq, resume)
        self.made += 1
        self.primary = r
        self.open.append(r)
        return r

    def leave(self, r: StreamReader) -> bool:
        """A reader closed: when it was the primary one, the newest reader still open takes the
        role (its reads count from the stream's cursor on). True when it was the primary one and
        no reader is left: the client is gone (a disconnect, D5)."""
        if r not in self.open:
            return False
        self.open.remove(r)
        if r is not self.primary:
            return False
        self.primary = self.open[-1] if self.open else None
        return self.primary is None

    def __len__(self) -> int:
        return len(self.open)
