"""The order of one step of the §4.3 loop is the lifecycle table's [[step]] (DECISIONS D53): the
loader refuses an order in which a phase comes before what it reads, the runtime runs the
check_point and select written for the table's order (runtime/stepgen.py writes one for every
order the loader accepts into runtime/runner.py, as code a traceback can name), and a reordered
table changes what the runtime returns and what the checker model explores alike."""

from __future__ import annotations

import inspect
import traceback
from pathlib import Path

import pytest
from _step_kit import move_phase
from click.testing import CliRunner

from decodespec.cli import main
from decodespec.machine.checker_model import Model
from decodespec.machine.checker_state import CANCEL, DEADLINE, PC, RequestState
from decodespec.runtime import ByteTableTokenizer, Request, ScriptedModel, generate, runner, stepgen
from decodespec.runtime.faults import Fault, FaultPlan
from decodespec.runtime.runner import RequestRun
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
    assert set(stepgen.PHASES) == set(STEP_NEEDS)


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


def _order(table) -> tuple[str, ...]:
    return tuple(p.phase for p in table.step)


def test_the_runtime_runs_the_step_written_for_the_tables_order():
    """check_point and select are the functions runner.py holds for the shipped order; a reordered
    table gets the pair whose phases run in its order."""
    shipped = load_spec("lifecycle")
    assert (RequestRun.check_point, RequestRun.select) == runner._STEPS[_order(shipped)] == runner._step_of(shipped)
    check_point, select = inspect.getsource(RequestRun.check_point), inspect.getsource(RequestRun.select)
    assert check_point.index("_cancel_requested") < check_point.index("_deadline_forced")
    assert select.index("self._winner(") < select.index("self.put_delta(")
    swapped = load_text(move_phase(move_phase(_lifecycle(), "observe_deadline", "observe_cancel"), "emit",
                                   "finish_checks"), "lifecycle.toml")
    check_point, select = (inspect.getsource(f) for f in runner._step_of(swapped))
    assert check_point.index("_deadline_forced") < check_point.index("_cancel_requested")
    assert select.index("self.put_delta(") < select.index("self._winner(")


def test_every_order_the_loader_accepts_has_its_step_and_runner_holds_what_stepgen_writes():
    """The block of runner.py between stepgen's marker lines is `stepgen.block()` (run `decodespec
    codegen` after changing a phase or STEP_NEEDS): one pair for each order of STEP_NEEDS."""
    assert stepgen.current() == stepgen.block()
    out = CliRunner().invoke(main, ["codegen", "--check"])
    assert out.exit_code == 0 and "up to date" in out.output, out.output
    observe = stepgen.orders(stepgen.OBSERVE)
    rest = stepgen.orders([p for p in STEP_NEEDS if p not in stepgen.OBSERVE])
    assert set(runner._STEPS) == {(*a, *b) for a in observe for b in rest} and len(runner._STEPS) == 4
    # a phase whose code changed, or a phase the code lacks, is a different block or a clear error
    edited = {**stepgen.PHASES, "emit": stepgen.Phase("§4.7", "sent", "pass\n")}
    assert stepgen.block(phases=edited) != stepgen.current()
    with pytest.raises(ValueError, match="STEP_NEEDS and runtime/stepgen.PHASES differ"):
        stepgen.block({**STEP_NEEDS, "flush": ("emit",)})
    no_step = load_text(_lifecycle().replace("[[step]]\nphase", "[[step-x]]\nphase"), "lifecycle.toml")
    with pytest.raises(RuntimeError, match="declares no \\[\\[step\\]\\]"):
        runner._step_of(no_step)


def test_a_failure_inside_the_step_names_runner_py_and_the_line():
    """A check that raises (here the request's content policy) shows the step's frames as code: the
    select written for the table's order and the shipped finish checks, in runner.py, each with the
    line that was running."""
    def policy(sent: bytes, chunk: bytes) -> bool:
        raise RuntimeError("policy failed")

    run = RequestRun(Request([1], max_output_tokens=3, content_policy=policy), model=ScriptedModel([2], vocab_size=6),
                     tokenizer=TOK)
    run.admit()
    run.check_point()
    run.begin_prefill()
    run.end_prefill(*run.model.prefill([1]))
    with pytest.raises(RuntimeError, match="policy failed") as caught:
        run.select(2)
    frames = {f.name: f for f in traceback.extract_tb(caught.value.__traceback__)}
    lines = Path(runner.__file__).read_text(encoding="utf-8").splitlines()
    for name, line in ((RequestRun.select.__name__, "event = self._winner(self, eos, safe, hit, t, checked)"),
                       ("_shipped_finish_checks", "and run.request.content_policy(bytes(run.output), safe)):")):
        frame = frames[name]
        assert Path(frame.filename) == Path(runner.__file__) and frame.line == line, frame
        assert lines[frame.lineno - 1].strip() == line
    assert "policy" in frames  # and the policy's own frame below them


def _both_pending() -> RequestState:
    """A model state at the top of a step with a cancel requested and the deadline passed."""
    zero = RequestState(*(0,) * len(RequestState._fields))
    return zero._replace(pc=PC.top_of_step, lifecycle=Model().life.i("DECODING"), cancel=CANCEL.requested,
                         deadline=DEADLINE.passed)


def _observed(tables=None) -> list[str]:
    model = Model(tables)
    return [s.tag.what for s in model.expand(_both_pending()) if s.tag.kind == "observe"]


# A cancel and the deadline land as the first decode completes: both wait at the next check point.
_BOTH = [Fault("decode.completed", 1, "cancel"), Fault("decode.completed", 1, "deadline")]
_INTERRUPT = {"content_policy": lambda sent, chunk: chunk == b"A"}


def test_a_reordered_step_changes_the_runtime_and_the_checker_beside_the_shipped_one():
    """With the deadline observed before the cancel and the emit before the finish checks, in an
    edited lifecycle table run beside the shipped one: a run whose cancel and deadline are pending at
    one check point ends deadline_exceeded instead of cancelled, a chunk the content policy refuses
    is sent, and the checker model observes the deadline first (the seeded-bug suite checks that
    the checker reports the sent chunk: refused_chunk_never_sent). The shipped table, run after it,
    is unchanged: the cancel wins the check point, the refused chunk is never sent (D11)."""
    edited = load_text(move_phase(move_phase(_lifecycle(), "observe_deadline", "observe_cancel"), "emit",
                                  "finish_checks"), "lifecycle.toml")
    for table, want in ((edited, [("FINISHED", FinishReason.DEADLINE_EXCEEDED), b"xA"]),
                        (None, [("CANCELLED", FinishReason.CANCELLED), b"x"])):
        r = generate(Request([1], max_output_tokens=3), model=ScriptedModel([1, 1, 1], vocab_size=6), tokenizer=TOK,
                     faults=FaultPlan(_BOTH), lifecycle=table)
        interrupted = generate(Request([1], max_output_tokens=3, **_INTERRUPT),
                               model=ScriptedModel([1, 2, 3], vocab_size=6), tokenizer=TOK, lifecycle=table)
        assert interrupted.finish_reason is FinishReason.CONTENT_INTERRUPTED
        assert [(r.state.value, r.finish_reason), interrupted.output] == want
    # The checker model runs the same list.
    assert _observed() == ["cancel"] and _observed({"lifecycle": edited}) == ["deadline"]
