"""What a server can be run `--without`: a request field or a parser it does not have, the cases
that need it, and why they are skipped (n/a) there instead of judged. Data only: the CLI's choices,
the presets' `without` (presets.toml) and OpenAIAdapter.unsupported all read WITHOUT.

A missing parser is an engine's choice, not a rule of chapter 4 it breaks: a server with no
reasoning parser sends `<think>` as content by design, so its reasoning cases prove nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from .cases import Case
from .chat_cases import chat_of


@attrs.frozen
class Lack:
    """One thing a server may lack: `needs(case)` says whether the case needs it; `why` completes
    the sentence "the server ..." of the skip."""

    needs: Callable[[Case], bool]
    why: str


def _chat_flag(flag: str) -> Callable[[Case], bool]:
    return lambda case: bool((chat_of(case) or {}).get(flag))


WITHOUT: Mapping[str, Lack] = {
    "stop_token_ids": Lack(lambda case: bool(case.inputs.get("stop_token_ids")), "offers no stop_token_ids request field"),
    "reasoning": Lack(_chat_flag("reasoning"), "has no reasoning parser, so reasoning_content never comes apart from content"),
    "tool_calls": Lack(_chat_flag("tools"), "has no tool-call parser, so a call never comes back as tool_calls"),
}


def lacking(case: Case, without: frozenset[str]) -> str | None:
    """Why `case` is n/a on a server run without `without` (WITHOUT's order), or None."""
    for name, lack in WITHOUT.items():
        if name in without and lack.needs(case):
            return f"the server {lack.why} (--without {name})"
    return None
