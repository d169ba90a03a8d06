"""Real engines' answers judged again from the exchanges the committed reports recorded (§4.3-§4.10).

fixtures/recorded_exchanges.json holds, verbatim, what vLLM 0.32, llama-server and llama-cpp-python
answered in the cases named below (reports/<engine>/report.json). Each is judged again offline
(replay.rejudge: the live judge, on the case's own tokenizer) and must say first what an engine
author has to fix: the text it lost, the count it got wrong, the field it ignored; never what the
wire cannot show (hold-back without token boundaries, D59), and never a context the engine did not
run with (§4.3, D10).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from _engine_kit import answering

from decodespec.properties.conformance import load_cases
from decodespec.properties.conformance.adapters.base import Outcome
from decodespec.properties.conformance.adapters.recorded import Recording, Unrecorded
from decodespec.properties.conformance.alignment import ask
from decodespec.properties.conformance.http_script import departed, prompt_cached
from decodespec.properties.conformance.replay import main, rejudge
from decodespec.properties.conformance.runner import Verdict, judge
from decodespec.properties.conformance.symptoms import Expected, Severity, severity_of

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "recorded_exchanges.json").read_text(encoding="utf-8"))["cases"]
RECORDED = {(e["engine"], e["case"]): e["exchanges"] for e in FIXTURE}
CASES = {c.id: c for c in load_cases()}


def _rejudge(engine: str, case_id: str):
    return rejudge(CASES[case_id], RECORDED[engine, case_id], engine)


def _symptoms(res) -> list[str]:
    return [f.symptom for f in res.failures]


# (engine, case, the lead's symptom, words of its message): what the engine lost or got wrong
LEADS = [
    # a genuine U+FFFD in the output is text; vLLM drops it at max_tokens 2 (its empty chunk is stream shape)
    ("vllm", "detok/replacement-char/001", "bytes_lost", "at max_tokens=2: the non-streamed text ends after 1 of 4 bytes: '\ufffd'"),
    # the whole '中' and '中文' the reference sends before the split tail, lost
    ("vllm", "detok/utf8-split/002", "bytes_lost", "the reference sends '中'"),
    # llama-server drops the text it held for a stop that never completes when the limit ends the run
    ("llama-server", "stop/cross-token/003", "held_not_released", "'ck', the start of the stop 'ck brown', was never sent"),
    ("llama-server", "stop/cross-token/004", "held_not_released", "'b', the start of the stop 'bcd', was never sent"),
    ("llama-server", "stop/overlap/001", "held_not_released", "'b', the start of the stop 'bc', was never sent"),
    ("llama-server", "stop/overlap/002", "held_not_released", "'b', the start of the stop 'bcd', was never sent"),
    # n = 2: usage counts one choice's tokens for both
    ("llama-server", "stop/n-choices/001", "count_low", "one choice's count, for 2 choices of 2 tokens each (4 in all"),
    # llama-server has no echo: the output alone, its first byte decoded without the prompt's
    ("llama-server", "detok/echo/001", "fields_ignored", "field_ignored: echo"),
    # llama-cpp-python leaves the invalid byte out and goes on; at max_tokens 2 and 3 it runs four tokens to EOS
    ("llama-cpp-python", "detok/invalid/003", "past_limit", "at max_tokens=2: usage.completion_tokens is 4 with max_tokens 2"),
    ("llama-cpp-python", "detok/invalid/001", "past_limit", "at max_tokens=3: usage.completion_tokens is 4 with max_tokens 3"),
]
@pytest.mark.parametrize(("engine", "case_id", "symptom", "words"),
                         [pytest.param(*lead, id=f"{lead[0]}:{lead[1]}") for lead in LEADS])
def test_a_recorded_failure_leads_with_what_the_engine_lost_or_got_wrong(engine, case_id, symptom, words):
    """§4.3-§4.10, D65: the case leads with the finding an engine author acts on, not an empty chunk."""
    res = _rejudge(engine, case_id)
    assert res.verdict is not Verdict.PASS and res.lead is not None, res
    assert (res.lead.symptom, words in res.lead.message) == (symptom, True), [(f.symptom, f.message) for f in res.failures]


@pytest.mark.parametrize("case_id", ["detok/invalid/001", "detok/invalid/003"])
def test_an_invalid_byte_left_out_is_never_called_sent_as_replacement(case_id):
    """§4.5, D12: llama-cpp-python leaves the byte ff out of its text and goes on ('ok fine', 'EaF');
    the finding says so, at every limit, and nothing says it was sent as U+FFFD."""
    found = _symptoms(_rejudge("llama-cpp-python", case_id))
    assert "invalid_dropped" in found and "invalid_sent" not in found, found


@pytest.mark.parametrize("case_id", ["stop/hold-back/001", "stop/cross-token/003", "stop/cross-token/004",
                                     "stop/overlap/002", "stop/overlap/003"])
def test_a_hold_back_the_stream_cannot_show_is_not_a_finding(case_id):
    """§4.6, D59: llama-cpp-python holds whole tokens while a stop may still match and releases each
    later in a chunk of its own, with no token reports in the stream: which tokens were selected when
    a chunk went out is not on the wire, so hold-back is not checked (and the result says so), never
    a stop prefix sent early. hold-back/001 and cross-token/003 had no other finding: they pass."""
    res = _llama_cpp_python_run()[case_id]
    assert "stop_prefix_sent" not in _symptoms(res), res.failures
    assert any(m.startswith("hold-back (the engine reports no token boundaries") for m in res.not_checked), res.not_checked
    if case_id in ("stop/hold-back/001", "stop/cross-token/003"):  # only the usage chunk it never sends (D71)
        assert res.verdict is Verdict.PASS and _symptoms(res) == ["usage_chunk"], res.failures


def _llama_cpp_python_run():
    """llama-cpp-python's recorded completions cases judged again and graded as one run (D71: the
    usage chunk it never sends is one cause of the run)."""
    from decodespec.properties.conformance.runner import grade_run

    ids = [e["case"] for e in FIXTURE if e["engine"] == "llama-cpp-python" and not e["case"].startswith("http/")]
    return {r.case.id: r for r in grade_run([_rejudge("llama-cpp-python", i) for i in ids])}


def test_replayed_cases_that_ask_for_the_usage_chunk_show_it_missing_once_for_the_run():
    """§4.10, D71: the replay judges the usage chunk the recorded stream asked for, as the live run
    does: alone, each llama-cpp-python case DIFFERS on it; graded as the recorded run, it is one
    engine-wide cause and the cases that lost text still fail on the text."""
    from decodespec.properties.conformance.engine_wide import ignored_engine_wide

    alone = _rejudge("llama-cpp-python", "stop/hold-back/001")
    assert alone.verdict is Verdict.DIFFERS and _symptoms(alone) == ["usage_chunk"], alone.failures
    run = _llama_cpp_python_run()
    assert [w.field for w in ignored_engine_wide(run.values())] == ["stream_options.include_usage"]
    assert run["detok/invalid/003"].verdict is Verdict.FAIL and run["detok/invalid/003"].lead.symptom == "past_limit"
    assert Verdict.DIFFERS not in {r.verdict for r in run.values()}, {i: r.verdict for i, r in run.items()}


def _asked_stream(chunks):
    """stop/hold-back/001's stream (max_tokens 2) asking for per-token reports (alignment.ask), as a
    completions server without token ids sends it: `chunks` (text, the logprob tokens it reports),
    then the finish chunk."""
    body = ask(RECORDED["llama-cpp-python", "stop/hold-back/001"][1]["request"]["body"], chat=False)
    lines = [{"id": "c", "object": "text_completion", "choices": [{
        "index": 0, "text": text, "finish_reason": None,
        "logprobs": {"tokens": tokens, "token_logprobs": [0.0] * len(tokens)}}]} for text, tokens in chunks]
    lines.append({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    sse = "".join(f"data: {json.dumps(x)}\n\n" for x in lines) + "data: [DONE]\n\n"
    return {"request": {"path": "/v1/completions", "body": body}, "status": 200, "sse": sse}


@pytest.mark.parametrize(("chunks", "lead"), [
    ([("AB", ["AB"]), ("CD", ["CD"])], None),  # llama-cpp-python's way: a held token goes out later with its text
    ([("AB", ["AB"]), ("", ["CD"]), ("CD", [])], "stop_prefix_sent"),  # reported as selected (vLLM's way)
])
def test_a_recorded_stream_asking_for_reports_is_judged_again_as_live(chunks, lead):
    """§4.6, D59: the stream a case sends again asking for per-token reports is in the recording and
    replayed as live. llama-cpp-python's reports (each token with its text, released once 'CD' ruled
    'BX' out) leave hold-back not checked, never a finding. Reports sent as tokens are selected show
    'AB' went out with one token selected: a stop prefix sent early, stream shape, which does not
    change the verdict (the usage chunk the plain stream left out gives it either way, D71)."""
    recorded = RECORDED["llama-cpp-python", "stop/hold-back/001"]
    res = rejudge(CASES["stop/hold-back/001"], [*recorded[:2], _asked_stream(chunks), *recorded[2:]], "replay")
    held = [f for f in res.failures if f.symptom != "usage_chunk"]
    assert res.verdict is Verdict.DIFFERS and [f.symptom for f in held] == ([lead] if lead else []), res.failures
    if lead is None:
        assert any("hold-back" in m and "only with its text" in m for m in res.not_checked), res.not_checked
    else:
        assert severity_of(held[0]) is Severity.STREAM_SHAPE and "asking for per-token reports" in held[0].message


def test_a_recorded_stream_without_its_terminal_fails_the_case_that_saw_it():
    """§4.7: llama-cpp-python's new stream after the disconnects ('O', then [DONE], no finish chunk)
    ends without its terminal; the request-life case that recorded it fails on it, in the main report
    as in the -life one, whatever its own question was."""
    case = CASES["http/lifecycle/disconnect/001"]
    exchanges = RECORDED["llama-cpp-python", case.id]
    res = judge(case, Outcome(judged=True, exchanges=tuple(exchanges)), "llama-cpp-python", frozenset())
    assert res.failed and res.lead.invariant == "single_terminal_event", res


def test_the_replay_judges_the_limits_the_recording_kept_and_says_which_it_did_not():
    """The recording keeps the served limit and the limits that failed: those are judged; the
    others are listed as not checked, so a replayed pass is partial."""
    exchanges = RECORDED["llama-server", "stop/cross-token/003"]
    assert Recording(CASES["stop/cross-token/003"], exchanges).sweep == {18, 3, 4}
    res = _rejudge("llama-server", "stop/cross-token/003")
    left = [m for m in res.not_checked if m.startswith("max_tokens [")]
    assert left and "1, 2, 5," in left[0], res.not_checked


def test_an_answer_that_left_the_script_is_an_error_naming_where_not_a_failure():
    """D27, D66: llama-server bans the EOS under ignore_eos and writes its runner-up '%' where the
    reference passes over the EOS as a token: the guard the case is about never ran, so the replay,
    as the live run, makes it an ERROR naming the token and what was written."""
    res = _rejudge("llama-server", "finish/ignore-eos/001")
    assert res.verdict is Verdict.ERROR and "guarded EOS at token 2: it wrote b'%'" in res.reason, res


def test_an_answer_off_its_script_at_a_sweep_limit_is_an_error_naming_the_limit_not_a_text_finding():
    """D27, §4.3: llama-server answered stop/overlap/001 at max_tokens 1 with 'E' (3 prompt tokens from
    its cache) where the script's first token is 'a': the engine ran another prompt or model there,
    so nothing of the case can be judged; the replay, as the live sweep, makes it an ERROR naming the
    limit and the token, never 'bytes replaced'. The earlier recording, on script at every limit,
    still leads with the held text never sent."""
    res = _rejudge("llama-server@2026-12-04", "stop/overlap/001")
    assert res.verdict is Verdict.ERROR and res.failures == (), res
    assert res.reason.startswith("at max_tokens=1: the engine did not follow the forced script at token 1")
    assert "it chose 'E'" in res.reason, res.reason
    assert res.reason.endswith("; the engine reports 3 of the prompt's tokens served from its prompt cache")
    assert _rejudge("llama-server", "stop/overlap/001").lead.symptom == "held_not_released"


@pytest.mark.parametrize(("answer", "cached"), [
    ({"timings": {"cache_n": 3, "prompt_n": 1}}, 3),                    # llama.cpp
    ({"usage": {"prompt_tokens_details": {"cached_tokens": 16}}}, 16),  # the OpenAI API, vLLM
    ({"timings": {"cache_n": 0}, "usage": {"prompt_tokens_details": None}}, 0),
    ({"timings": {"cache_n": True}}, 0),
    ("not an object", 0),
])
def test_an_answer_says_how_many_prompt_tokens_came_from_its_cache(answer, cached):
    """D27: what an answer reports of its prompt cache, read where llama.cpp and the OpenAI API put it;
    nothing reported (or not a count) is 0, and an off-script message then names no cache."""
    assert prompt_cached(answer) == cached
    assert departed("left", answer) == ("left" if not cached else
                                        f"left; the engine reports {cached} of the prompt's tokens served from its prompt cache")


def test_a_connection_the_recording_shows_sent_again_is_a_wire_finding():
    """A retried connection is never silent, replayed as live: llama-server dropped one stream of
    stop/cross-token/003 once, and the request was sent again."""
    res = _rejudge("llama-server", "stop/cross-token/003")
    [dropped] = [f for f in res.failures if f.symptom == "connection_dropped"]
    assert dropped.family == "wire" and "Server disconnected" in dropped.message, dropped


def test_the_replay_tool_prints_each_case_then_and_now(tmp_path, capsys):
    """`python -m decodespec.properties.conformance.replay REPORT --case ID`: the stored verdict and
    lead, and today's, for a case of a report; a case the report lacks is a usage error naming it."""
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"cases": [{
        "id": "stop/hold-back/001", "verdict": "FAIL",
        "failures": [{"symptom": "stop_prefix_sent", "message": "with token 1 the stream had sent 2 bytes"}],
        "reproducer": {"exchanges": RECORDED["llama-cpp-python", "stop/hold-back/001"]}}]}))
    assert main([str(report), "--case", "stop/hold-back/001"]) == 0
    out = capsys.readouterr().out
    assert "stop/hold-back/001: FAIL (stop_prefix_sent: with token 1" in out and "now DIFFERS (usage_chunk: " in out, out
    with pytest.raises(SystemExit):
        main([str(report), "--case", "stop/hold-back/009"])
    assert "no case stop/hold-back/009" in capsys.readouterr().err


