"""The finish checks of a selected token are the lifecycle table's ordered list (§4.3, §4.6, §4.10;
DECISIONS D3, D4, D11): the runtime runs that list, a copy of the tables with the list permuted
changes what the runtime reports, and token-id and string stops share one cut."""

from __future__ import annotations

import inspect
import itertools
import json
from types import SimpleNamespace

import pytest
from _spec_kit import probe, spec_copy
from _step_kit import move_check

from decodespec.properties import check_trace
from decodespec.runtime import ByteTableTokenizer, EventKind, Request, ScriptedModel, generate, runner, stepgen
from decodespec.runtime.finish import FINISH_CHECKS, Composed, finish_checks
from decodespec.spec import FinishReason, load_spec
from decodespec.spec.loader import SPEC_DIR, SpecError, load_text

# 1 "x", 2 "A", 3 "B", 4 "Z", 9 "Q", 5 EOS.
TOK = ByteTableTokenizer({1: b"x", 2: b"A", 3: b"B", 4: b"Z", 9: b"Q", 5: b""}, eos_id=5)


def _run(script, **kw):
    res = generate(Request([1], **kw), model=ScriptedModel(script, vocab_size=10), tokenizer=TOK)
    assert check_trace(res.trace, tokenizer=TOK) == [], [str(v) for v in check_trace(res.trace, tokenizer=TOK)]
    return res


def _length_first(text: str) -> str:
    """lifecycle.toml with the `length` finish check moved before `eos` (so before everything)."""
    return move_check(text, "length", "eos")


def _lifecycle_with(edit):
    return load_text(edit((SPEC_DIR / "lifecycle.toml").read_text(encoding="utf-8")), "lifecycle.toml")


def test_every_listed_check_has_one_implementation_and_every_implementation_is_listed():
    """The registry is checked both ways (as invariants and monitors are)."""
    listed = [c.event for c in load_spec("lifecycle").finish_checks if not c.tokens]  # token checks need no code
    assert sorted(listed) == sorted(FINISH_CHECKS)
    with pytest.raises(RuntimeError, match="implemented but not listed"):
        finish_checks(load_spec("lifecycle").finish_checks[:-1])


def test_the_runtime_runs_the_checks_in_the_lists_order():
    """The shipped list runs as one function with finish.py's conditions inline, in its order; any
    other list runs its checks one by one in its own order."""
    table = load_spec("lifecycle")
    assert [event for event, _ in finish_checks(table.finish_checks)] == [c.event for c in table.finish_checks]
    assert runner._winner_of(table) is runner._shipped_finish_checks
    src = inspect.getsource(runner._shipped_finish_checks)
    positions = [src.index(f'return "{c.event}"') for c in table.finish_checks]
    assert positions == sorted(positions)
    length = next(c for c in table.finish_checks if c.event == "length")
    assert stepgen.condition(length) == "t >= run.request.max_output_tokens" and stepgen.condition(length) in src
    reordered = runner._winner_of(_lifecycle_with(_length_first))
    assert isinstance(reordered, Composed) and [e for e, _ in reordered.checks][:2] == ["length", "eos"]


class _Grammar:
    def complete(self, text: str) -> bool:
        return text.endswith("A")


def _stub_run(policy, grammar, cache_length):
    request = SimpleNamespace(content_policy=policy, grammar=grammar, max_output_tokens=3)
    return SimpleNamespace(request=request, output=bytearray(b"x"), echo_len=0, finish_ids={"tool_call": frozenset({7})},
                           cache=SimpleNamespace(length=cache_length), model=SimpleNamespace(context_limit=10),
                           consumed_text=lambda safe: (b"x" + safe).decode())


def test_the_inline_checks_and_the_checks_one_by_one_agree_on_every_input():
    """The function written from finish.py and its checks composed in the same order pick the same
    event for every combination of the step's locals and the request's features."""
    composed = Composed(finish_checks(load_spec("lifecycle").finish_checks))
    def refuses_a(sent: bytes, chunk: bytes) -> bool:
        return chunk == b"A"

    seen = set()
    for policy, grammar, cache_length in itertools.product((None, refuses_a), (None, _Grammar()), (1, 9)):
        run = _stub_run(policy, grammar, cache_length)
        for eos, safe, hit, t, token in itertools.product((False, True), (b"", b"A", b"B"), (None, "hit"), (1, 3),
                                                         (None, 7, 8)):
            want = composed(run, eos, safe, hit, t, token)
            assert runner._shipped_finish_checks(run, eos, safe, hit, t, token) == want
            seen.add(want)
    assert seen == {None, *(c.event for c in load_spec("lifecycle").finish_checks)}


