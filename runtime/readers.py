"""The readers of one ordered stream (§4.7 rules 1-4, §4.8, DECISIONS D5).

Each HTTP connection of a request reads through its own `StreamReader`, a cursor over the stream's
retained log. `Readers` keeps which of them are open, numbers them, and knows the *primary* one:
the newest reader still open, whose reads are what backpressure counts (§4.8). The stream
(runtime/stream.py) owns the log, the lock and the unread counts; everything here runs with its
lock held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .events import EventKind

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .stream import OrderedStream, StreamEvent


def seq_of(entry: StreamEvent | tuple[int, bytes]) -> int | None:
    """The seq of a log entry (a delta is logged as its (seq, data) pair)."""
    return entry[0] if isinstance(entry, tuple) else entry.seq


class Readers:
    """The readers of one stream: each one's number, the ones still open (oldest first: the primary
    role's heirs) and the primary one (D5). Lock held by the stream."""

    __slots__ = ("made", "open", "primary")

    def __init__(self) -> None:
        self.made = 0  # readers made so far (each one's number)
        self.open: list[StreamReader] = []
        self.primary: StreamReader | None = None  # the reader whose reads backpressure counts

    def add(self, stream: OrderedStream, index: int, after_seq: int | None, resume: bool) -> StreamReader:
        """A new reader of `stream` from log index `index`; the newest one is primary."""
        number = self.made
        self.made = number + 1
        r = StreamReader(stream, index, number, after_seq, resume)
        self.primary = r
        self.open.append(r)
        return r

    def leave(self, r: StreamReader) -> bool:
        """`r` closed: when it was the primary one, the newest reader still open takes the role
        (its reads count from the producer's cursor on). True when it was the primary one and no
        reader is left: the client is gone (a disconnect, D5)."""
        if r not in self.open:
            return False
        self.open.remove(r)
        if r is not self.primary:
            return False
        self.primary = self.open[-1] if self.open else None
        return self.primary is None


class StreamReader:
    """One reader's cursor over an OrderedStream's log (`OrderedStream.reader`): each HTTP connection
    of a request reads through its own, so a reconnect never steals events from, nor loses events
    to, a connection that is still open. Each reader is numbered (`number`, 0 the first) and, on a
    traced stream, records `stream.reader_opened` and one `stream.delivered` per event handed out:
    the per-reader delivery trace the §4.7 monitor `reader_delivery_complete` checks."""

    __slots__ = ("stream", "index", "number", "_run")

    def __init__(self, stream: OrderedStream, index: int, number: int, after_seq: int | None, resume: bool) -> None:
        self.stream, self.index, self.number = stream, index, number
        self._run: list[Any] | None = None  # [first seq, last seq, count] handed out since the last record
        if stream._trace is not None:
            log = stream._log
            first = seq_of(log[index]) if index < len(log) else stream._next_seq
            stream._trace.emit(EventKind.READER_OPENED, reader=number, after=after_seq, resume=resume, first=first)

    @property
    def primary(self) -> bool:
        return self.stream._readers.primary is self

    def _next(self) -> tuple[StreamEvent | None, bool]:
        st = self.stream
        ev = st._take_for(self)
        if ev is not None:
            if st._trace is not None:
                run = self._run
                if run is None:
                    self._run = [ev.seq, ev.seq, 1]
                else:
                    run[1] = ev.seq
                    run[2] += 1
            if ev.terminal:  # done: it leaves the readers that may hold the primary role
                if st._trace is not None:
                    self._record(terminal=True)
                st._readers.leave(self)
            return ev, False
        return None, st._st.terminal and self.index >= len(st._log)

    def _record(self, *, terminal: bool = False, closed: bool = False) -> None:
        """One stream.delivered entry for the events handed out since the last one (first, last,
        count): a reader's deliveries cost one trace entry, not one per event (D5)."""
        run, self._run = self._run, None
        trace = self.stream._trace
        if trace is not None and (run is not None or closed):
            first, last, count = run or (None, None, 0)
            trace.emit(EventKind.DELIVERED, reader=self.number, first=first, seq=last, count=count,
                       terminal=terminal, closed=closed)

    def close(self) -> bool:
        """This reader leaves (its connection closed). True when it held the primary role and no
        reader is left to take it: the client is gone (D5). Closing twice changes nothing."""
        st = self.stream
        with st._cond:
            if self not in st._readers.open:
                return False
            if st._trace is not None:
                self._record(closed=True)
            return st._readers.leave(self)

    async def aget(self) -> StreamEvent | None:
        """The next event for this reader (None once it has had the terminal one); never blocks the loop."""
        got: StreamEvent | None = await self.stream._await(self._next)
        return got

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        while (ev := await self.aget()) is not None:
            yield ev
            if ev.terminal:
                return

    async def abatch(self) -> list[StreamEvent]:
        """For a reader of the whole answer (a response that is not streamed): every event this
        reader can take, once the stream has ended or its unread deltas reach half a cap; empty
        once the terminal event was had. Its task is woken a few times per request, not once per
        token (D61); the producer still never waits for it before a cap (§4.8)."""
        st = self.stream

        def ready() -> tuple[list[StreamEvent] | None, bool]:
            if st._st.state is st._st_open and not st._half_full():  # ended, paused or past OPEN: read now
                return None, False
            got: list[StreamEvent] = []
            while True:
                ev, done = self._next()
                if ev is None:
                    return got or None, done
                got.append(ev)
                if ev.terminal:
                    return got, True

        batch: list[StreamEvent] = await st._await(ready, bulk=True) or []
        return batch
