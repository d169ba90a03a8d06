"""The vocabulary shared by every table: the finish reasons of §4.10 (declared in
spec/reasons.toml, with their OpenAI wire names) and the kinds of decision."""

from __future__ import annotations

import enum
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

# The tables every layer loads: this package's, or a copy named by DECODESPEC_SPEC_DIR (a table
# change tried end to end, runtime and checker included, before anyone edits the originals).
SPEC_DIR = Path(os.environ.get("DECODESPEC_SPEC_DIR") or Path(__file__).resolve().parent)


def _reasons() -> list[dict[str, Any]]:
    path = SPEC_DIR / "reasons.toml"
    entries = tomllib.loads(path.read_text(encoding="utf-8")).get("reason", [])
    names = [e.get("name") for e in entries]
    bad = [n for n in names if not isinstance(n, str) or not n.isidentifier() or names.count(n) > 1]
    if not entries or bad:
        raise ValueError(f"{path}: every [[reason]] needs a unique identifier `name`; bad: {bad or 'none listed'}")
    return entries


def table_enum(name: str, values: Iterable[str], doc: str) -> type[enum.StrEnum]:
    """A StrEnum of the values a loaded table lists, each member named by its value in upper case:
    the run-time class of the enums whose members a table declares (FinishReason, the stream's
    policies, the resource kinds); a type checker reads the shipped members instead."""
    members = enum.StrEnum(name, [(v.upper(), v) for v in values])  # type: ignore[misc]  # functional API
    members.__doc__ = doc
    return members


E = TypeVar("E", bound=enum.StrEnum)


def table_member(cls: type[E], value: str | E, what: str, allowed: str = "known") -> E:
    """The member of a table enum that `value` names; an unknown value is a ValueError naming it,
    what it should have been and every member the loaded table lists."""
    try:
        return cls(value)
    except ValueError:
        members = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown {what} {value!r}; {allowed}: {members}") from None


REASON_ENTRIES = tuple(_reasons())
if TYPE_CHECKING:
    # What a type checker sees: the members of the shipped spec/reasons.toml, one per [[reason]]
    # (tests/test_typed_enums.py holds the two equal). At run time the class is built from
    # the tables loaded, which may be an edited copy (DECODESPEC_SPEC_DIR).
    class FinishReason(enum.StrEnum):
        """The finish reasons of §4.10 (spec/reasons.toml); a row's `reason` must be one of them."""

        EOS = "eos"
        STOP_SEQUENCE = "stop_sequence"
        GRAMMAR_COMPLETE = "grammar_complete"
        TOOL_CALLS = "tool_calls"
        MAX_OUTPUT_TOKENS = "max_output_tokens"
        CONTEXT_LIMIT = "context_limit"
        CANCELLED = "cancelled"
        DEADLINE_EXCEEDED = "deadline_exceeded"
        CONTENT_INTERRUPTED = "content_interrupted"
        MODEL_ERROR = "model_error"
        TRANSPORT_ERROR = "transport_error"
else:
    FinishReason = table_enum("FinishReason", (e["name"] for e in REASON_ENTRIES),
                              "The finish reasons of §4.10 (spec/reasons.toml); a row's `reason` must be one of them.")
# FinishReason -> the OpenAI wire finish_reason of a completion that ends with it.
OPENAI_FINISH: Mapping[FinishReason, str] = {FinishReason(e["name"]): e["openai"] for e in REASON_ENTRIES if "openai" in e}


class DecisionKind(enum.StrEnum):
    """How a (state, event) pair is decided (a row, an ignore or a rejection)."""

    ROW = "row"
    IGNORE = "ignore"
    REJECT = "reject"


# The phases of one step of the §4.3 loop (a lifecycle table's [[step]] orders them) and, per
# phase, the phases whose result it reads and which must therefore come before it: the order the
# table may choose is any one that keeps these (which of a pending cancel and a passed deadline is
# observed first; whether the finish checks judge a token's safe bytes before they are emitted).
STEP_NEEDS: Mapping[str, tuple[str, ...]] = {
    "observe_cancel": (),
    "observe_deadline": (),
    "choose": ("observe_cancel", "observe_deadline"),
    "consume": ("choose",),
    "push_bytes": ("consume",),
    "stop": ("push_bytes",),
    "finish_checks": ("stop",),
    "emit": ("stop",),
    "decode": ("finish_checks", "emit"),
}