# ---- run_script over a committed report's recording: the live judge, offline ------------------------

REPORTS = Path(__file__).parents[1] / "reports"


def _reported(engine: str, case_id: str) -> dict:
    [entry] = [e for e in json.loads((REPORTS / engine / "report.json").read_text(encoding="utf-8"))["cases"]
               if e["id"] == case_id]
    return entry


@pytest.mark.parametrize(("engine", "case_id"), [
    ("vllm", "detok/utf8-split/002"),  # the '中' lost before a split character, at the sweep's limits
    ("llama-server", "stop/cross-token/003"),  # held text never released; a connection sent again
    ("llama-server", "stop/hold-back/001"),  # D59: hold-back judged on the stream asking for per-token reports
    ("transformers-serve", "stop/cross-token/004"),  # D59: return_token_ids refused (422), logprobs alone
])
def test_run_script_over_a_recording_gives_the_verdict_and_findings_the_live_run_gave(engine, case_id):
    """§4.3-§4.10: a committed report's recording, answered to http_script.run_script in place of the
    engine (adapters/recorded.Recording), is judged in the live order: the same verdict and the same
    findings, lead first, as the report made live (the limits the recording left out not checked).
    Where the recording holds the stream asking for per-token reports, hold-back is judged on it."""
    entry = _reported(engine, case_id)
    res = rejudge(CASES[case_id], entry["reproducer"]["exchanges"], engine)
    assert res.verdict.value == entry["verdict"], (res.verdict, res.failures)
    assert [(f.symptom, f.message) for f in res.failures] == [(f["symptom"], f["message"]) for f in entry["failures"]]
    if engine == "llama-server":
        assert not any(m.startswith(("hold-back", "the stream at")) for m in res.not_checked), res.not_checked


