"""The named invariants of chapter 4 (spec/invariants.toml): their loader, as plain data, and the
registry that holds each invariant's one implementation per place it is checked.

Each place is a `Registry` held against the declarations both ways, e.g. the trace monitors
(properties/monitors.py, scope "trace" or "both").
"""

from __future__ import annotations

import enum
import functools
import tomllib
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

import attrs

from .loader import SPEC_DIR

INVARIANTS_FILE = SPEC_DIR / "invariants.toml"


class Scope(enum.StrEnum):
    """Where an invariant is checked: on runtime traces, on checker states, or both."""

    TRACE = "trace"
    STATE = "state"
    BOTH = "both"


class InvariantSpecError(ValueError):
    """spec/invariants.toml is malformed; the message names the entry and the problem."""


@attrs.frozen
class Invariant:
    """One named property with its section of the seed and a one-line statement."""

    name: str
    anchor: str
    statement: str
    scope: Scope
    needs: tuple[str, ...] = ()

    @property
    def on_traces(self) -> bool:
        return self.scope is not Scope.STATE

    @property
    def on_states(self) -> bool:
        return self.scope is not Scope.TRACE


_KEYS = {"name", "anchor", "statement", "scope", "needs"}


@functools.cache
def load_invariants(path: str | Path | None = None) -> dict[str, Invariant]:
    """The invariants of `path` (default spec/invariants.toml), keyed by name, in file order."""
    p = Path(path) if path is not None else INVARIANTS_FILE
    data = tomllib.loads(p.read_text(encoding="utf-8"))
    out: dict[str, Invariant] = {}
    for i, entry in enumerate(data.get("invariant", []), start=1):
        where = f"{p.name}: invariant {i}"
        unknown = set(entry) - _KEYS
        if unknown:
            raise InvariantSpecError(f"{where}: unknown keys {sorted(unknown)}")
        for key in ("name", "anchor", "statement", "scope"):
            if key not in entry:
                raise InvariantSpecError(f"{where}: missing '{key}'")
        if entry["name"] in out:
            raise InvariantSpecError(f"{where}: duplicate name '{entry['name']}'")
        try:
            scope = Scope(entry["scope"])
        except ValueError:
            raise InvariantSpecError(
                f"{where}: scope '{entry['scope']}' is not one of {[s.value for s in Scope]}"
            ) from None
        out[entry["name"]] = Invariant(
            entry["name"], entry["anchor"], entry["statement"], scope, tuple(entry.get("needs", ()))
        )
    return out


Check = TypeVar("Check", bound=Callable[..., Any])


class Registry(Generic[Check]):
    """The one implementation of each invariant at one place: `place` (Scope.TRACE: the trace
    monitors; Scope.STATE: the model checker's states) takes the invariants of that scope and of
    "both"; `register(name)` is a decorator, and a second implementation of a name is an error."""

    def __init__(self, what: str, place: Scope) -> None:
        if place is Scope.BOTH:
            raise ValueError("a registry's place is Scope.TRACE or Scope.STATE")
        self.what = what
        self.place = place
        self._checks: dict[str, Check] = {}

    def register(self, name: str) -> Callable[[Check], Check]:
        """Register the one `what` of invariant `name` (a second registration raises, naming the first)."""

        def add(fn: Check) -> Check:
            if name in self._checks:
                raise ValueError(f"invariant '{name}' already has a {self.what}: {self._checks[name].__qualname__}")
            self._checks[name] = fn
            return fn

        return add

    def registered(self) -> dict[str, Check]:
        """The implementations registered so far, by invariant name, in registration order."""
        return dict(self._checks)

    def mismatch(self, elsewhere: Collection[str] = (),
                 invariants: Mapping[str, Invariant] | None = None) -> tuple[list[str], list[str]]:
        """(invariants of this place with no implementation, names implemented here that are no
        invariant of this place); `elsewhere` names the ones this place checks by other means."""
        declared = {n for n, inv in (invariants or load_invariants()).items() if inv.scope in (self.place, Scope.BOTH)}
        here = set(self._checks) | set(elsewhere)
        return sorted(declared - here), sorted(here - declared)
