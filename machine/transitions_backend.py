"""The same table run by the `transitions` library (docs/concepts.md, "How it is checked"), for users of its callbacks.

Each row becomes a transition whose `after` callback records the row's action; each ignore is
an internal transition (``dest=None``); a rejection is simply absent, so the library itself
refuses it (MachineError) and we re-raise it as the stepper's IllegalTransition, state kept.
It passes the same generated tests as the compiled stepper and is much slower
(benchmarks/bench_stepper.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import transitions
from transitions.extensions import LockedMachine

from ..spec import DecisionKind, Table
from .compiled import IllegalTransition


class _Model:
    """The object `transitions` decorates with the state attribute and trigger methods."""

    state: enum.StrEnum  # a member of the table's State
    trigger: Callable[..., bool]


class TransitionsMachine:
    """One instance of `table` driven by a ``transitions.Machine`` (or LockedMachine if `locked`)."""

    def __init__(self, table: Table, state: str | enum.Enum | None = None, *, locked: bool = False) -> None:
        self.table = table
        self.name = table.name
        self.State = table.State
        self._locked = locked
        self._action: str | None = None
        self._model = _Model()
        start = table.State[str(state) if state is not None else table.initial]
        machine_class = LockedMachine if locked else transitions.Machine
        self._machine = machine_class(
            model=self._model,
            states=list(table.State),
            initial=start,
            transitions=self._transitions(),
            auto_transitions=False,
            ignore_invalid_triggers=False,
        )

    def new(self, state: str | enum.Enum | None = None) -> TransitionsMachine:
        """A fresh instance of the same table at its initial state, or at `state`."""
        return TransitionsMachine(self.table, state, locked=self._locked)

    def fire(self, event: str) -> tuple[str | None, enum.Enum]:
        """Apply `event`: returns (action, new state) or raises IllegalTransition (state kept)."""
        before = self._model.state
        self._action = None
        try:
            self._model.trigger(event)
        except transitions.MachineError:
            raise IllegalTransition(self.name, before, event, self.table.decision(before, event).note) from None
        except AttributeError:
            note = self.table.decision(before, event).note if event in self.table.events else "undeclared event"
            raise IllegalTransition(self.name, before, event, note) from None
        return self._action, self._model.state

    def allows(self, event: str) -> bool:
        return event in self._machine.get_triggers(self._model.state)

    @property
    def state(self) -> enum.Enum:
        return self._model.state

    @property
    def machine(self) -> transitions.Machine:
        """The underlying `transitions` machine, e.g. to add the library's own callbacks."""
        return self._machine

    @property
    def model(self) -> object:
        """The model object the machine drives (its `state` attribute is the current state)."""
        return self._model

    @property
    def terminal(self) -> bool:
        return self.table.is_terminal(self._model.state)

    def __repr__(self) -> str:
        return f"<TransitionsMachine {self.name} at {self.state.value}>"

    def _transitions(self) -> list[dict]:
        """Rows and ignores as `transitions` specs; rejected pairs get no transition."""
        S = self.table.State
        specs = []
        for d in self.table.decisions.values():
            if d.kind is DecisionKind.REJECT:
                continue
            dest = S[d.target] if d.kind is DecisionKind.ROW else None
            specs.append({"trigger": d.event, "source": S[d.state], "dest": dest, "after": self._recorder(d.action)})
        return specs

    def _recorder(self, action: str | None) -> Callable[[], None]:
        def record() -> None:
            self._action = action

        return record
