"""Trace monitors and invariants (docs/concepts.md): `check_trace(events) -> list[Violation]`."""

from .monitors import Violation, check_trace

__all__ = ["Violation", "check_trace"]
