"""What generate() returns (DESIGN "Public API"; usage as DECISIONS D7 defines it)."""

from __future__ import annotations

import enum

import attrs

from ..spec import FinishReason
from .events import Event


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
        d = attrs.asdict(self)
        d["completion_tokens"] = self.completion_tokens
        return d


@attrs.frozen
class Result:
    """The end of one request: its terminal state, reason, bytes returned and full trace."""

    request_id: str
    state: enum.Enum
    finish_reason: FinishReason
    output: bytes
    events: tuple[Event, ...] = attrs.field(repr=False)
    usage: Usage
    tokens: tuple[int, ...] = ()
    error: str | None = None
    stop: str | None = None

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", errors="replace")
