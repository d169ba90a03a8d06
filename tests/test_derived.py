"""Facts derived from the tables once (spec/derived.py): the resources the model
holds, the stream event and state of each terminal, the reasons a run can end with in each
terminal state. Every layer reads these; a table change moves them with no other edit."""

from __future__ import annotations

import re

import attrs
import pytest
from _engine_kit import ascii_tokenizer, tiny_model

from decodespec.machine.checker import check
from decodespec.machine.checker_model import Model, ModelConfig
from decodespec.runtime import Request
from decodespec.runtime.engine import Engine
from decodespec.runtime.ledger import ResourceLedger
from decodespec.runtime.stream import OrderedStream
from decodespec.spec import Decision, DecisionKind, FinishReason, SpecError, default_spec
from decodespec.spec.derived import (
    detokenizer_states,
    driver_states,
    final_reasons,
    model_resources,
    resource_states,
    sequence_states,
    stop_states,
    stream_end_of,
    stream_resources,
    stream_states,
    terminal_stream_event,
)
from decodespec.spec.loader import SPEC_DIR, load_text

R = FinishReason


def _table(name, edit=lambda t: t):
    """The shipped spec/<name>.toml with `edit` applied to its text."""
    return load_text(edit((SPEC_DIR / f"{name}.toml").read_text(encoding="utf-8")), f"{name}.toml")


def _lifecycle(edit=lambda t: t):
    return _table("lifecycle", edit)


def test_the_reasons_of_each_terminal_state_follow_from_the_rows():
    """§4.10: the reason of the last row that fixes one, on every path to the terminal."""
    assert final_reasons() == {
        "FINISHED": {R.EOS, R.STOP_SEQUENCE, R.GRAMMAR_COMPLETE, R.MAX_OUTPUT_TOKENS, R.CONTEXT_LIMIT,
                     R.DEADLINE_EXCEEDED, R.CONTENT_INTERRUPTED, R.TOOL_CALLS},
        "CANCELLED": {R.CANCELLED},
        "FAILED": {R.MODEL_ERROR, R.TRANSPORT_ERROR, R.CONTEXT_LIMIT},
    }


def test_a_changed_row_changes_the_reasons_everywhere():
    """Refusing admission with model_error instead of context_limit removes context_limit from
    FAILED in the derivation, and so in the checker model built on that table."""
    edited = _lifecycle(lambda t: t.replace('action = "reject_request"\nreason = "context_limit"',
                                            'action = "reject_request"\nreason = "model_error"', 1))
    assert R.CONTEXT_LIMIT not in final_reasons(edited)["FAILED"]
    assert R.CONTEXT_LIMIT not in Model({"lifecycle": edited}).reasons_of_state["FAILED"]


def test_terminal_events_and_resources_come_from_the_tables():
    assert terminal_stream_event() == {"FINISHED": "complete", "CANCELLED": "cancel", "FAILED": "fail"}
    assert stream_end_of() == {"FINISHED": "COMPLETED", "CANCELLED": "CANCELLED", "FAILED": "FAILED"}
    assert model_resources() == ("kv_cache", "batch_slot", "rng_state")
    assert stream_resources() == ("stream_buffer", "trace_handle")


def test_terminal_events_must_name_every_terminal_state():
    edited = _lifecycle(lambda t: t.replace('terminal_events = { FINISHED = "complete", CANCELLED = "cancel", FAILED = "fail" }',
                                            'terminal_events = { FINISHED = "complete", CANCELLED = "cancel" }'))
    with pytest.raises(SpecError, match="must name each terminal state"):
        terminal_stream_event(edited)
    edited = _lifecycle(lambda t: t.replace('FAILED = "fail" }', 'FAILED = "explode" }'))
    with pytest.raises(SpecError, match="'explode' is not an event of the stream table"):
        terminal_stream_event(edited)