@pytest.mark.parametrize(("entry", "problem"), [
    ('event = "nope"\nanchor = "§4.3"', "undeclared event 'nope'"),
    ('event = "schedule"\nanchor = "§4.3"', "no row fires 'schedule' with a finish reason"),
    ('event = "eos"\nanchor = "§4.6"', "'eos' is checked twice"),
    ('event = "length"\nwhen = "always"', "unknown key 'when'"),
])
def test_a_bad_finish_check_is_refused_naming_it(entry, problem):
    text = (SPEC_DIR / "lifecycle.toml").read_text(encoding="utf-8")
    with pytest.raises(SpecError, match=problem):
        load_text(text + f"\n[[finish_check]]\n{entry}\n", "lifecycle.toml")


def test_content_policy_beats_a_stop_string_on_the_same_token():
    """D4/D11: the policy judges the safe bytes before anything is sent; a refused chunk is
    never sent even when the same token completes a stop."""
    res = _run([2, 3, 4], stop=["B"], max_output_tokens=3, content_policy=lambda sent, chunk: chunk == b"A")
    assert res.finish_reason is FinishReason.CONTENT_INTERRUPTED and res.output == b""


def test_a_stop_on_the_last_allowed_token_reports_the_stop():
    """D4: stop_hit is checked before length."""
    res = _run([2, 3], stop=["AB"], max_output_tokens=2)
    assert res.finish_reason is FinishReason.STOP_SEQUENCE and res.output == b""


def test_a_token_id_stop_keeps_the_bytes_the_string_matcher_held():
    """§4.6: "A" is held as a possible start of the stop "AB"; the token-id
    stop Z ends the text after "A", so "A" is final and returned, not dropped."""
    res = _run([1, 2, 4, 1], stop=["AB"], stop_token_ids=[[4]], max_output_tokens=4)
    assert res.finish_reason is FinishReason.STOP_SEQUENCE and res.stop == (4,)
    assert res.output == b"xA"


def test_a_partial_token_id_match_does_not_delay_a_complete_string_stop():
    """§4.6: the string matcher sees B at once; the stop "AB" ends the run on
    that token even though B might begin the stop ids [3, 9]."""
    res = _run([1, 2, 3, 9], stop=["AB"], stop_token_ids=[[3, 9]], max_output_tokens=4)
    assert res.stop == "AB" and len(res.tokens) == 3 and res.output == b"x"


def test_when_both_kinds_hit_on_one_token_the_earlier_cut_wins():
    """D3: the token ids [4] cut at Z; the string "BZ" cuts at B, earlier: the string wins."""
    res = _run([1, 3, 4], stop=["BZ"], stop_token_ids=[[4]], max_output_tokens=3)
    assert res.stop == "BZ" and res.output == b"x"
    res = _run([1, 3, 4], stop=["Z"], stop_token_ids=[[3, 4]], max_output_tokens=3)
    assert res.stop == (3, 4) and res.output == b"x"


def test_bytes_a_partial_token_id_match_withheld_are_sent_when_it_fails():
    res = _run([1, 3, 2, 1], stop_token_ids=[[3, 4]], max_output_tokens=4)
    assert res.output == b"xBAx" and res.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    deltas = [e.data["bytes"] for e in res.trace.events if e.kind is EventKind.RESPONSE_DELTA]
    assert deltas == [b"x", b"BA", b"x"]  # B waited for the token after it


def test_the_stop_hit_event_carries_index_and_span():
    """D3 promises which stop matched and where: stop.hit has index, start and end."""
    res = _run([1, 2, 3], stop=["Q", "AB"], max_output_tokens=3)
    hit = next(e for e in res.trace.events if e.kind is EventKind.STOP_HIT)
    assert (hit.data["index"], hit.data["start"], hit.data["end"]) == (1, 1, 3)


