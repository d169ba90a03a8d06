"""The stepper API, the same for the compiled stepper and the `transitions` backend."""

from __future__ import annotations

import pytest

from decodespec.machine import IllegalTransition, compile_table, compiled
from decodespec.machine.transitions_backend import TransitionsMachine
from decodespec.spec import load_spec

BACKENDS = {
    "compiled": lambda name: compiled(name).new,
    "transitions": lambda name: TransitionsMachine(load_spec(name)).new,
    "locked": lambda name: TransitionsMachine(load_spec(name), locked=True).new,
}


@pytest.fixture(params=sorted(BACKENDS))
def new(request):
    """`new(name, state=None)`: a fresh instance of shipped machine `name` on one backend."""
    return lambda name, state=None: BACKENDS[request.param](name)(state)


def test_row_returns_action_and_target(new) -> None:
    """A row moves to its target and returns its action (§4.1: CREATED -enqueue-> QUEUED)."""
    st = new("lifecycle")
    action, state = st.fire("enqueue")
    assert (action, state, st.state) == ("admit", "QUEUED", "QUEUED")
    assert state is load_spec("lifecycle").State.QUEUED and state.value == "QUEUED"


def test_ignore_returns_its_action_and_keeps_the_state(new) -> None:
    """A kernel that completes after a cancel is discarded, not applied (§4.9)."""
    st = new("lifecycle", "CANCEL_REQUESTED")
    assert st.fire("decode_done") == ("discard_step_result", "CANCEL_REQUESTED")
    assert st.fire("cancel") == (None, "CANCEL_REQUESTED")


def test_rejection_keeps_state_and_names_machine_state_event_and_note(new) -> None:
    """The first hit is absorbing: more output after it is refused, state unchanged (§4.6, §4.3)."""
    st = new("stop_matcher", "HIT")
    with pytest.raises(IllegalTransition) as info:
        st.fire("clear")
    assert str(info.value) == (
        "stop_matcher: event 'clear' is not allowed in state HIT "
        "(the first hit is absorbing: no later visible output is accepted (§4.3))"
    )
    assert (info.value.machine, info.value.state, info.value.event) == ("stop_matcher", "HIT", "clear")
    assert st.state == "HIT" and not st.terminal


def test_undeclared_event_is_refused_as_such(new) -> None:
    """An event outside the table's vocabulary is an error, never a silent no-op (§4.1)."""
    st = new("resources", "HELD")
    with pytest.raises(IllegalTransition) as info:
        st.fire("borrow")
    assert str(info.value) == "resources: event 'borrow' is not allowed in state HELD (undeclared event)"
    assert info.value.note == "undeclared event" and st.state == "HELD"


def test_terminal_flag_and_allows_follow_the_table(new) -> None:
    """Terminal states allow only their ignores (§4.1, §4.10: a double release is recorded)."""
    st = new("resources")
    assert (st.allows("acquire"), st.allows("release"), st.terminal) == (True, False, False)
    st.fire("acquire")
    assert st.fire("release") == ("free", "RELEASED") and st.terminal
    assert (st.allows("acquire"), st.allows("release")) == (False, True)
    assert st.fire("release") == ("record_double_release", "RELEASED")


def test_a_full_lifecycle_ends_in_exactly_one_terminal_state(new) -> None:
    """CREATED to FINISHED through the §4.3 loop; afterwards only a cancel is accepted (ignored)."""
    st = new("lifecycle")
    path = ["enqueue", "schedule", "prefill_done", "select", "decode_done", "select", "stop_hit", "complete"]
    states = [str(st.fire(e)[1]) for e in path]
    assert states[-2:] == ["DRAINING", "FINISHED"] and st.terminal
    assert st.fire("cancel") == (None, "FINISHED")
    with pytest.raises(IllegalTransition):
        st.fire("complete")


def test_new_positions_at_any_state_and_instances_are_independent(new) -> None:
    """Instances share no control state (no state is global)."""
    a, b = new("stream"), new("stream", "PAUSED")
    a.fire("start")
    assert (a.state, b.state) == ("OPEN", "PAUSED")


def test_compiled_machine_is_built_once_per_name() -> None:
    """`compiled(name)` caches; `compile_table` builds a fresh machine from any table."""
    assert compiled("stream") is compiled("stream")
    assert compile_table(load_spec("stream")) is not compiled("stream")
    assert repr(compiled("stream").new()) == "<Stepper stream at NEW>"


@pytest.mark.parametrize("name", ["lifecycle", "stop_matcher", "detokenizer", "stream", "resources"])
def test_self_loops_are_exactly_the_states_where_a_fire_changes_nothing(name) -> None:
    """A per-token caller skips the fire in `self_loops(event, action)`; that is sound only
    if, in exactly those states, firing keeps the state and returns that action (every event and
    action of every shipped table, checked against a fresh stepper)."""
    m = compiled(name)
    table = m.table
    pairs = {(e, d.action) for (_, e), d in table.decisions.items() if d.kind == "row"}
    for event, action in sorted(pairs, key=str):
        loops = m.self_loops(event, action)
        for s in table.states:
            st = m.new(s)
            quiet = False
            if st.allows(event):
                got_action, got = st.fire(event)
                quiet = got.value == s and got_action == action and table.decision(s, event).kind == "row"
            assert (table.State[s] in loops) == quiet, (name, s, event, action)


def test_self_loops_refuses_an_action_no_row_of_the_event_has() -> None:
    """A misspelt action would silently make every fire look necessary: it is an error instead."""
    with pytest.raises(ValueError, match=r"stream: no row of event 'delta' has action 'emit_dleta'"):
        compiled("stream").self_loops("delta", "emit_dleta")


def test_state_is_kept_by_a_rejection_and_set_by_fire() -> None:
    """The compiled stepper keeps its state as a plain slot: a rejected fire leaves it,
    an accepted one sets it to the row's target."""
    st = compiled("stream").new()
    assert st.state.value == st.machine.table.initial
    before = st.state
    with pytest.raises(IllegalTransition):
        st.fire("delta")
    assert st.state is before
    _, after = st.fire("start")
    assert st.state is after