def test_the_openai_mapping_covers_exactly_the_reasons_a_completion_ends_with():
    """The wire finish_reason is data (spec/reasons.toml); every reason a run can end
    FINISHED with has one, and no reason that only ends a cancelled or failed run does."""
    from decodespec.spec.vocabulary import OPENAI_FINISH

    finished = final_reasons()["FINISHED"]
    assert set(OPENAI_FINISH) == set(finished)
    assert set(OPENAI_FINISH.values()) <= {"stop", "length", "content_filter", "tool_calls", "function_call"}


def test_the_driver_states_are_the_states_the_engine_branched_on():
    """§4.3, §4.9, §4.10: the sets the Engine's scheduler and shutdown read, found from the rows,
    are the states it named by hand: the safe points QUEUED and DECODING, model work in
    PREFILLING, DECODING and DRAINING, a reader's failure in DECODING and DRAINING, the tail in
    DRAINING, the safe point of an observed cancel in CANCEL_REQUESTED."""
    assert attrs.asdict(driver_states()) == {
        "selecting": {"DECODING"},
        "safe_point": {"QUEUED", "DECODING"},
        "model_work": {"PREFILLING", "DECODING", "DRAINING"},
        "transport": {"DECODING", "DRAINING"},
        "draining": {"DRAINING"},
        "cancel_observed": {"CANCEL_REQUESTED"},
    }


_PREFILL_REJECTS = '"safe_point", "complete", "decode_error", "transport_error"]'
_PREFILL_TRANSPORT = '''"safe_point", "complete", "decode_error"]
note = "no token can be chosen before prefill completes"

[[row]]
state = "PREFILLING"
event = "transport_error"
target = "FAILED"
action = "fail"
reason = "transport_error"
anchor = "§4.10"
'''


def test_an_edited_table_moves_the_driver_states_and_the_engines_runs_follow_it():
    """A transport_error row in PREFILLING puts PREFILLING among the states where a reader's failure
    ends the run, and an Engine given that table hands its runs the edited sets."""
    edited = _lifecycle(lambda t: t.replace(_PREFILL_REJECTS + "\nnote = \"no token can be chosen before prefill "
                                            "completes; deadlines are only observed at loop check points "
                                            "(DECISIONS D1)\"", _PREFILL_TRANSPORT, 1))
    assert driver_states(edited).transport == {"PREFILLING", "DECODING", "DRAINING"}
    assert driver_states(edited).safe_point == driver_states().safe_point
    engine = Engine(tiny_model(), ascii_tokenizer(), lifecycle=edited)
    run = engine.submit(Request("hi", max_output_tokens=2))
    assert run.driver_states == driver_states(edited) != driver_states()


def test_a_driver_state_no_state_fills_is_refused_by_name():
    """A table with no model_error row leaves the Engine no way to end a run whose kernel failed
    (§4.10): refused, naming the set and the event."""
    edited = _lifecycle(lambda t: re.sub(r'\[\[row\]\]\nstate = "(\w+)"\nevent = "model_error"\n(?:\w+ = .*\n)*',
                                         r'[[reject]]\nstate = "\1"\nevents = ["model_error"]\n', t))
    with pytest.raises(SpecError, match="driver states model_work: no state has a row for model_error"):
        driver_states(edited)


def test_the_sequence_states_are_the_states_the_engine_branched_on_and_move_with_the_table():
    """§4.8: a parked sequence is where unpark is a row, a swapped-out one where resume is; a copy
    of spec/sequence.toml that lets a swapped-out sequence unpark moves SWAPPED into the parked set."""
    assert attrs.asdict(sequence_states()) == {"parked": {"PARKED"}, "swapped": {"SWAPPED"}}
    text = (SPEC_DIR / "sequence.toml").read_text(encoding="utf-8")
    edited = load_text(text.replace('state = "SWAPPED"\nevents = ["admit", "park", "unpark", "preempt"]',
                                    'state = "SWAPPED"\nevents = ["admit", "park", "preempt"]', 1)
                       + '\n[[row]]\nstate = "SWAPPED"\nevent = "unpark"\ntarget = "RESIDENT"\n'
                         'action = "restore_cache"\nanchor = "§4.8"\n', "sequence.toml")
    assert sequence_states(edited).parked == {"PARKED", "SWAPPED"}
    engine = Engine(tiny_model(), ascii_tokenizer(), spec=default_spec().replace(edited))
    assert {s.value for s in engine._parked_states} == {"PARKED", "SWAPPED"}