def test_a_request_the_recording_does_not_hold_is_an_error_naming_it():
    """A recording answers only what it holds: run_script's stream at the served limit, cut from it
    or recorded without asking for its usage chunk, is an Unrecorded error naming that request (never
    an answer made up, never the engine's ERROR); a sweep limit cut from it is listed as not checked,
    as one the recording never kept."""
    exchanges = _reported("vllm", "detok/utf8-split/002")["reproducer"]["exchanges"]
    served = [e for e in exchanges if e["request"]["body"]["max_tokens"] != 6 or not e["request"]["body"]["stream"]]
    with pytest.raises(Unrecorded, match="no answer to POST /v1/completions max_tokens=6 streamed"):
        rejudge(CASES["detok/utf8-split/002"], served)
    # an answer to a stream that did not ask for its usage chunk cannot say whether one was honoured
    unasked = [{**e, "request": {**e["request"], "body": {k: v for k, v in e["request"]["body"].items()
                                                          if k != "stream_options"}}} for e in exchanges]
    with pytest.raises(Unrecorded, match="max_tokens=6 streamed asking for stream_options.include_usage "):
        rejudge(CASES["detok/utf8-split/002"], unasked)
    swept = [e for e in exchanges if e["request"]["body"]["max_tokens"] != 2]
    res = rejudge(CASES["detok/utf8-split/002"], swept)
    assert any(m.startswith("max_tokens [2, 4] ") for m in res.not_checked), res.not_checked


