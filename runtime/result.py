"""What generate() returns (docs/concepts.md, "Using it as a library"; usage as D7 defines it:
selected, processed and returned tokens)."""

from __future__ import annotations

import enum

import attrs

from ..spec import FinishReason
from .events import Event, Trace
from .stop import StopValue


@attrs.frozen
class Usage:
    """Token counts of §4.10: selected, processed (in cache), returned differ at a stop or EOS."""

    prompt_tokens: int = 0
    selected_tokens: int = 0
    processed_tokens: int = 0
    returned_tokens: int = 0
    returned_bytes: int = 0

    @property
    def completion_tokens(self) -> int:
        return self.selected_tokens

    def as_dict(self) -> dict[str, int]:
        d = {name: getattr(self, name) for name in _USAGE_FIELDS}  # attrs.asdict is 10x slower
        d["completion_tokens"] = self.completion_tokens
        return d


_USAGE_FIELDS = tuple(a.name for a in attrs.fields(Usage))


@attrs.frozen
class Result:
    """The end of one request: its terminal state, reason, bytes returned and full trace."""

    request_id: str
    state: enum.Enum
    finish_reason: FinishReason
    output: bytes
    usage: Usage
    trace: Trace = attrs.field(repr=False, eq=False)
    trace_length: int = attrs.field(repr=False, eq=False)  # events recorded when the request ended
    tokens: tuple[int, ...] = ()
    error: str | None = None
    stop: StopValue | None = None  # the stop that ended the request, as configured

    @property
    def events(self) -> tuple[Event, ...]:
        """The trace up to the end of the request. Its Events are built from the raw entries when
        first read (the trace is recorded, not formatted, on the per-token path)."""
        return tuple(self.trace.events[: self.trace_length])

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", errors="replace")