def test_a_loop_that_selects_in_two_states_is_refused():
    """§4.3: the loop selects in one state (the Engine and generate() ask `decoding` once a token);
    a select row in DRAINING too is refused, naming both."""
    edited = _lifecycle(lambda t: t.replace('events = ["enqueue", "reject", "schedule", "prefill_done", "select", '
                                            '"decode_done", "eos",\n          "length"',
                                            'events = ["enqueue", "reject", "schedule", "prefill_done", '
                                            '"decode_done", "eos",\n          "length"', 1)
                        + '\n[[row]]\nstate = "DRAINING"\nevent = "select"\ntarget = "DRAINING"\n'
                          'action = "record_selected"\nanchor = "§4.2"\n')
    with pytest.raises(SpecError, match=r"the loop selects in one state; select is a row in \['DECODING', 'DRAINING'\]"):
        driver_states(edited)


def test_the_stream_and_resource_states_are_the_states_the_code_named():
    """§4.7, §4.8, §4.10: the ordered stream takes deltas in OPEN and its producer waits in PAUSED;
    the ledger's resource is held in HELD: the states the stream and the ledger named by hand."""
    assert attrs.asdict(stream_states()) == {"sending": {"OPEN"}, "paused": {"PAUSED"}}
    assert attrs.asdict(resource_states()) == {"held": {"HELD"}}


def test_renamed_stream_states_move_the_sets_and_the_stream_follows_them():
    """§4.8: with OPEN called STREAMING and PAUSED called WAITING, a pause-policy stream of that table
    is writable when started, would block at its cap, and goes on once its reader made room."""
    edited = _table("stream", lambda t: t.replace('"OPEN"', '"STREAMING"').replace('"PAUSED"', '"WAITING"'))
    assert attrs.asdict(stream_states(edited)) == {"sending": {"STREAMING"}, "paused": {"WAITING"}}
    s = OrderedStream("r", max_events=2, table=edited)
    s.start()
    assert s.writable and not s.would_block()
    s.delta(b"a")
    s.delta(b"b")  # the cap is reached: the table's block row
    assert s.state == "WAITING" and s.would_block() and not s.writable
    assert [ev.kind for ev in (s.get(timeout=0), s.get(timeout=0))] == ["start", "delta"]
    assert s.state == "STREAMING" and s.writable


def test_a_renamed_held_state_is_what_the_ledger_counts_as_held():
    """§4.10: with HELD called TAKEN, an acquired kind is held (and leaks at close) under that name."""
    edited = _table("resources", lambda t: t.replace('"HELD"', '"TAKEN"'))
    assert resource_states(edited).held == {"TAKEN"}
    ledger = ResourceLedger("r", table=edited)
    ledger.acquire("kv_cache")
    assert ledger.held == ["kv_cache"] and ledger.close() == ["kv_cache"]


def test_a_stream_table_without_what_the_stream_branches_on_is_refused():
    """A stream table where no state resumes the producer (no unblock row) or where deltas are taken in
    two states is a SpecError naming the set; so is a terminal state no §4.7 terminal event names."""
    no_unblock = _table("stream", lambda t: t.replace(
        '[[row]]\nstate = "PAUSED"\nevent = "unblock"\ntarget = "OPEN"\naction = "resume_producer"',
        '[[ignore]]\nstate = "PAUSED"\nevents = ["unblock"]\naction = "resume_producer"', 1))
    with pytest.raises(SpecError, match="stream states paused.*no state has a row for unblock"):
        stream_states(no_unblock)
    two_senders = _table("stream", lambda t: t.replace(
        'events = ["start", "delta", "block", "overflow"]', 'events = ["start", "block", "overflow"]', 1)
        + '\n[[row]]\nstate = "PAUSED"\nevent = "delta"\ntarget = "PAUSED"\naction = "emit_delta"\nanchor = "§4.7"\n')
    with pytest.raises(SpecError, match=r"takes deltas in one state; delta is a row in \['OPEN', 'PAUSED'\]"):
        stream_states(two_senders)
    renamed_end = _table("stream", lambda t: t.replace('"COMPLETED"', '"DONE"'))
    with pytest.raises(SpecError, match="terminal state DONE.*names no terminal event of §4.7"):
        OrderedStream("r", table=renamed_end)


