"""ResourceLedger: every resource of a request is freed exactly once (§4.10)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from decodespec.machine import IllegalTransition
from decodespec.properties.stateful import exhaustive_check, stateful_test_for
from decodespec.runtime.events import EventKind, Trace
from decodespec.runtime.ledger import (
    LedgerProblem,
    LedgerViolation,
    ResourceKind,
    ResourceLedger,
)
from decodespec.spec import load_spec


def counting_ledger(trace: Trace | None = None) -> tuple[ResourceLedger, dict[ResourceKind, int]]:
    frees = {k: 0 for k in ResourceKind}

    def bump(k: ResourceKind):
        def fn() -> None:
            frees[k] += 1

        return fn

    return ResourceLedger("r1", trace=trace, on_free={k: bump(k) for k in ResourceKind}), frees


def test_kinds_are_the_table_params_in_order():
    """§4.10: the five resources (cache, slot, RNG, stream buffer, trace handle) come from the table."""
    assert [k.value for k in ResourceKind] == load_spec("resources").params["kinds"]


def test_acquire_then_release_frees_once_and_traces_both():
    """§4.10: acquire then release calls the free callback once and logs acquired/released."""
    trace = Trace("r1")
    ledger, frees = counting_ledger(trace)
    ledger.acquire("kv_cache")
    assert ledger.held == [ResourceKind.KV_CACHE]
    assert ledger.release("kv_cache") is True
    assert frees[ResourceKind.KV_CACHE] == 1
    assert ledger.held == [] and ledger.violations == []
    assert [(e.kind, e.data["resource"]) for e in trace] == [
        (EventKind.RESOURCE_ACQUIRED, "kv_cache"),
        (EventKind.RESOURCE_RELEASED, "kv_cache"),
    ]


def test_free_passed_to_acquire_overrides_on_free():
    """§4.10: the callback given at acquire is the one run at the release."""
    ledger, frees = counting_ledger()
    called = []
    ledger.acquire(ResourceKind.BATCH_SLOT, free=lambda: called.append(1))
    ledger.release(ResourceKind.BATCH_SLOT)
    assert called == [1] and frees[ResourceKind.BATCH_SLOT] == 0


def test_double_release_is_recorded_not_raised_and_frees_nothing():
    """§4.10: a second release is a violation `double_release`, not a second free, not a crash."""
    trace = Trace("r1")
    ledger, frees = counting_ledger(trace)
    ledger.acquire("rng_state")
    assert ledger.release("rng_state") is True
    assert ledger.release("rng_state") is False
    assert frees[ResourceKind.RNG_STATE] == 1
    assert ledger.violations == [LedgerViolation(ResourceKind.RNG_STATE, LedgerProblem.DOUBLE_RELEASE)]
    assert trace.events[-1].kind == EventKind.RESOURCE_VIOLATION
    assert dict(trace.events[-1].data) == {"resource": "rng_state", "problem": "double_release"}


def test_release_of_never_acquired_is_rejected_by_the_table():
    """§4.10 table: releasing what was never acquired is a caller bug (IllegalTransition)."""
    ledger, frees = counting_ledger()
    with pytest.raises(IllegalTransition, match="release"):
        ledger.release("stream_buffer")
    assert ledger.state("stream_buffer") == "UNACQUIRED" and sum(frees.values()) == 0


@pytest.mark.parametrize("first", [[], ["release"]])
def test_reacquire_is_rejected(first):
    """§4.10 table: a resource is acquired once and a released one is not reopened."""
    ledger, _ = counting_ledger()
    ledger.acquire("trace_handle")
    for op in first:
        getattr(ledger, op)("trace_handle")
    with pytest.raises(IllegalTransition, match="acquire"):
        ledger.acquire("trace_handle")


def test_unknown_kind_is_a_clear_error():
    """§4.10: only the five listed resources exist; anything else names itself and the known ones."""
    ledger, _ = counting_ledger()
    with pytest.raises(ValueError, match="unknown resource kind 'gpu'.*kv_cache"):
        ledger.acquire("gpu")
    with pytest.raises(TypeError, match="must be a str"):
        ledger.acquire(3)  # type: ignore[arg-type]


def test_leak_reported_at_close_once():
    """§4.10: a resource still held at the end is a leak, recorded as a violation and traced."""
    trace = Trace("r1")
    ledger, frees = counting_ledger(trace)
    ledger.acquire("kv_cache")
    ledger.acquire("batch_slot")
    ledger.release("batch_slot")
    assert ledger.leaks() == [ResourceKind.KV_CACHE]
    assert ledger.close() == [ResourceKind.KV_CACHE]
    ledger.close()
    assert ledger.violations == [LedgerViolation(ResourceKind.KV_CACHE, LedgerProblem.LEAK)]
    leaks = [e for e in trace if e.kind == EventKind.RESOURCE_VIOLATION]
    assert [dict(e.data) for e in leaks] == [{"resource": "kv_cache", "problem": "leak"}]
    assert frees[ResourceKind.KV_CACHE] == 0


def test_release_all_frees_held_in_table_order():
    """§4.10 (and the §4.3 order): release_all frees what is held, model resources first."""
    trace = Trace("r1")
    ledger, frees = counting_ledger(trace)
    for k in ("trace_handle", "stream_buffer", "rng_state", "kv_cache"):
        ledger.acquire(k)
    ledger.release("rng_state")
    assert ledger.release_all() == [ResourceKind.KV_CACHE, ResourceKind.STREAM_BUFFER, ResourceKind.TRACE_HANDLE]
    released = [e.data["resource"] for e in trace if e.kind == EventKind.RESOURCE_RELEASED]
    assert released == ["rng_state", "kv_cache", "stream_buffer", "trace_handle"]
    assert ledger.release_all() == [] and ledger.close() == [] and ledger.violations == []
    assert frees == {k: int(k != ResourceKind.BATCH_SLOT) for k in ResourceKind}


def test_failed_free_is_recorded_and_the_kind_stays_released():
    """§4.10: a failed clean-up is a background error; it never reopens the resource."""
    ledger, _ = counting_ledger()

    def broken() -> None:
        raise OSError("device gone")

    ledger.acquire("kv_cache", free=broken)
    assert ledger.release("kv_cache") is True
    assert ledger.state("kv_cache") == "RELEASED"
    assert ledger.violations == [
        LedgerViolation(ResourceKind.KV_CACHE, LedgerProblem.FREE_FAILED, "OSError: device gone")
    ]


def test_racing_releases_free_exactly_once():
    """§4.10: a cancel racing a completion, both releasing: one free, one recorded double release,
    and the losing release returns only after the free has finished (fire and free are one step).

    Two threads release the same kind of a fresh ledger per round, 1000 rounds, meeting at a barrier
    each round, with a tiny switch interval so that the interpreter interleaves them often.
    """
    rounds = 1000
    barrier = threading.Barrier(2)
    ledgers: list[ResourceLedger] = []
    frees = [0] * rounds
    seen: list[list[tuple[bool, int]]] = [[] for _ in range(rounds)]

    def slow_free(i: int):
        def fn() -> None:
            time.sleep(0.0002)
            frees[i] += 1

        return fn

    for i in range(rounds):
        ledger = ResourceLedger(f"r{i}")
        ledger.acquire("kv_cache", free=slow_free(i))
        ledgers.append(ledger)

    def worker() -> None:
        for i, ledger in enumerate(ledgers):
            barrier.wait(timeout=10)
            freed = ledger.release("kv_cache")
            seen[i].append((freed, frees[i]))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    for i, ledger in enumerate(ledgers):
        assert sorted(seen[i]) == [(False, 1), (True, 1)], f"round {i}: {seen[i]}"
        assert frees[i] == 1
        assert [v.problem for v in ledger.violations] == [LedgerProblem.DOUBLE_RELEASE]


OPS = st.lists(st.tuples(st.sampled_from(["acquire", "release"]), st.sampled_from(list(ResourceKind))), max_size=30)


@settings(deadline=None, max_examples=200)
@given(OPS)
def test_random_ops_follow_the_resource_table(ops):
    """§4.10: over any op sequence, frees == first releases after an acquire, each at most once;
    double releases are counted as violations; rejected ops change nothing; leaks == held."""
    ledger, frees = counting_ledger()
    model = {k: "UNACQUIRED" for k in ResourceKind}
    doubles = {k: 0 for k in ResourceKind}
    for op, k in ops:
        before = model[k]
        if op == "acquire":
            if before == "UNACQUIRED":
                ledger.acquire(k)
                model[k] = "HELD"
            else:
                with pytest.raises(IllegalTransition):
                    ledger.acquire(k)
        elif before == "UNACQUIRED":
            with pytest.raises(IllegalTransition):
                ledger.release(k)
        else:
            assert ledger.release(k) is (before == "HELD")
            doubles[k] += before == "RELEASED"
            model[k] = "RELEASED"
        assert ledger.state(k) == model[k]
    assert frees == {k: int(model[k] == "RELEASED") for k in ResourceKind}
    assert ledger.leaks() == [k for k in ResourceKind if model[k] == "HELD"]
    assert sum(doubles.values()) == len(ledger.violations)
    assert all(v.problem is LedgerProblem.DOUBLE_RELEASE for v in ledger.violations)


class _OneKind:
    """The stepper API over one kind of a real ledger, for the walks generated from the table."""

    def __init__(self, state: str | None = None) -> None:
        self.ledger, self.kind = ResourceLedger("walk"), ResourceKind.KV_CACHE
        for event in {None: (), "UNACQUIRED": (), "HELD": ("acquire",), "RELEASED": ("acquire", "release")}[state]:
            self.fire(event)

    def fire(self, event: str):
        if event == "acquire":
            self.ledger.acquire(self.kind)
            action = "record_acquire"
        else:
            action = "free" if self.ledger.release(self.kind) else "record_double_release"
        return action, self.state

    def allows(self, event: str) -> bool:
        return load_spec("resources").decision(str(self.state), event).allowed

    @property
    def state(self):
        return self.ledger.state(self.kind)

    @property
    def terminal(self) -> bool:
        return load_spec("resources").is_terminal(str(self.state))


def test_ledger_follows_the_generated_resources_walks():
    """§4.10: the walks and the exhaustive pair check generated from spec/resources.toml pass on a
    real ledger (a rejected pair raises and leaves the kind's state unchanged)."""
    table = load_spec("resources")
    assert exhaustive_check(table, _OneKind) == []
    run_state_machine_as_test(
        stateful_test_for(table, _OneKind), settings=settings(max_examples=40, deadline=None, database=None)
    )
