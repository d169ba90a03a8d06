"""The judge against engines that each get one thing wrong (§4.3-§4.10; D26, D27, D65, D66).

An engine frontend over the reference's own tokens (tests/_frontend_kit.py: the reference Engine
selects, the frontend detokenizes, matches stops, ends, counts and streams) carries one realistic
bug per switch. With the switch on, the suite fails exactly the cases the bug shows in, each led by
the finding that names it, on the basis it rests on; with it off the same cases pass. And no
finding, here or in a committed report, prints a negative count.
"""

from __future__ import annotations

import json
import re

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodespec.properties.conformance import load_cases
from decodespec.properties.conformance.adapters.base import case_prompt, case_script, case_tokenizer, reference_on
from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.checkpoints import TABLE_GROUP, build_group, group_of, http_blocker
from decodespec.properties.conformance.forced import PROBE_MAX
from decodespec.properties.conformance.judgement import Observed, expected_of, judge_observed, stream_text
from decodespec.properties.conformance.runner import Verdict, run_case, unexpected
from decodespec.properties.conformance.script_check import Prefix, banned_eos, banned_eos_id, prompt_placed
from decodespec.properties.conformance.symptoms import (
    CHAPTER_BASIS,
    FIELD_BASIS,
    Severity,
    basis_of,
    compare_count,
    compare_text,
    severity_of,
)

pytest.importorskip("transformers")
from _frontend_kit import TokenEngine, frontend_app

CASES = {c.id: c for c in load_cases()}
NEGATIVE = re.compile(r"(?<![\w.\-])-\d+ (?:byte|token|character|chunk)")

# switch -> (the cases it fails, the symptom that leads each, the basis (kind, ref) of that lead)
SPOTS = {
    "prompt_count": (("finish/length/001", "stop/cross-token/001", "usage/eos/001", "finish/min-tokens/001"),
                     "prompt_count", (CHAPTER_BASIS, "usage_consistent")),
    "no_hold_back": (("stop/absorbing/001", "stop/cross-token/001", "stop/cross-token/004", "stop/flush-tail/001",
                      "stop/last-token/001", "stop/overlap/001", "stop/overlap/002", "stop/overlap/003",
                      "stop/overlap/004", "usage/stop/001"),
                     "stop_prefix_left", (CHAPTER_BASIS, "stop_prefix_held")),
    "repeat_delta": (("finish/length/001", "stop/include-stop/001", "stop/prompt-boundary/001", "usage/eos/001"),
                     "bytes_repeated", (CHAPTER_BASIS, "detok_concat_equals_batch")),
    "late_delta": (("finish/length/001", "stop/cross-token/001", "finish/eos-last-token/001", "stop/n-choices/001"),
                   "content_after_finish", (CHAPTER_BASIS, "no_delta_after_terminal")),
    "logit_bias_ignored": (("finish/logit-bias/001", "finish/min-tokens/001", "finish/min-tokens/002"),
                           "fields_ignored", (FIELD_BASIS, "logit_bias")),
    "no_usage_chunk": (("finish/length/001", "stop/cross-token/001", "usage/eos/001"),
                       "usage_chunk", (FIELD_BASIS, "stream_options.include_usage")),
    "n_ignored": (("stop/n-choices/001",), "choices_missing", (FIELD_BASIS, "n")),
}
# cases no switch above may fail: they show none of the bugs (no stop, no field, one delta or none to repeat)
CONTROLS = {
    "prompt_count": (),
    "no_hold_back": ("finish/length/001", "stop/hold-back/001", "stop/include-stop/001"),
    "repeat_delta": ("finish/eos-last-token/001",),
    "late_delta": (),
    "logit_bias_ignored": ("finish/length/001", "finish/min-tokens/003", "finish/ignore-eos/001"),
    "no_usage_chunk": (),
    "n_ignored": ("finish/length/001", "stop/cross-token/001"),
}


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """The byte-table checkpoint with the long program (the request-life recipes run on it)."""
    cases = [c for c in CASES.values() if group_of(c) == TABLE_GROUP and http_blocker(c) is None]
    return build_group(TABLE_GROUP, cases, tmp_path_factory.mktemp("blind") / TABLE_GROUP)


@pytest.fixture(scope="module")
def frontend(ck, app_server):
    """`frontend(*bugs)`: the URL of a frontend over one shared engine with those bugs planted."""
    engine, urls = TokenEngine(ck), {}

    def start(*bugs: str) -> str:
        key = frozenset(bugs)
        if key not in urls:
            urls[key] = app_server(frontend_app(engine, bugs))
        return urls[key]

    return start


