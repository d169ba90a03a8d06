"""The registry of trace monitors: exactly one per invariant of spec/invariants.toml.

Each invariant of scope "trace" or "both" has one monitor, registered with `@monitor(name)` in
`MONITORS` (a spec.invariants.Registry, the kind the model checker's state checks use too);
properties.monitors holds them and its `registry_mismatch()` names what is on one side only
(tests/test_invariants_registry.py fails on any). This module imports no monitor: the registry is
one-way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..spec.invariants import INVARIANTS_FILE, Invariant, InvariantSpecError, Registry, Scope, load_invariants

__all__ = [
    "INVARIANTS_FILE", "MONITORS", "Invariant", "InvariantSpecError", "MonitorFn", "Scope", "load_invariants",
    "monitor", "registered",
]

# A monitor yields (event index or None for end of trace, message) per violation.
MonitorFn = Callable[[Any], Iterable[tuple[int | None, str]]]
MONITORS: Registry[MonitorFn] = Registry("monitor", Scope.TRACE)


def monitor(name: str) -> Callable[[MonitorFn], MonitorFn]:
    """Register the one trace monitor of invariant `name` (a second registration is an error)."""
    return MONITORS.register(name)


def registered() -> dict[str, MonitorFn]:
    """The monitors registered so far by invariant name (properties.monitors registers them all
    when imported; its `monitors()` is the full registry)."""
    return MONITORS.registered()