# ---- a disconnect judged from the engine's own metrics, not from timing alone (§4.9, D72) ----------

# llama-server's http/lifecycle/disconnect/001 as its report measured it: 4 long streams cut after 8
# deltas; the new streams' last start 1.02 s after the disconnect against a rest estimated at 0.08 s;
# its running gauge back to its level 0.01 s after the disconnect; no per-step decode counter.
LLAMA_SERVER_DISCONNECT = {"slots": 4, "cut_at": 8, "bound_s": 10.0, "rest_s": 0.08, "freed_s": 0.01,
                           "decoded_late": None, "late": [], "reuse_s": 1.02, "gauges": ["llamacpp:requests_processing"],
                           "told": ["no X-Request-Id: disconnect only"], "cuts": [8]}


@pytest.mark.parametrize(("changed", "ran_on", "unchecked"), [
    ({}, False, None),  # the gauge fell back at once: the work stopped, whatever the queue's timing
    ({"freed_s": None}, True, None),  # the gauge stayed up and the places came back as late as the rest: ran on
    ({"gauges": [], "freed_s": None}, False, "only timing shows it"),  # no gauge: timing alone decides nothing
    ({"gauges": [], "freed_s": None, "reuse_s": 0.01}, False, None),  # the places came back at once
    ({"freed_s": None, "reuse_s": 0.01}, False, "the engine's gauges as evidence"),
    # the decode counter still counting late in the watch: ran on, whatever the timing's estimate
    ({"freed_s": None, "decoded_late": 40.0, "reuse_s": 0.06}, True, None),
    ({"gauges": [], "freed_s": None, "decoded_late": 4.0, "reuse_s": 0.01}, True, None),
    # a still counter decides nothing (a stream parked on its full buffer holds its place without
    # decoding): the gauge and the timing decide, as with fewer tokens than abandoned streams
    ({"freed_s": None, "decoded_late": 0.0}, True, None),
    ({"freed_s": None, "decoded_late": 2.0, "reuse_s": 0.06}, False, "whether the work stopped"),
])
def test_a_disconnect_runs_on_only_where_the_engine_counts_on_or_its_gauges_and_the_timing_both_say_so(
        changed, ran_on, unchecked):
    """§4.9, D72: whether an abandoned stream's work stopped is judged from the engine's own metrics:
    its per-step decode counter, still counting well after the disconnect with nothing else running,
    shows the work going on; else its running gauges (a still counter proves nothing: a parked
    stream decodes nothing and keeps its place). The new
    streams' start against the rest estimated from one stream alone (which swings by 100x between
    runs) confirms a run-on the gauges show but never decides one alone: without a gauge or counter a
    late start is not checked, with the reason."""
    from decodespec.properties.conformance.life.recipes import judge_abort

    found, missed = judge_abort({**LLAMA_SERVER_DISCONNECT, **changed})
    assert [f.symptom for f in found] == (["ran_on"] if ran_on else []), found
    assert (missed == []) if unchecked is None else (unchecked in missed[0]), missed


# ---- the context an engine runs with (§4.3, D10) ---------------------------------------------------


@pytest.fixture(scope="module")
def context_checkpoint(tmp_path_factory):
    from decodespec.properties.conformance.checkpoints import TABLE_GROUP, build_group

    return build_group(TABLE_GROUP, [CASES["finish/context-limit/001"]], tmp_path_factory.mktemp("ctx") / TABLE_GROUP,
                       long=False)


def _models(**entry):
    return {"object": "list", "data": [{"id": "model", "object": "model", **entry}]}