def judged(ck, url, ids, *, sweep=True):
    a = OpenAIAdapter(url, checkpoint=ck, sweep=sweep)
    return {i: run_case(a, CASES[i]) for i in ids}


@pytest.fixture(scope="module")
def clean(ck, frontend):
    """Every case the switches use, on the frontend with no bug."""
    ids = sorted({i for cases, _, _ in SPOTS.values() for i in cases} | {i for c in CONTROLS.values() for i in c})
    return judged(ck, frontend(), ids)


def test_with_no_bug_the_frontend_passes_every_case_the_switches_use(clean):
    """The frontend is a correct engine when no switch is on: what a switch fails is the bug's."""
    assert {i: (r.verdict, [f.message for f in r.failures]) for i, r in clean.items()
            if r.verdict is not Verdict.PASS} == {}


@pytest.mark.parametrize("bug", sorted(SPOTS))
def test_each_bug_fails_its_cases_led_by_the_finding_that_names_it(ck, frontend, clean, bug):
    """Per switch (tests/_frontend_kit.BUGS): exactly its cases are caught (none is an ERROR or n/a),
    each led by the symptom that names the bug, on the right basis (symptoms.basis_of), never with a
    negative count: FAIL where the basis is the chapter, DIFFERS where it is a field the engine
    ignored (runner.grade, D69); its controls, and every case with the switch off, pass."""
    cases, lead, (kind, ref) = SPOTS[bug]
    caught = Verdict.FAIL if kind == CHAPTER_BASIS else Verdict.DIFFERS
    got = judged(ck, frontend(bug), [*cases, *CONTROLS[bug]])
    assert {i: r.verdict for i, r in got.items()} == {i: caught if i in cases else Verdict.PASS for i in got}
    for i in cases:
        first = got[i].failures[0]
        assert first.symptom == lead, (i, [(f.symptom, f.message) for f in got[i].failures])
        basis = basis_of(first, CASES[i])
        assert (basis.kind, basis.ref) == (kind, ref), (i, basis)
        assert not any(NEGATIVE.search(f.message) for f in got[i].failures), got[i].failures
        assert clean[i].verdict is Verdict.PASS


def test_a_text_past_the_finish_chunk_is_not_also_called_lost(ck, frontend):
    """D65: the bytes a stream sent after its finish chunk are where its missing text went: that
    finding leads, and the stream's text is not reported lost or different from the answer as well."""
    for r in judged(ck, frontend("late_delta"), SPOTS["late_delta"][0]).values():
        assert not {"bytes_lost", "held_not_released", "stream_vs_batch"} & {f.symptom for f in r.failures}, r.failures


def test_a_prompt_count_one_too_high_judges_every_case_and_fails_the_accounting(ck, frontend):
    """D26, §4.10 (must-show): with nothing before the prompt (the probe says 0) and a prompt count
    one too high, the run judges as many cases as without the bug, each of them fails on its count
    (an accounting finding, chapter basis) and the run does not pass; without the bug it does."""
    ids = [c.id for c in CASES.values() if c.id in ck.programs] + \
        ["http/usage/001", "http/finish/length/001", "http/stop/cross-token/001"]
    right = judged(ck, frontend(), ids, sweep=False)
    wrong = judged(ck, frontend("prompt_count"), ids, sweep=False)
    ran = {i for i, r in right.items() if r.verdict in (Verdict.PASS, Verdict.FAIL)}
    assert len(ran) >= 35 and {i for i, r in wrong.items() if r.verdict in (Verdict.PASS, Verdict.FAIL)} == ran
    assert all(right[i].verdict is Verdict.PASS for i in ran)
    # a run the reference fails (D12) is answered with an error, no usage: its count is not shown
    counted = {i for i in ran if (right[i].observed.get("reference") or {}).get("finish_reason", "recipe")}
    assert len(counted) >= len(ran) - 3
    assert {i: wrong[i].verdict for i in counted if wrong[i].verdict is not Verdict.FAIL} == {}
    for i in counted:
        lead = wrong[i].failures[0]
        assert (lead.symptom, severity_of(lead)) == ("prompt_count", Severity.ACCOUNTING), (i, wrong[i].failures)
        assert "the 0 token(s) the engine put before them" in lead.message
    failing = {r.case.id for r in unexpected(list(wrong.values()))}  # the MUST ones fail the run
    assert not unexpected(list(right.values())) and failing and failing <= counted


SMALL_LOAD = {"in_flight": 4, "long": 1, "timeout_s": 120}


