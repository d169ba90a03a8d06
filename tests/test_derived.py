"""Facts derived from the tables once (spec/derived.py): the resources the model
holds, the stream event and state of each terminal, the reasons a run can end with in each
terminal state. Every layer reads these; a table change moves them with no other edit."""

from __future__ import annotations

import pytest

from decodespec.machine.checker_model import Model
from decodespec.spec import FinishReason, SpecError
from decodespec.spec.derived import (
    final_reasons,
    model_resources,
    stream_end_of,
    stream_resources,
    terminal_stream_event,
)
from decodespec.spec.loader import SPEC_DIR, load_text

R = FinishReason


def _lifecycle(edit=lambda t: t):
    return load_text(edit((SPEC_DIR / "lifecycle.toml").read_text(encoding="utf-8")), "lifecycle.toml")


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
