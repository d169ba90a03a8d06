"""Tests generated from a table: a Hypothesis state machine and an exhaustive pair check.

The table is the oracle (docs/concepts.md, "How it is checked"). For every (state, event) pair the implementation
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
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ..machine.compiled import IllegalTransition
from ..spec import Table

Factory = Callable[..., Any]

#: The pool an event is drawn from, by the index Hypothesis draws (0, its simplest choice, first):
#: `fresh` = allowed events not yet fired from this state in this run (so one run spreads over the
#: rows), `onward` = allowed events into another live state, else into any other state (walks
#: get deep: §4.3's CREATED ... DRAINING), `allowed` = any row or ignore, `rejected` = the events
#: that must raise and keep the state. An empty pool falls back to a wider one.
_POOLS = ("fresh", "onward", "allowed", "rejected")


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

    One rule, `fire`: draw an event (see `_POOLS`) and check the implementation against the
    decision for (model state, event). A terminal state gets one probe event (§4.1: it must
    stay put) and then the walk restarts on a new instance. Invariant: implementation state
    and terminal flag equal the model's.
    """
    pools = {s: _event_pools(table, s) for s in table.states}

    class TableWalk(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model = table.initial
            self.impl = factory(None)
            self.fired: set[tuple[str, str]] = set()

        def draw_event(self, data: st.DataObject) -> str:
            onward, allowed, rejected = pools[self.model]
            fresh = tuple(e for e in allowed if (self.model, e) not in self.fired)
            choice = _POOLS[data.draw(st.integers(0, len(_POOLS) - 1), label="pool")]
            pool = {"fresh": fresh or onward, "onward": onward, "allowed": allowed, "rejected": rejected}[choice]
            return data.draw(st.sampled_from(pool or allowed or rejected), label="event")

        @rule(data=st.data())
        def fire(self, data: st.DataObject) -> None:
            """One event; in a terminal state that one probe is the last before a restart."""
            event = self.draw_event(data)
            problem = check_pair(table, self.impl, self.model, event)
            assert problem is None, f"{table.name}: {problem}"
            self.fired.add((self.model, event))
            if table.is_terminal(self.model):
                self.model, self.impl = table.initial, factory(None)
            else:
                self.model = table.decision(self.model, event).target

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


def _event_pools(table: Table, state: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(onward, allowed, rejected) events of `state` (see `_POOLS`)."""
    allowed = table.allowed_events(state)
    targets = {e: table.decision(state, e).target for e in allowed}
    leaving = tuple(e for e in allowed if targets[e] != state)
    onward = tuple(e for e in leaving if not table.is_terminal(targets[e])) or leaving
    return onward, allowed, tuple(e for e in table.events if e not in targets)
