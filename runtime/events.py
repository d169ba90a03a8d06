"""The trace: one Event per observable step of a request (§4.12 last part).

Kinds are fixed (EventKind); `data` holds the fields each kind documents. A Trace hands out the
per-request index and a monotonic time; serialisation to JSON Lines happens off the hot path.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, TextIO

import attrs


class EventKind(enum.StrEnum):
    REQUEST_CREATED = "request.created"  # request parameters (stop, limits, seed ...)
    LIFECYCLE = "lifecycle.transition"  # from, to, event, action, reason
    LIFECYCLE_IGNORED = "lifecycle.ignored"  # state, event, action (an [[ignore]] row fired)
    PREFILL_STARTED = "prefill.started"
    PREFILL_COMPLETED = "prefill.completed"  # cache_len
    TOKEN_SELECTED = "token.selected"  # step, token, eos
    DECODE_STARTED = "decode.started"  # step
    DECODE_COMPLETED = "decode.completed"  # step, cache_len
    STOP_HIT = "stop.hit"  # stop, rule_version, kind ("string" | "token_ids")
    RESPONSE_START = "response.start"  # request_id, model
    RESPONSE_DELTA = "response.delta"  # seq, bytes
    RESPONSE_COMPLETED = "response.completed"  # seq, finish_reason, usage
    RESPONSE_CANCELLED = "response.cancelled"  # seq, finish_reason, usage
    RESPONSE_FAILED = "response.failed"  # seq, finish_reason, usage, error
    CANCEL_REQUESTED = "cancel.requested"
    CANCEL_OBSERVED = "cancel.observed"
    DEADLINE_EXCEEDED = "deadline.exceeded"
    TRANSPORT = "transport"  # what: "disconnect" | "reconnect" | "send_failed" | "detach_timeout"
    RESOURCE_ACQUIRED = "resource.acquired"  # resource
    RESOURCE_RELEASED = "resource.released"  # resource
    RESOURCE_VIOLATION = "resource.violation"  # resource, problem ("double_release" | "leak")
    FAULT_INJECTED = "fault.injected"  # point, step, action
    TIMINGS = "timings"  # queue_s, prefill_s, decode_s, stop_buffer_s, send_s
    PREEMPTED = "sequence.preempted"  # mode ("swap" | "recompute"), cache_len (§4.8; no lifecycle change)
    RESUMED = "sequence.resumed"  # mode, cache_len
    READER_OPENED = "stream.reader_opened"  # reader (its number), after (Last-Event-ID or None), resume
    DELIVERED = "stream.delivered"  # reader, seq, terminal: one event handed to one reader (§4.7)
    DETOK_DROPPED = "detok.dropped"  # bytes: a guarded run's unfinished character at an end it did not choose (D16)


# The kinds put on the per-token path. Their entry is flat, `Trace.put((kind.value, t, *values))`,
# and each function here names the values, in that order, when the Event is built. Flat and with
# the kind as its plain string, the entry is one tuple of atomic values: nothing nested to allocate,
# and the cyclic garbage collector stops tracking it at its first pass, so a long trace adds nothing
# to the full collections, which with torch loaded are long (they walk all its objects).
def _selected(e: tuple) -> dict[str, Any]:
    _, _, step, token, eos = e
    return {"step": step, "token": token, "eos": eos}


def _started(e: tuple) -> dict[str, Any]:
    return {"step": e[2]}


def _completed(e: tuple) -> dict[str, Any]:
    _, _, step, cache_len = e
    return {"step": step, "cache_len": cache_len}


def _delta(e: tuple) -> dict[str, Any]:
    _, _, seq, data, unread_events, unread_bytes = e
    return {"seq": seq, "bytes": data, "unread_events": unread_events, "unread_bytes": unread_bytes}


# kind -> the function that names a flat entry's values (it takes the whole entry).
FIELDS: Mapping[EventKind, Callable[[tuple], dict[str, Any]]] = MappingProxyType({
    EventKind.TOKEN_SELECTED: _selected,
    EventKind.DECODE_STARTED: _started,
    EventKind.DECODE_COMPLETED: _completed,
    EventKind.RESPONSE_DELTA: _delta,
})
# A flat entry's plain-string kind -> (its EventKind, its FIELDS function): one lookup per Event.
_FLAT: Mapping[str, tuple[EventKind, Callable[[tuple], dict[str, Any]]]] = MappingProxyType(
    {k.value: (k, fn) for k, fn in FIELDS.items()}
)

TERMINAL_KINDS = frozenset(
    {EventKind.RESPONSE_COMPLETED, EventKind.RESPONSE_CANCELLED, EventKind.RESPONSE_FAILED}
)


_NO_DATA: Mapping[str, Any] = MappingProxyType({})
_new = tuple.__new__  # builds an Event from its fields without the named tuple's Python-level __new__


class Event(NamedTuple):
    """One trace entry. `data` is a plain mapping; `bytes` values serialise as latin-1 text.

    An immutable named tuple rather than a frozen attrs class: several are made per token,
    and a tuple is built in a third of the time a frozen attrs instance takes.
    """

    kind: str
    request_id: str
    # the entry's position in its trace; the field shadows tuple.index, which nothing calls on an Event
    index: int  # type: ignore[assignment]
    t: float
    data: Mapping[str, Any] = _NO_DATA

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "request_id": self.request_id,
            "index": self.index,
            "t": self.t,
            "data": {k: _jsonable(v) for k, v in self.data.items()},
        }

    def describe(self) -> str:
        """One readable line, e.g. `response.delta(seq=0, b'A')` (for the CLI and experiments)."""
        parts = []
        for k, v in self.data.items():
            if v is None or k in ("usage",):
                continue
            parts.append(repr(bytes(v)) if k == "bytes" else f"{k}={v.value if isinstance(v, enum.Enum) else v!r}")
        return f"{self.kind}({', '.join(parts)})"

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Event:
        data = dict(obj.get("data", {}))
        if "bytes" in data and isinstance(data["bytes"], dict):
            data["bytes"] = bytes.fromhex(data["bytes"]["hex"])
        return cls(kind=obj["kind"], request_id=obj["request_id"], index=obj["index"], t=obj["t"], data=data)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray)):
        return {"hex": bytes(v).hex(), "text": bytes(v).decode("utf-8", "replace")}
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, Mapping):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if attrs.has(type(v)):
        return {k: _jsonable(x) for k, x in attrs.asdict(v, recurse=False).items()}
    return v


class Trace:
    """Append-only event log of one request.

    An entry is a raw tuple: `(kind, t, data)` with `data` the keyword dict of `emit`, or for a
    kind of FIELDS `(kind.value, t, *values)`; `t` is a reading of `clock`.
    `put(entry)` is the one writer: with no listener it *is* the list's C-level append
    (four events per token: the per-token path calls `put` itself). `list.append` is atomic under
    the GIL, so a cancel logged from another thread takes its own position, and the position is
    the event's index: no lock on the hot path. `Event` objects are built when `events` is read.
    Listeners get the built event at once; they run outside any lock and may emit in turn.
    """

    __slots__ = ("request_id", "clock", "put", "_raw", "_built", "_listeners", "_lock")

    def __init__(self, request_id: str, clock=time.monotonic) -> None:
        self.request_id = request_id
        self.clock = clock
        self._raw: list[tuple] = []
        self.put = self._raw.append
        self._built: list[Event] = []  # Event objects of the first len(_built) raw entries
        self._listeners: list = []
        self._lock = threading.Lock()  # guards only the building of `events`

    def subscribe(self, fn) -> None:
        """Call `fn(event)` for every later event (the CLI's --events, the fault injector)."""
        self._listeners.append(fn)
        self.put = self._put_and_notify

    def emit(self, kind: str, /, **data: Any) -> float:
        """Record one event; returns its time (the clock's reading), which callers may reuse."""
        t = self.clock()
        self.put((kind, t, data))
        return t

    def _put_and_notify(self, entry: tuple) -> None:
        raw = self._raw
        raw.append(entry)
        index = len(raw) - 1
        while raw[index] is not entry:  # another thread appended since: look back to ours
            index -= 1
        ev = _event(entry, self.request_id, index)
        for fn in self._listeners:
            fn(ev)

    @property
    def events(self) -> list[Event]:
        """Every event so far, in index order (a new list)."""
        return self.since(0)

    def since(self, start: int) -> list[Event]:
        """The events from index `start` on (a reader that keeps its place reads each event once)."""
        with self._lock:
            built, raw = self._built, self._raw
            end = len(raw)
            if len(built) < end:
                rid = self.request_id
                built.extend([_event(entry, rid, i) for i, entry in enumerate(raw[len(built):end], len(built))])
            return built[start:end]

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self._raw)


def _event(entry: tuple, request_id: str, index: int) -> Event:
    """The Event of a raw entry; a flat per-token entry gets its EventKind and FIELDS names here."""
    kind, t, data = entry[0], entry[1], entry[2]
    if type(data) is not dict:
        kind, fields = _FLAT[kind]
        data = fields(entry)
    return _new(Event, (kind, request_id, index, t, data))


def write_jsonl(events: Iterable[Event], fh: TextIO) -> None:
    for ev in events:
        fh.write(json.dumps(ev.to_json(), ensure_ascii=False) + "\n")


def read_jsonl(fh: TextIO) -> list[Event]:
    return [Event.from_json(json.loads(line)) for line in fh if line.strip()]
