"""The ordered stream of one request (§4.7) with its bounded buffer (§4.8).

Control state lives in a `stream` stepper (spec/stream.toml); this module does the data work:
numbering, the retained log and its replay, the unread-buffer accounting and the producer's wait.
Beside it, one job each: what a reader receives (stream_events), the caps of the buffer and what
a full one does (backpressure), each connection's reader (readers: they read through the surface
this stream offers them, `ReadSource`) and the waking of asyncio readers (wakes). Those modules
know nothing of this one.

Invariants (checked by tests/test_stream.py):
- §4.7 rule 1: delta seq numbers are 0, 1, 2, ... with no gap; the terminal event takes the next one.
- §4.7 rule 3: exactly one terminal event (completed, cancelled or failed), after every delta; after
  it the table rejects everything but reads (replay, disconnect, reconnect).
- §4.8: unread deltas are bounded. `pause` stops the producer at the cap (`block`, then `unblock`
  once the reader has made room); `buffer` (cap `max_bytes`) and `fail` (cap `max_events`) never
  wait and fire `overflow` past the cap: failed(transport_error, "stream buffer overflow") and
  StreamOverflow for the producer (DECISIONS D6). Nothing is ever dropped silently; the terminal
  event has a reserved slot past the cap.
- The terminal transition, its append to the log and its trace event happen in one critical
  section, so a reader never sees a terminal state without its event (or the reverse).

Threads: one producer thread and one consumer (a thread, or an asyncio task through `aget`). The
asyncio readers a producer wakes inside `wakes.batched_wakes()` are woken once per event loop
(DECISIONS D57); `_sleep` flushes that batch before it blocks, since the reader it waits for may
be in it.
"""
from __future__ import annotations

import enum
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, TypeVar

import attrs

from ..machine import CompiledMachine, compiled_of, per_table
from ..machine.actions import ActionError, Executor, Plan, run_phases
from ..spec import FinishReason, SpecError, Table, default_spec
from ..spec.derived import stream_states
from .backpressure import OVERFLOW_ERROR, BackpressurePolicy, BufferCaps, StreamOverflow
from .events import EventKind, Trace
from .readers import Readers, StreamReader
from .stream_events import StreamEvent, StreamEventKind, finish_reason_of
from .wakes import Waiter, flush_wakes, wait_until, wake

T = TypeVar("T")
_PAUSE_POLICY = BackpressurePolicy.PAUSE
_RESPONSE_DELTA = EventKind.RESPONSE_DELTA.value  # a per-token entry carries the plain string (events.py)
_Entry = StreamEvent | tuple[int, bytes]  # a log entry: an event, or a delta as its (seq, data) pair

_TRACE_KIND = {  # the trace event of each terminal stream event
    StreamEventKind.COMPLETED: EventKind.RESPONSE_COMPLETED,
    StreamEventKind.CANCELLED: EventKind.RESPONSE_CANCELLED,
    StreamEventKind.FAILED: EventKind.RESPONSE_FAILED,
}


def _seq_of(entry: _Entry) -> int | None:
    return entry.seq if type(entry) is StreamEvent else entry[0]


