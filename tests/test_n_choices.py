"""n > 1 choices (D34, §4.6): an engine that takes `n` and answers one choice ignored a field; one
that answers every choice and loses the bytes of one lost text the chapter forbids.

Each exchange is built by hand in the OpenAI shape (non-streamed answer and stream) for
stop/n-choices/001 (greedy, stop 'CD': every choice is 'AB', finish 'stop', 2 tokens) and judged
as an HTTP engine's answer is (http_script.judge_exchange), then graded (runner.grade).
"""

from __future__ import annotations

from typing import Any

from decodespec.properties.conformance.adapters.base import (
    Outcome,
    case_prompt,
    case_script,
    case_tokenizer,
    reference_on,
)
from decodespec.properties.conformance.cases import load_cases
from decodespec.properties.conformance.http_script import judge_exchange
from decodespec.properties.conformance.judgement import expected_of
from decodespec.properties.conformance.runner import CaseResult, Verdict, judge
from decodespec.properties.conformance.symptoms import Basis, Severity, severity_of
from decodespec.properties.conformance.wire import Streamed

CASE = next(c for c in load_cases() if c.id == "stop/n-choices/001")


def _expected() -> Any:
    tok = case_tokenizer(CASE)
    prompt, script = case_prompt(CASE, tok), case_script(CASE, tok)
    return expected_of(CASE, tok, prompt, script, reference_on(CASE, tok, prompt, script))


def _exchange(texts: dict[int, str], tokens: int) -> tuple[int, dict[str, Any], str, Streamed]:
    """A 200 answer and its stream with one choice per entry of `texts` (index -> text), each
    finishing 'stop', and usage.completion_tokens `tokens`."""
    usage = {"prompt_tokens": 2, "completion_tokens": tokens, "total_tokens": 2 + tokens}
    data = {"choices": [{"index": i, "text": t, "finish_reason": "stop"} for i, t in texts.items()], "usage": usage}
    chunks: list[dict[str, Any]] = [{"choices": [{"index": i, "text": t, "finish_reason": None}]}
                                    for i, t in texts.items() if t]
    chunks += [{"choices": [{"index": i, "text": "", "finish_reason": "stop"}]} for i in texts]
    chunks.append({"choices": [], "usage": usage})
    return 200, data, "", Streamed(status=200, chunks=chunks, done=True)


def _judged(texts: dict[int, str], tokens: int) -> CaseResult:
    found, not_checked = judge_exchange(CASE, _expected(), *_exchange(texts, tokens))
    return judge(CASE, Outcome(findings=tuple(found), not_checked=tuple(not_checked), judged=True), "e", frozenset())


def test_both_choices_answered_alike_pass() -> None:
    assert _judged({0: "AB", 1: "AB"}, 4).verdict is Verdict.PASS


def test_an_engine_answering_one_choice_ignored_n_it_lost_no_bytes() -> None:
    """D34: the second choice never came; that is `n` taken and ignored (field_ignored: n, DIFFERS),
    never choice 1's 'AB' lost nor its finish reason missing; usage counts the one choice answered."""
    r = _judged({0: "AB"}, 2)
    assert [f.symptom for f in r.failures] == ["choices_missing"], r.failures
    lead = r.failures[0]
    assert r.basis(lead) == Basis("field_ignored", "n") and severity_of(lead) is Severity.TEXT
    assert "field_ignored: n" in lead.message and "[1] never came" in lead.message
    assert r.verdict is Verdict.DIFFERS


def test_an_engine_answering_every_choice_but_losing_one_choices_bytes_fails() -> None:
    """§4.6, detok_concat_equals_batch: choice 1 came with no text; its 'AB' was lost, on the chapter."""
    r = _judged({0: "AB", 1: ""}, 4)
    assert r.verdict is Verdict.FAIL
    assert r.lead is not None and r.lead.symptom == "bytes_lost" and r.lead.message.startswith("choice 1:")
    assert r.basis(r.lead).chapter and "choices_missing" not in {f.symptom for f in r.failures}


def test_a_chapter_finding_of_the_answered_choice_leads_the_ignored_n() -> None:
    """§4.6: the one choice answered sends the stop 'CD'; that leads, the ignored n follows it."""
    r = _judged({0: "ABCD"}, 2)
    assert r.verdict is Verdict.FAIL and [f.symptom for f in r.failures][:1] == ["stop_sent"], r.failures
    assert "choices_missing" in {f.symptom for f in r.failures}
