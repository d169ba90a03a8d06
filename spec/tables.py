"""Frozen value types for a transition table (one file per machine in spec/)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from .vocabulary import DecisionKind


@attrs.frozen
class Decision:
    """How one (state, event) pair is decided.

    ``kind`` is a row (a transition, maybe to the same state), an ignore (no state change,
    optionally an action with no effect on control state) or a rejection (IllegalTransition).
    """

    kind: DecisionKind
    state: str
    event: str
    target: str
    action: str | None = None
    anchor: str | None = None
    note: str = ""
    reason: str | None = None
    where: str = ""  # "row 3", "ignore 2", "reject 5": the entry in the file

    @property
    def allowed(self) -> bool:
        return self.kind is not DecisionKind.REJECT


@attrs.frozen
class FinishCheck:
    """One check a selected token goes through (§4.3 "check finish conditions"): when it holds,
    `event` fires. A table's checks run in their listed order and the first that holds wins."""

    event: str
    anchor: str
    note: str = ""
    # A token check: it holds when the selected token is one the request names for this event
    # (Request.finish_tokens), a token that is not text (like EOS, never detokenized). Any other
    # check is a condition implemented once in runtime/finish.FINISH_CHECKS.
    tokens: bool = False
    # The guards (the table's [finish_guards]) that turn this check off while one holds; only a
    # check whose token is not text (eos, a token check) may have them (DECISIONS D31).
    unless: tuple[str, ...] = ()


@attrs.frozen
class StepPhase:
    """One phase of the §4.3 loop's step (a lifecycle table's [[step]], in its order): the runtime
    (runtime/stepgen.PHASES) and the checker model (checker_model.Model) each run the phases in it."""

    phase: str
    anchor: str
    note: str = ""


@attrs.frozen
class FinishGuard:
    """A request condition under which the finish checks that name it do not hold (§4.3; the
    table's [finish_guards], DECISIONS D31): the token is then a token like any other. Each
    guard is implemented once in the runtime and once in the checker model."""

    name: str
    anchor: str
    note: str = ""


@attrs.frozen
class Effect:
    """One effect an action may have (a table's [effects]); each executor implements it once.

    `phase`: ``before`` the state changes, ``with`` the change (in its trace entry) or ``after``.
    `takes_reason`: it applies the row's finish reason.
    """

    name: str
    phase: str
    anchor: str
    note: str = ""
    takes_reason: bool = False


@attrs.frozen
class Table:
    """A validated transition table: every (state, event) pair has exactly one Decision."""

    name: str
    anchor: str
    spec_version: int
    initial: str
    terminal: tuple[str, ...]
    states: tuple[str, ...]
    events: tuple[str, ...]
    decisions: Mapping[tuple[str, str], Decision] = attrs.field(repr=False)
    params: Mapping[str, Any] = attrs.field(factory=dict, repr=False)
    source: str = ""
    finish_checks: tuple[FinishCheck, ...] = ()
    finish_guards: Mapping[str, FinishGuard] = attrs.field(factory=dict, repr=False)
    step: tuple[StepPhase, ...] = ()  # the order of the loop's step (lifecycle; empty elsewhere)
    effects: Mapping[str, Effect] = attrs.field(factory=dict, repr=False)
    actions: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict, repr=False)  # action -> effects
    State: type[enum.Enum] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        camel = "".join(p.capitalize() for p in self.name.split("_"))
        object.__setattr__(self, "State", enum.StrEnum(f"{camel}State", [(s, s) for s in self.states]))

    def decision(self, state: str, event: str) -> Decision:
        return self.decisions[(str(state), event)]

    @property
    def rows(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions.values() if d.kind is DecisionKind.ROW)

    def allowed_events(self, state: str) -> tuple[str, ...]:
        return tuple(e for e in self.events if self.decisions[(str(state), e)].allowed)

    def is_terminal(self, state: str) -> bool:
        return str(state) in self.terminal
