"""spec/invariants.toml and the monitor registry agree both ways (issue 5 item 1): each trace
invariant has exactly one registered monitor and each monitor names a declared invariant."""

from __future__ import annotations

import re

import pytest

from decodespec.properties.invariants import InvariantSpecError, Scope, load_invariants, monitor
from decodespec.properties.monitors import monitors, registry_mismatch

SECTION = re.compile(r"^§4\.(?:[1-9]|1[0-2])$")


def test_every_trace_invariant_has_a_monitor_and_every_monitor_an_invariant():
    """No invariant without its one implementation, no implementation without its entry (§4.1-§4.12)."""
    missing, extra = registry_mismatch()
    assert missing == [] and extra == []


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
    """The invariants the issue names are all present (issue 5 item 1 list)."""
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