@pytest.mark.parametrize(("served", "runs", "words"), [
    # llama-server started with --ctx-size 6: llama.cpp rounds it up to 256 (its /props says so)
    ({"/props": {"default_generation_settings": {"n_ctx": 256}}, "/v1/models": _models()}, False,
     "runs with a context of 256 positions (GET /props default_generation_settings.n_ctx), not the 6"),
    ({"/props": {"n_ctx": 256}, "/v1/models": _models()}, False, "(GET /props n_ctx)"),
    ({"/v1/models": _models(max_model_len=6)}, True, ""),  # vLLM, decodespec serve: max_model_len with the model
    ({"/v1/models": _models()}, False, "does not say the context length it runs with"),  # llama-cpp-python
    # LiteLLM's proxy: its own /v1/models says nothing; its pass-through of the worker's /props does
    ({"/v1/models": _models(), "/worker/props": {"default_generation_settings": {"n_ctx": 6}}}, True, ""),
    ({"/v1/models": _models(), "/worker/v1/models": _models(max_model_len=256)}, False,
     "runs with a context of 256 positions (GET /worker/v1/models data.0.max_model_len)"),
])
def test_a_context_limit_case_runs_only_on_the_context_the_engine_says_it_runs_with(context_checkpoint, served,
                                                                                   runs, words):
    """§4.3, D10: the case's limit is where runs end only if the server runs with the context it was
    started with; the adapter reads the context from the server (llama-server's /props, max_model_len
    in /v1/models) and, where it differs or is not said, leaves the case n/a with the reason instead
    of judging a limit the engine never had."""
    from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
    from decodespec.properties.conformance.checkpoints import served_context

    case = CASES["finish/context-limit/001"]
    need = served_context(case, context_checkpoint)
    assert need == 6
    with answering({path: json.dumps(body) for path, body in served.items()}) as url:
        why = OpenAIAdapter(url, checkpoint=context_checkpoint, context=need).unsupported(case)
    assert (why is None) == runs and words in (why or ""), why


# ---- a field ignored in the whole run (D71) ---------------------------------------------------------


def _chat_run(entries):
    """llama-cpp-python-chat's recorded cases as its report stored them (verdict, findings, exchanges),
    read back as the regrade reads a report (chat variants cannot be judged again offline), graded as
    one run."""
    from decodespec.properties.conformance.checkpoints import with_chat
    from decodespec.properties.conformance.regrade import result_of
    from decodespec.properties.conformance.runner import grade_run

    chat = {c.id: c for c in with_chat(load_cases())}
    return grade_run([result_of({"id": e["case"], "verdict": e["verdict"], "failures": e["failures"],
                                 "reproducer": {"exchanges": e["exchanges"]}}, chat[e["case"]], e["engine"], "project")
                      for e in entries])


USAGE_CHUNK_RUN = [e for e in FIXTURE if e["engine"] == "llama-cpp-python-chat"]


def test_a_field_the_engine_ignored_in_every_case_is_one_cause_of_the_run_not_a_verdict_per_case():
    """§4.10, D71: llama-cpp-python never sends the usage chunk stream_options.include_usage asks for.
    Its recorded cases no longer DIFFER on that alone: they pass with the finding listed; the headline
    names the field once with the cases that showed it and its basis, its cause is marked engine-wide;
    chat/stop/multi-byte/002, which also lost text, still fails on the text."""
    from decodespec.properties.conformance.engine_wide import ignored_engine_wide
    from decodespec.properties.conformance.reports import causes, headline

    results = _chat_run(USAGE_CHUNK_RUN)
    [wide] = ignored_engine_wide(results)
    assert (wide.field, len(wide.cases)) == ("stream_options.include_usage", len(USAGE_CHUNK_RUN)), wide
    by = {r.case.id: r for r in results}
    text = by.pop("chat/stop/multi-byte/002")
    assert text.verdict is Verdict.FAIL and severity_of(text.lead) is Severity.TEXT, text.failures
    assert "usage_chunk" in _symptoms(text)
    assert {r.verdict for r in by.values()} == {Verdict.PASS}, [(r.case.id, r.verdict) for r in by.values()]
    assert all("usage_chunk" in _symptoms(r) for r in by.values())
    said = headline(results, "llama-cpp-python-chat")
    assert said.count("stream_options.include_usage") == 1, said
    assert f"engine-wide: field_ignored: stream_options.include_usage in all {len(USAGE_CHUNK_RUN)} cases" in said
    [cause] = [c for c in causes(results) if c["symptom"] == "usage_chunk"]
    assert cause.get("engine_wide") is True and cause["basis"]["kind"] == "field_ignored", cause


def _with_usage_chunk(exchanges):
    """The recording with its first stream asking for the usage chunk given one, as an engine that
    honours the field sends it."""
    out, done = [], False
    for ex in exchanges:
        body = (ex.get("request") or {}).get("body") or {}
        if not done and "sse" in ex and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            ex = {**ex, "sse": ex["sse"].replace("data: [DONE]", f"data: {json.dumps(usage)}\n\ndata: [DONE]")}
            done = True
        out.append(ex)
    return out


@pytest.mark.parametrize("kept", [2, len(USAGE_CHUNK_RUN)])
def test_a_field_is_engine_wide_only_when_enough_cases_show_it_and_none_honours_it(kept):
    """D71: below MIN_CASES cases, or with one case whose stream sent the usage chunk (the field
    works there), the finding weighs in each case as before: a usage-only case DIFFERS."""
    from decodespec.properties.conformance.engine_wide import MIN_CASES, ignored_engine_wide

    entries = USAGE_CHUNK_RUN[:kept]
    if kept >= MIN_CASES:
        entries = [{**entries[0], "failures": [], "verdict": "PASS",
                    "exchanges": _with_usage_chunk(entries[0]["exchanges"])}, *entries[1:]]
    results = _chat_run(entries)
    assert ignored_engine_wide(results) == ()
    assert results[1].verdict is Verdict.DIFFERS and _symptoms(results[1]) == ["usage_chunk"], results[1]