def test_every_eos_id_the_checkpoint_lists_ends_the_output(tmp_path):
    """§4.6: a generation_config listing several EOS ids (Llama 3) ends on any of them."""
    from tokenizers import Tokenizer, models

    from decodespec.runtime.tokenizers import HFTokenizer

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 2, "<eot>": 3}, unk_token="a"))
    tok.add_special_tokens(["<eos>", "<eot>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    hf = HFTokenizer(tmp_path)
    assert hf.eos_ids == {2, 3}
    res = generate(Request([0], max_output_tokens=4), model=ScriptedModel([1, 3, 1, 1], vocab_size=4), tokenizer=hf)
    assert res.finish_reason is FinishReason.EOS and res.tokens == (1, 3)


def test_a_permuted_list_changes_what_the_runtime_reports_beside_the_shipped_one():
    """Move `length` before `stop_hit` and `eos` in an edited lifecycle table run beside the shipped
    one: the runtime then reports max_output_tokens for a stop or an EOS on the last allowed token;
    the shipped table, run after it, still reports the stop and the EOS."""
    permuted = _lifecycle_with(_length_first)
    tok = ByteTableTokenizer({1: b"x", 2: b"A", 3: b"B", 5: b""}, eos_id=5)
    for script, kw, output in (([2, 3], {"stop": ["AB"]}, b""), ([2, 5], {}, b"A")):
        r = generate(Request([1], max_output_tokens=2, **kw), model=ScriptedModel(script, vocab_size=6), tokenizer=tok,
                     lifecycle=permuted)
        # finish_reason_precedence (D4) is the one monitor that says the order is wrong
        assert (r.finish_reason, r.output) == (FinishReason.MAX_OUTPUT_TOKENS, output)
        assert [v.invariant for v in check_trace(r.trace, tokenizer=tok)] == ["finish_reason_precedence"]
    assert _run([2, 3], stop=["AB"], max_output_tokens=2).finish_reason is FinishReason.STOP_SEQUENCE
    assert _run([2, 5], max_output_tokens=2).finish_reason is FinishReason.EOS


def test_the_checker_model_runs_the_same_list():
    """With `length` first, the checker finds no stop on the last allowed
    token: its witness goes missing, the report is not ok, and nothing else breaks."""
    from decodespec.machine.checker import check

    assert "stop_at_last_allowed_token" in check(1).witnesses
    report = check(1, tables={"lifecycle": _lifecycle_with(_length_first)})
    assert "stop_at_last_allowed_token" in report.missing_witnesses and not report.ok
    assert not report.violations  # the permuted list is consistent: only the stop witness is gone


def test_a_new_finish_reason_needs_spec_files_only(tmp_path):
    """Declare `budget_exhausted` (OpenAI "length") in spec/reasons.toml and let
    the length row fix it in spec/lifecycle.toml, in a copy of spec/ (2 files, no code). The
    runtime reports it, the monitors accept it, the server maps it, the checker and the diagrams
    follow."""
    old = 'event = "length"\ntarget = "DRAINING"\naction = "fix_reason"\nreason = "max_output_tokens"'
    assert (SPEC_DIR / "lifecycle.toml").read_text(encoding="utf-8").count(old) == 1
    copy = spec_copy(tmp_path, {
        "reasons.toml": lambda t: t + '\n[[reason]]\nname = "budget_exhausted"\nanchor = "§4.3"\nopenai = "length"\n',
        "lifecycle.toml": lambda t: t.replace(old, old.replace("max_output_tokens", "budget_exhausted")),
    })
    lines = probe(copy, f"""
        from decodespec.runtime import ByteTableTokenizer, Request, ScriptedModel, generate
        from decodespec.runtime.openai_schema import finish_fields
        from decodespec.properties import check_trace
        from decodespec.machine.checker import check
        from decodespec.machine.diagrams import render
        from decodespec.spec import load_spec
        tok = ByteTableTokenizer({{1: b"x", 2: b"A", 5: b""}}, eos_id=5)
        r = generate(Request([1], max_output_tokens=2), model=ScriptedModel([2, 2], vocab_size=6), tokenizer=tok)
        print(r.finish_reason.value, finish_fields(r.finish_reason, None)[0], len(check_trace(r.trace, tokenizer=tok)))
        report = check(1)
        print(report.ok, report.reasons_never_reached, len(report.violations))
        paths = render(load_spec("lifecycle"), {str(tmp_path)!r}, formats=("dot",))
        print(any("budget_exhausted" in open(p).read() for p in paths))
    """)
    assert lines[:3] == ["budget_exhausted length 0", "True () 0", "True"], lines


def _with_function_call(text: str) -> str:
    """lifecycle.toml with a `function_call` event: a token finish check right after EOS, its row in
    DECODING fixing the new reason `function_call`, refused everywhere else."""
    events = '"transport_error", "tool_call"]\n\n#'
    assert text.count(events) == 1
    text = text.replace(events, events.replace('"tool_call"]', '"tool_call", "function_call"]'))
    eos = '[[finish_check]]\nevent = "content_interrupt"\n'
    text = text.replace(eos, '[[finish_check]]\nevent = "function_call"\ntokens = true\nanchor = "§4.3"\n\n' + eos, 1)
    text += ('\n[[row]]\nstate = "DECODING"\nevent = "function_call"\ntarget = "DRAINING"\naction = "fix_reason"\n'
             'reason = "function_call"\nanchor = "§4.3"\n')
    for state in ("CREATED", "QUEUED", "PREFILLING", "DRAINING", "CANCEL_REQUESTED", "FINISHED", "CANCELLED", "FAILED"):
        text += f'\n[[reject]]\nstate = "{state}"\nevents = ["function_call"]\n'
    return text


def test_a_new_event_and_reason_need_spec_files_only(tmp_path):
    """A `function_call` event (a token finish check) with the reason
    `function_call` (OpenAI's older "function_call"), declared in a copy of spec/ only
    (lifecycle.toml and reasons.toml, no code): the runtime ends on the request's token without
    sending it, the monitors accept the trace, the server maps the reason, the checker explores the
    new row (check(1) ok), the diagrams draw it, and the Engine ends the same way."""
    copy = spec_copy(tmp_path, {
        "reasons.toml": lambda t: t + '\n[[reason]]\nname = "function_call"\nanchor = "§4.3"\nopenai = "function_call"\n',
        "lifecycle.toml": _with_function_call,
    })
    lines = probe(copy, f"""
        from decodespec.runtime import ByteTableTokenizer, Engine, Request, ScriptedModel, generate
        from decodespec.runtime.openai_schema import finish_fields
        from decodespec.properties import check_trace
        from decodespec.machine.checker import check
        from decodespec.machine.diagrams import render
        from decodespec.spec import load_spec
        tok = ByteTableTokenizer({{1: b"x", 2: b"A", 5: b"", 7: b"<call>"}}, eos_id=5)
        req = Request([1], max_output_tokens=4, finish_tokens={{"function_call": [7]}})
        r = generate(req, model=ScriptedModel([2, 7, 2], vocab_size=8), tokenizer=tok)
        print(r.finish_reason.value, r.output, finish_fields(r.finish_reason, None)[0], len(check_trace(r.trace, tokenizer=tok)))
        engine = Engine(ScriptedModel([2, 7, 2], vocab_size=8), tok)
        run = engine.submit(req)
        engine.run_until_idle()
        e = run.result()
        print(e.finish_reason.value, e.output, len(check_trace(e.trace, tokenizer=tok)))
        report = check(1)
        print(report.ok, report.rows_never_fired["lifecycle"], report.reasons_never_reached, len(report.violations))
        paths = render(load_spec("lifecycle"), {str(tmp_path)!r}, formats=("dot",))
        print(any("function_call" in open(p).read() for p in paths))
    """)
    assert lines[:4] == ["function_call b'A' function_call 0", "function_call b'A' 0", "True () () 0", "True"], lines


def test_the_shipped_tool_call_check_ends_the_turn_on_its_token():
    """D47 (§4.3): the request's tool-call token (</tool_call>, named by the server when the request
    has tools) ends the run with `tool_calls`; like EOS it is not text, and the trace is clean."""
    tok = ByteTableTokenizer({1: b"x", 2: b"A", 5: b"", 7: b"</tool_call>"}, eos_id=5)
    res = generate(Request([1], max_output_tokens=4, finish_tokens={"tool_call": [7]}),
                   model=ScriptedModel([2, 7, 2], vocab_size=8), tokenizer=tok)
    assert (res.finish_reason, res.output) == (FinishReason.TOOL_CALLS, b"A")
    assert check_trace(res.trace, tokenizer=tok) == []


def test_finish_tokens_must_name_a_token_check_of_the_table():
    """A request naming a token check the tables do not declare is refused, naming the field."""
    from decodespec.runtime.errors import RequestError

    with pytest.raises(RequestError, match=r"finish_tokens.*'tool_use' is not a token finish check of "
                                           r"spec/lifecycle.toml \(declared: tool_call\)"):
        Request([1], finish_tokens={"tool_use": [7]})
    with pytest.raises(RequestError, match="finish_tokens"):
        Request([1], finish_tokens=[7])
