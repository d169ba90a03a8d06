"""The finish checks of a selected token and their guards (§4.3 "check finish conditions",
DECISIONS D4, D31): one plain function each, run in the lifecycle table's order.

A check is `holds(run, eos, safe, hit, t, token)` over the step's locals (RequestRun.select): eos:
y_t is an EOS id; safe: the bytes this token would send; hit: a stop hit; t: tokens selected;
token: y_t, or None where a guard made it a token like any other. Each is one `return` of a
condition that holds for any request (a request without a content policy is never interrupted),
so runtime/stepgen.py can write the shipped table's list into runner.py as one function with the
conditions inline (the per-token path pays one call); `composed` runs any other order. A token
check (`tokens = true` in the table) is `token_check(event)`: y_t is one of the request's ids for it.

A guard is `held(run, token, t)`: while it holds, a check that lists it in `unless` does not hold
for its not-text token (EOS, a token check's ids). `request_guard` composes a request's guards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..spec.tables import FinishCheck, FinishGuard

Check = Callable[[Any, bool, bytes, Any, int, "int | None"], bool]
Guard = Callable[[Any, int, int], bool]


def _eos(run: Any, eos: bool, safe: bytes, hit: Any, t: int, token: int | None) -> bool:
    """y_t is an EOS id: not text, never detokenized, so it has no bytes a later check could judge."""
    return eos


def _content_interrupt(run: Any, eos: bool, safe: bytes, hit: Any, t: int, token: int | None) -> bool:
    """The request's content policy refuses the bytes this token would send (D11): never sent."""
    return run.request.content_policy is not None and safe != b"" and run.request.content_policy(
        bytes(run.output), safe)


def _stop_hit(run: Any, eos: bool, safe: bytes, hit: Any, t: int, token: int | None) -> bool:
    """A string or a token-id stop completed on this token (§4.6, D3)."""
    return hit is not None


def _length(run: Any, eos: bool, safe: bytes, hit: Any, t: int, token: int | None) -> bool:
    """The request's max_output_tokens are selected."""
    return t >= run.request.max_output_tokens


def _context_full(run: Any, eos: bool, safe: bytes, hit: Any, t: int, token: int | None) -> bool:
    """Decoding y_t would fill the model's context."""
    return run.cache.length + 1 >= run.model.context_limit


def _grammar_done(run: Any, eos: bool, safe: bytes, hit: Any, t: int, token: int | None) -> bool:
    """The request's grammar is complete over the text the decoder consumed (D14)."""
    return run.request.grammar is not None and run.request.grammar.complete(run.consumed_text(safe))


def _token(run: Any, eos: bool, safe: bytes, hit: Any, t: int, token: int | None, event: str) -> bool:
    """A token check: y_t is one of the ids the request names for `event` (RequestRun.finish_ids
    holds every token check's event, with no ids where the request names none)."""
    return token in run.finish_ids[event]


# event -> its check (a token check's is token_check(event))
FINISH_CHECKS: Mapping[str, Check] = {
    "eos": _eos,
    "content_interrupt": _content_interrupt,
    "stop_hit": _stop_hit,
    "length": _length,
    "context_full": _context_full,
    "grammar_done": _grammar_done,
}


def token_check(event: str) -> Check:
    """The check of a token check's `event` (`_token` with its event)."""
    return functools.partial(_token, event=event)


def finish_checks(checks: Sequence[FinishCheck]) -> tuple[tuple[str, Check], ...]:
    """(event, check) of each of `checks` (a table's [[finish_check]] list), in its order. The table
    and FINISH_CHECKS must name the same conditions."""
    unknown = [c.event for c in checks if not c.tokens and c.event not in FINISH_CHECKS]
    listed = {c.event for c in checks if not c.tokens}
    unused = [e for e in FINISH_CHECKS if e not in listed]
    if unknown or unused:
        raise RuntimeError(f"lifecycle finish checks and runtime/finish.FINISH_CHECKS differ: listed without an "
                           f"implementation {unknown}, implemented but not listed {unused}")
    return tuple((c.event, token_check(c.event) if c.tokens else FINISH_CHECKS[c.event]) for c in checks)


@attrs.frozen
class Composed:
    """`winner(run, eos, safe, hit, t, token)`: the event of the first of `checks` that holds, or
    None. The shipped list runs as the one function runtime/stepgen.py writes; this runs any list."""

    checks: tuple[tuple[str, Check], ...]

    def __call__(self, run: Any, eos: bool, safe: bytes, hit: Any, t: int, token: int | None) -> str | None:
        for event, holds in self.checks:
            if holds(run, eos, safe, hit, t, token):
                return event
        return None


def _ignore_eos(run: Any, token: int, t: int) -> bool:
    """The request asked to go on past EOS."""
    return bool(run.request.ignore_eos)


def _min_tokens(run: Any, token: int, t: int) -> bool:
    """The t-th token with t <= min_tokens ends nothing (the sampler also masks it until then)."""
    return bool(t <= run.request.min_tokens)


# guard -> (its condition, the request feature without which it never holds)
FINISH_GUARDS: Mapping[str, tuple[Guard, str]] = {
    "ignore_eos": (_ignore_eos, "ignore_eos"),
    "min_tokens": (_min_tokens, "min_tokens"),
}
GUARD_FEATURES = tuple(feature for _, feature in FINISH_GUARDS.values())


@attrs.frozen
class Guarded:
    """A request's guard: `rules` are (event, the guards that turn its check off) in the table's
    order, for the checks whose token is not text."""

    rules: tuple[tuple[str, tuple[Guard, ...]], ...]

    def __call__(self, run: Any, token: int, t: int) -> bool:
        for event, held in self.rules:
            # the eos check's ids are the tokenizer's EOS ids; a token check's, the request's
            if token in (run.eos_ids if event == "eos" else run.finish_ids[event]):
                return any(g(run, token, t) for g in held)
        return False


def finish_guard(checks: Sequence[FinishCheck], guards: Mapping[str, FinishGuard],
                 features: frozenset[str] = frozenset(GUARD_FEATURES)) -> Guarded | None:
    """`guarded(run, token, t)`: does a guard of the not-text check `token` fires turn that check
    off? Composed from the table's checks and [finish_guards] (`guards`) with the guards whose
    feature is not in `features` left out; None when no guard can hold."""
    unknown = [g for g in guards if g not in FINISH_GUARDS]
    unused = [g for g in FINISH_GUARDS if g not in guards]
    if unknown or unused:
        raise RuntimeError(f"lifecycle finish guards and runtime/finish.FINISH_GUARDS differ: declared without an "
                           f"implementation {unknown}, implemented but not declared {unused}")
    rules = tuple((c.event, held) for c in checks
                  if (held := tuple(FINISH_GUARDS[g][0] for g in c.unless if FINISH_GUARDS[g][1] in features)))
    return Guarded(rules) if rules else None


# One guard per table and set of request features, built on first use.
_GUARDS: dict[tuple[tuple[FinishCheck, ...], tuple[str, ...], frozenset[str]], Guarded | None] = {}


def request_guard(checks: tuple[FinishCheck, ...], guards: Mapping[str, FinishGuard], request: Any) -> Guarded | None:
    """The guard of `request` (finish_guard with the guards its fields set), None when it sets none."""
    features = frozenset(f for f, present in zip(GUARD_FEATURES, (request.ignore_eos, request.min_tokens > 0))
                         if present)
    if not features:
        return None
    key = (checks, tuple(guards), features)
    if key not in _GUARDS:
        _GUARDS[key] = finish_guard(checks, guards, features)
    return _GUARDS[key]
