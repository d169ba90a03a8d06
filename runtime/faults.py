"""Fault injection at named points of the loop (§4.9, §4.10, §4.12).

A Fault fires when the trace records the event named by `point` for the given `step` (the `step`
field of token/decode events, the `seq` of response.delta; prefill points take step 0). A run's
FaultHooks watch its trace for those points and deliver each action to the run (`FaultTarget`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Protocol

import attrs

from .events import Event, EventKind, Trace


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


class FaultTarget(Protocol):
    """What a fault does to the run it is injected into (runner.RequestRun)."""

    def cancel(self, source: str = "client") -> None:
        """Request a cancel, as a client would (§4.9)."""

    def disconnect(self) -> None:
        """The client goes away (§4.7, D5)."""

    def force_deadline(self) -> None:
        """The deadline counts as passed at the next check point (§4.9)."""

    def check_decoding(self) -> None:
        """From now on every push asks `FaultHooks.decoding_fails` first (§4.5, §4.10)."""


class FaultHooks:
    """The fault injection points of one run (§4.9, §4.10, §4.12): the plan's faults, watched
    for on the run's trace, each delivered to the run as it fires (`_DELIVER`). A run with no
    faults has inactive hooks: nothing watches its trace, and the per-token path asks nothing.

    Faults that fire while the run is still being built (at request.created) wait until `start`,
    once the stream has started (the stream table accepts nothing before response.start). A
    model_error waits for the kernel in flight to ask (`take_kernel_fault`), a decoding_error for
    the push of its step (`decoding_fails`), a transport_error for the send of its seq
    (`send_fails`)."""

    __slots__ = ("plan", "active", "_target", "_trace", "_deferred", "_kernel_fault", "_poisoned")

    def __init__(self, plan: FaultPlan, target: FaultTarget, trace: Trace) -> None:
        self.plan = plan
        self.active = bool(plan.faults)
        self._target, self._trace = target, trace
        self._deferred: list[tuple[FaultAction, int]] | None = []
        self._kernel_fault = False
        self._poisoned: set[int] = set()
        if self.active:
            trace.subscribe(self._inject)

    def start(self) -> None:
        """Deliver what fired while the run was being built; from now on each fault lands as it fires."""
        deferred, self._deferred = self._deferred or [], None
        for action, step in deferred:
            _DELIVER[action](self, step)

    def take_kernel_fault(self) -> bool:
        """True (once) when a model_error fault was injected into the kernel now in flight."""
        fault, self._kernel_fault = self._kernel_fault, False
        return fault

    def decoding_fails(self, step: int) -> bool:
        """True when a decoding_error fault was injected for the push of `step`."""
        return step in self._poisoned

    def send_fails(self, seq: int) -> bool:
        """True (and recorded in the trace) when a transport_error fault fails the send of delta `seq`."""
        if FaultAction.TRANSPORT_ERROR not in self.plan.at("response.delta", seq):
            return False
        self._trace.emit(EventKind.FAULT_INJECTED, point="response.delta", step=seq, action="transport_error")
        return True

    def _inject(self, ev: Event) -> None:
        data = ev.data
        step = data.get("seq") if ev.kind == EventKind.RESPONSE_DELTA else data.get("step", 0)
        if step is None:
            return
        for action in self.plan.at(str(ev.kind), step):
            self._trace.emit(EventKind.FAULT_INJECTED, point=str(ev.kind), step=step, action=action.value)
            if self._deferred is not None:  # the run is still being built: delivered by start()
                self._deferred.append((action, step))
            else:
                _DELIVER[action](self, step)

    def _poison(self, step: int) -> None:
        self._poisoned.add(step)
        self._target.check_decoding()  # only a run with an injected decoding_error pays for the check

    def _fail_kernel(self, step: int) -> None:
        self._kernel_fault = True


# What each action does when it fires; a transport_error is asked for by the send itself (send_fails).
_DELIVER: dict[FaultAction, Callable[[FaultHooks, int], None]] = {
    FaultAction.CANCEL: lambda hooks, step: hooks._target.cancel(source="fault"),
    FaultAction.DEADLINE: lambda hooks, step: hooks._target.force_deadline(),
    FaultAction.MODEL_ERROR: FaultHooks._fail_kernel,
    FaultAction.DECODING_ERROR: FaultHooks._poison,
    FaultAction.TRANSPORT_ERROR: lambda hooks, step: None,
    FaultAction.DISCONNECT: lambda hooks, step: hooks._target.disconnect(),
}
