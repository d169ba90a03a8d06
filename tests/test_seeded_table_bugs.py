"""Seeded table bugs: small semantic edits of the tables that the loader accepts,
each of which the one-request checker must refuse (`decodespec check` exits 1), with a short
counterexample where the bug is a reachable violation. Kinds: a changed reason, a changed target,
an ignore made a reject and a reject made an ignore, a row given another action, an action given
other effects (the model runs a row's action through machine/actions.py, as the runtime does), a
new row the model never offers, a finish-check guard taken off (D31), the loop's step reordered
(D53), and edits refused by invariants the chapter implies beyond single rows (an observed cancel that ends FAILED, a
failed send reported as a model error, a selection while draining)."""

from __future__ import annotations

import pytest
from _step_kit import move_phase

from decodespec.machine.checker import check
from decodespec.spec.loader import SPEC_DIR, load_text

_CHANGE = ("lifecycle", "DECODING tool_call")


def _edit(name: str, old: str, new: str) -> tuple[str, str]:
    text = (SPEC_DIR / f"{name}.toml").read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{name}.toml: the seeded edit's anchor text is not unique: {old!r}"
    return name, text.replace(old, new)


def _step_edit(phase: str, before: str) -> tuple[str, str]:
    """The lifecycle table with its [[step]] reordered (D53): `phase` moved before `before`."""
    return "lifecycle", move_phase((SPEC_DIR / "lifecycle.toml").read_text(encoding="utf-8"), phase, before)


def _new_row() -> tuple[str, str]:
    """A declared event ("handoff") with a DECODING row that nothing in the model ever fires."""
    text = (SPEC_DIR / "lifecycle.toml").read_text(encoding="utf-8")
    declared = '"transport_error", "tool_call"]\n\n#'
    assert text.count(declared) == 1, "lifecycle.toml: the events list's end moved"
    text = text.replace(declared, declared.replace('"tool_call"]', '"tool_call", "handoff"]'), 1)
    text += ('\n[[row]]\nstate = "DECODING"\nevent = "handoff"\ntarget = "DRAINING"\naction = "fix_reason"\n'
             'reason = "eos"\nanchor = "§4.3"\n')
    for state in ("CREATED", "QUEUED", "PREFILLING", "DRAINING", "CANCEL_REQUESTED", "FINISHED", "CANCELLED", "FAILED"):
        text += f'\n[[reject]]\nstate = "{state}"\nevents = ["handoff"]\n'
    return "lifecycle", text


