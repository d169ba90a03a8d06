"""Fault injection at named points of the loop (§4.9, §4.10, §4.12).

A Fault fires when the trace records the event named by `point` for the given `step` (the `step`
field of token/decode events, the `seq` of response.delta; prefill points take step 0).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs


class FaultAction(enum.StrEnum):
    CANCEL = "cancel"
    DEADLINE = "deadline"
    MODEL_ERROR = "model_error"
    DECODING_ERROR = "decoding_error"
    TRANSPORT_ERROR = "transport_error"
    DISCONNECT = "disconnect"


POINTS = (
    "request.created",
    "prefill.started",
    "prefill.completed",
    "token.selected",
    "response.delta",
    "decode.started",
    "decode.completed",
)

# Which actions make sense where: a kernel can only fail while it runs, a push only on a token,
# a send only on a delta. Asynchronous actions (cancel, deadline, disconnect) may arrive anywhere.
_ALLOWED = {
    FaultAction.MODEL_ERROR: ("prefill.started", "decode.started"),
    FaultAction.DECODING_ERROR: ("token.selected",),
    FaultAction.TRANSPORT_ERROR: ("response.delta",),
}


def _action(v: str | FaultAction) -> FaultAction:
    try:
        return FaultAction(v)
    except ValueError:
        raise ValueError(f"unknown fault action {v!r}; known: {', '.join(a.value for a in FaultAction)}") from None


@attrs.frozen
class Fault:
    """Inject `action` when the loop reaches `point` at `step`."""

    point: str = attrs.field()
    step: int = attrs.field()
    action: FaultAction = attrs.field(converter=_action)

    @point.validator
    def _point(self, _a: attrs.Attribute, v: str) -> None:
        if v not in POINTS:
            raise ValueError(f"unknown fault point {v!r}; known: {', '.join(POINTS)}")

    @step.validator
    def _step(self, _a: attrs.Attribute, v: int) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"fault step must be an int >= 0, got {v!r}")

    def __attrs_post_init__(self) -> None:
        where = _ALLOWED.get(self.action)
        if where is not None and self.point not in where:
            raise ValueError(f"fault action {self.action.value!r} can only be injected at {', '.join(where)}, not {self.point!r}")


def _fault_tuple(faults: Iterable[Fault]) -> tuple[Fault, ...]:
    return tuple(faults)


@attrs.frozen
class FaultPlan:
    """A set of faults for one request; `at(point, step)` lists those that fire there."""

    faults: tuple[Fault, ...] = attrs.field(converter=_fault_tuple, factory=tuple)

    def at(self, point: str, step: int) -> tuple[FaultAction, ...]:
        return tuple(f.action for f in self.faults if f.point == point and f.step == step)

    def points(self) -> frozenset[str]:
        return frozenset(f.point for f in self.faults)