def test_the_headline_the_cause_and_the_summary_count_the_same_cases_of_a_field_ignored_engine_wide():
    """§4.10, D71: one run states one count for one cause. chat/stop/multi-byte/002's stream ended
    without the usage chunk it asked for; stored by a judge that never said so (its finding left
    out), the regrade finds it from the recorded stream, so the headline, the engine-wide cause and
    summary.engine_wide each count every case whose stream showed it."""
    from decodespec.properties.conformance.reports import causes, headline, summary

    text_case = "chat/stop/multi-byte/002"
    entries = [{**e, "failures": [f for f in e["failures"] if f["symptom"] != "usage_chunk"]}
               if e["case"] == text_case else e for e in USAGE_CHUNK_RUN]
    results = _chat_run(entries)
    [cause] = [c for c in causes(results) if c["symptom"] == "usage_chunk"]
    [wide] = summary(results)["engine_wide"]
    said = headline(results, "llama-cpp-python-chat")
    assert text_case in cause["cases"] and cause.get("engine_wide") is True, cause
    assert len(cause["cases"]) == wide["cases"] == len(USAGE_CHUNK_RUN), (cause["cases"], wide)
    assert f"stream_options.include_usage in all {len(USAGE_CHUNK_RUN)} cases" in said, said


@pytest.mark.parametrize("case_id", ["detok/invalid/001", "detok/invalid/003"])
def test_a_stream_without_the_usage_chunk_it_asked_for_is_a_finding_where_the_reference_fails_too(case_id):
    """§4.10, D71: the reference ends detok/invalid FAILED, llama-cpp-python finishes normally and
    its stream, asked for its usage, sends none: the field had no effect there as anywhere."""
    assert "usage_chunk" in _symptoms(_rejudge("llama-cpp-python", case_id))


# ---- hold-back from incomplete token reports (§4.6, D59) --------------------------------------------


def test_hold_back_is_not_judged_from_token_reports_that_leave_out_selected_tokens():
    """§4.6, D59: llama-server-chat's stream asking for per-token reports in chat/stop/overlap/003
    reports 2 of the 4 tokens the run selects (the held and the stop's are never reported), so the
    chunk 'a' cannot be placed after a number of selected tokens: hold-back is not checked, with the
    reason, never a stop prefix sent early. With reports of every selected token the same chunks
    would be judged (and show 'a' sent while it could begin 'aab')."""
    from decodespec.properties.conformance.adapters.base import case_prompt, case_script, case_tokenizer
    from decodespec.properties.conformance.http_script import expected_at
    from decodespec.properties.conformance.symptoms import compare_held
    from decodespec.properties.conformance.wire import parse_sse

    *_, asked = RECORDED["llama-server-chat", "chat/stop/overlap/003"]
    assert asked["request"]["body"]["logprobs"] is True
    case = CASES["stop/overlap/003"]  # the chat variant's script, stop and limit
    tok = case_tokenizer(case)
    exp = expected_at(case, asked["request"]["body"]["max_tokens"], tok, case_prompt(case, tok), case_script(case, tok))
    tl = parse_sse(asked["sse"], status=asked["status"]).timeline("the stream asking for per-token reports")
    assert (tl.reported_in_all, exp.selected) == (2, 4)
    found, missed = compare_held(exp, tl)
    assert found == [] and missed == ["hold-back (the stream asking for per-token reports reports 2 of the 4 tokens "
                                      "the run selects: the boundaries of the others are not on the wire, D59)"]
    complete, _ = compare_held(exp, attrs.evolve(tl, reported_in_all=4))
    assert [f.symptom for f in complete] == ["stop_prefix_sent"], complete


def test_token_reports_past_the_references_text_tokens_show_no_selection_order():
    """§4.6, D59: a stream whose reports count more tokens than the reference's run spelled text
    with (vLLM where min_tokens masks a scripted EOS and the engine goes on its own way) places no
    chunk by them, rather than breaking the judge; a report within them that spells text not yet
    sent does."""
    from decodespec.properties.conformance.symptoms import Expected, reports_per_step

    exp = Expected(output=b"ab", reason="length", wire_reason="length", selected=2, max_tokens=2,
                   script_text=b"ab", stops=(b"x",), released=(1, 2), spelled=(1, 2))
    assert not reports_per_step(exp, sent=[0, 2], reported=[4, 5])
    assert reports_per_step(exp, sent=[0, 2], reported=[1, 2])


# ---- a guard that passes over the script's EOS (§4.6, D31, D59) --------------------------------------

# A generated example (reports/fuzz/vllm): the script opens with its EOS, which min_tokens masks
# (D32), so the reference selects on past it: the runner-up the logit_bias lifts, then the script.
FUZZ = {e["case"]: e for e in FIXTURE if e["case"].startswith("fuzz/")}


def test_a_stream_selecting_past_the_scripts_eos_is_judged_on_what_the_reference_selected():
    """§4.6, D31, D59: in fuzz/g0001/029 min_tokens masks the script's opening EOS; the reference
    and vLLM select '\\ufffd' twice, then the bytes of 'é', its stop. vLLM's stream asking for
    per-token reports reports each of the four selections as it makes it, so hold-back is judged
    against what the reference selected (not the script's text before its EOS, which is none), and
    the answer passes: no ERROR from the judge."""
    from decodespec.properties.conformance.fuzz.strategies import case_of

    entry = FUZZ["fuzz/g0001/029"]
    res = rejudge(case_of(entry["case"], entry["inputs"]), entry["exchanges"], "vllm")
    assert (res.verdict, res.failures) == (Verdict.PASS, ()), (res.reason, res.failures)
    assert not any(m.startswith("hold-back") for m in res.not_checked), res.not_checked


