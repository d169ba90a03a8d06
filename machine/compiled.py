"""The compiled stepper: a table becomes dict dispatch, cheap enough for every token (docs/concepts.md, "The runtime").

`fire(event)` returns ``(action, new_state)`` precomputed per row (no allocation per step), or
raises IllegalTransition naming machine, state and event; on a rejection the state is unchanged
(the h11 way: a missing entry is a protocol error with a clear message).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

from ..spec import DecisionKind, Table, load_spec

T = TypeVar("T")


class IllegalTransition(RuntimeError):
    """An event the table rejects (or does not declare) in the current state."""

    def __init__(self, machine: str, state: str, event: str, note: str = "") -> None:
        self.machine, self.state, self.event, self.note = machine, str(state), event, note
        text = f"{machine}: event '{event}' is not allowed in state {state}"
        super().__init__(f"{text} ({note})" if note else text)


class CompiledMachine:
    """Immutable dispatch tables of one Table; `new()` makes a Stepper positioned at a state.

    Each state's rows are one dict, event -> (rows of the target state, (action, target)): a
    step is one dict lookup and returns the precomputed pair, so nothing is allocated per step.
    """

    __slots__ = ("table", "name", "State", "_rows", "_index", "_members", "_terminal")

    def __init__(self, table: Table) -> None:
        self.table = table
        self.name = table.name
        self.State = table.State
        self._index = {s: i for i, s in enumerate(table.states)}
        self._members = tuple(table.State[s] for s in table.states)
        self._terminal = frozenset(table.State[s] for s in table.terminal)
        rows: dict[str, dict[str, tuple[dict, tuple[str | None, enum.Enum]]]] = {s: {} for s in table.states}
        for s in table.states:
            for e in table.events:
                d = table.decision(s, e)
                if d.kind is not DecisionKind.REJECT:
                    rows[s][e] = (rows[d.target], (d.action, table.State[d.target]))
        self._rows = tuple(rows[s] for s in table.states)

    def self_loops(self, event: str, action: str | None) -> frozenset[enum.Enum]:
        """The states whose row for `event` leads back to the same state with `action`.

        There a fire changes nothing and returns that action, so a per-token caller that performs
        the action itself may skip the call: `if st.state not in loops: st.fire(event)`.
        The table decides where that holds; in every other state the caller fires as usual.
        """
        rows = [(s, self.table.decision(s, event)) for s in self.table.states]
        if not any(d.kind is DecisionKind.ROW and d.action == action for _, d in rows):
            raise ValueError(f"{self.name}: no row of event '{event}' has action {action!r}")
        return frozenset(self.State[s] for s, d in rows if d.kind is DecisionKind.ROW and d.target == s and d.action == action)

    def new(self, state: str | enum.Enum | None = None) -> Stepper:
        """A stepper at the table's initial state, or at `state` (for exhaustive tests)."""
        return Stepper(self, self._index[str(state) if state is not None else self.table.initial])

    def illegal(self, state: str | enum.Enum, event: str) -> IllegalTransition:
        state = str(state)
        if event not in self.table.events:
            return IllegalTransition(self.name, state, event, "undeclared event")
        return IllegalTransition(self.name, state, event, self.table.decision(state, event).note)


class Stepper:
    """One running instance of a compiled table.

    `state` is the current state's Enum member, a plain attribute so that reading it on the
    per-token path costs a slot load; only `fire` changes it.
    """

    __slots__ = ("_m", "_rows", "state")

    def __init__(self, machine: CompiledMachine, index: int) -> None:
        self._m = machine
        self._rows = machine._rows[index]
        self.state: enum.Enum = machine._members[index]

    def fire(self, event: str) -> tuple[str | None, enum.Enum]:
        """Apply `event`: returns (action, new state) or raises IllegalTransition (state kept)."""
        entry = self._rows.get(event)
        if entry is None:
            raise self._m.illegal(self.state, event)
        self._rows, result = entry
        self.state = result[1]
        return result

    def allows(self, event: str) -> bool:
        return event in self._rows

    @property
    def terminal(self) -> bool:
        return self.state in self._m._terminal

    @property
    def machine(self) -> CompiledMachine:
        return self._m

    def __repr__(self) -> str:
        return f"<Stepper {self._m.name} at {self.state.value}>"


def per_table(build: Callable[[Table], T]) -> Callable[[Table], T]:
    """`build`, run once per table object: what a table compiles to (its machine, the plans and fast
    paths a runtime class derives from it) is made when a run first takes that table and shared by
    every later run of it. The table is kept with its result, so its id is not reused meanwhile."""
    cache: dict[int, tuple[Table, T]] = {}

    def of(table: Table) -> T:
        hit = cache.get(id(table))
        if hit is None or hit[0] is not table:
            hit = cache[id(table)] = (table, build(table))
        return hit[1]

    return of


def compile_table(table: Table) -> CompiledMachine:
    """Compile any Table (a shipped one or one loaded from a file), afresh."""
    return CompiledMachine(table)


compiled_of = per_table(CompiledMachine)
compiled_of.__doc__ = "The CompiledMachine of any Table (a shipped one or an edited copy), built once per table."


def compiled(name: str) -> CompiledMachine:
    """The compiled machine of the spec directory's table `name` (`load_spec`)."""
    return compiled_of(load_spec(name))
