"""The named invariants of chapter 4 (spec/invariants.toml) and the registry of their monitors.

Each invariant in the TOML file has exactly one trace monitor, registered with `@monitor(name)`;
`registry_mismatch()` names what is on one side only (tests/test_invariants_registry.py fails on
any). The model checker (machine/checker.py) reads the same file to know which invariants it
checks in every state (scope "state" or "both").
"""

from __future__ import annotations

import enum
import functools
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from ..spec.loader import SPEC_DIR

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


# A monitor yields (event index or None for end of trace, message) per violation.
MonitorFn = Callable[[Any], Iterable[tuple[int | None, str]]]
_MONITORS: dict[str, MonitorFn] = {}


def monitor(name: str) -> Callable[[MonitorFn], MonitorFn]:
    """Register the one trace monitor of invariant `name` (a second registration is an error)."""

    def register(fn: MonitorFn) -> MonitorFn:
        if name in _MONITORS:
            raise ValueError(f"invariant '{name}' already has a monitor: {_MONITORS[name].__qualname__}")
        _MONITORS[name] = fn
        return fn

    return register


def monitors() -> dict[str, MonitorFn]:
    """The registered monitors by invariant name (importing properties.monitors fills it)."""
    from . import monitors as _loaded  # noqa: F401  (registration happens at import)

    return dict(_MONITORS)


def registry_mismatch() -> tuple[list[str], list[str]]:
    """(trace invariants without a monitor, monitors without a trace invariant in the TOML)."""
    declared = {n for n, inv in load_invariants().items() if inv.on_traces}
    registered = set(monitors())
    return sorted(declared - registered), sorted(registered - declared)