class OrderedStream:
    """Producer/consumer stream with seq numbers, replay and a bounded unread buffer (§4.7, §4.8).

    `pause_timeout_s` (pause policy only): a producer that has waited that long for the reader fails
    the stream with transport_error and gets StreamOverflow (DECISIONS D5: a parked request whose
    reader is gone ends; None waits for ever). `usage_provider` gives the usage of an overflow's
    failed event, which the producer does not pass. `table`: the stream table it follows (default:
    the spec directory's; StreamRules).
    """

    # Slots: the engine reads these for every run at every step, just after the model has pushed
    # them out of the CPU caches.
    __slots__ = (
        "max_bytes", "max_events", "pause_timeout_s", "paused_s", "policy", "request_id",
        "_async_waiters", "_bulk_waiters", "_caps", "_cond", "_connected", "_cursor", "_inline_max", "_lock", "_log",
        "_next_seq", "_pending", "_readers", "_sleepers", "_st", "_trace", "_unread_bytes", "_unread_events",
        "_usage_provider", "_rules", "_st_open", "_st_paused", "_delta_fast", "_inline_open",
    )

    def __init__(
        self,
        request_id: str,
        *,
        policy: str | BackpressurePolicy = "pause",
        max_events: int = 256,
        max_bytes: int = 1 << 20,
        pause_timeout_s: float | None = None,
        usage_provider: Callable[[], Any] | None = None,
        trace: Trace | None = None,
        table: Table | None = None,
    ) -> None:
        caps = self._caps = BufferCaps(policy, max_events, max_bytes, pause_timeout_s)
        # read per delta or per step: a slot each
        self.policy, self.max_events, self.max_bytes = caps.policy, caps.max_events, caps.max_bytes
        self.pause_timeout_s = caps.pause_timeout_s
        # The largest delta `deliver` takes in its one critical section (BufferCaps.inline_max).
        self._inline_max = caps.inline_max
        self.request_id = request_id
        self._usage_provider = usage_provider
        self._trace = trace
        rules = self._rules = stream_rules(table or default_spec()["stream"])
        self._st = rules.machine.new()
        # read per delta: a slot each
        self._st_open, self._st_paused = rules.open, rules.paused
        self._delta_fast, self._inline_open = rules.delta_fast, rules.inline_open
        self._lock = threading.RLock()  # `with self._lock` on the per-delta paths: a C-level enter
        self._cond = threading.Condition(self._lock)
        # Every event, retained for replay. A delta is kept as its (seq, data) pair and becomes a
        # StreamEvent when read (`_event`): a producer that reads inline never builds one.
        self._log: list[_Entry] = []
        self._cursor = 0  # index in _log of the (primary) reader's next unread event
        self._readers = Readers()  # the connections' readers and the primary role (D5)
        self._unread_events = 0  # unread deltas (the terminal has its own slot)
        self._unread_bytes = 0
        self._pending = 0  # size of the delta a paused producer is waiting to send
        self.paused_s = 0.0  # seconds the producer waited for the reader (pause policy, §4.8)
        self._sleepers = 0  # threads in `_sleep`
        self._next_seq = 0
        self._connected = True
        self._async_waiters: list[Waiter] = []
        # asyncio readers of the whole answer (StreamReader.abatch): a delta wakes them only when
        # the unread buffer reaches half a cap; every other event wakes them as it wakes the rest.
        self._bulk_waiters: list[Waiter] = []

    # ---- producer side -------------------------------------------------------------------

    def start(self, model: str = "") -> None:
        """Send response.start (§4.7); it precedes every other event."""
        with self._cond:
            self._move("start", model=model)

    def delta(self, data: bytes) -> int | None:
        """Send `data` as the next delta and return its seq; empty data sends nothing (None).

        Pause policy: waits while the buffer is full (see class doc for the timeout). Buffer/fail
        policy: past the cap the stream fails and StreamOverflow is raised. After the terminal
        event: IllegalTransition.
        """
        if type(data) is not bytes:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"delta data must be bytes, got {type(data).__name__}")
            data = bytes(data)  # a private copy: the log must not change under the reader
        with self._lock:
            if not data:
                if self._st.state not in self._st_paused and not self._st.allows("delta"):
                    self._st.fire("delta")  # raises the table's IllegalTransition
                return None
            size = len(data)
            pause = self.policy is _PAUSE_POLICY
            if pause:
                if self._st.state is not self._st_open or not self._has_room(size):
                    self._wait_for_room(size)
            elif not self._caps.within_cap(self._unread_events, self._unread_bytes, size):
                raise StreamOverflow(self.request_id, self.overflow(), OVERFLOW_ERROR)
            # a row that is a self-loop only queues
            seq = self._queue(data) if self._st.state in self._delta_fast else self._move("delta", data=data)
            if pause and not self._has_room(1):
                self._move("block")
            return seq

    def deliver(self, data: bytes) -> int | None:
        """`delta(data)` for a producer that is its own reader (generate() reads inline): the
        delta is sent and taken at once, and every earlier unread event is taken with it.

        When nothing is unread, the delta fits (`BufferCaps.inline_max`), the table's `delta` row only
        queues it (`StreamRules.delta_fast`) and no other reader waits, this is one critical section: the
        delta is logged and traced as `_queue` does (`_log_delta`), the one unread event at that
        moment (with the cursor at the end of the log nothing else is unread), and the cursor
        passes it, so the unread counts stay 0. Otherwise it is `delta()` followed by reads.
        """
        if type(data) is bytes and 0 < len(data) <= self._inline_max:
            lock = self._lock
            lock.acquire()  # a `with` costs half as much again on this path
            try:
                log = self._log
                cursor = self._cursor
                if (cursor == len(log) and self._st.state is self._inline_open
                        and not (self._sleepers or self._async_waiters or self._bulk_waiters)):
                    seq: int | None = self._log_delta(data, 1, len(data))  # nothing else is unread
                    self._cursor = cursor + 1
                    return seq
            finally:
                lock.release()
        seq = self.delta(data)
        while self.get(timeout=0) is not None:
            pass
        return seq

    def complete(self, finish_reason: str | FinishReason, usage: Any = None) -> int:
        """Send response.completed; returns its seq (one past the last delta)."""
        reason = finish_reason_of(finish_reason)
        if reason is FinishReason.CANCELLED:
            raise ValueError("finish_reason 'cancelled' ends a stream through cancel(), not complete()")
        return self._end("complete", reason, usage, None)

    def cancel(self, usage: Any = None) -> int:
        """Send response.cancelled with finish_reason cancelled (§4.9); returns its seq."""
        return self._end("cancel", FinishReason.CANCELLED, usage, None)

    def fail(self, finish_reason: str | FinishReason, usage: Any = None, error: str = "") -> int:
        """Send response.failed with its reason and error text (§4.10); returns its seq."""
        reason = finish_reason_of(finish_reason)
        if reason is FinishReason.CANCELLED:
            raise ValueError("finish_reason 'cancelled' ends a stream through cancel(), not fail()")
        return self._end("fail", reason, usage, error)

    def would_block(self) -> bool:
        """True while a pause-policy producer would wait: the engine skips this request's decode."""
        with self._cond:
            return self._st.state in self._st_paused

    def would_wait(self, size: int) -> bool:
        """Producer side (§4.8): would a pause-policy send wait for the reader now? True when the
        stream is not OPEN, or when unread bytes plus `size` would pass max_bytes.

        Read without the lock (the engine asks once per run and step): only the producer blocks
        the stream and the reader only makes room, so a stale answer errs towards waiting.
        """
        if self.policy is not _PAUSE_POLICY:
            return False
        if self._st.state is not self._st_open:
            return True
        unread = self._unread_bytes
        return unread > 0 and unread + size > self.max_bytes

    @property
    def writable(self) -> bool:
        """True when a delta would be accepted now without waiting (started, open, not paused)."""
        with self._cond:
            return self._st.state is self._st_open

    # ---- consumer side -------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> StreamEvent | None:
        """The next unread event, waiting up to `timeout` s (None: for ever).

        Returns None on timeout, or at once when the terminal event has already been read.
        """
        with self._lock:
            ev = self._take()
            if ev is not None or self._drained() or (timeout is not None and timeout <= 0):
                return ev  # the non-blocking read of an inline reader: no clock, no wait
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._sleep(left)
                ev = self._take()
                if ev is not None or self._drained():
                    return ev

    def __iter__(self) -> Iterator[StreamEvent]:
        """Every unread event up to and including the terminal one."""
        while (ev := self.get()) is not None:
            yield ev
            if ev.terminal:
                return

    async def aget(self) -> StreamEvent | None:
        """`get()` for an asyncio reader: never blocks the loop; cancelling it loses no event."""
        return await self.wait_for(lambda: (ev := self._take(), ev is None and self._drained()))

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        while (ev := await self.aget()) is not None:
            yield ev
            if ev.terminal:
                return

    def reader(self, after_seq: int | None = None, *, resume: bool = False) -> StreamReader:
        """A reader with its own cursor over the retained log: it sees every event once, in order,
        up to the terminal one, whatever other readers do (§4.7 rules 1-4, DECISIONS D5).

        The newest reader is the *primary* one: its reads are what backpressure counts (§4.8). A
        first reader starts at the first unread event. With `resume` (a reconnect, `after_seq` the
        last seq the client has, None for all) it starts after that seq, the events up to now count
        as read (the `replay` row: a paused producer may resume), and a reader that was primary
        keeps its own view but no longer holds the producer back. Resuming a finished stream at or
        past its end still yields the terminal event, so the client always sees how it ended. A
        reader that leaves calls `close()`: the primary role goes back to the newest reader still
        open (DECISIONS D5). Resuming an open stream after a seq it has not sent raises ValueError
        (`resume_refusal`) and changes nothing."""
        if after_seq is not None and (isinstance(after_seq, bool) or not isinstance(after_seq, int)):
            raise TypeError(f"after_seq must be an int or None, got {type(after_seq).__name__}")
        with self._cond:
            if not resume:
                start = self._cursor
            else:
                refusal = self._past_end(after_seq)
                if refusal is not None:  # before anything changes: a refused resume leaves no trace
                    raise ValueError(refusal)
                start = self._resume(after_seq)
                if start == len(self._log) and self._st.terminal and self._log:
                    start = len(self._log) - 1  # the terminal event again: the client sees the end
            return self._readers.add(self, start, after_seq, resume)

    @property
    def open_readers(self) -> int:
        """Readers made and not yet closed (the server caps them per request)."""
        return len(self._readers)

    def resume_refusal(self, after_seq: int | None) -> str | None:
        """Why a resume after `after_seq` is refused, or None: on a stream still open, a seq not
        yet sent names an event the client cannot have had (D5; past the end of a finished
        stream the terminal event is sent again instead)."""
        with self._cond:
            return self._past_end(after_seq)

    def _past_end(self, after_seq: int | None) -> str | None:
        if after_seq is None or self._st.terminal or after_seq < self._next_seq:
            return None
        sent = f"seq {self._next_seq - 1}" if self._next_seq else "none yet"
        return f"seq {after_seq} was never sent: the last event so far is {sent}"

    def _resume(self, after_seq: int | None) -> int:
        """The `replay` row (lock held): everything logged counts as read, a paused producer may
        resume; returns the log index of the first event with seq > `after_seq` (None: 0)."""
        start = 0 if after_seq is None else next(
            (i for i, e in enumerate(self._log) if (seq := _seq_of(e)) is not None and seq > after_seq),
            len(self._log))
        self._move("replay")
        return start

    def replay(self, after_seq: int | None = None) -> list[StreamEvent]:
        """Retained events with seq > `after_seq` (None: the whole log, start included), for a
        reconnecting reader (§4.7 rule 4). They count as read: the live reader continues after
        them and a paused producer may resume."""
        if after_seq is not None and (isinstance(after_seq, bool) or not isinstance(after_seq, int)):
            raise TypeError(f"after_seq must be an int or None, got {type(after_seq).__name__}")
        with self._cond:
            return [self._event(entry) for entry in self._log[self._resume(after_seq):]]

    def disconnect(self) -> None:
        """The reader's transport went away: recorded, never EOS, not a cancel (DECISIONS D5)."""
        self._transport("disconnect")

    def reconnect(self) -> None:
        """A reader is attached again; it catches up with `replay(last_seen_seq)`."""
        self._transport("reconnect")

    # ---- what a reader reads through (readers.ReadSource; lock held but for wait_for) ----------

    @property
    def lock(self) -> threading.Condition:
        """The stream's lock (a condition): every read and write of its state holds it."""
        return self._cond

    @property
    def trace(self) -> Trace | None:
        return self._trace

    def read_at(self, index: int, counted: bool) -> StreamEvent | None:
        """The event at log `index` (None past the end). A `counted` read (the primary reader's,
        D5) past the stream's cursor moves the cursor: the deltas it passes are read (§4.8)."""
        if index >= len(self._log):
            return None
        entry = self._log[index]
        if counted and index >= self._cursor:
            self._cursor = index + 1
            if type(entry) is not StreamEvent:  # a delta
                self._unread_events -= 1
                self._unread_bytes -= len(entry[1])
                self._after_read()
        return self._event(entry)

    def ended_at(self, index: int) -> bool:
        """The terminal event is queued and the log holds nothing at `index` or after."""
        return self._st.terminal and index >= len(self._log)

    def seq_at(self, index: int) -> int | None:
        """The seq of the event at log `index`; past the end, the seq the next event will take."""
        return _seq_of(self._log[index]) if index < len(self._log) else self._next_seq

    def bulk_ready(self) -> bool:
        """A whole-answer reader reads now: the stream has left its open state (ended or paused)
        or its unread deltas have reached half a cap, well before a pause-policy producer would
        wait for the reader (§4.8)."""
        return self._st.state is not self._st_open or self._caps.half_full(self._unread_events, self._unread_bytes)

    async def wait_for(self, step: Callable[[], tuple[T | None, bool]], bulk: bool = False) -> T | None:
        """Call `step` (lock held) until it gives something or says the reader is done, waiting on
        the producer in between without blocking the loop (every asyncio read goes through here).
        A `bulk` waiter is woken by a delta only at the half-full mark (`_queue`)."""
        return await wait_until(self._cond, self._bulk_waiters if bulk else self._async_waiters, step)

    # ---- observation ---------------------------------------------------------------------

    @property
    def state(self) -> enum.Enum:
        return self._st.state

    @property
    def closed(self) -> bool:
        """True once the terminal event is queued."""
        return self._st.terminal

    @property
    def next_seq(self) -> int:
        """The seq the next delta (or the terminal event) will take (§4.7 rule 1)."""
        with self._cond:
            return self._next_seq

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def unread(self) -> tuple[int, int]:
        """(unread deltas, unread bytes): what the §4.8 caps bound."""
        with self._cond:
            return self._unread_events, self._unread_bytes

    @property
    def events(self) -> list[StreamEvent]:
        """A copy of the retained log."""
        with self._cond:
            return [self._event(entry) for entry in self._log]

    # ---- internals (called with self._cond held) -----------------------------------------

    def _end(self, event: str, reason: FinishReason, usage: Any, error: str | None) -> int:
        with self._cond:
            return self._move(event, reason=reason, usage=usage, error=error)

    def _move(self, event: str, **ctx: Any) -> Any:
        """Fire `event` and run its row's effects (the STREAM executor below) with `ctx`, the call's
        data, through the one phase loop (machine.actions.run_phases); returns what an effect left
        in ctx["seq"]. A refused event changes nothing. Lock held."""
        key = (self._st.state._value_, event)

        def missing(fn: Callable[..., Any], exc: KeyError) -> ActionError:
            """An effect needs what this call does not carry (an edited table gave the row another action)."""
            name = next(n for n, f in STREAM.impl.items() if f is fn)
            return ActionError(f"stream row ({key[0]}, {key[1]}): effect {name} needs {exc.args[0]!r}, "
                               "which this call does not carry")

        # a refused pair: the fire raises the table's IllegalTransition
        run_phases(self._rules.plans.get(key), (self, ctx), self._st.fire, (event,), error=missing)
        return ctx.get("seq")

    def _queue(self, data: bytes) -> int:
        """queue_delta: the delta is logged with the next seq and counts as unread (lock held)."""
        events = self._unread_events = self._unread_events + 1
        nbytes = self._unread_bytes = self._unread_bytes + len(data)
        seq = self._log_delta(data, events, nbytes)
        if self._sleepers or self._async_waiters or (
                self._bulk_waiters and self._caps.half_full(events, nbytes)):
            self._wake()
        return seq

    def _log_delta(self, data: bytes, events: int, nbytes: int) -> int:
        """Log the delta with the next seq and trace it with the unread counts it leaves (lock
        held): `_append`'s work, inline on the per-token paths. Returns the seq."""
        seq = self._next_seq
        self._next_seq = seq + 1
        self._log.append((seq, data))
        trace = self._trace
        if trace is not None:
            trace.put((_RESPONSE_DELTA, trace.clock(), seq, data, events, nbytes))
        return seq

    def _terminate(self, state: enum.Enum, reason: FinishReason, usage: Any, error: str | None) -> int:
        """Queue the one terminal event of `state` (same critical section as its transition)."""
        seq = self._next_seq
        self._next_seq += 1
        kind = self._rules.terminal_kind[state]
        data: dict[str, Any] = {"seq": seq, "finish_reason": reason.value, "usage": usage}
        if kind is StreamEventKind.FAILED:
            data["error"] = error or ""
        ev = StreamEvent(kind, seq, finish_reason=reason, usage=usage,
                         error=data.get("error"), request_id=self.request_id)
        self._append(_TRACE_KIND[kind], ev, **data)
        return seq

    def _append(self, trace_kind: EventKind, entry: _Entry, **trace_data: Any) -> None:
        self._log.append(entry)
        if self._trace is not None:
            self._trace.emit(trace_kind, **trace_data)
        self._wake()

    def _event(self, entry: _Entry) -> StreamEvent:
        """The StreamEvent of a log entry (a delta is logged as its (seq, data) pair)."""
        if type(entry) is StreamEvent:
            return entry
        return StreamEvent(StreamEventKind.DELTA, entry[0], entry[1], request_id=self.request_id)

    def overflow(self) -> int:
        """A delta did not fit (§4.8 buffer/fail policy): fire the table's `overflow` row and queue
        failed(transport_error); returns its seq. A producer that asked `fits` first calls this
        with its verdict, so a reader making room in between cannot let the refused delta through
        after its lifecycle has already failed (DECISIONS D6)."""
        with self._lock:
            return self._move("overflow", reason=FinishReason.TRANSPORT_ERROR, usage=self._overflow_usage(),
                              error=OVERFLOW_ERROR)

    def fits(self, size: int) -> bool:
        """Would a delta of `size` bytes be taken without overflowing? Always True under `pause`,
        which waits instead (§4.8); the producer asks first so that its own lifecycle can fail
        before the stream's overflow row emits the terminal event (transition_and_emit_terminal)."""
        if self.policy is _PAUSE_POLICY:  # fixed at construction: no lock needed
            return True
        with self._cond:
            return self._caps.within_cap(self._unread_events, self._unread_bytes, size)

    def _has_room(self, size: int) -> bool:
        """Pause policy: may a delta of `size` bytes join the unread ones (BufferCaps.has_room)?"""
        return self._caps.has_room(self._unread_events, self._unread_bytes, size)

    def _wait_for_room(self, size: int) -> None:
        """Pause policy: block (table `block`) until the reader makes room (`unblock`)."""
        if self._st.state is self._st_open and not self._has_room(size):
            self._move("block")
        if self._st.state not in self._st_paused:
            return
        paused_at = time.monotonic()
        deadline = None if self.pause_timeout_s is None else paused_at + self.pause_timeout_s
        self._pending = size
        try:
            while self._st.state in self._st_paused:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    error = f"reader stalled: producer paused for {self.pause_timeout_s} s"
                    seq = self._move("fail", reason=FinishReason.TRANSPORT_ERROR, usage=self._overflow_usage(),
                                     error=error)
                    raise StreamOverflow(self.request_id, seq, error)
                self._sleep(left)
        finally:
            self._pending = 0
            self.paused_s += time.monotonic() - paused_at

    def _overflow_usage(self) -> Any:
        return self._usage_provider() if self._usage_provider is not None else None

    def _take(self) -> StreamEvent | None:
        if self._cursor >= len(self._log):
            return None
        entry = self._log[self._cursor]
        self._cursor += 1
        if type(entry) is StreamEvent:
            return entry
        self._unread_events -= 1  # a delta
        self._unread_bytes -= len(entry[1])
        self._after_read()
        return self._event(entry)

    def _after_read(self) -> None:
        """The reader made room: resume a paused producer once its pending delta fits."""
        if self._st.state in self._st_paused and self._has_room(max(self._pending, 1)):
            self._move("unblock")

    def _drained(self) -> bool:
        """Terminal event already read: nothing will ever come."""
        return self._st.terminal and self._cursor >= len(self._log)

    def _sleep(self, timeout: float | None) -> None:
        """Wait on the condition (a reader for events, a paused producer for room), counted so that
        `_wake` notifies only when a thread sleeps. A producer's batched wakes go out first: the
        reader it waits for may be one of them."""
        flush_wakes()
        self._sleepers += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._sleepers -= 1

    def _wake(self) -> None:
        """Wake the sleeping readers and the asyncio ones, whole-answer readers included (at the
        end of an open batch, D57)."""
        if self._sleepers:
            self._cond.notify_all()
        for waiters in (self._async_waiters, self._bulk_waiters):
            if waiters:
                wake(waiters)

    def _transport(self, what: str) -> None:
        with self._cond:
            self._move(what)

    def __repr__(self) -> str:
        return f"<OrderedStream {self.request_id} {self._st.state.value} next_seq={self._next_seq}>"


