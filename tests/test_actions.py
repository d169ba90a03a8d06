"""Actions are effects, run through one registry by the runtime and by the checker model
(machine/actions.py): every action a table names is declared with its effects, every
effect has exactly one implementation per executor, and firing a row runs what its action says,
so an edited action changes what the runtime does (§4.3, §4.10)."""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from unittest import mock

import pytest
from _spec_kit import edited_spec

from decodespec.machine import checker_model
from decodespec.machine.actions import ActionError, Executor
from decodespec.properties import check_trace
from decodespec.runtime import (
    ByteTableTokenizer,
    Request,
    ScriptedModel,
    detokenizer,
    effects,
    engine,
    generate,
    ledger,
    stop,
    stream,
)
from decodespec.spec import MACHINES, Spec, Table, load_spec, load_text
from decodespec.spec.invariants import load_invariants
from decodespec.spec.loader import SPEC_DIR

REPO = Path(__file__).resolve().parent.parent

EXECUTORS = {
    "checker model": checker_model.EXECUTORS,
    "runtime": {"lifecycle": effects.LIFECYCLE, "resources": ledger.RESOURCES, "sequence": engine.SEQUENCE, "overlap": engine.OVERLAP,
                "stream": stream.STREAM, "stop_matcher": stop.STOP, "detokenizer": detokenizer.DETOK},
}


@pytest.mark.parametrize("name", MACHINES)
def test_every_action_a_table_names_is_declared_with_its_effects(name):
    table = load_spec(name)
    named = {d.action for d in table.decisions.values() if d.action}
    assert named and named <= set(table.actions)
    assert {e for fx in table.actions.values() for e in fx} == set(table.effects)


@pytest.mark.parametrize("who, name", [(w, n) for w, xs in EXECUTORS.items() for n in xs])
def test_each_executor_implements_exactly_the_effects_of_its_table(who, name):
    executor = EXECUTORS[who][name]
    table = load_spec(name)
    assert set(executor.impl) == set(table.effects)
    plans = executor.plans(table)
    assert set(plans) == {k for k, d in table.decisions.items() if d.allowed}
    for (state, event), plan in plans.items():
        assert plan.action == table.decision(state, event).action
        assert plan.effects == table.actions.get(plan.action, ())


def test_the_model_says_why_it_abstracts_an_effect():
    """An effect the model does not represent is registered with what stands for it, and that holds:
    a state of its table that every row with the effect enters (PAUSED for `pause`), an invariant of
    spec/invariants.toml, or a test file of this checkout."""
    invariants = load_invariants()
    for executor in checker_model.EXECUTORS.values():
        table = load_spec(executor.table)
        assert set(executor.why) == {name for name, fn in executor.impl.items() if fn is None}
        for name, why in executor.why.items():
            words = set(re.findall(r"[\w/.]+", why))
            states, named = words & set(table.states), words & set(invariants)
            tests = {w for w in words if w.startswith("tests/") and (REPO / w).is_file()}
            assert states or named or tests, f"{executor.table}.{name}: the reason names nothing that stands for it: {why!r}"
            entered = {d.target for d in table.decisions.values() if d.action and name in table.actions[d.action]}
            for state in states:
                assert entered == {state}, f"{executor.table}.{name}: said to be {state}, its rows enter {sorted(entered)}"


def test_an_executor_missing_an_effect_or_implementing_an_extra_one_is_refused():
    table = load_spec("resources")
    bare = Executor("resources", "a test executor")
    with pytest.raises(ActionError) as info:
        bare.plans(table)
    assert str(info.value) == "a test executor: no implementation of effect(s) ['free'] of spec/resources.toml"
    extra = Executor("resources", "a test executor")
    extra.effect("free")(lambda *a: None)
    extra.effect("shred")(lambda *a: None)
    with pytest.raises(ActionError) as info:
        extra.verify(table)
    assert str(info.value) == "a test executor: implements ['shred'], which spec/resources.toml does not declare"
    with pytest.raises(ActionError, match="implemented twice"):
        extra.effect("free")(lambda *a: None)


