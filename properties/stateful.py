"""Tests generated from a table: a Hypothesis state machine and an exhaustive pair check.

The table is the oracle (DESIGN, properties/). For every (state, event) pair the implementation
must do what the table decides: a row or an ignore returns the entry's action and moves to its
target (an ignore stays put), a rejection raises IllegalTransition and leaves the state alone
(§4.1: terminal states are irreversible, so every row out of them is a rejection).

An implementation is anything with the stepper API (`fire`, `state`, `terminal`, `allows`);
`factory(state=None)` builds one positioned at `state`, e.g. ``compile_table(t).new`` or
``TransitionsMachine(t).new``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..machine.compiled import IllegalTransition
from ..spec import Table

Factory = Callable[..., Any]

#: A draw picks among the allowed events of the model state with probability 1 - 1/_ANY_ONE_IN
#: (plus their share of the uniform draw), so walks get deep instead of bouncing off rejections.
_ANY_ONE_IN = 5


def check_pair(table: Table, impl: Any, state: str, event: str) -> str | None:
    """Fire `event` on `impl` (which is at `state`) and compare with the table; None if it agrees."""
    d = table.decision(state, event)
    pair = f"({state}, {event})"
    if impl.allows(event) != d.allowed:
        return f"{pair}: allows() says {not d.allowed}, the table decides {d.kind.value}"
    if not d.allowed:
        try:
            got = impl.fire(event)
        except IllegalTransition:
            if str(impl.state) != state:
                return f"{pair}: rejected but the state moved to {impl.state}"
            return None
        return f"{pair}: expected IllegalTransition, got {_show(got)}"
    try:
        action, target = impl.fire(event)
    except IllegalTransition as exc:
        return f"{pair}: expected {d.kind.value} -> {d.target} / {d.action}, got IllegalTransition ({exc})"
    if (action, str(target)) != (d.action, d.target) or str(impl.state) != d.target:
        return f"{pair}: expected {d.kind.value} -> {d.target} / {d.action}, got {_show((action, target))}"
    return None


def exhaustive_check(table: Table, factory: Factory) -> list[str]:
    """Every (state, event) pair on a fresh implementation at that state; returns the mismatches."""
    mismatches = []
    for state in table.states:
        for event in table.events:
            impl = factory(state)
            if str(impl.state) != state:
                mismatches.append(f"({state}, {event}): factory({state!r}) starts at {impl.state}")
                continue
            problem = check_pair(table, impl, state, event)
            if problem is not None:
                mismatches.append(problem)
    return mismatches


def stateful_test_for(table: Table, factory: Factory) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine that walks `table` on `factory()` with the table as oracle.

    Rules: `fire` draws an event (mostly one the model state allows) and checks the
    implementation against the decision for (model state, event); `restart` begins a new
    instance once the model is in a terminal state. Invariant: implementation state and
    terminal flag equal the model's.
    """
    allowed = {s: table.allowed_events(s) for s in table.states}
    any_event = st.sampled_from(table.events)

    def draw_event(data: st.DataObject, state: str) -> str:
        pick_any = not allowed[state] or data.draw(st.integers(0, _ANY_ONE_IN - 1), label="any event") == 0
        return data.draw(any_event if pick_any else st.sampled_from(allowed[state]), label="event")

    class TableWalk(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model = table.initial
            self.impl = factory(None)

        @rule(data=st.data())
        def fire(self, data: st.DataObject) -> None:
            event = draw_event(data, self.model)
            problem = check_pair(table, self.impl, self.model, event)
            assert problem is None, f"{table.name}: {problem}"
            self.model = table.decision(self.model, event).target

        @precondition(lambda self: table.is_terminal(self.model))
        @rule()
        def restart(self) -> None:
            self.model = table.initial
            self.impl = factory(None)

        @invariant()
        def implementation_follows_the_table(self) -> None:
            assert str(self.impl.state) == self.model, (
                f"{table.name}: implementation at {self.impl.state}, table at {self.model}"
            )
            assert self.impl.terminal == table.is_terminal(self.model), (
                f"{table.name}: terminal flag {self.impl.terminal} at {self.model}"
            )

    camel = "".join(p.capitalize() for p in table.name.split("_"))
    TableWalk.__name__ = TableWalk.__qualname__ = f"{camel}TableWalk"
    return TableWalk


def _show(result: object) -> str:
    if isinstance(result, tuple) and len(result) == 2:
        return f"-> {result[1]} / {result[0]}"
    return repr(result)
