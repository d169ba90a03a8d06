"""The model checker's state checks (machine/checker_invariants.py), one request state at a time:
each registered check flags a state that breaks its invariant and names it, and no check flags
an initial request. The guards (a step the tables must refuse) are flagged only where a seeded
table allows that step. The search around them is tests/test_checker.py's."""

from __future__ import annotations

import attrs
import pytest

from decodespec.machine.checker_invariants import STATE_CHECKS, StateJudge
from decodespec.machine.checker_model import REASONS, Model, ModelConfig
from decodespec.machine.checker_state import CANCEL, DEADLINE, EOS, KERNEL, PC, Judged, RequestState
from decodespec.spec import Decision, DecisionKind, FinishReason, load_spec


def _seeded(name: str, state: str, event: str, target: str | None = None, kind: DecisionKind = DecisionKind.ROW,
            action: str | None = None) -> dict:
    """The shipped table `name` with the decision of (state, event) replaced."""
    table = load_spec(name)
    decisions = dict(table.decisions)
    decisions[(state, event)] = Decision(kind, state, event, target or state, action=action, anchor="§4.1",
                                         where="seeded")
    return {name: attrs.evolve(table, decisions=decisions)}


def _reason(r: FinishReason) -> int:
    return REASONS.index(r)


def _state(model: Model, **changes: object) -> RequestState:
    """The first initial request with `changes`; a machine's field given as its state name."""
    names = {"lifecycle": model.life, "stream": model.stream, "kv_cache": model.res, "sequence": model.seq}
    return model.initial()[0]._replace(**{k: names[k].i(v) if isinstance(v, str) else v for k, v in changes.items()})


# invariant -> (tables, config, the broken request state's fields): each breaks only its invariant's check
BROKEN: dict[str, tuple[dict, ModelConfig | None, dict]] = {
    "terminal_exclusive": ({}, None, dict(pc=PC.done, lifecycle="FINISHED", stream="CANCELLED", terminals=1,
                                          reason=_reason(FinishReason.EOS), eos=EOS.ended)),
    "terminal_with_transition": ({}, None, dict(pc=PC.decode_in_flight, lifecycle="FINISHED", stream="OPEN")),
    "single_terminal_event": ({}, None, dict(terminals=2)),
    "no_leak": ({}, None, dict(pc=PC.done, kv_cache="HELD")),
    "detok_concat_equals_batch": ({}, None, dict(lost=1, lifecycle="FINISHED")),
    "model_released_before_terminal": ({}, None, dict(lifecycle="FAILED", kv_cache="HELD")),
    "selected_minus_decoded_0_or_1": ({}, None, dict(selected=2, decoded=0)),
    "decode_after_selected": ({}, None, dict(kernel=KERNEL.decode, selected=1, decoded=1)),
    "no_kernel_in_flight_at_cancelled": ({}, None, dict(lifecycle="CANCELLED", kernel=KERNEL.prefill)),
    "cancelled_only_if_requested": ({}, None, dict(lifecycle="CANCEL_REQUESTED", cancel=CANCEL.none)),
    "deadline_not_cancelled": ({}, None, dict(deadline=DEADLINE.observed, reason=_reason(FinishReason.CANCELLED))),
    "transport_not_eos": ({}, None, dict(reason=_reason(FinishReason.EOS), eos=EOS.none)),
    "eos_guards_respected": ({}, ModelConfig(guards=("ignore_eos",)),
                             dict(guard=1, lifecycle="FINISHED", reason=_reason(FinishReason.EOS), eos=EOS.ended)),
    "finish_reason_matches_state": ({}, None, dict(lifecycle="FINISHED", reason=_reason(FinishReason.MODEL_ERROR))),
    "length_respected": ({}, None, dict(selected=3, decoded=3)),
    "stream_bounded": ({}, None, dict(unread=2)),
    "terminal_irreversible": (_seeded("lifecycle", "FINISHED", "cancel", "CANCEL_REQUESTED", action="observe_cancel"),
                              None, dict(lifecycle="FINISHED")),
    "no_delta_after_terminal": (_seeded("stream", "COMPLETED", "delta"), None, dict(stream="COMPLETED")),
    "release_exactly_once": (_seeded("resources", "HELD", "acquire", kind=DecisionKind.IGNORE), None,
                             dict(kv_cache="HELD")),
    "no_select_after_cancel_observed": (_seeded("lifecycle", "CANCEL_REQUESTED", "select", kind=DecisionKind.IGNORE),
                                        None, dict(lifecycle="CANCEL_REQUESTED", cancel=CANCEL.observed)),
    "no_select_while_draining": (_seeded("lifecycle", "DRAINING", "select", kind=DecisionKind.IGNORE), None,
                                 dict(lifecycle="DRAINING")),
}


