"""Model-check the chat answer's split (spec/channels.toml; §4.7, issue 25, DECISIONS D45-D47).

Breadth-first over every sequence the scanner can produce: in each state the environment offers
every event the table allows there (the scanner looks only for those tags; `call_close` and
`call_bad` both, since the call's JSON decides), up to `max_texts` text pieces and `max_tags` tag
events, and `end` at any point. Every row's action runs through its effects on an abstract answer
(each text piece a numbered label, each tag a named label) by this module's own executor, checked
both ways against the table like the others (machine/actions.py). What the answer must be is said
here independently of the rows, from the events alone (the intended meaning of D45-D47):

- `pieces_once`: every text piece goes out exactly once, in one channel or inside a reported call;
- `reasoning_is_bracketed`: a piece is reasoning exactly when the last think tag before it was an
  opening one;
- `order_kept`: each channel's pieces go out in the order they came (§4.7);
- `think_tags_never_text`: a think tag that fired is no channel's text;
- `calls_only_when_closed`: a call is reported only at a `call_close`, holding exactly the pieces
  since its `call_open`; a call cut by `end` or closed bad is never reported;
- `calls_end_as_calls`: the answer ends in ENDED_CALLS exactly when it holds a reported call.

The shortest counterexample comes as a `checker.Counterexample` (steps on the channels machine).
`tests/test_channels.py` seeds edits of the table that the loader accepts and this checker refuses.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs

from ..spec import DecisionKind, Table, load_spec
from .actions import Executor, fire_with_effects
from .checker import Counterexample
from .compiled import compile_table

INVARIANTS = {
    "pieces_once": "§4.7", "reasoning_is_bracketed": "§4.7", "order_kept": "§4.7",
    "think_tags_never_text": "§4.7", "calls_only_when_closed": "§4.7", "calls_end_as_calls": "§4.10",
}
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


def _violations(events: list[tuple[str, str]], a: Answer, final: str, table: Table) -> list[tuple[str, str]]:
    """The invariants above on one sequence's answer (`events`: (event, label) in order)."""
    out = []
    texts = [lab for ev, lab in events if ev == "text"]
    held_in_calls = [x for c in a.calls for x in c if x.startswith("p")]
    emitted = [x for x in a.content + a.reasoning if x.startswith("p")] + held_in_calls
    open_call = [x for x in a.call if x.startswith("p")] if not a.closed else []
    if sorted(emitted + open_call) != sorted(texts) or len(set(emitted)) != len(emitted):
        out.append(("pieces_once", f"pieces sent {texts}; content {a.content}, reasoning {a.reasoning}, calls {a.calls}"))
    think, want = False, []
    for ev, lab in events:
        think = True if ev == "think_open" else False if ev == "think_close" else think
        if ev == "text" and think:
            want.append(lab)
    if [x for x in a.reasoning if x.startswith("p")] != want:
        out.append(("reasoning_is_bracketed", f"reasoning {a.reasoning}; the pieces inside <think> were {want}"))
    for name, got in (("content", a.content), ("reasoning", a.reasoning)):
        nums = [int(x[1:]) for x in got if x.startswith("p")]
        if nums != sorted(nums):
            out.append(("order_kept", f"{name} {got} is out of order"))
    leaked = [x for x in a.content + a.reasoning if x.startswith("think_")]
    if leaked:
        out.append(("think_tags_never_text", f"the tag(s) {leaked} went out as text"))
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
        out.append(("calls_only_when_closed", f"calls reported {a.calls}; the calls closed well were {closed_calls}"))
    if (final == "ENDED_CALLS") != bool(a.calls) and table.is_terminal(final):
        out.append(("calls_end_as_calls", f"ended in {final} with {len(a.calls)} reported call(s)"))
    return out


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
                    found[name] = Counterexample(name, INVARIANTS[name], message,
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
