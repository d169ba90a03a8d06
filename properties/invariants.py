"""The registry of trace monitors: exactly one per invariant of spec/invariants.toml.

Each invariant of scope "trace" or "both" has one monitor, registered with `@monitor(name)`;
`registry_mismatch()` names what is on one side only (tests/test_invariants_registry.py fails on
any). The invariants themselves are spec data (decodespec.spec.invariants).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..spec.invariants import INVARIANTS_FILE, Invariant, InvariantSpecError, Scope, load_invariants

__all__ = [
    "INVARIANTS_FILE", "Invariant", "InvariantSpecError", "MonitorFn", "Scope", "load_invariants",
    "monitor", "monitors", "registry_mismatch",
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


def monitors() -> dict[str, MonitorFn]:
    """The registered monitors by invariant name (importing properties.monitors fills it)."""
    from . import monitors as _loaded  # noqa: F401  (registration happens at import)

    return dict(_MONITORS)


def registry_mismatch() -> tuple[list[str], list[str]]:
    """(trace invariants without a monitor, monitors without a trace invariant in the TOML)."""
    declared = {n for n, inv in load_invariants().items() if inv.on_traces}
    registered = set(monitors())
    return sorted(declared - registered), sorted(registered - declared)
