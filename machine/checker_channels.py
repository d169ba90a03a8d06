"""Model-check the chat answer's split (spec/channels.toml; §4.7, DECISIONS D45-D47).

Breadth-first over every sequence the scanner can produce: in each state the environment offers
every event the table allows there (the scanner looks only for those tags; `call_close` and
`call_bad` both, since the call's JSON decides), up to `max_texts` text pieces and `max_tags` tag
events, and `end` at any point. Every row's action runs through its effects on an abstract answer
(each text piece a numbered label, each tag a named label) by this module's own executor, checked
both ways against the table like the others (machine/actions.py). What the answer must be is said
here independently of the rows, from the events alone (the intended meaning of D45-D47): the
invariants of `INVARIANTS`, one function each, judge every ended sequence's answer.

The shortest counterexample comes as a `checker.Counterexample` (steps on the channels machine).
`tests/test_channels.py` seeds edits of the table that the loader accepts and this checker refuses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from ..spec import DecisionKind, Table, load_spec
from .actions import Executor, fire_with_effects
from .checker import Counterexample
from .compiled import compile_table

TAGS = ("think_open", "think_close", "call_open", "call_close", "call_bad")


@attrs.define
class Answer:
    """The abstract answer the effects build: labels, not bytes."""

    content: list[str] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    calls: list[tuple[str, ...]] = attrs.field(factory=list)
    call: list[str] = attrs.field(factory=list)
    closed: bool = False


MODEL = Executor("channels", "the checker model (checker_channels)")


@MODEL.effect("to_content")
def _to_content(a: Answer, piece: str) -> None:
    a.content.append(piece)


@MODEL.effect("to_reasoning")
def _to_reasoning(a: Answer, piece: str) -> None:
    a.reasoning.append(piece)


MODEL.abstracts("swallow_tag", "the tag is dropped: the model keeps no label for it, which is the effect")


@MODEL.effect("begin_call")
def _begin_call(a: Answer, piece: str) -> None:
    a.call = [piece]


@MODEL.effect("to_call")
def _to_call(a: Answer, piece: str) -> None:
    a.call.append(piece)


@MODEL.effect("call_out")
def _call_out(a: Answer, piece: str) -> None:
    a.calls.append(tuple(a.call))
    a.call = []


@MODEL.effect("call_to_content")
def _call_to_content(a: Answer, piece: str) -> None:
    a.content.extend(a.call + ([piece] if piece else []))
    a.call = []


@MODEL.effect("close_output")
def _close(a: Answer, piece: str) -> None:
    a.closed = True


@attrs.frozen
class ChannelsReport:
    """What one exhaustive run over the channels table found."""

    sequences: int
    states: int
    violations: tuple[Counterexample, ...]
    rows_never_fired: tuple[tuple[str, str], ...]

    @property
    def ok(self) -> bool:
        return not self.violations and not self.rows_never_fired


Events = list[tuple[str, str]]  # (event, label) in order


def _pieces(labels: list[str]) -> list[str]:
    return [x for x in labels if x.startswith("p")]


def _pieces_once(events: Events, a: Answer, final: str, table: Table) -> list[str]:
    """Every text piece goes out exactly once, in one channel or inside a reported call (or the
    call still open, while the output is not closed)."""
    texts = [lab for ev, lab in events if ev == "text"]
    emitted = _pieces(a.content + a.reasoning) + [x for c in a.calls for x in _pieces(list(c))]
    open_call = _pieces(a.call) if not a.closed else []
    if sorted(emitted + open_call) != sorted(texts) or len(set(emitted)) != len(emitted):
        return [f"pieces sent {texts}; content {a.content}, reasoning {a.reasoning}, calls {a.calls}"]
    return []


def _reasoning_is_bracketed(events: Events, a: Answer, final: str, table: Table) -> list[str]:
    """A piece is reasoning exactly when the last think tag before it was an opening one."""
    think, want = False, []
    for ev, lab in events:
        think = True if ev == "think_open" else False if ev == "think_close" else think
        if ev == "text" and think:
            want.append(lab)
    if _pieces(a.reasoning) != want:
        return [f"reasoning {a.reasoning}; the pieces inside <think> were {want}"]
    return []


def _order_kept(events: Events, a: Answer, final: str, table: Table) -> list[str]:
    """Each channel's pieces go out in the order they came (§4.7)."""
    out = []
    for name, got in (("content", a.content), ("reasoning", a.reasoning)):
        nums = [int(x[1:]) for x in _pieces(got)]
        if nums != sorted(nums):
            out.append(f"{name} {got} is out of order")
    return out