@pytest.mark.parametrize("bug,lead", [("eos_text", "eos_sent"), ("repeat_delta", "bytes_repeated")])
def test_a_text_bug_on_the_long_program_is_a_failure_of_the_frontend_not_a_departure(ck, frontend, bug, lead):
    """D27: the long program's tokens (its answer's logprobs) follow its script, so a frontend that
    writes the EOS text after it, or sends a delta twice, FAILs the request-life case with that
    finding; it is not an ERROR saying the model left its script. Without the bug it passes."""
    case = CASES["http/stream/terminal-under-load/001"]
    case = attrs.evolve(case, inputs={**case.inputs, **SMALL_LOAD})
    res = run_case(OpenAIAdapter(frontend(bug), checkpoint=ck), case)
    assert res.verdict is Verdict.FAIL, (res.verdict, res.reason)
    assert res.failures[0].symptom == lead and "long program" in res.failures[0].message, res.failures
    assert run_case(OpenAIAdapter(frontend(), checkpoint=ck), case).verdict is Verdict.PASS


# ---- the judge's pieces, without an engine ------------------------------------------------------


def _expected(case_id, **inputs):
    case = CASES[case_id]
    if inputs:
        case = attrs.evolve(case, inputs={**case.inputs, **inputs})
    tok = case_tokenizer(case)
    prompt, script = case_prompt(case, tok), case_script(case, tok)
    return case, expected_of(case, tok, prompt, script, reference_on(case, tok, prompt, script))


@pytest.mark.parametrize("extra,lead", [(b"B", "stop_prefix_left"), (b"BC", "stop_prefix_left"),
                                        (b"BCDE", "text_after_stop"), (b"x", "bytes_added")])
def test_text_past_the_reference_is_named_by_where_it_lies(extra, lead):
    """§4.6: past 'A' (the stop 'BCD' cuts there) a stream's 'B' or 'BC' is the start of the stop that
    completes next (a hold-back failure), 'BCDE' goes on after the stop's end, other bytes were
    added; never 'text after the stop' with a count of 0 or less."""
    _, exp = _expected("stop/cross-token/001")
    assert exp.output == b"A" and exp.stop == b"BCD"
    found = compare_text(exp, exp.output + extra, "stream", cut_right=True)
    assert found[-1].symptom == lead and not any(NEGATIVE.search(f.message) for f in found), found
    if lead == "text_after_stop":
        assert "goes on 1 byte(s) past the end of the stop" in found[-1].message


def test_a_stream_that_repeats_a_delta_or_sends_one_after_its_finish_says_so():
    """§4.5, §4.7: a delta sent twice in a row is named as such (not as bytes 'added' past the
    stop), and a stream whose last delta came after its finish chunk leads with that, its text then
    the reference's; a delta repeated anywhere else, or late bytes that do not complete the text,
    leave the text's own findings."""
    _, exp = _expected("finish/length/001")
    assert exp.output == b"EFG"
    found, text = stream_text(exp, [b"E", b"F", b"F", b"G"])
    assert [f.symptom for f in found] == ["bytes_repeated"] and text == b"EFG" and "delta 2" in found[0].message
    found, text = stream_text(exp, [b"E", b"F"], [b"G"])
    assert [f.symptom for f in found] == ["content_after_finish"] and text == b"EFG"
    assert stream_text(exp, [b"E", b"G", b"F", b"G"])[1] == b"EGFG"
    obs = Observed(text=b"EFG", finish_reason="length", completion_tokens=3, chunks=(b"E", b"F"),
                   stream_finish_reasons=("length",), content_after_finish=(b"G",))
    assert [f.symptom for f in judge_observed(exp, obs)[0]] == ["content_after_finish"]


def test_a_field_ignored_where_the_guard_masks_the_eos_is_named_by_the_field():
    """D66: min_tokens masks the scripted EOS and logit_bias chooses the token in its place ('J').
    An engine that ignores the bias writes its own runner-up there, any token, and goes on as the
    reference does: logit_bias had no effect (its basis), never 'bytes replaced'. Other bytes where
    the script itself decides (logit-bias/001's 'F') stay bytes replaced."""
    case, exp = _expected("finish/min-tokens/001")
    assert exp.output == b"EJFG"
    for got in (b"EXFG", b"E\x00FG", b"E%%FG"):
        [f] = compare_text(exp, got, "stream")
        assert f.symptom == "fields_ignored" and f.fields == ("logit_bias",), f
        assert (basis_of(f, case).kind, basis_of(f, case).ref) == (FIELD_BASIS, "logit_bias")
    assert [f.symptom for f in compare_text(exp, b"EXFH", "stream")] == ["bytes_replaced"]
    _, bias = _expected("finish/logit-bias/001")
    assert [f.symptom for f in compare_text(bias, b"EXGH", "stream")] == ["bytes_replaced"]