def test_a_table_without_actions_is_refused_by_name():
    raw = (SPEC_DIR / "resources.toml").read_text(encoding="utf-8")
    bare = load_text(raw[: raw.index("# --- What each action does")], "bare.toml")
    executor = Executor("resources", "the runtime")
    executor.effect("free")(lambda *a: None)
    with pytest.raises(ActionError) as info:
        executor.plans(bare)
    assert str(info.value) == "bare.toml: declares no [actions]; the runtime runs a row's effects"


def test_a_row_naming_an_undeclared_action_is_refused_by_name():
    """The loader refuses such a row; a Table built past it (attrs.evolve) is
    refused by the executor too, naming the row and the action, instead of running nothing."""
    import attrs

    table = load_spec("resources")
    key = ("HELD", "release")
    decisions = {**table.decisions, key: attrs.evolve(table.decisions[key], action="shred")}
    with pytest.raises(ActionError) as info:
        ledger.RESOURCES.plans(attrs.evolve(table, decisions=decisions))
    assert str(info.value) == ("the runtime (ledger.ResourceLedger): (HELD, release) of spec/resources.toml names "
                               "action 'shred', which its [actions] does not declare")


def test_a_changed_action_changes_what_the_runtime_does():
    """§4.3: with the drain's `complete` row given the action `admit` (no effects) in an edited
    spec, the runtime enters FINISHED without releasing or emitting anything, and the monitors
    judging by that spec say so; with the shipped tables the same run, in the same process, is clean."""
    old = 'event = "complete"\ntarget = "FINISHED"\naction = "release_and_emit_terminal"'
    spec = edited_spec({"lifecycle": lambda t: t.replace(old, old.replace("release_and_emit_terminal", "admit"))})
    tok = ByteTableTokenizer({1: b"x", 2: b"A", 5: b""}, eos_id=5)

    def run(spec: Spec | None = None) -> tuple:
        r = generate(Request([1], max_output_tokens=2), model=ScriptedModel([2, 5], vocab_size=6), tokenizer=tok,
                     spec=spec)
        return r.state, sorted({v.invariant for v in check_trace(r.trace, tokenizer=tok, spec=spec)})

    assert run(spec=spec) == ("FINISHED", ["model_released_before_terminal", "no_leak", "single_terminal_event",
                                           "terminal_with_transition"])
    assert run() == ("FINISHED", [])


def test_a_changed_sequence_action_changes_what_the_engine_does():
    """§4.4: with a finished resident sequence's `drop` given the action `forget` (its place is
    not given back) in an edited spec, the Engine keeps the finished run in its batch and drops it
    again on the next step, which the table refuses by name; with the shipped table both runs end."""
    from _engine_kit import ascii_tokenizer, tiny_model

    from decodespec.machine import IllegalTransition

    old = 'state = "RESIDENT"\nevent = "drop"\ntarget = "DONE"\naction = "leave_batch"'
    spec = edited_spec({"sequence": lambda t: t.replace(old, old.replace("leave_batch", "forget"))})

    def run(spec: Spec | None = None) -> list[str]:
        eng = engine.Engine(tiny_model(), ascii_tokenizer(), max_batch=1, spec=spec)
        runs = [eng.submit(Request("ab", max_output_tokens=3)) for _ in range(2)]
        try:
            eng.run_until_idle(max_steps=300)
        except IllegalTransition as exc:
            return [f"refused: {exc}"]
        return [r.state for r in runs]

    assert run(spec=spec)[0].startswith("refused: sequence: event 'drop' is not allowed in state DONE")
    assert run() == ["FINISHED", "FINISHED"]


def test_a_changed_stream_action_changes_what_the_stream_does():
    """§4.7: with the open stream's `disconnect` given the action `attach_reader` in an edited
    table, a disconnect leaves the stream connected (and traced as a reconnect); an effect whose
    input the call does not carry is refused by name (a `complete` given `emit_delta`)."""
    detach = 'state = "OPEN"\nevents = ["disconnect"]\naction = "detach_reader"'
    complete = 'state = "OPEN"\nevent = "complete"\ntarget = "COMPLETED"\naction = "emit_terminal"'
    table = edited_spec({"stream": lambda t: t.replace(detach, detach.replace("detach_reader", "attach_reader"))
                         .replace(complete, complete.replace("emit_terminal", "emit_delta"))})["stream"]

    def run(table: Table | None = None) -> list:
        s = stream.OrderedStream("r1", table=table)
        s.start()
        s.disconnect()
        try:
            s.complete("eos")
        except ActionError as exc:
            return [s.connected, str(exc)]
        return [s.connected, ""]

    assert run(table=table) == [True, "stream row (OPEN, complete): effect queue_delta needs 'data', which this call "
                                      "does not carry"]
    assert run() == [False, ""]


