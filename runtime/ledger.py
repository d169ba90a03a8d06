"""The resource ledger of one request: each resource is freed exactly once (§4.10).

§4.10 asks that the cache, the batch slot, the RNG state, the stream buffer and the trace handle are
each released once, and that a failed clean-up is recorded rather than reopening anything. The ledger
runs one `resources` table (spec/resources.toml) per kind; the table decides every step:

- ``acquire`` in UNACQUIRED -> HELD; any other acquire is rejected (IllegalTransition).
- ``release`` in HELD -> RELEASED with action ``free``, whose effect ``free`` runs the callback, once.
- ``release`` in RELEASED is an ignore row (``record_double_release``): recorded as a violation,
  nothing freed, no exception.
- ``release`` in UNACQUIRED is rejected: releasing what was never acquired is a caller bug, so the
  ledger lets the table's IllegalTransition reach the caller instead of recording it.

A cancel racing a completion may both call ``release``: fire and callback run under one lock, so the
first caller frees and the second records a double release (invariant: at most one free per kind).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import attrs

from ..machine import Stepper, compiled_of, per_table
from ..machine.actions import Executor, fire_with_effects
from ..spec import Table, default_spec, load_spec
from ..spec.derived import model_resources_of, resource_states, stream_resources_of
from ..spec.vocabulary import table_enum, table_member
from .events import EventKind, Trace

if TYPE_CHECKING:
    # What a type checker sees: the shipped spec/resources.toml `kinds` (tests/test_typed_enums.py
    # holds the two equal); at run time the members are the loaded table's.
    class ResourceKind(enum.StrEnum):
        """The resources of a request (§4.10), in release order (spec/resources.toml `kinds`)."""

        KV_CACHE = "kv_cache"
        BATCH_SLOT = "batch_slot"
        RNG_STATE = "rng_state"
        STREAM_BUFFER = "stream_buffer"
        TRACE_HANDLE = "trace_handle"
else:
    ResourceKind = table_enum("ResourceKind", load_spec("resources").params["kinds"],
                              "The resources of a request (§4.10), in release order (spec/resources.toml `kinds`).")

FreeFn = Callable[[], None]


class LedgerProblem(enum.StrEnum):
    """What went wrong with one resource (§4.10)."""

    DOUBLE_RELEASE = "double_release"  # a second release: recorded, nothing freed
    LEAK = "leak"  # still held when the request's ledger is closed
    FREE_FAILED = "free_failed"  # the free callback raised: a background error, kind stays released


@attrs.frozen
class LedgerViolation:
    """One recorded resource problem; `detail` holds the error text of a failed free."""

    kind: ResourceKind
    problem: LedgerProblem
    detail: str = ""


def resource_kind(kind: str | ResourceKind) -> ResourceKind:
    """`kind` as a ResourceKind, or a ValueError naming it and the known kinds."""
    if isinstance(kind, ResourceKind):
        return kind
    if not isinstance(kind, str):
        raise TypeError(f"resource kind must be a str, got {type(kind).__name__}")
    return table_member(ResourceKind, kind, "resource kind")


class ResourceLedger:
    """Acquire/release bookkeeping for one request, one stepper of its `resources` table (default:
    the spec directory's) per kind (§4.10)."""

    def __init__(
        self,
        request_id: str,
        *,
        trace: Trace | None = None,
        on_free: Mapping[str | ResourceKind, FreeFn] | None = None,
        table: Table | None = None,
    ) -> None:
        self.request_id = request_id
        self._trace = trace
        self._lock = threading.RLock()  # RLock: a free callback may read the ledger
        table = table or default_spec()["resources"]
        machine, self._plans = compiled_of(table), _plans_of(table)
        # the kinds the model holds, released before the terminal event, and the rest (§4.10)
        self.model_kinds, self.stream_kinds = _split_of(table)
        self._held = _held_of(table)  # the states where a kind is held: its release frees it
        self._steppers: dict[ResourceKind, Stepper] = {k: machine.new() for k in ResourceKind}
        self._free: dict[ResourceKind, FreeFn] = {
            resource_kind(k): fn for k, fn in (on_free or {}).items()
        }
        self._violations: list[LedgerViolation] = []
        self._closed = False

    def acquire(self, kind: str | ResourceKind, free: FreeFn | None = None) -> None:
        """Mark `kind` held; `free` (else the `on_free` entry) runs at its one release.

        A second acquire, or an acquire after release, raises IllegalTransition (the table rejects).
        """
        k = resource_kind(kind)
        with self._lock:
            self._steppers[k].fire("acquire")
            if free is not None:
                self._free[k] = free
            self._emit(EventKind.RESOURCE_ACQUIRED, resource=k.value)

    def release(self, kind: str | ResourceKind) -> bool:
        """Release `kind`: True if freed now (callback called once), False for a repeated release.

        A repeated release is recorded as a `double_release` violation and frees nothing. A free
        callback that raises is recorded as `free_failed`; the kind stays released (§4.10: a failed
        clean-up is a background error, never a reason to reopen). Never acquired: IllegalTransition.
        """
        k = resource_kind(kind)
        with self._lock:
            # the row's action: `free` runs the callback; never acquired: IllegalTransition
            plan = fire_with_effects(self._steppers[k], self._plans, "release", self, k)
            if not plan.has("free"):
                self._record(k, LedgerProblem.DOUBLE_RELEASE)
                return False
            return True

    def release_all(self) -> list[ResourceKind]:
        """Release every kind still held, in ResourceKind order; returns the kinds freed now."""
        with self._lock:
            return [k for k in self.held if self.release(k)]

    def close(self) -> list[ResourceKind]:
        """End of the request: record each kind still held as a `leak` (once); returns them."""
        with self._lock:
            leaked = self.leaks()
            if not self._closed:
                self._closed = True
                for k in leaked:
                    self._record(k, LedgerProblem.LEAK)
            return leaked

    def leaks(self) -> list[ResourceKind]:
        """The kinds acquired and not yet released."""
        return self.held

    def state(self, kind: str | ResourceKind) -> enum.Enum:
        """The table state of `kind`: UNACQUIRED, HELD or RELEASED."""
        return self._steppers[resource_kind(kind)].state

    @property
    def held(self) -> list[ResourceKind]:
        with self._lock:
            return [k for k, st in self._steppers.items() if st.state in self._held]

    @property
    def violations(self) -> list[LedgerViolation]:
        with self._lock:
            return list(self._violations)

    def _record(self, kind: ResourceKind, problem: LedgerProblem, detail: str = "") -> None:
        self._violations.append(LedgerViolation(kind, problem, detail))
        data = {"resource": kind.value, "problem": problem.value}
        if detail:
            data["detail"] = detail
        self._emit(EventKind.RESOURCE_VIOLATION, **data)

    def _emit(self, kind: EventKind, **data: object) -> None:
        if self._trace is not None:
            self._trace.emit(kind, **data)

    def __repr__(self) -> str:
        return f"<ResourceLedger {self.request_id} held={[k.value for k in self.held]}>"


# The runtime's implementation of the resources table's effects (machine/actions.py).
RESOURCES = Executor("resources", "the runtime (ledger.ResourceLedger)")


@RESOURCES.effect("free")
def _free_effect(ledger: ResourceLedger, k: ResourceKind) -> None:
    """The one free of `k`: its callback runs; one that raises is a background error (§4.10)."""
    ledger._emit(EventKind.RESOURCE_RELEASED, resource=k.value)
    fn = ledger._free.pop(k, None)
    if fn is not None:
        try:
            fn()
        except Exception as exc:  # recorded as a background error (§4.10)
            ledger._record(k, LedgerProblem.FREE_FAILED, f"{type(exc).__name__}: {exc}")


_plans_of = per_table(RESOURCES.plans)
_split_of = per_table(lambda table: (model_resources_of(table), stream_resources_of(table)))
_held_of = per_table(lambda table: resource_states(table).held)
