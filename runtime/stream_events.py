"""What a reader of a stream receives (§4.7): the events of the minimal protocol, and the
client-side merge of a replay with a live read (`Deduper`, §4.7 rule 4)."""

from __future__ import annotations

import enum
from typing import Any, final

import attrs

from ..spec import FinishReason
from ..spec.vocabulary import table_member


class StreamEventKind(enum.StrEnum):
    """The events of the minimal protocol of §4.7."""

    START = "start"
    DELTA = "delta"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


def _event_kind(value: str | StreamEventKind) -> StreamEventKind:
    """StreamEventKind(value), without the Enum lookup when it already is one (per delta)."""
    return value if type(value) is StreamEventKind else StreamEventKind(value)


@final  # the stream's log tells a delta pair from an event by `type(entry) is StreamEvent`
@attrs.frozen
class StreamEvent:
    """One event a reader receives (§4.7): start (seq None), delta (bytes) or the terminal one."""

    kind: StreamEventKind = attrs.field(converter=_event_kind)
    seq: int | None = None
    data: bytes = b""
    finish_reason: FinishReason | None = None
    usage: Any = None
    error: str | None = None
    request_id: str = ""
    model: str | None = None

    @property
    def terminal(self) -> bool:
        return self.kind not in (StreamEventKind.START, StreamEventKind.DELTA)


def finish_reason_of(value: str | FinishReason) -> FinishReason:
    """The §4.10 reason `value` names; an unknown one is a ValueError that lists the known ones."""
    return table_member(FinishReason, value, "finish_reason", "§4.10 allows")


class Deduper:
    """Client-side merge of a replay with a live read (§4.7 rule 4): each (request_id, seq) once."""

    def __init__(self) -> None:
        self._seen: dict[str, set[int | None]] = {}

    def accept(self, request_id: str, seq: int | None) -> bool:
        """True the first time (request_id, seq) is seen; False for a duplicate."""
        seen = self._seen.setdefault(request_id, set())
        if seq in seen:
            return False
        seen.add(seq)
        return True

    def accept_event(self, event: StreamEvent) -> bool:
        """`accept` keyed by the event's own request_id and seq."""
        return self.accept(event.request_id, event.seq)
