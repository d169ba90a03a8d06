"""Grammar acceptance as a stop condition (§4.6 "grammar acceptance", DECISIONS D14)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from .errors import RequestError


class Grammar(Protocol):
    """An acceptor over the output: `complete(text)` is True once the output is a finished sentence."""

    def complete(self, text: str) -> bool: ...


@attrs.frozen
class RegexGrammar:
    """Complete as soon as the whole output text matches the pattern (`re.fullmatch`)."""

    pattern: re.Pattern[str]

    def complete(self, text: str) -> bool:
        return self.pattern.fullmatch(text) is not None


@attrs.frozen
class DFAGrammar:
    """An explicit DFA over characters: complete in an accepting state with no way onward."""

    start: str
    accept: frozenset[str]
    edges: Mapping[tuple[str, str], str]

    def complete(self, text: str) -> bool:
        state: str | None = self.start
        for ch in text:
            state = self.edges.get((state, ch))
            if state is None:
                return False
        return state in self.accept and not any(src == state for src, _ in self.edges)


def as_grammar(value: Any) -> Grammar | None:
    """Accept None, a Grammar, a compiled pattern or a pattern string (invalid ones are refused)."""
    if value is None or hasattr(value, "complete"):
        return value
    if isinstance(value, re.Pattern):
        return RegexGrammar(value)
    if isinstance(value, str):
        try:
            return RegexGrammar(re.compile(value))
        except re.error as exc:
            raise RequestError("grammar", f"invalid regular expression: {exc}") from None
    raise RequestError("grammar", f"must be a regular expression or a Grammar, got {type(value).__name__}")
