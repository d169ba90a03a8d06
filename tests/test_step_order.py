"""The order of one step of the §4.3 loop is the lifecycle table's [[step]] (DECISIONS D53, issue 27
item 3): the loader refuses an order in which a phase comes before what it reads, the runtime's
check_point and select are generated from the list, and a reordered copy of spec/ changes what the
runtime returns and what the checker model explores alike."""

from __future__ import annotations

import pytest
from _spec_kit import probe, spec_copy
from _step_kit import move_phase

from decodespec.machine.checker_model import F_CANCEL, F_DEADLINE, F_LC, F_PC, P_TOP, Model
from decodespec.runtime import ByteTableTokenizer, Request, ScriptedModel, generate
from decodespec.runtime.faults import Fault, FaultPlan
from decodespec.runtime.runner import STEP_CODE, RequestRun, step_functions
from decodespec.spec import FinishReason, load_spec
from decodespec.spec.loader import SPEC_DIR, SpecError, load_text
from decodespec.spec.vocabulary import STEP_NEEDS

TOK = ByteTableTokenizer({1: b"x", 2: b"A", 3: b"B", 5: b""}, eos_id=5)


def _lifecycle() -> str:
    return (SPEC_DIR / "lifecycle.toml").read_text(encoding="utf-8")


def test_the_shipped_step_is_the_order_of_the_reference_loop():
    """§4.3: cancel, deadline, choose, consume, push, stop; the checks judge before the emit (D11)."""
    assert [p.phase for p in load_spec("lifecycle").step] == [
        "observe_cancel", "observe_deadline", "choose", "consume", "push_bytes", "stop", "finish_checks", "emit",
        "decode"]
    assert all(p.anchor.startswith("§4.") for p in load_spec("lifecycle").step)
    assert set(STEP_CODE) == set(STEP_NEEDS)


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda t: move_phase(t, "stop", "push_bytes"), "phase 'stop' reads what 'push_bytes' does: it must come after it"),
    (lambda t: move_phase(t, "decode", "emit"), "phase 'decode' reads what 'emit' does"),
    (lambda t: t.replace('phase = "emit"', 'phase = "send"'), "unknown phase 'send'"),
    (lambda t: t.replace('phase = "emit"', 'phase = "stop"'), "phase 'stop' is listed twice"),
    (lambda t: t.replace('[[step]]\nphase = "emit"\nanchor = "§4.7"\n', '[[step]]\nphase = "emit"\n'), "missing 'anchor'"),
    (lambda t: t.replace('[[step]]\nphase = "choose"\n', '[[step]]\nphase = "choose"\nwhen = "always"\n'),
     "unknown key 'when'"),
])
def test_a_step_out_of_order_is_refused_naming_the_phase(edit, problem):
    with pytest.raises(SpecError, match=problem):
        load_text(edit(_lifecycle()), "lifecycle.toml")


def test_the_runtime_step_is_generated_from_the_list_in_its_order():
    steps = load_spec("lifecycle").step
    check_point, select = step_functions(steps)
    assert RequestRun.select.__doc__ == select.__doc__ and RequestRun.check_point.__doc__ == check_point.__doc__
    assert check_point.__doc__.index("_cancel_requested") < check_point.__doc__.index("_deadline_forced")
    assert select.__doc__.index("self._winner(") < select.__doc__.index("self._put_delta(")
    swapped = load_text(move_phase(move_phase(_lifecycle(), "observe_deadline", "observe_cancel"), "emit",
                                   "finish_checks"), "lifecycle.toml").step
    check_point, select = step_functions(swapped)
    assert check_point.__doc__.index("_deadline_forced") < check_point.__doc__.index("_cancel_requested")
    assert select.__doc__.index("self._put_delta(") < select.__doc__.index("self._winner(")
    with pytest.raises(RuntimeError, match="STEP_CODE differ"):
        step_functions(steps[:-1])


def _both_pending() -> tuple[int, ...]:
    """A model state at the top of a step with a cancel requested and the deadline passed."""
    model = Model()
    comp = [0] * len(model.initial()[0])
    comp[F_PC], comp[F_LC], comp[F_CANCEL], comp[F_DEADLINE] = P_TOP, model.life.i("DECODING"), 1, 1
    return tuple(comp)


def _observed(tables=None) -> list[str]:
    model = Model(tables)
    return [s.tag.what for s in model.expand(_both_pending()) if s.tag.kind == "observe"]


# A cancel and the deadline land as the first decode completes: both wait at the next check point.
_BOTH = [Fault("decode.completed", 1, "cancel"), Fault("decode.completed", 1, "deadline")]
_INTERRUPT = {"content_policy": lambda sent, chunk: chunk == b"A"}


def test_a_reordered_step_in_a_copy_of_the_tables_changes_the_runtime_and_the_checker(tmp_path):
    """With the deadline observed before the cancel and the emit before the finish checks, in a
    copy of spec/ only: a run whose cancel and deadline are pending at one check point ends
    deadline_exceeded instead of cancelled, a chunk the content policy refuses is sent, and the
    checker model observes the deadline first (the seeded-bug suite checks that the checker reports
    the sent chunk: refused_chunk_never_sent)."""
    edit = lambda t: move_phase(move_phase(t, "observe_deadline", "observe_cancel"), "emit", "finish_checks")  # noqa: E731
    copy = spec_copy(tmp_path, {"lifecycle.toml": edit})
    lines = probe(copy, """
        from decodespec.runtime import ByteTableTokenizer, Request, ScriptedModel, generate
        from decodespec.runtime.faults import Fault, FaultPlan
        from decodespec.machine.checker import check
        tok = ByteTableTokenizer({1: b"x", 2: b"A", 3: b"B", 5: b""}, eos_id=5)
        both = [Fault("decode.completed", 1, "cancel"), Fault("decode.completed", 1, "deadline")]
        r = generate(Request([1], max_output_tokens=3), model=ScriptedModel([1, 1, 1], vocab_size=6), tokenizer=tok,
                     faults=FaultPlan(both))
        print(r.state.value, r.finish_reason.value)
        r = generate(Request([1], max_output_tokens=3, content_policy=lambda sent, chunk: chunk == b"A"),
                     model=ScriptedModel([1, 2, 3], vocab_size=6), tokenizer=tok)
        print(r.finish_reason.value, r.output)
    """)
    assert lines[:2] == ["FINISHED deadline_exceeded", "content_interrupted b'xA'"], lines
    # The shipped order: the cancel wins the check point, the refused chunk is never sent (D11).
    r = generate(Request([1], max_output_tokens=3), model=ScriptedModel([1, 1, 1], vocab_size=6), tokenizer=TOK,
                 faults=FaultPlan(_BOTH))
    assert (r.state.value, r.finish_reason) == ("CANCELLED", FinishReason.CANCELLED)
    r = generate(Request([1], max_output_tokens=3, **_INTERRUPT), model=ScriptedModel([1, 2, 3], vocab_size=6),
                 tokenizer=TOK)
    assert (r.finish_reason, r.output) == (FinishReason.CONTENT_INTERRUPTED, b"x")
    # The checker model runs the same list.
    edited = {"lifecycle": load_text(edit(_lifecycle()), "lifecycle.toml")}
    assert _observed() == ["cancel"] and _observed(edited) == ["deadline"]
