"""The overlapped step as rows (spec/overlap.toml; §4.3, §4.9, §4.11, DECISIONS D73): loaded and
validated, drawn, and model-checked for one to three requests sharing a batch; edits of its rows
that the loader accepts and that break what the chapter says are caught, and a cancel observed
while a step runs has a witness."""

from __future__ import annotations

import re

import pytest

from decodespec.machine.checker_overlap import MODEL, check_overlap
from decodespec.spec import FinishReason, SpecError, load_spec, load_text
from decodespec.spec.derived import discovered_events
from decodespec.spec.loader import SPEC_DIR


def _text() -> str:
    return (SPEC_DIR / "overlap.toml").read_text(encoding="utf-8")


def _edit(old: str, new: str):
    text = _text()
    assert text.count(old) == 1, old
    return load_text(text.replace(old, new), "overlap.toml (seeded)")


def test_only_a_request_that_goes_on_has_its_result_taken():
    """§4.3: z_{t+1} only for a request that continues: `take_step` is the action of GOING_ON's
    completion alone; every end found while the step runs leads to DISCARDING, whose completion
    discards (§4.9)."""
    table = load_spec("overlap")
    takes = [(d.state, d.event) for d in table.rows if d.action == "take_step"]
    assert takes == [("GOING_ON", "complete")]
    for event in set(discovered_events(table).values()) - {"cancel", "deadline"}:
        assert table.decision("IN_FLIGHT", event).target == "DISCARDING", event
    assert table.decision("DISCARDING", "complete").action == "discard_step"
    assert [d.state for d in table.rows if d.event == "release"] == ["IDLE"]  # never while in flight (§4.9)


def test_every_finish_reason_names_the_event_it_is_to_a_step_in_flight():
    assert set(discovered_events()) == set(FinishReason)


@pytest.mark.parametrize(("old", "new", "message"), [
    ('stop_sequence = "stop_hit"\n', "", "no event for the finish reason(s) ['stop_sequence']"),
    ('eos = "eos"\n', 'eos = "eos"\nstopped = "eos"\n', "['stopped'] are not finish reasons"),
    ('eos = "eos"\n', 'eos = "eos_found"\n', "not events of the table"),
])
def test_a_missing_or_unknown_discovered_entry_is_a_clear_error(old, new, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        discovered_events(_edit(old, new))


def test_an_undecided_pair_is_refused_by_the_loader():
    old = 'state = "GOING_ON"\nevent = "deadline"'
    text = _text()
    cut = text.index("[[row]]\n" + old)
    end = text.index("[[reject]]", cut)
    with pytest.raises(SpecError, match=r"undecided pair \(GOING_ON, deadline\)"):
        load_text(text[:cut] + text[end:], "overlap.toml (seeded)")


def test_the_executor_implements_exactly_the_effects_of_the_table():
    table = load_spec("overlap")
    assert set(MODEL.impl) == set(table.effects)


@pytest.mark.parametrize("requests", [1, 2])
def test_the_checker_explores_one_and_two_requests_and_every_invariant_holds(requests):
    report = check_overlap(requests=requests)
    assert report.ok, ([(v.name, v.message, v.labels) for v in report.violations], report.rows_never_fired)
    assert report.states > 100


def test_three_requests_sharing_a_batch_break_no_invariant():
    report = check_overlap(requests=3, outcomes=("go_on", "other_token", "stop_hit"))
    assert not report.violations, [(v.name, v.message, v.labels) for v in report.violations]
    assert "cancel_observed_while_running" in report.witnesses and report.states > 10_000


def test_a_cancel_observed_while_a_step_runs_has_a_witness():
    """§4.11 B: a cancel lands between decode.started and decode.completed; the shortest witness
    launches the step, sends y_t and observes the cancel before the join."""
    w = check_overlap().witnesses["cancel_observed_while_running"]
    assert ("env: cancel for request 0" in w.labels and w.labels[-1].endswith("go_on")
            and (0, "overlap", "GOING_ON", "cancel") in w.steps)


@pytest.mark.parametrize(("old", "new", "invariant"), [
    # a stop found while the step runs, and its result taken anyway (§4.11 A: no next token)
    ('event = "stop_hit"\ntarget = "DISCARDING"', 'event = "stop_hit"\ntarget = "GOING_ON"', "no_result_after_end"),
    # a cancel observed while the step runs that does not discard it (§4.11 B)
    ('state = "GOING_ON"\nevent = "cancel"\ntarget = "DISCARDING"', 'state = "GOING_ON"\nevent = "cancel"\ntarget = "GOING_ON"',
     "no_result_after_end"),
    # the discarded result taken (§4.9)
    ('target = "IDLE"\naction = "discard_step"', 'target = "IDLE"\naction = "take_step"', "no_result_after_end"),
    # the step of a token the host did not choose taken
    ('event = "other_token"\ntarget = "DISCARDING"', 'event = "other_token"\ntarget = "GOING_ON"', "no_result_of_another_token"),
    # a continuing request's result never taken: the next token comes from nothing
    ('take_step = ["take_result"]', 'take_step = ["take_result", "discard_result"]', "no_token_from_discarded"),
    # released while the step still writes its cache (§4.9 safe point)
    ('state = "DISCARDING"\nevents = ["launch", "go_on", "other_token", "stop_hit", "eos", "length", "context_full", '
     '"loop_end", "failed", "release"]',
     'state = "DISCARDING"\nevents = ["launch", "go_on", "other_token", "stop_hit", "eos", "length", "context_full", '
     '"loop_end", "failed"]\n\n[[row]]\nstate = "DISCARDING"\nevent = "release"\ntarget = "ENDED"\naction = "release"\n'
     'anchor = "§4.10"', "no_release_in_flight"),
    # the resources released by the discard too (§4.10: once)
    ('discard_step = ["discard_result", "keep_cache"]', 'discard_step = ["discard_result", "keep_cache", "release_resources"]',
     "released_once"),
    # released when the host work lets the step go on, while it runs
    ('keep_step = []', 'keep_step = ["release_resources"]', "no_release_in_flight"),
    # a completion the table refuses: the Engine could not join its step
    ('state = "GOING_ON"\nevent = "complete"\ntarget = "IDLE"\naction = "take_step"',
     'state = "GOING_ON"\nevent = "complete"\ntarget = "DISCARDING"\naction = "drop_step"', "no_token_from_discarded"),
])
def test_a_seeded_edit_of_the_rows_is_caught_by_the_checker(old, new, invariant):
    """Edits the loader accepts (every pair decided, every state reachable) that break what §4.3,
    §4.9 and §4.11 say: the checker refuses each, naming the invariant."""
    report = check_overlap(_edit(old, new), requests=1)
    assert invariant in [v.name for v in report.violations], [(v.name, v.message) for v in report.violations]


def test_decodespec_check_checks_the_overlapped_step_and_refuses_a_seeded_table(tmp_path):
    """`decodespec check --table overlap.toml` runs the overlap checker too: the edit that takes a
    stopped request's step fails the run, named."""
    from click.testing import CliRunner

    from decodespec.cli import main

    path = tmp_path / "overlap.toml"
    path.write_text(_text().replace('event = "stop_hit"\ntarget = "DISCARDING"', 'event = "stop_hit"\ntarget = "GOING_ON"'),
                    encoding="utf-8")
    result = CliRunner().invoke(main, ["check", "--table", str(path), "--max-depth", "1"])
    assert result.exit_code == 1 and "no_result_after_end" in result.output, result.output