def test_the_stop_and_detokenizer_states_are_the_states_the_checker_named():
    """§4.6, §4.5: a stop string has matched where its discard is a row (HIT); bytes wait for the rest
    of a character where finish() may find them invalid (PENDING). Renamed, the sets move."""
    assert attrs.asdict(stop_states()) == {"matched": {"HIT"}}
    assert attrs.asdict(detokenizer_states()) == {"pending": {"PENDING"}}
    assert stop_states(_table("stop_matcher", lambda t: t.replace('"HIT"', '"MATCHED"'))).matched == {"MATCHED"}
    assert detokenizer_states(_table("detokenizer", lambda t: t.replace('"PENDING"', '"PARTIAL"'))).pending == {"PARTIAL"}


def test_the_checker_reads_a_set_no_state_fills_as_empty_where_the_drivers_refuse_it():
    """The drivers refuse a lifecycle table whose DRAINING refuses complete (the loader would too:
    FINISHED is out of reach); the model checker judges it instead (`refuse=False`: the set is
    empty, the search finds the deadlock). An event the table lacks is refused either way."""
    life = _lifecycle()
    no_complete = attrs.evolve(life, decisions={**life.decisions, ("DRAINING", "complete"): Decision(
        DecisionKind.REJECT, "DRAINING", "complete", "DRAINING", anchor="§4.3", where="edited")})
    with pytest.raises(SpecError, match="driver states draining: no state has a row for complete"):
        driver_states(no_complete)
    assert driver_states(no_complete, refuse=False).draining == frozenset()
    assert Model({"lifecycle": no_complete}).draining == frozenset()
    with pytest.raises(SpecError, match=r"\['unpark'\] are not events of the table"):
        sequence_states(_table("sequence", lambda t: t.replace('"unpark"', '"wake"')), refuse=False)


# table -> {state: new name}: every state the checker's model and state checks branch on by a set
# of spec/derived.py, under another name
RENAMED = {
    "lifecycle": {"DRAINING": "FLUSHING", "CANCEL_REQUESTED": "CANCEL_SEEN", "CANCELLED": "ABORTED", "FINISHED": "ENDED"},
    "stream": {"PAUSED": "WAITING"},
    "resources": {"HELD": "TAKEN", "RELEASED": "GIVEN_BACK"},
    "sequence": {"PARKED": "HELD_BACK", "SWAPPED": "SWAPPED_OUT"},
    "stop_matcher": {"HIT": "MATCHED", "HOLDING": "KEEPING", "DISCARDED": "DROPPED"},
    "detokenizer": {"PENDING": "PARTIAL"},
}


def _renamed(name: str) -> object:
    def edit(text: str) -> str:
        for old, new in RENAMED[name].items():
            text = re.sub(rf"\b{old}\b", new, text)
        return text
    return _table(name, edit)


def test_the_checker_judges_tables_with_renamed_states_as_it_judges_the_shipped_ones():
    """The model checker finds its states by what the rows say, not by name (§4.1-§4.10): with the
    states it branches on renamed in every table, one request explores as many states as with the
    shipped tables, and no invariant is broken. (Witnesses name table pairs, so they go missing.)"""
    config = ModelConfig(max_output_tokens=1, policies=("pause",))
    shipped = check(requests=1, config=config)
    renamed = check(requests=1, config=config, tables={name: _renamed(name) for name in RENAMED})
    assert [v.name for v in renamed.violations] == [] and shipped.violations == ()
    assert (renamed.states, renamed.transitions) == (shipped.states, shipped.transitions)