# ---- the runtime's implementation of every stream effect (machine/actions.py) ----------------
# Each runs as (stream, ctx) with the lock held; OrderedStream._move runs them by phase.
STREAM = Executor("stream", "the runtime (stream.OrderedStream)")


@STREAM.effect("open")
def _open(st: OrderedStream, ctx: dict) -> None:
    model = ctx.get("model", "")
    st._append(EventKind.RESPONSE_START, StreamEvent(StreamEventKind.START, request_id=st.request_id, model=model),
               model=model)


@STREAM.effect("queue_delta")
def _queue_delta(st: OrderedStream, ctx: dict) -> None:
    ctx["seq"] = st._queue(ctx["data"])


@STREAM.effect("queue_terminal")
def _queue_terminal(st: OrderedStream, ctx: dict) -> None:
    ctx["seq"] = st._terminate(st._st.state, ctx["reason"], ctx["usage"], ctx["error"])


STREAM.abstracts("pause", "the paused state is the fact: a pause-policy delta() waits while the stream is in it")


@STREAM.effect("resume")
def _resume_producer(st: OrderedStream, ctx: dict) -> None:
    st._cond.notify_all()  # the producer waiting in _wait_for_room goes on


@STREAM.effect("replay")
def _replay(st: OrderedStream, ctx: dict) -> None:
    """Everything logged counts as read: the live reader continues after it (§4.7)."""
    st._cursor = len(st._log)
    st._unread_events = st._unread_bytes = 0
    st._after_read()