def _think_tags_never_text(events: Events, a: Answer, final: str, table: Table) -> list[str]:
    """A think tag that fired is no channel's text."""
    leaked = [x for x in a.content + a.reasoning if x.startswith("think_")]
    return [f"the tag(s) {leaked} went out as text"] if leaked else []


def _calls_only_when_closed(events: Events, a: Answer, final: str, table: Table) -> list[str]:
    """A call is reported only at a `call_close`, holding exactly the pieces since its `call_open`;
    a call cut by `end` or closed bad is never reported."""
    closed_calls, cur = [], None
    for ev, lab in events:
        if ev == "call_open":
            cur = [lab]
        elif ev == "text" and cur is not None:
            cur.append(lab)
        elif ev in ("call_close", "call_bad"):
            if ev == "call_close" and cur is not None:
                closed_calls.append(tuple(cur))
            cur = None
    if a.calls != closed_calls:
        return [f"calls reported {a.calls}; the calls closed well were {closed_calls}"]
    return []


def _calls_end_as_calls(events: Events, a: Answer, final: str, table: Table) -> list[str]:
    """The answer ends in ENDED_CALLS exactly when it holds a reported call."""
    if (final == "ENDED_CALLS") != bool(a.calls) and table.is_terminal(final):
        return [f"ended in {final} with {len(a.calls)} reported call(s)"]
    return []


# name -> (section, check of one ended sequence's answer: its messages, none when it holds)
INVARIANTS: dict[str, tuple[str, Callable[[Events, Answer, str, Table], list[str]]]] = {
    "pieces_once": ("§4.7", _pieces_once),
    "reasoning_is_bracketed": ("§4.7", _reasoning_is_bracketed),
    "order_kept": ("§4.7", _order_kept),
    "think_tags_never_text": ("§4.7", _think_tags_never_text),
    "calls_only_when_closed": ("§4.7", _calls_only_when_closed),
    "calls_end_as_calls": ("§4.10", _calls_end_as_calls),
}


def _violations(events: Events, a: Answer, final: str, table: Table) -> list[tuple[str, str]]:
    """(invariant, message) for every invariant one sequence's answer breaks."""
    return [(name, msg) for name, (_, check) in INVARIANTS.items() for msg in check(events, a, final, table)]


def check_channels(table: Table | None = None, *, max_texts: int = 3, max_tags: int = 4) -> ChannelsReport:
    """Explore every event sequence within the bounds (see module); shortest counterexamples first."""
    table = table or load_spec("channels")
    plans = MODEL.plans(table)
    machine = compile_table(table)
    fired: set[tuple[str, str]] = set()
    found: dict[str, Counterexample] = {}
    queue: deque[tuple[tuple[str, str], ...]] = deque([()])
    seen_states: set[Any] = set()
    sequences = 0
    while queue:
        path = queue.popleft()
        st, answer = machine.new(), Answer()
        for ev, lab in path:
            fire_with_effects(st, plans, ev, answer, lab)
        state = st.state.value
        seen_states.add((state, tuple(answer.content), tuple(answer.reasoning), tuple(answer.calls), tuple(answer.call)))
        if table.is_terminal(state):
            sequences += 1
            for name, message in _violations(list(path), answer, state, table):
                if name not in found:
                    steps = _steps(table, path)
                    found[name] = Counterexample(name, INVARIANTS[name][0], message,
                                                 tuple(ev if lab in ("", ev) else f"{ev} {lab}" for ev, lab in path),
                                                 tuple((0, "channels", s, e) for s, e in steps))
            continue
        texts = sum(1 for ev, _ in path if ev == "text")
        tags = sum(1 for ev, _ in path if ev in TAGS)
        for ev in table.allowed_events(state):
            d = table.decision(state, ev)
            if ev == "text" and texts >= max_texts or ev in TAGS and tags >= max_tags:
                continue
            if d.kind is DecisionKind.ROW:
                fired.add((state, ev))
            queue.append((*path, (ev, f"p{texts}" if ev == "text" else ev if ev in TAGS else "")))
    never = tuple((d.state, d.event) for d in table.rows if (d.state, d.event) not in fired)
    return ChannelsReport(sequences, len(seen_states), tuple(found.values()), never)


def _steps(table: Table, path: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    state, out = table.initial, []
    for ev, _ in path:
        out.append((state, ev))
        d = table.decision(state, ev)
        state = d.target if d.kind is DecisionKind.ROW else state
    return out
