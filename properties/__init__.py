"""Trace monitors and invariants (DESIGN, properties/): `check_trace(events) -> list[Violation]`."""

from .monitors import Violation, check_trace

__all__ = ["Violation", "check_trace"]
