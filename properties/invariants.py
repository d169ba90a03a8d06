"""The registry of trace monitors: exactly one per invariant of spec/invariants.toml.

Each invariant of scope "trace" or "both" has one monitor, registered with `@monitor(name)`;
properties.monitors holds them and its `registry_mismatch()` names what is on one side only
(tests/test_invariants_registry.py fails on any). The invariants themselves are spec data
(decodespec.spec.invariants). This module imports no monitor: the registry is one-way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..spec.invariants import INVARIANTS_FILE, Invariant, InvariantSpecError, Scope, load_invariants

__all__ = [
    "INVARIANTS_FILE", "Invariant", "InvariantSpecError", "MonitorFn", "Scope", "load_invariants",
    "monitor", "registered",
]

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


def registered() -> dict[str, MonitorFn]:
    """The monitors registered so far by invariant name (properties.monitors registers them all
    when imported; its `monitors()` is the full registry)."""
    return dict(_MONITORS)
