"""The bounded buffer of a stream (§4.8, DECISIONS D6): its caps and what a full buffer does.

`BufferCaps` answers, from the unread counts a stream keeps, whether a delta fits: `pause` stops
the producer at the cap (`has_room`), `buffer` (cap `max_bytes`) and `fail` (cap `max_events`)
never wait and overflow past the cap (`within_cap`); the stream fails with transport_error and
the producer gets `StreamOverflow`. Nothing here knows a stream.
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING, Any

import attrs

from ..spec import FinishReason, load_spec
from ..spec.vocabulary import table_enum, table_member

if TYPE_CHECKING:
    # What a type checker sees: the shipped spec/stream.toml `policies` (tests/test_typed_enums.py
    # holds the two equal); at run time the members are the loaded table's.
    class BackpressurePolicy(enum.StrEnum):
        """What a full buffer does (§4.8, DECISIONS D6): pause, buffer or fail."""

        PAUSE = "pause"
        BUFFER = "buffer"
        FAIL = "fail"
else:
    BackpressurePolicy = table_enum("BackpressurePolicy", load_spec("stream").params["policies"],
                                    "What a full buffer does (§4.8, DECISIONS D6): pause, buffer or fail.")

OVERFLOW_ERROR = "stream buffer overflow"


class StreamOverflow(Exception):
    """Raised to the producer when the stream failed for lack of room (§4.8, DECISIONS D6).

    The failed terminal event is already queued; `finish_reason` is transport_error.
    """

    def __init__(self, request_id: str, seq: int, error: str) -> None:
        self.request_id, self.seq, self.error = request_id, seq, error
        self.finish_reason = FinishReason.TRANSPORT_ERROR
        super().__init__(f"stream {request_id}: {error} (failed with transport_error at seq {seq})")


def _policy(value: str | BackpressurePolicy) -> BackpressurePolicy:
    return table_member(BackpressurePolicy, value, "backpressure policy")


def _positive(_: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


def _not_negative(_: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen
class BufferCaps:
    """The caps of one stream's unread deltas and its policy (§4.8, D6); the terminal event has
    a reserved slot past them. `pause_timeout_s` (pause policy only): how long a producer waits
    for the reader before the stream fails (D5; None: for ever)."""

    policy: BackpressurePolicy = attrs.field(converter=_policy)
    max_events: int = attrs.field(validator=_positive)
    max_bytes: int = attrs.field(validator=_positive)
    pause_timeout_s: float | None = attrs.field(validator=_not_negative)

    @property
    def inline_max(self) -> int:
        """The largest delta that fits an empty buffer without a pause (whose cap must leave room
        after it, or the send would pause before the read) or an overflow."""
        return {
            BackpressurePolicy.PAUSE: self.max_bytes - 1 if self.max_events > 1 else 0,
            BackpressurePolicy.BUFFER: self.max_bytes,
            BackpressurePolicy.FAIL: sys.maxsize,  # it caps events, and an empty buffer has room
        }[self.policy]

    def has_room(self, events: int, nbytes: int, size: int) -> bool:
        """Pause policy: may a delta of `size` bytes join `events` unread deltas of `nbytes`
        without passing a cap? One larger than max_bytes is taken when nothing is unread
        (waiting cannot help)."""
        if events >= self.max_events:
            return False
        return events == 0 or nbytes + size <= self.max_bytes

    def within_cap(self, events: int, nbytes: int, size: int) -> bool:
        """Buffer/fail policy: may a delta of `size` bytes be queued after `events` unread deltas
        of `nbytes` (D6)?"""
        if self.policy is BackpressurePolicy.BUFFER:
            return nbytes + size <= self.max_bytes
        return events < self.max_events

    def half_full(self, events: int, nbytes: int) -> bool:
        """The unread deltas have reached half of either cap: a whole-answer reader reads now,
        well before a pause-policy producer would wait for it."""
        return 2 * events >= self.max_events or 2 * nbytes >= self.max_bytes