def test_a_changed_stop_matcher_action_changes_what_the_matcher_returns():
    """§4.3, §4.6: with the holding matcher's `flush` given the action `discard_from_match` in an
    edited table, the held suffix is dropped at the end instead of sent; shipped, it is sent."""
    flush = 'state = "HOLDING"\nevent = "flush"\ntarget = "FLUSHED"\naction = "emit_held"'
    table = edited_spec({"stop_matcher": lambda t: t.replace(flush, flush.replace("emit_held", "discard_from_match"))})[
        "stop_matcher"]

    def run(table: Table | None = None) -> tuple:
        m = stop.StopMatcher(["AB"], table=table)
        return m.push(b"xA"), m.flush()

    assert run(table=table) == ((b"x", None), b"")
    assert run() == ((b"x", None), b"A")


def test_a_changed_detokenizer_action_changes_what_the_runtime_returns():
    """§4.5: with the `hold` rows given `emit_bytes` (no hold_partial) in an edited spec, the
    first byte of a character split across two tokens is not held: the next push sees a lone
    continuation byte, which no later token can repair, and raises (D12), so generate() FAILS
    where the shipped table holds the byte and returns the character whole."""
    old = 'event = "hold"\ntarget = "PENDING"\naction = "emit_complete_hold_rest"'
    assert (SPEC_DIR / "detokenizer.toml").read_text(encoding="utf-8").count(old) == 2
    spec = edited_spec({"detokenizer": lambda t: t.replace(old, old.replace("emit_complete_hold_rest", "emit_bytes"))})
    tok = ByteTableTokenizer({1: b"x", 2: b"\xc3", 3: b"\xa9y", 5: b""}, eos_id=5)

    def run(spec: Spec | None = None) -> list:
        d, out = detokenizer.IncrementalDetokenizer(tok, table=spec["detokenizer"] if spec else None), []
        try:
            for t in (1, 2, 3):
                out.append(d.push(t))
        except Exception as exc:
            out.append(type(exc).__name__)
        r = generate(Request([1], max_output_tokens=3), model=ScriptedModel([1, 2, 3], vocab_size=6), tokenizer=tok,
                     spec=spec)
        return [out, d.state.value, r.state.value, r.output, r.error and str(r.error)]

    assert run() == [[b"x", b"", b"\xc3\xa9y"], "EMPTY", "FINISHED", b"x\xc3\xa9y", None]
    edited = run(spec=spec)
    assert edited[:4] == [[b"x", b"", "DecodingError"], "FAILED", "FAILED", b"x"], edited
    assert edited[4].startswith("decoding_error: invalid UTF-8 in the output: a9"), edited


def test_an_effect_that_raises_names_its_file_and_line():
    """The lifecycle effects are code in runtime/effects.py (no source built at run time): a stream
    that fails to send the terminal event (§4.3, transition_and_emit_terminal) shows the drain and
    emit_terminal frames there, each with the line that was running."""
    tok = ByteTableTokenizer({1: b"x", 2: b"A", 5: b""}, eos_id=5)

    def complete(*args: object) -> int:
        raise RuntimeError("terminal send failed")

    with mock.patch.object(stream.OrderedStream, "complete", complete), \
         pytest.raises(RuntimeError, match="terminal send failed") as caught:
        generate(Request([1], max_output_tokens=2), model=ScriptedModel([2, 5], vocab_size=6), tokenizer=tok)
    frames = {f.name: f for f in traceback.extract_tb(caught.value.__traceback__)}
    lines = Path(effects.__file__).read_text(encoding="utf-8").splitlines()
    for name, line in (("drain", 'run.fire("complete")'),
                       ("_emit_terminal", "send(run.stream, run.final_reason, run.usage().as_dict(), run.error)")):
        frame = frames[name]
        assert Path(frame.filename) == Path(effects.__file__) and frame.line == line, frame
        assert lines[frame.lineno - 1].strip() == line