def test_a_run_that_raises_keeps_what_it_exchanged_for_its_reproducer(monkeypatch):
    """A run whose adapter or judge raises is an ERROR naming the exception, never a pass, and it
    keeps the exchanges made before (reproducer.exchanges), so the answers can be judged again
    offline once the judge is mended."""
    from decodespec.properties.conformance.adapters import openai
    from decodespec.properties.conformance.reports import reproducer
    from decodespec.properties.conformance.runner import run_case

    exchanges = FUZZ["fuzz/g0001/029"]["exchanges"]

    def breaks(a, case):
        a.log_exchanges(list(exchanges))
        return ()[0]

    case = CASES["http/usage/001"]
    monkeypatch.setitem(openai.RECIPES, case.recipe, breaks)
    res = run_case(openai.OpenAIAdapter("http://127.0.0.1:9"), case)
    assert (res.verdict, res.reason) == (Verdict.ERROR, "IndexError: tuple index out of range"), res
    kept = reproducer(res)
    assert kept["exchanges"] == exchanges and "writer_error" not in kept, kept


FUZZ_MINIMAL = json.loads((Path(__file__).parent / "fixtures" / "fuzz_exchanges.json").read_text(encoding="utf-8"))["cases"]


def _fuzz_rejudge(engine: str, case_id: str):
    """A fuzz run's case judged again from the exchanges its report recorded (fixtures/fuzz_exchanges.json)."""
    from decodespec.properties.conformance.cases import parse_case

    entry = next(e for e in FUZZ_MINIMAL if (e["engine"], e["case"]["id"]) == (engine, case_id))
    return rejudge(parse_case(entry["case"]), entry["exchanges"], engine)


@pytest.mark.parametrize(("engine", "case_id", "field"), [
    # min_tokens 4 masks the 4th token's EOS; the reference then fails the run, the engine ends '€', 'stop'
    ("llama-server", "fuzz-minimal/tail-dropped/029", "min_tokens"),
    # min_tokens 1 masks the first token's EOS; the engine counts that EOS (D15) and reports 'stop'
    ("llama-server", "fuzz-minimal/stop-without-hit/028", "min_tokens"),
    # ignore_eos: the engine ends at the EOS with '中😀', before the reference's stop '😀😀' completes
    ("llama-cpp-python", "fuzz-minimal/stop-prefix-left/016", "ignore_eos"),
])
def test_an_eos_the_guard_turns_off_that_ends_the_run_leads_as_the_guard_ignored(engine, case_id, field):
    """§4.10, D31, D65: an engine that ends the run at the script's EOS despite min_tokens or
    ignore_eos leads with guard_ignored on that field, whether the reference then fails the run, its
    count includes the EOS, or its text ends in the start of a stop the run never reached: the
    text, reason and count that follow from the early end are not what a maintainer fixes."""
    res = _fuzz_rejudge(engine, case_id)
    assert res.lead is not None and (res.lead.symptom, res.basis(res.lead).kind, res.basis(res.lead).ref) == \
        ("guard_ignored", "field_ignored", field), [(f.symptom, f.message) for f in res.failures]
    assert not {"tail_dropped", "stop_without_hit", "stop_prefix_left", "stream_vs_batch"} & set(_symptoms(res))


def test_a_stop_inside_the_echoed_prompt_is_not_a_stop_sent():
    """§4.6, D33: stop strings match output only. vLLM echoes 'hello' after the case markers' text
    (fuzz-minimal/stop-sent/010, stop 'o', the script's EOS first): the 'o' is in its echo, which
    is longer than the reference's, so the judge names the inserted markers' text, not a stop sent."""
    res = _fuzz_rejudge("vllm", "fuzz-minimal/stop-sent/010")
    assert "stop_sent" not in _symptoms(res), res.failures
    assert res.lead is not None and res.lead.symptom == "bytes_inserted", res.failures
    assert "puts '<|decodespec-case-1|><|decodespec-anchor|> ' in at byte 0" in res.lead.message, res.lead.message


@pytest.mark.parametrize(("case_id", "kept"), [
    # WordPiece, the script's EOS alone, include_stop_str_in_output and skip_special_tokens false:
    # vLLM ends on the EOS as on a stop token id and keeps its text ' [SEP]'
    ("fuzz-minimal/eos-sent/005", "keeps the EOS token's text ' [SEP]'"),
    # WordPiece ' end' is a stop token id and holds the stop string 'd': vLLM ends on the id and keeps
    # its text; the 'd' in it is that kept text, not a stop string sent past its match
    ("fuzz-minimal/stop-sent/010", "keeps the stop token's text ' end'"),
])
def test_a_stop_token_or_eos_text_kept_under_include_stop_str_rests_on_d33(case_id, kept):
    """D33: include_stop_str_in_output keeps a stop string, never the text of the token id that
    ended the run; vLLM keeps that text, the EOS's too (it ends on EOS as on a stop id). Its answer
    differs on D33 (stop_id_kept), not a chapter failure: neither the EOS's text sent nor a stop
    string inside the kept token's text (vLLM fuzz run, seed 2)."""
    res = _fuzz_rejudge("vllm-seed2", case_id)
    assert res.verdict is Verdict.DIFFERS and res.lead is not None, (res.verdict, res.failures)
    assert (res.lead.symptom, res.basis(res.lead).ref) == ("stop_id_kept", "D33"), res.failures
    assert kept in res.lead.message and not {"eos_sent", "stop_sent"} & set(_symptoms(res)), res.failures