def test_every_state_check_has_a_broken_state_here():
    assert set(BROKEN) == set(STATE_CHECKS.registered())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_state_check_flags_the_state_that_breaks_its_invariant(name):
    """The broken state is flagged by its invariant's check (§4.1-§4.12), and with the shipped
    tables and a plain request a state check of a guard flags nothing (only the table's edit does)."""
    tables, config, changes = BROKEN[name]
    model = Model(tables, config)
    found = StateJudge(model)(_state(model, **changes))
    assert name in {n for n, _, _ in found}, found
    guards = [g for n, _, g in found if n == name and g is not None]
    if tables:
        assert guards, f"{name}: a guard names the step the edited table allows"
        plain = Model(config=config)
        assert name not in {n for n, _, _ in StateJudge(plain)(_state(plain, **changes))}


def test_no_state_check_flags_an_initial_request():
    model = Model(config=ModelConfig(guards=("ignore_eos", "min_tokens")))
    judge = StateJudge(model)
    for request in model.initial():
        assert judge(request) == [] and judge(tuple(request)) == []


def test_requests_that_differ_outside_the_judged_fields_are_judged_alike():
    """The judged fields are RequestState's, in its order; a request judged once answers for every
    request with the same judged fields (here: another stop matcher state and reader)."""
    fields = RequestState._fields
    assert [fields.index(f) for f in Judged._fields] == sorted(fields.index(f) for f in Judged._fields)
    model = Model()
    judge = StateJudge(model)
    broken = _state(model, unread=2)
    other = broken._replace(stop_matcher=model.stop.i("HOLDING"), reader=1)
    assert judge(broken) is judge(other) and [n for n, _, _ in judge(other)] == ["stream_bounded"]


# invariant -> (tables, request fields, what the message says, the guard or None): the branches of
# the checks that judge more than one way, each on its own (BROKEN above reaches one per check)
BRANCHES: dict[str, tuple[dict, dict, str, tuple[str, str, str] | None]] = {
    "single_terminal_event/ended without one": ({}, dict(pc=PC.done, terminals=0), "without a terminal event", None),
    "no_leak/released unfreed": ({}, dict(kv_cache="RELEASED", freed=0), "without their free callback", None),
    "release_exactly_once/a second place": (
        _seeded("sequence", "RESIDENT", "admit", "RESIDENT", action="prefill"), dict(sequence="RESIDENT"),
        "takes a second place", ("sequence", "RESIDENT", "admit")),
}


@pytest.mark.parametrize("case", sorted(BRANCHES))
def test_each_branch_of_a_state_check_reports_its_violation(case):
    """A request that ended with no terminal event (§4.7), a resource released without its free
    callback (§4.10) and a sequence table that lets a resident sequence take a second batch place
    (§4.4) are each reported by their check, with the message and guard that name them."""
    name = case.split("/")[0]
    tables, changes, says, guard = BRANCHES[case]
    model = Model(tables)
    found = [(msg, g) for n, msg, g in StateJudge(model)(_state(model, **changes)) if n == name]
    assert any(says in msg and g == guard for msg, g in found), found