# name -> (table, edited text, what must catch it: an invariant with the longest counterexample
# allowed, or "witness:NAME" / "unexplored").
SEEDED = {
    "reason: length reports eos": (*_edit(
        "lifecycle", 'event = "length"\ntarget = "DRAINING"\naction = "fix_reason"\nreason = "max_output_tokens"',
        'event = "length"\ntarget = "DRAINING"\naction = "fix_reason"\nreason = "eos"'), ("transport_not_eos", 12)),
    "reason: a deadline in DECODING reports cancelled": (*_edit(
        "lifecycle", 'state = "DECODING"\nevent = "deadline"\ntarget = "DRAINING"\naction = "fix_reason"\n'
                     'reason = "deadline_exceeded"',
        'state = "DECODING"\nevent = "deadline"\ntarget = "DRAINING"\naction = "fix_reason"\nreason = "cancelled"'),
        ("cancelled_only_if_requested", 10)),
    "reason: a content interruption reports eos": (*_edit(
        "lifecycle", 'state = "DECODING"\nevent = "content_interrupt"\ntarget = "DRAINING"\naction = "fix_reason"\n'
                     'reason = "content_interrupted"',
        'state = "DECODING"\nevent = "content_interrupt"\ntarget = "DRAINING"\naction = "fix_reason"\nreason = "eos"'),
        ("transport_not_eos", 8)),
    "target: a cancel while decoding skips the safe point": (*_edit(
        "lifecycle", 'state = "DECODING"\nevent = "cancel"\ntarget = "CANCEL_REQUESTED"',
        'state = "DECODING"\nevent = "cancel"\ntarget = "DRAINING"'), ("refinement", 10)),
    "target: a prefill model error is swallowed": (*_edit(
        "lifecycle", 'state = "PREFILLING"\nevent = "model_error"\ntarget = "FAILED"',
        'state = "PREFILLING"\nevent = "model_error"\ntarget = "PREFILLING"'), ("refinement", 8)),
    "target: the terminal of a paused stream never comes": (*_edit(
        "stream", 'state = "PAUSED"\nevent = "complete"\ntarget = "COMPLETED"',
        'state = "PAUSED"\nevent = "complete"\ntarget = "PAUSED"'), ("terminal_with_transition", 10)),
    "target: unblock leaves the producer paused": (*_edit(
        "stream", 'state = "PAUSED"\nevent = "unblock"\ntarget = "OPEN"',
        'state = "PAUSED"\nevent = "unblock"\ntarget = "PAUSED"'), "witness:replay_resumes_paused_producer"),
    "ignore -> reject: a late cancel while draining": (*_edit(
        "lifecycle", '[[ignore]]\nstate = "DRAINING"\nevents = ["cancel"]',
        '[[reject]]\nstate = "DRAINING"\nevents = ["cancel"]'), ("refinement", 8)),
    "ignore -> reject: a cancel after CANCELLED": (*_edit(
        "lifecycle", '[[ignore]]\nstate = "CANCELLED"\nevents = ["cancel"]',
        '[[reject]]\nstate = "CANCELLED"\nevents = ["cancel"]'), ("refinement", 10)),
    "ignore -> reject: a racing second release": (*_edit(
        "resources", '[[ignore]]\nstate = "RELEASED"\nevents = ["release"]\naction = "record_double_release"',
        '[[reject]]\nstate = "RELEASED"\nevents = ["release"]'), ("refinement", 12)),
    "reject -> ignore: a second acquire of a resource": (*_edit(
        "resources", '[[reject]]\nstate = "HELD"\nevents = ["acquire"]',
        '[[ignore]]\nstate = "HELD"\nevents = ["acquire"]'), ("release_exactly_once", 4)),
    "action: the safe point only fixes the reason": (*_edit(
        "lifecycle", 'action = "cancel_at_safe_point"', 'action = "fix_reason"'), ("terminal_with_transition", 6)),
    "action: completing the drain does nothing": (*_edit(
        "lifecycle", 'event = "complete"\ntarget = "FINISHED"\naction = "release_and_emit_terminal"',
        'event = "complete"\ntarget = "FINISHED"\naction = "admit"'), ("terminal_with_transition", 8)),
    "action: the open stream's complete queues a delta": (*_edit(
        "stream", 'state = "OPEN"\nevent = "complete"\ntarget = "COMPLETED"\naction = "emit_terminal"',
        'state = "OPEN"\nevent = "complete"\ntarget = "COMPLETED"\naction = "emit_delta"'), ("single_terminal_event", 8)),
    "action: an overflow opens the stream instead of ending it": (*_edit(
        "stream", 'action = "emit_overflow_terminal"', 'action = "emit_start"'), ("single_terminal_event", 12)),
    "action: a release records a double release instead of freeing": (*_edit(
        "resources", 'event = "release"\ntarget = "RELEASED"\naction = "free"',
        'event = "release"\ntarget = "RELEASED"\naction = "record_double_release"'), ("no_leak", 4)),
    "action: the stop matcher's discard emits the match": (*_edit(
        "stop_matcher", 'action = "discard_from_match"', 'action = "emit_held"'), ("nothing_after_stop_hit", 8)),
    "action: a clear push discards the safe bytes": (*_edit(
        "stop_matcher", 'state = "SCANNING"\nevent = "clear"\ntarget = "SCANNING"\naction = "emit_safe"',
        'state = "SCANNING"\nevent = "clear"\ntarget = "SCANNING"\naction = "discard_from_match"'),
        ("detok_concat_equals_batch", 10)),
    "action: invalid bytes are drained instead of raised": (*_edit(
        "detokenizer", 'state = "EMPTY"\nevent = "invalid"\ntarget = "FAILED"\naction = "raise_decoding_error"',
        'state = "EMPTY"\nevent = "invalid"\ntarget = "FAILED"\naction = "drain_tail"'), ("refinement", 8)),
    "effects: fail keeps the model resources": (*_edit(
        "lifecycle", 'fail = ["release_model", "fix_reason", "emit_terminal"]', 'fail = ["fix_reason", "emit_terminal"]'),
        ("model_released_before_terminal", 6)),
    "sequence action: a preemption keeps the place": (*_edit(
        "sequence", 'state = "RESIDENT"\nevent = "preempt"\ntarget = "SWAPPED"\naction = "give_back_cache"',
        'state = "RESIDENT"\nevent = "preempt"\ntarget = "SWAPPED"\naction = "hold_slot"'), ("release_exactly_once", 8)),
    "sequence action: a finished resident sequence is forgotten with its place": (*_edit(
        "sequence", 'state = "RESIDENT"\nevent = "drop"\ntarget = "DONE"\naction = "leave_batch"',
        'state = "RESIDENT"\nevent = "drop"\ntarget = "DONE"\naction = "forget"'), ("release_exactly_once", 8)),
    "sequence effects: a resume takes no place": (*_edit(
        "sequence", 'restore_cache = ["take_place", "restore_cache"]', 'restore_cache = ["restore_cache"]'),
        ("release_exactly_once", 8)),
    "sequence reject -> row: a second admission of a resident sequence": (*_edit(
        "sequence", '[[reject]]\nstate = "RESIDENT"\nevents = ["admit", "resume"]',
        '[[row]]\nstate = "RESIDENT"\nevent = "admit"\ntarget = "RESIDENT"\naction = "prefill"\nanchor = "§4.4"\n\n'
        '[[reject]]\nstate = "RESIDENT"\nevents = ["resume"]'), ("release_exactly_once", 6)),
    # Invariants the chapter implies beyond single rows: an observed cancel ends CANCELLED, a failed
    # send is reported as such, nothing is selected while draining.
    "ignore -> row: a model error after an observed cancel fails the request": (*_edit(
        "lifecycle", '[[ignore]]\nstate = "CANCEL_REQUESTED"\nevents = ["model_error", "transport_error"]',
        '[[row]]\nstate = "CANCEL_REQUESTED"\nevent = "model_error"\ntarget = "FAILED"\naction = "fail"\n'
        'reason = "model_error"\nanchor = "§4.9"\n\n[[ignore]]\nstate = "CANCEL_REQUESTED"\nevents = ["transport_error"]'),
        ("observed_cancel_ends_cancelled", 8)),
    "reason: a failed send while decoding reports model_error": (*_edit(
        "lifecycle", 'state = "DECODING"\nevent = "transport_error"\ntarget = "FAILED"\naction = "fail"\n'
                     'reason = "transport_error"',
        'state = "DECODING"\nevent = "transport_error"\ntarget = "FAILED"\naction = "fail"\nreason = "model_error"'),
        ("transport_failure_reported_as_such", 10)),
    "reject -> ignore: a selection while draining": (*_edit(
        "lifecycle", '[[reject]]\nstate = "DRAINING"\nevents = ["enqueue", "reject", "schedule", "prefill_done", "select", ',
        '[[ignore]]\nstate = "DRAINING"\nevents = ["select"]\n\n'
        '[[reject]]\nstate = "DRAINING"\nevents = ["enqueue", "reject", "schedule", "prefill_done", '),
        ("no_select_while_draining", 6)),
    # The order of the loop's step is table data too (D53).
    "step: the emit before the finish checks": (*_step_edit("emit", "finish_checks"), ("refused_chunk_never_sent", 10)),
    "new row: an event the model never offers": (*_new_row(), "unexplored"),
    # D31: a guard taken off the eos check (the loader accepts a guard no check names)
    "guard: the eos check loses min_tokens": (*_edit(
        "lifecycle", 'unless = ["ignore_eos", "min_tokens"]', 'unless = ["ignore_eos"]'), ("eos_guards_respected", 8)),
    "guard: the eos check loses ignore_eos": (*_edit(
        "lifecycle", 'unless = ["ignore_eos", "min_tokens"]', 'unless = ["min_tokens"]'), ("eos_guards_respected", 8)),
}