@pytest.mark.parametrize(("case_id", "sent"), [
    ("fuzz/g0005/055", "'##.'"),  # the script '##.' after 'The': the reference sends '.'
    ("fuzz/g0001/018", "'##. world Ångström 文'"),  # two [UNK] skipped, then '##.' and the rest
])
def test_a_wordpiece_marker_sent_with_the_scripts_token_is_judged_as_text_not_an_error(case_id, sent):
    """§4.3, §4.5, D27: transformers serve decodes the output without the prompt, so the script's
    continuation '##.' goes out with its marker. The engine followed its script (the script's tokens
    decoded alone spell that text), so the case is judged: the marker is bytes inserted, never an
    ERROR saying the engine chose another token."""
    res = _fuzz_rejudge("transformers-serve", case_id)
    assert res.verdict is Verdict.FAIL and res.lead is not None, (res.verdict, res.reason)
    assert (res.lead.symptom, f"puts '##' in at byte 0, the rest as the reference sends it: {sent}" in res.lead.message) \
        == ("bytes_inserted", True), res.lead.message


def test_logprob_tokens_given_as_wordpiece_vocabulary_pieces_follow_the_script():
    """§4.3, D27: vLLM lists a WordPiece continuation's logprob token as its vocabulary piece,
    marker and all ('##😀', '##中', '.', '##中' for the text '😀中.中'); those are the script's
    tokens, so the case is judged, never an ERROR saying the engine chose '##😀##中.##中'."""
    res = _fuzz_rejudge("vllm-seed2", "fuzz/g0005/025")
    assert res.verdict is not Verdict.ERROR, res.reason
    assert "did not follow the forced script" not in (res.reason or "")


def test_a_valid_request_refused_leads_with_the_refusal_not_the_text_it_never_sent():
    """§4.1, §4.6, D65: transformers serve answers a stop string its vocabulary cannot spell ('B' in
    a lower-case WordPiece vocabulary) with 400, and its stream with that error as the only event;
    stop strings are matched on the text, so the request is valid. The refusal leads; the stream's
    missing '.' follows from its error and is no bytes_lost."""
    res = _fuzz_rejudge("transformers-serve", "fuzz-minimal/bytes-lost/003")
    assert res.lead is not None and res.lead.symptom == "refused", res.failures
    assert "error_in_stream" in _symptoms(res) and "bytes_lost" not in _symptoms(res), res.failures


def test_a_character_the_script_spells_twice_is_no_delta_sent_twice():
    """§4.5, D65: the script spells 'é' twice (c3, a9, c3, a9) and max_tokens 3 ends it inside the
    second; llama-cpp-python runs a fourth token to finish it and streams 'é', 'é'. The second delta
    is the script's next character, not a repeat: the run past max_tokens leads."""
    res = _fuzz_rejudge("llama-cpp-python-seed2", "fuzz-minimal/bytes-repeated/007")
    assert res.lead is not None and res.lead.symptom == "past_limit", res.failures
    assert "bytes_repeated" not in _symptoms(res), res.failures


def test_an_answer_without_a_count_that_ends_at_the_guarded_eos_is_the_guard_ignored():
    """§4.10, D31: llama-cpp-python with n 2 and ignore_eos (fuzz-minimal/bytes-lost/004) answers one
    choice, '' with 'stop', and no count of its own: its text is the script's whole characters
    before the EOS (the lone 'e2'), so the EOS ended it; the '€' the reference goes on to is not
    bytes lost."""
    found = _symptoms(_fuzz_rejudge("llama-cpp-python", "fuzz-minimal/bytes-lost/004"))
    assert "guard_ignored" in found and "bytes_lost" not in found, found


def test_an_eos_no_guard_turns_off_is_never_the_guard_ignored():
    """D31 needs a guard: a script `c3` then EOS, max_tokens 2, no min_tokens or ignore_eos: the
    reference fails the run at the EOS (D12, the character never completes) and an engine that sends
    U+FFFD and 'stop' there sent invalid bytes, not ignored a guard the request never asked for
    (llama-server, fuzz seed 2, `fuzz-minimal/guard-ignored/021`)."""
    from decodespec.properties.conformance.judgement import _guard_ignored

    failed = dict(output=b"", reason=None, wire_reason=None, selected=2, max_tokens=2, script_text=b"\xc3",
                  eos_at=2, error="decoding_error: the output ends inside a UTF-8 character")
    assert not Expected(**failed).guard_passed
    assert _guard_ignored(Expected(**failed), "stop", 2, False) == []
    guarded = Expected(**failed, guarded=True)
    assert guarded.guard_passed
    assert [f.symptom for f in _guard_ignored(guarded, "stop", 2, False)] == ["guard_ignored"]


@pytest.mark.parametrize(("case_id", "wrote"), [
    ("fuzz-minimal/bytes-added/001", "b'#'"),  # SentencePiece: the script's EOS alone, ignore_eos, max_tokens 1
    ("fuzz-minimal/bytes-added/002", 'b"\'"'),  # the byte table, the same with a stop kept
    ("fuzz-minimal/bytes-replaced/008", 'b"\'"'),  # skip_special_tokens false: the reference writes '</s>'
])
def test_a_guarded_eos_banned_on_the_last_allowed_token_is_no_text_finding(case_id, wrote):
    """D31, D66: llama-server bans the EOS under ignore_eos (bias -inf), so where the script's EOS
    is the last allowed token it writes the runner-up ('#', "'") in its place and ends at the limit.
    The guard the case is about never ran: an ERROR naming the ban, never bytes added on the chapter
    (llama-server fuzz run, seed 3)."""
    res = _fuzz_rejudge("llama-server-seed3", case_id)
    assert res.verdict is Verdict.ERROR, (res.verdict, res.failures)
    assert f"did not pass over the guarded EOS at token 1: it wrote {wrote}" in res.reason, res.reason
