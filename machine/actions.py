"""Actions as effects: one registry per executor, checked both ways against the tables (D17).

A row names an action; the table's ``[actions]`` lists what the action does as effects, and its
``[effects]`` gives each effect a phase (spec/loader.py validates both). An *executor* (the
runtime's request loop, the checker model's step, the resource ledger) registers exactly one
implementation per effect of a table, and nothing else: `Executor.plans(table)` refuses a table
with an effect it does not implement, or an implementation no effect names, as properties/monitors
does for invariants. The plans it derives say, per (state, event), which implementations run before
the state changes, with the change and after it; firing a row runs what its action says. So a
changed action, or an action's changed effects, changes what the runtime does and what the
checker explores alike.

An effect an executor does not represent (the checker model keeps no bytes, only whether they go
out) is registered with `abstracts`, which states why; it runs nothing and is still counted, so a
new effect cannot slip past either executor unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs

from ..spec import DecisionKind, Table

PHASES = ("before", "with", "after")


class ActionError(ValueError):
    """An executor and a table disagree about the effects (the message names table and effect)."""


@attrs.frozen
class Plan:
    """What firing one (state, event) runs: the row's action and its effects, phase by phase."""

    action: str | None
    before: tuple[Callable[..., Any], ...] = ()
    with_: tuple[Callable[..., Any], ...] = ()
    after: tuple[Callable[..., Any], ...] = ()
    effects: tuple[str, ...] = ()

    def has(self, effect: str) -> bool:
        return effect in self.effects


class _Stepper(Protocol):
    state: Any

    def fire(self, event: str) -> Any: ...


def run_phases(
    plan: Plan | None,
    args: tuple,
    change: Callable[..., Any],
    change_args: tuple = (),
    *,
    refused: Callable[[], Any] | None = None,
    entry: Callable[[Any], None] | None = None,
    error: Callable[[Callable[..., Any], KeyError], Exception] | None = None,
) -> Any:
    """The one phase loop of every executor: for the plan of the (state, event) being fired, run
    the `before` effects, the state change `change(*change_args)`, the `with` effects, the hook
    `entry(what change returned)` (the runtime's trace entry, §4.12), the `after` effects; each
    effect as `fn(*args)`. Returns what `change` returned. Hooks: `refused()` answers a pair the
    table refuses (plan None) and runs nothing else: the checker model records a refinement
    violation; without it `change` answers (a compiled stepper's fire raises the table's
    IllegalTransition, changing nothing). `error(fn, exc)` turns an effect's KeyError (an input
    this call does not carry) into the error to raise, naming the effect."""
    if plan is None:
        return change(*change_args) if refused is None else refused()
    try:
        for fn in plan.before:  # what must happen before the state changes (release_model, §4.3)
            fn(*args)
        out = change(*change_args)
        for fn in plan.with_:
            fn(*args)
        if entry is not None:
            entry(out)
        for fn in plan.after:
            fn(*args)
    except KeyError as exc:
        if error is None:
            raise
        raise error(fn, exc) from None
    return out


def fire_with_effects(stepper: _Stepper, plans: Mapping[tuple[str, str], Plan], event: str, *args: Any) -> Plan:
    """Fire `event` on `stepper` and run its row's effects by phase (`run_phases`), each as
    `fn(*args)`; returns the plan. A refused event raises the table's IllegalTransition and runs
    nothing; an event the stepper took that `plans` has no plan for (plans of another table) is
    an ActionError."""
    state = stepper.state._value_
    plan = plans.get((state, event))
    run_phases(plan, args, stepper.fire, (event,))
    if plan is None:
        raise ActionError(f"({state}, {event}) fired, but the plans given have none for it (plans of another table?)")
    return plan


class Executor:
    """The implementations of one table's effects in one executor (`who`: for messages)."""

    def __init__(self, table: str, who: str) -> None:
        self.table, self.who = table, who
        self.impl: dict[str, Callable[..., Any] | None] = {}
        self.why: dict[str, str] = {}

    def effect(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: `fn` implements effect `name` (one implementation per effect)."""
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self._add(name, fn)
            return fn
        return register

    def abstracts(self, name: str, why: str) -> None:
        """Effect `name` has nothing to do in this executor, for the reason `why`."""
        self._add(name, None)
        self.why[name] = why

    def _add(self, name: str, fn: Callable[..., Any] | None) -> None:
        if name in self.impl:
            raise ActionError(f"{self.who}: effect '{self.table}.{name}' is implemented twice")
        self.impl[name] = fn

    def verify(self, table: Table) -> None:
        """Both ways: every effect of `table` is implemented here, and nothing else is."""
        if table.name != self.table:
            raise ActionError(f"{self.who} executes the {self.table} table, not {table.name}")
        if not table.actions:
            raise ActionError(f"{table.source}: declares no [actions]; {self.who} runs a row's effects")
        missing = sorted(set(table.effects) - set(self.impl))
        extra = sorted(set(self.impl) - set(table.effects))
        if missing:
            raise ActionError(f"{self.who}: no implementation of effect(s) {missing} of {table.source}")
        if extra:
            raise ActionError(f"{self.who}: implements {extra}, which {table.source} does not declare")

    def plans(self, table: Table) -> dict[tuple[str, str], Plan]:
        """Per allowed (state, event): the plan its row or ignore runs (verified first); a row
        naming an action the table does not declare is refused by name (a Table built past the
        loader, which refuses it too, could otherwise run nothing for it)."""
        self.verify(table)
        out: dict[tuple[str, str], Plan] = {}
        for key, d in table.decisions.items():
            if d.kind is DecisionKind.REJECT:
                continue
            if d.action and d.action not in table.actions:
                raise ActionError(f"{self.who}: ({d.state}, {d.event}) of {table.source} names action "
                                  f"'{d.action}', which its [actions] does not declare")
            effects = table.actions[d.action] if d.action else ()
            phases: Mapping[str, list] = {p: [] for p in PHASES}
            for name in effects:
                fn = self.impl[name]
                if fn is not None:
                    phases[table.effects[name].phase].append(fn)
            out[key] = Plan(d.action, tuple(phases["before"]), tuple(phases["with"]), tuple(phases["after"]), effects)
        return out