@pytest.mark.parametrize("name", sorted(SEEDED))
def test_the_checker_catches_each_seeded_table_bug(name):
    machine, text, catcher = SEEDED[name]
    table = load_text(text, f"{machine}.toml")  # the loader accepts it: only the checker can tell
    report = check(1, tables={machine: table})
    assert not report.ok, f"{name}: passed the checker"
    if catcher == "unexplored":
        assert report.unexplored and report.rows_never_fired["lifecycle"] == (("DECODING", "handoff"),)
    elif isinstance(catcher, str):
        assert catcher.split(":", 1)[1] in report.missing_witnesses
    else:
        invariant, longest = catcher
        found = [v for v in report.violations if v.name == invariant]
        assert found, f"{name}: caught by {[v.name for v in report.violations]}, not {invariant}"
        assert len(found[0].labels) <= longest, f"{name}: counterexample of {len(found[0].labels)} steps"


def test_the_shipped_tables_pass():
    """The control: the same check on the unedited tables is ok."""
    assert check(1).ok


def test_a_counterexample_gives_every_machine_state_at_every_step():
    """As TLC does, the trace holds the state of every machine (and the loop's
    data) before the first step and after each, in text (what changed) and JSON (everything)."""
    import json

    machine, text, _ = SEEDED["reason: a deadline in DECODING reports cancelled"]
    report = check(1, tables={machine: load_text(text, f"{machine}.toml")})
    cx = next(v for v in report.violations if v.name == "cancelled_only_if_requested")
    assert len(cx.states) == len(cx.labels) + 1
    first, last = cx.states[0][0], cx.states[-1][0]
    assert (first["lifecycle"], first["stream"], first["pc"]) == ("CREATED", "NEW", "new")
    assert (last["lifecycle"], last["reason"], last["cancel"]) == ("DRAINING", "cancelled", "none")
    lines = cx.text().splitlines()
    assert lines[0] == "  0. initial state" and lines[-1].strip() == (
        "r0: pc=draining_finish lifecycle=DRAINING reason=cancelled deadline=observed")
    data = json.loads(json.dumps(cx.to_json()))
    assert data["states"][-1][0]["reason"] == "cancelled" and len(data["states"]) == len(data["labels"]) + 1