@STREAM.effect("detach")
def _detach(st: OrderedStream, ctx: dict) -> None:
    st._connected = False
    if st._trace is not None:
        st._trace.emit(EventKind.TRANSPORT, what="disconnect")


@STREAM.effect("attach")
def _attach(st: OrderedStream, ctx: dict) -> None:
    st._connected = True
    if st._trace is not None:
        st._trace.emit(EventKind.TRANSPORT, what="reconnect")


@attrs.frozen(eq=False)
class StreamRules:
    """A stream table as OrderedStream runs it (§4.7, §4.8): its machine, each pair's plan, its
    open state (the one where a delta is a row, `stream_states().sending`), its paused states
    (where `unblock` is a row: a pause-policy producer waits there), and where a delta's row is a
    self-loop whose action only queues it (`delta_fast`): there the per-delta paths queue it
    without the fire, so another action goes through `_move`. `inline_open`: the open state when
    it is such a state (`deliver`'s one critical section), else None. `terminal_kind`: the §4.7
    terminal event each terminal state queues, the one its name names (COMPLETED: completed);
    a terminal state no such event names is a SpecError."""

    machine: CompiledMachine
    plans: Mapping[tuple[str, str], Plan]
    open: enum.Enum
    paused: frozenset[enum.Enum]
    delta_fast: frozenset[enum.Enum]
    inline_open: enum.Enum | None
    terminal_kind: Mapping[enum.Enum, StreamEventKind]

    @classmethod
    def of(cls, table: Table) -> StreamRules:
        machine, plans, where = compiled_of(table), STREAM.plans(table), stream_states(table)
        fast = frozenset(machine.State[s] for (s, e), plan in plans.items()
                         if e == "delta" and plan.effects == ("queue_delta",) and table.decision(s, e).target == s)
        (sending,) = where.sending
        open_ = machine.State[sending]
        return cls(machine, plans, open_, frozenset(machine.State[s] for s in where.paused), fast,
                   open_ if open_ in fast else None, {machine.State[s]: _terminal_kind(table, s) for s in table.terminal})


def _terminal_kind(table: Table, state: str) -> StreamEventKind:
    """The §4.7 terminal event a terminal stream state queues: the one its name names."""
    kind = next((k for k in _TRACE_KIND if k.value == state.lower()), None)
    if kind is None:
        raise SpecError(table.source, f"terminal state {state}",
                        f"names no terminal event of §4.7 ({', '.join(_TRACE_KIND)})")
    return kind


stream_rules = per_table(StreamRules.of)
