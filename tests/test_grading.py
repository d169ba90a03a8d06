"""Verdicts by severity and basis: what fails a case, what only differs, what never fails (runner.grade).

A case FAILs only on a text, ending or accounting finding that rests on a rule of chapter 4; one
whose such findings all rest on a project decision or an ignored request field DIFFERS (the default
profile) or passes (`--profile chapter`); stream-shape and wire findings never fail a case, and
`--strict` fails the run on them. A decision the engine declares its own makes the cases resting
on it n/a. Every recorded stream is held to §4.7's one terminal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decodespec.properties.conformance.adapters.base import Outcome
from decodespec.properties.conformance.cases import load_cases
from decodespec.properties.conformance.matrix import to_markdown as matrix_markdown
from decodespec.properties.conformance.reports import Grading, causes, headline, to_json, to_markdown
from decodespec.properties.conformance.runner import Verdict, grade, judge, unexpected
from decodespec.properties.conformance.symptoms import finding
from decodespec.properties.conformance.wire import unterminated

CASES = {c.id: c for c in load_cases()}


def judged(case_id: str, *symptoms: str, exchanges: tuple = ()):  # type: ignore[no-untyped-def]
    found = tuple(finding(s, f"{s} seen") for s in symptoms)
    return judge(CASES[case_id], Outcome(findings=found, judged=True, exchanges=exchanges), "e", frozenset())


def test_stream_shape_alone_never_fails_a_must_case_and_strict_counts_it() -> None:
    """§4.3 delta_nonempty: an empty chunk is stream shape, reported with the pass."""
    r = judged("stop/cross-token/001", "empty_delta", "done_missing")
    assert r.case.grade.value == "MUST" and r.verdict is Verdict.PASS
    assert [f.symptom for f in r.shape] == ["empty_delta"] and [f.symptom for f in r.wire] == ["done_missing"]
    assert unexpected([r]) == [] and unexpected([r], strict=True) == [r]


def test_a_text_finding_leads_an_empty_chunk_and_fails_the_case() -> None:
    """The lost bytes lead, whatever order the judge found them in (§4.5 before §4.3's shape)."""
    r = judged("detok/replacement-char/001", "empty_delta", "bytes_lost")
    assert r.verdict is Verdict.FAIL and r.lead is not None and r.lead.symptom == "bytes_lost"
    assert unexpected([r]) == [r]


def test_findings_resting_only_on_decisions_differ_and_the_chapter_profile_passes_them() -> None:
    """D31: vLLM's stop after min_tokens is its documented choice, not a §4.6 failure."""
    r = judged("stop/min-tokens/001", "stop_sent", "text_after_stop", "token_after_stop", "empty_delta")
    assert r.verdict is Verdict.DIFFERS and not r.failed
    assert unexpected([r]) == [r]  # a MUST case under the default profile judges the decisions too
    chapter = grade(r, "chapter")
    assert chapter.verdict is Verdict.PASS and unexpected([chapter]) == []
    mixed = judged("stop/min-tokens/001", "stop_sent", "bytes_replaced")  # D31 does not cover replaced bytes
    assert mixed.verdict is Verdict.FAIL and grade(mixed, "chapter").verdict is Verdict.FAIL


def test_an_ignored_field_differs_and_is_named_by_the_field() -> None:
    r = judged("finish/min-tokens/001", "guard_ignored", "empty_delta")
    assert r.verdict is Verdict.DIFFERS and r.basis(r.lead).kind == "field_ignored" and r.basis(r.lead).ref == "min_tokens"


def test_a_declared_decision_makes_its_cases_na_and_its_findings_elsewhere_weigh_nothing() -> None:
    r = judged("stop/min-tokens/001", "stop_sent")
    na = grade(r, "project", frozenset({"D31"}))
    assert na.verdict is Verdict.SKIP and "D31 (min_tokens and ignore_eos)" in na.reason and "--declare D31" in na.reason
    late = judged("detok/after-stop/001", "precedence")  # D4's finding in a case that does not rest on D4
    assert late.verdict is Verdict.DIFFERS and grade(late, "project", frozenset({"D4"})).verdict is Verdict.PASS
    with pytest.raises(ValueError, match="D999"):
        grade(r, "project", frozenset({"D999"}))


_DONE_NO_FINISH = 'data: {"choices": [{"text": "O", "index": 0, "finish_reason": null}]}\n\ndata: [DONE]\n'
_FINISHED = ('data: {"choices": [{"text": "O", "index": 0, "finish_reason": null}]}\n\n'
             'data: {"choices": [{"text": "", "index": 0, "finish_reason": "length"}]}\n\ndata: [DONE]\n')


def _ex(sse: str, **more: object) -> dict[str, object]:
    return {"request": {"path": "/v1/completions", "body": {"stream": True}}, "status": 200, "sse": sse, **more}


def test_a_recorded_stream_without_its_terminal_fails_whatever_the_case_checks() -> None:
    """§4.7, single_terminal_event: 'O' then [DONE] with no finish chunk (llama-cpp-python after a
    disconnect) fails the case that recorded it, not only a request-life run; a stream the client cut
    itself, or one with its finish chunk, is no finding."""
    bare = _ex(_DONE_NO_FINISH, label="a new stream after the disconnects")
    assert [f.symptom for f in unterminated([bare])] == ["no_reason"]
    assert [f.symptom for f in unterminated([_ex(_DONE_NO_FINISH.replace("data: [DONE]\n", ""))])] == ["stream_cut"]
    assert unterminated([_ex(_FINISHED), _ex(_DONE_NO_FINISH, timing_s={"first": 0.1, "cut": 0.2})]) == []
    r = judged("http/lifecycle/disconnect/001", exchanges=(bare,))
    assert r.verdict is Verdict.FAIL and r.lead is not None and r.lead.symptom == "no_reason"
    assert "a new stream after the disconnects" in r.lead.message


def test_reports_count_findings_by_severity_and_give_each_its_basis() -> None:
    results = [judged("detok/replacement-char/001", "empty_delta", "bytes_lost"),
               judged("stop/min-tokens/001", "stop_sent", "token_after_stop"),
               judged("stop/n-choices/001", "count_low"),
               judged("stop/cross-token/001", "empty_delta", "done_missing")]
    said = headline(results, "e")
    assert said.startswith("e: 4 of 4 cases ran; 2 text, 1 ending, 1 accounting, 2 stream-shape, 1 wire findings "
                           "(3 on a project decision or an ignored field); 1 pass (25%, 1 with only stream-shape or "
                           "wire findings), 1 fail the chapter (1 MUST, 0 SHOULD), 2 differ"), said
    assert [c["severity"] for c in causes(results)] == ["text", "text", "ending", "accounting", "stream_shape", "wire"]
    data = to_json(results, "e")
    lead = data["cases"][1]["failures"][0]
    assert lead["basis"]["kind"] == "decision" and lead["basis"]["text"].startswith("D31 (min_tokens and ignore_eos): ")
    assert "instead: vLLM searches stop strings only after min_tokens" in lead["basis"]["text"]
    assert data["cases"][0]["failures"][0]["basis"]["text"].startswith("chapter §4.5 detok_concat_equals_batch: ")
    md = to_markdown(results, "e")
    assert md.index("| text | 2 |") < md.index("## Causes") < md.index("## Failures of the chapter (1)") \
        < md.index("## Differs on a project decision or an ignored field (2)") < md.index("## Passed (1)")
    assert "- **accounting** · token count too low · `usage_consistent` · basis: D34: " in md


def test_the_chapter_profile_says_so_in_the_headline() -> None:
    results = [grade(judged("stop/min-tokens/001", "stop_sent"), "chapter")]
    said = headline(results, "e", Grading("chapter"))
    assert "(profile chapter: decisions and ignored fields not judged)" in said and "1 pass (100%" in said


def test_a_matrix_cell_names_the_most_severe_finding_and_its_basis(tmp_path: Path) -> None:
    results = [judged("stop/min-tokens/001", "empty_delta", "stop_sent"), judged("stop/cross-token/001", "empty_delta")]
    rep = json.loads(json.dumps(to_json(results, "e")))
    md = matrix_markdown({"e": rep})
    assert "| `stop/min-tokens/001` | MUST | **DIFFERS** [text] stop bytes sent (D31) |" in md
    assert "| `stop/cross-token/001` | MUST | PASS (stream-shape) |" in md
    assert "| e | 2 of 2 ran; 1 text, 2 stream-shape; 1 pass, 0 fail, 1 differ, 0 error |" in md


def test_causes_put_what_leads_cases_before_what_follows_from_it() -> None:
    """Within a severity, the cause that leads cases comes before one that only follows (the
    stream differing from the answer is what a held text never sent also shows)."""
    results = [judged("stop/cross-token/001", "held_not_released", "stream_vs_batch"),
               judged("stop/cross-token/002", "bytes_lost", "stream_vs_batch")]
    assert [c["symptom"] for c in causes(results)] == ["bytes_lost", "held_not_released", "stream_vs_batch"]


def test_a_request_life_recipe_holds_every_stream_the_server_ended_to_one_terminal() -> None:
    """§4.7: the disconnect recipe's new streams, and an abandoned stream the server ended itself
    before the client's cut, each end with a finish chunk; one the client cut needs none."""
    from decodespec.properties.conformance.life.exchange import Exchange, Job
    from decodespec.properties.conformance.life.recipes import ended_alone
    from decodespec.properties.conformance.wire import parse_sse

    job = Job("recipe", "/v1/completions", {"stream": True}, True)
    bare = Exchange(job, status=200, streamed=parse_sse(_DONE_NO_FINISH))
    whole = Exchange(job, status=200, streamed=parse_sse(_FINISHED))
    cut = Exchange(job, status=200, streamed=parse_sse(_DONE_NO_FINISH), cut=1.0)
    found = ended_alone([whole, bare, cut], "new stream", first=2)
    assert [(f.symptom, f.message.split(":")[0]) for f in found] == [("no_reason", "new stream 3")]


def test_the_command_line_grades_its_results_as_one_run_with_a_field_ignored_engine_wide() -> None:
    """D71: `decodespec conform` grades what it ran as one run (cli_conform._run_declared): a usage
    chunk asked for and missing in every case is one cause, not a DIFFERS per case; a case that also
    lost bytes still fails."""
    from decodespec import cli_conform
    from decodespec.properties.conformance.judgement import no_usage_chunk

    ids = ["stop/cross-token/001", "stop/cross-token/002", "finish/length/001", "detok/replacement-char/001"]
    outcomes = {i: (no_usage_chunk(), *((finding("bytes_lost", "lost"),) if i.startswith("detok") else ()))
                for i in ids}

    def run(todo, tick):  # type: ignore[no-untyped-def]
        return [judge(c, Outcome(findings=outcomes[c.id], judged=True), "e", frozenset()) for c in todo]

    policy = cli_conform.Policy(frozenset(), strict=False, partial_ok=False, grading=Grading())
    got = {r.case.id: r.verdict for r in cli_conform._run_declared([CASES[i] for i in ids], policy, "e", run)}
    assert got == {**{i: Verdict.PASS for i in ids[:3]}, "detok/replacement-char/001": Verdict.FAIL}, got
    alone = judge(CASES[ids[0]], Outcome(findings=outcomes[ids[0]], judged=True), "e", frozenset())
    assert alone.verdict is Verdict.DIFFERS


def test_a_field_is_engine_wide_on_enough_base_cases_a_case_under_two_chat_templates_counting_once() -> None:
    """D71: MIN_CASES counts base cases. chat/<id> and chat-bos/<id> send one request under two
    templates: two base cases shown under both (four cases) are not enough; three base cases are."""
    from decodespec.properties.conformance.checkpoints import with_chat
    from decodespec.properties.conformance.engine_wide import MIN_CASES, ignored_engine_wide
    from decodespec.properties.conformance.judgement import no_usage_chunk

    chat = {c.id: c for c in with_chat(load_cases())}
    bases = ["finish/length/001", "usage/eos/001", "detok/replacement-char/001"]

    def run(ids: list[str]) -> list:  # type: ignore[type-arg]
        return [judge(chat[i], Outcome(findings=(no_usage_chunk(),), judged=True), "e", frozenset()) for i in ids]

    twins = run([f"{template}/{b}" for b in bases[:2] for template in ("chat", "chat-bos")])
    assert len(bases[:2]) < MIN_CASES <= len(twins) and ignored_engine_wide(twins) == ()
    [wide] = ignored_engine_wide(run([f"chat/{b}" for b in bases]))
    assert (wide.field, len(wide.cases)) == ("stream_options.include_usage", 3), wide