def test_a_guarded_eos_is_judged_banned_from_the_token_ids_first():
    """D27, D66, D70: under ignore_eos the reference selects the scripted EOS as token 2 and goes on.
    Token ids that have the EOS there passed it over, whatever text a frontend made of them (its
    text is the case's to judge); ids with another token there banned it (the ERROR); text alone
    still decides where no ids are shown."""
    case, exp = _expected("finish/ignore-eos/001")
    tok = case_tokenizer(case)
    script = case_script(case, tok)
    ref = reference_on(case, tok, case_prompt(case, tok), script).tokens
    assert exp.guard_passed and ref[exp.eos_at - 1] == tok.eos_id
    assert banned_eos_id(exp, script, ref, list(ref), tok) is None
    other = next(t for t in script if t != tok.eos_id)
    wrote = [*ref[:exp.eos_at - 1], other, *ref[exp.eos_at:]]
    assert "did not pass over the guarded EOS at token 2" in banned_eos_id(exp, script, ref, wrote, tok)
    assert banned_eos(exp, script, ref, exp.output[:1] + tok.token_bytes(other) + exp.output[1:]) is not None


@pytest.mark.parametrize("sent,ids,prefix,as_text,want", [
    (5, 4, Prefix(0, False, "0"), False, "miscounted"),
    (4, 4, Prefix(0, False, "0"), False, None),
    (5, 4, Prefix(1, False, "1"), False, None),
    (None, 4, Prefix(0, False, "0"), False, None),
    (5, 4, Prefix(0, False, "0"), True, "changed"),
    (5, 4, Prefix(None, False, "?"), False, "changed"),
    (None, 4, Prefix(None, False, "?"), False, "changed"),
    (4, 4, Prefix(None, False, "?"), False, None),
    (4 + PROBE_MAX + 3, 4, Prefix(PROBE_MAX, True, "8+"), False, None),
    (4 + PROBE_MAX - 1, 4, Prefix(PROBE_MAX, True, "8+"), False, "miscounted"),
])
def test_a_prompt_count_is_judged_against_the_prompt_the_probe_shows(sent, ids, prefix, as_text, want):
    """D26: ids sent, and the probe telling the prefix: the prompt run is known, and a count that
    differs is the engine's miscount (the case judged). Sent as text (the engine tokenized it
    itself) or with the prefix unknown, a count other than the prompt says another prompt ran: n/a."""
    placed = prompt_placed(sent, ids, prefix, as_text=as_text)
    assert (placed.changed is not None, placed.miscounted is not None) == (want == "changed", want == "miscounted")


# ---- no negative counts ------------------------------------------------------------------------

_STOP_CASES = ["stop/cross-token/001", "stop/overlap/002", "stop/include-stop/001", "finish/length/001",
               "usage/eos/001", "finish/min-tokens/001", "stop/multi-byte/001"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(case_id=st.sampled_from(_STOP_CASES), cut=st.integers(0, 12), tail=st.binary(max_size=6),
       repeat=st.booleans(), count=st.integers(0, 12))
def test_no_message_of_the_judge_prints_a_negative_count(case_id, cut, tail, repeat, count):
    """Whatever an engine sends (a prefix of the reference's text or of its script's, then any bytes,
    a piece of it twice, any token count), every count the judge works out and prints is 0 or more."""
    _, exp = _expected(case_id)
    base = exp.script_text[:cut] if cut <= len(exp.script_text) else exp.output + exp.script_text[:cut % 4]
    got = base + (base[-2:] if repeat else b"") + tail
    found = compare_text(exp, got, "stream") + compare_text(exp, got, "stream", cut_right=True) + \
        compare_count(exp, count)
    obs = Observed(text=got, finish_reason="stop", completion_tokens=count, chunks=(got[:1], got[1:], got[1:]),
                   stream_finish_reasons=("stop",), content_after_finish=(tail,) if tail else ())
    found += judge_observed(exp, obs)[0]
    assert not [f.message for f in found if NEGATIVE.search(f.message)]


def test_no_committed_report_prints_a_negative_count(repo_root):
    """Every finding of every committed report (reports/*/report.json) counts 0 or more."""
    bad = []
    for path in sorted((repo_root / "reports").glob("*/report.json")):
        for case in json.loads(path.read_text())["cases"]:
            bad += [f"{path.parent.name} {case['id']}: {m[:120]}" for f in case.get("failures") or []
                    for m in [f["message"]] if NEGATIVE.search(m)]
    assert bad == []


def test_the_negative_count_check_can_fail():
    """The pattern the two tests above rely on sees the old message, and not a byte value or a limit."""
    assert NEGATIVE.search("the stream goes on -2 byte(s) past the end of the stop 'BCD'")
    assert not NEGATIVE.search("at max_tokens=2: e4-b8 bytes; 0 byte(s); tokens-aligned-001 byte")

