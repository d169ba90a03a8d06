"""The lifecycle table is a value the runtime runs (§4.1, §4.3; DECISIONS D4, D31, D53): generate()
and the Engine take one, so the shipped table and an edited copy run side by side in one process,
each run following its own table and neither changing what the other does. Without one a run
follows the spec directory's (spec/, or DECODESPEC_SPEC_DIR: a command line convenience)."""

from __future__ import annotations

from _step_kit import move_check, move_phase

from decodespec.runtime import ByteTableTokenizer, Engine, Request, ScriptedModel, generate
from decodespec.runtime.faults import Fault, FaultPlan
from decodespec.runtime.runner import RequestRun, lifecycle_of
from decodespec.spec import FinishReason, load_spec
from decodespec.spec.loader import SPEC_DIR, load_text

TOK = ByteTableTokenizer({1: b"x", 2: b"A", 3: b"B", 5: b""}, eos_id=5)
SHIPPED = (SPEC_DIR / "lifecycle.toml").read_text(encoding="utf-8")


def _edited() -> str:
    """The deadline observed before the cancel, the emit before the finish checks (D53), `length`
    checked first (D4) and ignore_eos taken off the eos check (D31)."""
    text = move_phase(move_phase(SHIPPED, "observe_deadline", "observe_cancel"), "emit", "finish_checks")
    return move_check(text, "length", "eos").replace('unless = ["ignore_eos", "min_tokens"]', 'unless = ["min_tokens"]')


EDITED = load_text(_edited(), "lifecycle.toml (edited)")
_BOTH = FaultPlan([Fault("decode.completed", 1, "cancel"), Fault("decode.completed", 1, "deadline")])


def _outcomes(**table) -> list:
    """What one table makes of four requests: a cancel and a deadline pending at one check point, a
    chunk the content policy refuses, a stop on the last allowed token, an EOS under ignore_eos."""
    runs = [
        generate(Request([1], max_output_tokens=3), model=ScriptedModel([1, 1, 1], vocab_size=6), tokenizer=TOK,
                 faults=_BOTH, **table),
        generate(Request([1], max_output_tokens=3, content_policy=lambda sent, chunk: chunk == b"A"),
                 model=ScriptedModel([1, 2, 3], vocab_size=6), tokenizer=TOK, **table),
        generate(Request([1], max_output_tokens=2, stop=["AB"]), model=ScriptedModel([2, 3], vocab_size=6),
                 tokenizer=TOK, **table),
        generate(Request([1], max_output_tokens=4, ignore_eos=True), model=ScriptedModel([2, 5, 2, 5], vocab_size=6),
                 tokenizer=TOK, **table),
    ]
    return [(r.state.value, r.finish_reason, r.output) for r in runs]


# The shipped table: the cancel wins the check point, the refused chunk is never sent (D11), the stop
# is reported, EOS ends nothing under ignore_eos. The edited one: each of those the other way.
SHIPPED_OUTCOMES = [("CANCELLED", FinishReason.CANCELLED, b"x"), ("FINISHED", FinishReason.CONTENT_INTERRUPTED, b"x"),
                    ("FINISHED", FinishReason.STOP_SEQUENCE, b""), ("FINISHED", FinishReason.MAX_OUTPUT_TOKENS, b"AA")]
EDITED_OUTCOMES = [("FINISHED", FinishReason.DEADLINE_EXCEEDED, b"x"),
                   ("FINISHED", FinishReason.CONTENT_INTERRUPTED, b"xA"),
                   ("FINISHED", FinishReason.MAX_OUTPUT_TOKENS, b""), ("FINISHED", FinishReason.EOS, b"A")]


def test_the_shipped_table_and_an_edited_copy_run_side_by_side():
    assert _outcomes() == SHIPPED_OUTCOMES
    assert _outcomes(lifecycle=EDITED) == EDITED_OUTCOMES
    assert _outcomes(lifecycle=load_spec("lifecycle")) == SHIPPED_OUTCOMES  # the edited one left nothing behind
    assert _outcomes(lifecycle=EDITED) == EDITED_OUTCOMES


def test_an_engine_runs_the_table_it_is_given_beside_one_that_runs_the_shipped_table():
    def served(engine: Engine) -> tuple:
        run = engine.submit(Request([1], max_output_tokens=3, content_policy=lambda sent, chunk: chunk == b"A"))
        engine.run_until_idle()
        r = run.result()
        return r.finish_reason, r.output

    edited, shipped = (Engine(ScriptedModel([1, 2, 3], vocab_size=6), TOK, lifecycle=t) for t in (EDITED, None))
    assert served(edited) == (FinishReason.CONTENT_INTERRUPTED, b"xA")  # the emit comes before the checks
    assert served(shipped) == (FinishReason.CONTENT_INTERRUPTED, b"x")


def test_a_run_of_another_step_order_is_a_request_run_of_that_order():
    """A table whose [[step]] order is another gets RequestRun's subclass that runs that order;
    one that only reorders its finish checks is a plain RequestRun with its own checks."""
    run = RequestRun(Request([1]), model=ScriptedModel([1], vocab_size=6), tokenizer=TOK, lifecycle=EDITED)
    assert isinstance(run, RequestRun) and type(run) is not RequestRun
    assert (type(run).check_point, type(run).select) == lifecycle_of(EDITED).step != (RequestRun.check_point,
                                                                                        RequestRun.select)
    checks_only = load_text(move_check(SHIPPED, "length", "eos"), "lifecycle.toml")
    plain = RequestRun(Request([1]), model=ScriptedModel([1], vocab_size=6), tokenizer=TOK, lifecycle=checks_only)
    assert type(plain) is RequestRun and plain._winner is lifecycle_of(checks_only).winner is not RequestRun(
        Request([1]), model=ScriptedModel([1], vocab_size=6), tokenizer=TOK)._winner
