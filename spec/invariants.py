"""The named invariants of chapter 4 (spec/invariants.toml): their loader, as plain data.

The model checker (machine/checker.py) reads them to know which invariants it checks in every
state (scope "state" or "both"); properties/invariants.py registers one trace monitor per
invariant of scope "trace" or "both".
"""

from __future__ import annotations

import enum
import functools
import tomllib
from pathlib import Path

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
