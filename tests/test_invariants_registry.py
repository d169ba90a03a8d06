"""spec/invariants.toml and its registries agree both ways: each trace invariant has exactly one
registered monitor and each monitor names a declared invariant; each state invariant is judged by
the model checker (a registered state check, a step's report or the search) and each of those
names a declared state invariant."""

from __future__ import annotations

import re

import pytest

from decodespec.machine import checker
from decodespec.machine.checker_invariants import STATE_CHECKS
from decodespec.machine.checker_model import STEP_CHECKS, Model
from decodespec.properties.invariants import Invariant, InvariantSpecError, Scope, load_invariants, monitor
from decodespec.properties.monitors import monitors, registry_mismatch
from decodespec.spec.invariants import Registry

SECTION = re.compile(r"^§4\.(?:[1-9]|1[0-2])$")


def test_every_trace_invariant_has_a_monitor_and_every_monitor_an_invariant():
    """No invariant without its one implementation, no implementation without its entry (§4.1-§4.12)."""
    missing, extra = registry_mismatch()
    assert missing == [] and extra == []


def test_the_model_checker_judges_every_state_invariant_and_nothing_else():
    """Each invariant of scope state/both (§4.1-§4.12) has a state check, a step's report or a search
    check in the model checker, and each of those names such an invariant."""
    assert checker.registry_mismatch() == ([], [])


def test_a_registry_names_what_is_on_one_side_only():
    """A declared invariant without an implementation is missing; an implementation whose invariant
    is not declared (here: taken out of the declarations) is extra."""
    elsewhere = {*STEP_CHECKS, *checker.SEARCH_CHECKS}
    invs = load_invariants()
    more = {**invs, "new_invariant": Invariant("new_invariant", "§4.1", "a new state invariant", Scope.STATE)}
    assert STATE_CHECKS.mismatch(elsewhere, more) == (["new_invariant"], [])
    fewer = {name: inv for name, inv in invs.items() if name != "stream_bounded"}
    assert STATE_CHECKS.mismatch(elsewhere, fewer) == ([], ["stream_bounded"])


def test_a_second_state_check_for_one_invariant_is_refused():
    """Exactly one state check per invariant, as for the monitors."""
    with pytest.raises(ValueError, match="'no_leak' already has a state check"):
        STATE_CHECKS.register("no_leak")(lambda m, c: ())


def test_a_registry_is_for_traces_or_for_states():
    with pytest.raises(ValueError, match="Scope.TRACE or Scope.STATE"):
        Registry("check", Scope.BOTH)


def test_a_step_reporting_an_undeclared_invariant_is_refused():
    """A model step names only the invariants STEP_CHECKS lists (a typo is an error, not a new name)."""
    model = Model()
    step = model.expand(model.initial()[0])[0]
    with pytest.raises(KeyError, match="'no_such_invariant', which STEP_CHECKS does not list"):
        step.violate("no_such_invariant", "a message")


def test_entries_are_well_formed():
    """Each entry names a chapter-4 section, states itself in one line and has a known scope."""
    invs = load_invariants()
    assert len(invs) >= 30
    for inv in invs.values():
        assert SECTION.match(inv.anchor), inv
        assert inv.statement and "\n" not in inv.statement
        assert isinstance(inv.scope, Scope)
        assert set(inv.needs) <= {"tokenizer"}


def test_required_invariants_are_declared():
    """The trace invariants the monitors and checker rely on by name are all declared."""
    required = {
        "terminal_exclusive", "terminal_irreversible", "start_first", "no_delta_after_terminal",
        "single_terminal_event", "terminal_after_all_deltas", "seq_strictly_increasing", "seq_contiguous",
        "release_exactly_once", "no_leak", "model_released_before_terminal", "stop_bytes_never_emitted",
        "nothing_after_stop_hit", "eos_not_emitted", "selected_minus_decoded_0_or_1", "decode_after_selected",
        "no_select_after_cancel_observed", "no_kernel_in_flight_at_cancelled", "deadline_not_cancelled",
        "cancelled_only_if_requested", "transport_not_eos", "finish_reason_matches_state", "length_respected",
        "usage_consistent", "refinement", "detok_concat_equals_batch", "stream_bounded",
    }
    assert required <= set(load_invariants())


def test_a_second_monitor_for_one_invariant_is_refused():
    """Exactly one implementation per invariant: registering another raises, naming the first."""
    name = next(iter(monitors()))
    with pytest.raises(ValueError, match=f"'{name}' already has a monitor"):
        monitor(name)(lambda rt: ())


@pytest.mark.parametrize(
    "text, problem",
    [
        ('[[invariant]]\nname="a"\nanchor="§4.1"\nstatement="s"\nscope="sometimes"\n', "scope 'sometimes'"),
        ('[[invariant]]\nname="a"\nanchor="§4.1"\nscope="trace"\n', "missing 'statement'"),
        ('[[invariant]]\nname="a"\nanchor="§4.1"\nstatement="s"\nscope="trace"\nwhy="x"\n', "unknown keys"),
        ('[[invariant]]\nname="a"\nanchor="§4.1"\nstatement="s"\nscope="trace"\n' * 2, "duplicate name 'a'"),
    ],
)
def test_malformed_invariant_files_are_refused(tmp_path, text, problem):
    """A broken invariants file raises InvariantSpecError naming the entry and the problem."""
    p = tmp_path / "inv.toml"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(InvariantSpecError, match=problem):
        load_invariants(p)
