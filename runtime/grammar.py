"""Grammar acceptance as a stop condition (§4.6 "grammar acceptance", DECISIONS D14)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import interegular

from .errors import RequestError


class Grammar(Protocol):
    """An acceptor over the output: `complete(text)` is True once the output is a finished sentence."""

    def complete(self, text: str) -> bool: ...


@attrs.frozen
class RegexGrammar:
    """Complete once the whole output text matches the pattern and no longer text could (D14):
    `a+` is never complete (more a's may follow), `[0-9]{3}` is at "123". Acceptance is
    `re.fullmatch`; "no longer match" walks the pattern's automaton (interegular), built once. A
    pattern interegular cannot turn into an automaton (a backreference, a lookaround), or a
    case-insensitive one, completes at its first full match, as D14 states."""

    pattern: re.Pattern[str]
    fsm: Any = attrs.field(init=False, eq=False, repr=False)

    @fsm.default
    def _fsm(self) -> Any:
        try:
            return interegular.parse_pattern(self.pattern.pattern).to_fsm()
        except Exception:  # interegular raises its own errors for syntax it does not model
            return None

    def complete(self, text: str) -> bool:
        if self.pattern.fullmatch(text) is None:
            return False
        fsm = self.fsm
        if fsm is None or self.pattern.flags & re.IGNORECASE:
            return True
        state, alphabet, other = fsm.initial, fsm.alphabet, interegular.fsm.anything_else
        for ch in text:
            state = fsm.map.get(state, {}).get(alphabet[ch] if ch in alphabet else alphabet[other])
            if state is None:
                return True  # the automaton disagrees with re: trust re's match
        return not any(fsm.islive(nxt) for nxt in fsm.map.get(state, {}).values())


@attrs.frozen
class DFAGrammar:
    """An explicit DFA over characters: complete in an accepting state with no way onward."""

    start: str
    accept: frozenset[str]
    edges: Mapping[tuple[str, str], str]

    def complete(self, text: str) -> bool:
        state = self.start
        for ch in text:
            nxt = self.edges.get((state, ch))
            if nxt is None:
                return False
            state = nxt
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
