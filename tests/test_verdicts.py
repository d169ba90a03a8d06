"""Verdicts an engine author can act on: findings by symptom, wire conventions apart.

The fixtures are exchanges of real engines (vLLM 0.32 CPU, llama-server, llama-cpp-python,
transformers serve) recorded in the committed reports and audited by hand against the seed: each
names the invariant whose statement the raw answer breaks. Re-judging them offline must lead with
that invariant (§4.3-§4.10), never with the case's own by default.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from decodespec.properties.conformance import load_cases
from decodespec.properties.conformance.adapters.base import case_prompt, case_script, case_tokenizer, reference_on
from decodespec.properties.conformance.alignment import chunk_reports, message_report
from decodespec.properties.conformance.cases import CaseKind, parse_case
from decodespec.properties.conformance.chat import (
    ChatExpected,
    chat_reference,
    judge_answers,
    judge_chat,
    leading,
    observe_message,
    observe_stream,
    split_reference,
    splits,
)
from decodespec.properties.conformance.checkpoints import with_chat
from decodespec.properties.conformance.forced import Program
from decodespec.properties.conformance.http_script import judge_exchange
from decodespec.properties.conformance.judgement import Observed, expected_of, judge_observed, observe
from decodespec.properties.conformance.script_check import Returned, banned_eos, deviation
from decodespec.properties.conformance.symptoms import WIRE, Timeline, basis_of, compare_text, merge
from decodespec.properties.conformance.wire import ANSWER, CHUNK, parse_sse, shape_error, wire_findings

AUDITED = json.loads((Path(__file__).parent / "fixtures" / "audited_exchanges.json").read_text(encoding="utf-8"))
CASES = {c.id: c for c in load_cases()}


def _reference(case):
    """The reference's run of `case` as an Expected, with the case's script and the tokens it selected."""
    tok = case_tokenizer(case)
    prompt, script = case_prompt(case, tok), case_script(case, tok)
    res = reference_on(case, tok, prompt, script)
    return expected_of(case, tok, prompt, script, res), script, res.tokens


def _expected(case_id):
    case = CASES[case_id]
    return case, _reference(case)[0]


def _rejudge(entry):
    case, exp = _expected(entry["case"])
    ns, st = entry["exchanges"]
    return judge_exchange(case, exp, ns["status"], json.loads(ns["response"]), ns["response"],
                          parse_sse(st["sse"], status=st["status"]))[0]


@pytest.mark.parametrize("entry", AUDITED, ids=[f"{e['engine']}:{e['case']}" for e in AUDITED])
def test_an_audited_failure_leads_with_the_invariant_it_breaks(entry):
    """§4.3-§4.10: the lead finding is the one audited by hand (not the case's invariant by default)."""
    found = _rejudge(entry)
    semantic = [f for f in found if f.family != WIRE]
    if entry["lead_invariant"] is None:
        assert semantic == [], [(f.invariant, f.message) for f in semantic]
        return
    assert semantic, found
    assert (semantic[0].invariant, semantic[0].symptom) == (entry["lead_invariant"], entry["lead_symptom"]), \
        [(f.invariant, f.symptom, f.message) for f in semantic]


def test_a_missing_done_is_a_wire_finding_not_a_terminal_event_failure():
    """§4.7 asks for one terminal event; [DONE] is the OpenAI convention, its own family."""
    st = parse_sse('data: {"id":"c","choices":[{"text":"E","finish_reason":null}]}\n\n'
                   'data: {"id":"c","choices":[{"text":"F","finish_reason":"length"}]}\n\n')
    assert st.finish_reasons == ["length"] and st.deltas == ["E", "F"]
    [f] = wire_findings(st)
    assert (f.invariant, f.family) == ("openai_sse_done", WIRE)


def test_empty_chunks_after_text_are_deltas_and_fail_delta_nonempty():
    """§4.3: a token with no safe bytes sends nothing; an empty chunk after text is an empty delta
    (the SSE parser keeps every chunk), while empty chunks before any text are the stream's opening."""
    st = parse_sse('data: {"choices":[{"text":"","finish_reason":null}]}\n\n'
                   'data: {"choices":[{"text":"E","finish_reason":null}]}\n\n'
                   'data: {"choices":[{"text":"","finish_reason":null}]}\n\n'
                   'data: {"choices":[{"text":"中F","finish_reason":"length"}]}\n\ndata: [DONE]\n\n')
    assert st.texts == ["E", "", "中F"]
    _, exp = _expected("stream/delta-nonempty/001")
    found, _ = judge_observed(exp, Observed(text="E中F".encode(), finish_reason="length", completion_tokens=4,
                                            chunks=tuple(t.encode() for t in st.texts), stream_finish_reasons=("length",)))
    assert [f.invariant for f in found] == ["delta_nonempty"]


def test_a_stream_that_differs_from_the_answer_is_a_finding_of_its_own():
    """§4.5: stream and non-stream disagreeing is named, beside each one's difference from the reference."""
    _, exp = _expected("detok/invalid/003")
    found, _ = judge_observed(exp, Observed(text="E\ufffdaF".encode(), finish_reason="length", completion_tokens=4,
                                            chunks=(b"E", "\ufffd".encode(), b"F"), stream_finish_reasons=("length",)))
    assert {f.symptom for f in found} >= {"invalid_sent", "stream_vs_batch"}


@pytest.mark.parametrize(("got", "symptom", "how"), [
    ("EaF", "invalid_dropped", "leaving them out"),  # llama-cpp-python skips the byte ff and goes on
    ("E\ufffdaF", "invalid_sent", "sending them as U+FFFD"),
])
def test_invalid_bytes_left_out_and_sent_as_replacement_are_told_apart(got, symptom, how):
    """§4.5, D12: the reference ends the run at bytes no continuation makes valid; an engine that goes
    on says, by what its text holds, whether it sent them as U+FFFD or left them out."""
    _, exp = _expected("detok/invalid/003")
    [found] = compare_text(exp, got.encode(), "stream")
    assert found.symptom == symptom and how in found.message, found


def _inline(inputs):
    """(Expected, script, the reference's tokens) for a case of `inputs` on the SentencePiece fixture, prompt 'The'."""
    case = parse_case({"id": "t/inline/001", "anchor": "§4.5", "grade": "MUST", "invariant": "detok_concat_equals_batch",
                       "diagram": "detokenizer", "description": "-", "kind": "script",
                       "inputs": {"tokenizer": {"fixture": "sentencepiece_byte_fallback"}, "prompt": {"text": "The"},
                                  **inputs},
                       "expect": {"output": "", "finish_reason": "max_output_tokens"}})
    return _reference(case)


def test_text_held_for_a_stop_when_the_run_failed_is_no_invalid_byte_but_a_dropped_tail():
    """§4.5, §4.6, D12: `€` whole, then e2 that the limit leaves unfinished; the reference holds `€` (the
    start of the stop `€€`) and fails the run there, sending nothing. An engine that sends `€` and ends
    'length' went on past no invalid byte: it dropped the unfinished tail (vLLM answers so)."""
    exp = _inline({"script": [{"token": "<0xE2>"}, {"token": "<0x82>"}, {"token": "<0xAC>"}, {"token": "<0xE2>"}],
                   "max_tokens": 4, "stop": ["€€"]})[0]
    assert exp.reason is None and exp.output == b""
    found, _ = judge_observed(exp, Observed(text="€".encode(), finish_reason="length", completion_tokens=4,
                                            chunks=("€".encode(),), stream_finish_reasons=("length",)))
    assert [f.symptom for f in found] == ["tail_dropped"], found
    [past] = compare_text(exp, "€x".encode(), "stream")  # a byte past the held text is past the invalid ones
    assert past.symptom == "invalid_dropped", past


@pytest.mark.parametrize(("got", "ignored"), [
    ("\ufffdE", True),  # llama-server: the output alone, its first byte (ad) decoded without the prompt's e4 b8
    ("\xadE", False),  # a soft hyphen (c2 ad) before E: other bytes than the output alone
    ("> 中E", False),  # the reference's answer
    ("中E", False),  # the prompt's text cut, not left out: named as bytes, not as a field
])
def test_an_echo_the_engine_ignored_is_a_field_ignored(got, ignored):
    """D33: with echo the text opens with the prompt's; a text that is the output alone (as the
    reference sends it after the prompt, or decoded on its own) shows the field had no effect, named
    as echo ignored, not as bytes replaced."""
    _, exp = _expected("detok/echo/001")
    found = compare_text(exp, got.encode(), "stream")
    assert (found[:1] != [] and found[0].symptom == "fields_ignored" and "field_ignored: echo" in found[0].message) \
        == ignored, found


def test_an_eos_selected_past_the_limit_is_a_length_finding():
    """§4.3: 'stop' at max_tokens with the script's EOS as the next token: selected past the limit."""
    _, exp = _expected("finish/length/004")
    found, _ = judge_observed(exp, Observed(text=b"EF", finish_reason="stop", completion_tokens=2,
                                            chunks=(b"E", b"F"), stream_finish_reasons=("stop",)))
    assert found and found[0].invariant == "length_respected" and found[0].symptom == "past_limit"


def _held(chunks, reported=None, selected=None, text=b"ABCD", count=2):
    return Observed(text=text, finish_reason="length", completion_tokens=count, chunks=chunks,
                    timeline=Timeline(chunks, reported, selected), stream_finish_reasons=("length",))


@pytest.mark.parametrize(("chunks", "reported", "selected"), [
    ((b"AB", b"CD"), None, (1, 2)),  # the engine says how many tokens it had selected (the reference's clock)
    ((b"AB", b"", b"CD"), (1, 2, 2), None),  # vLLM: each token reported as selected, 'CD' with an empty chunk
])
def test_a_stop_prefix_sent_before_its_stop_is_ruled_out_fails_where_the_stream_shows_when(chunks, reported, selected):
    """§4.6, D59 over the wire: 'B' of 'AB' may begin the stop 'BX' until 'CD' rules it out. Where the
    stream shows how many tokens were selected when each chunk went out, 'AB' sent with one token
    selected fails; holding as the reference does, or longer (vLLM holds a fixed window), passes."""
    _, exp = _expected("stop/hold-back/001")
    found, not_checked = judge_observed(exp, _held(chunks, reported, selected))
    assert "stop_prefix_sent" in [f.symptom for f in found] and not any("hold-back" in m for m in not_checked)
    held = (b"A", *chunks[1:-1], b"BCD")
    found, not_checked = judge_observed(exp, _held(held, reported, selected))
    assert "stop_prefix_sent" not in [f.symptom for f in found] and not any("hold-back" in m for m in not_checked)


@pytest.mark.parametrize(("chunks", "reported", "why"), [
    ((b"AB", b"CD"), None, "reports no token boundaries"),  # llama-cpp-python's stream: one chunk a token, no reports
    ((b"AB", b"CD"), (1, 2), "only with its text"),  # each token reported with its text: when it was selected is unknown
    ((b"A", b"BCD"), (1, 2), "only with its text"),  # the reference's reports: a token with its first byte (D59)
])
def test_hold_back_is_never_inferred_from_chunks_that_do_not_show_when_tokens_were_selected(chunks, reported, why):
    """§4.6: an engine may hold whole tokens and release them later, one chunk each (llama-cpp-python
    sends 'AB' once 'CD' has ruled 'BX' out): the number of chunks, or reports that go out with their
    token's text, do not show which tokens were selected when a chunk went out. Hold-back is then not
    checked, and the result says so; it is never a finding."""
    _, exp = _expected("stop/hold-back/001")
    found, not_checked = judge_observed(exp, _held(chunks, reported))
    assert found == [] and any(m.startswith("hold-back") and why in m for m in not_checked), not_checked


def test_the_ends_flush_is_not_held_back_text_sent_early():
    """§4.6: with max_tokens 1 and stop 'BCD', 'B' of 'AB' is held until the run ends, then sent: a
    chunk that goes out once every token was selected may carry it (no count tells the last step
    from the end), however the engine counts its tokens."""
    _, exp = _expected("stop/flush-tail/001")
    for selected in ((1, 1), (1, 2)):
        found, not_checked = judge_observed(exp, _held((b"A", b"B"), selected=selected, text=b"AB", count=1))
        assert found == [] and not any("hold-back" in m for m in not_checked), (selected, found, not_checked)


def test_reports_tied_to_the_text_are_not_read_as_when_tokens_were_selected():
    """§4.6, D59: with stops 'BX' and 'CDY' the reference sends 'A' (its 'B' held), then with 'CD'
    selected releases 'B' and holds all of 'CD', then 'CDE'. Its reports go with each token's first
    byte: 'B' goes out with one token reported, though two were selected. Read as a clock they would
    fail the reference; they are not judged, and its own count of the tokens selected passes."""
    case = CASES["stop/hold-back/001"]
    case = attrs.evolve(case, inputs={**case.inputs, "stop": ["BX", "CDY"], "max_tokens": 3})
    exp = _reference(case)[0]
    chunks = (b"A", b"B", b"CDE")
    found, not_checked = judge_observed(exp, _held(chunks, reported=(1, 1, 3), text=b"ABCDE", count=3))
    assert found == [] and any("only with its text" in m for m in not_checked), (found, not_checked)
    found, not_checked = judge_observed(exp, _held(chunks, selected=(1, 2, 3), text=b"ABCDE", count=3))
    assert found == [] and not any("hold-back" in m for m in not_checked), (found, not_checked)
    early = _held((b"AB", b"CDE"), selected=(1, 3), text=b"ABCDE", count=3)
    assert [f.symptom for f in judge_observed(exp, early)[0]] == ["stop_prefix_sent"]


@pytest.mark.parametrize("report", [
    lambda ids, pieces, selected: {"token_ids": ids},  # vLLM's return_token_ids
    lambda ids, pieces, selected: {"logprobs": {"tokens": pieces, "token_logprobs": [0.0] * len(pieces)}},
    lambda ids, pieces, selected: {"decodespec": {"selected": selected}},  # the reference's count
])
def test_a_streams_token_reports_give_the_boundaries_hold_back_is_judged_by(report):
    """§4.6, D59: a completions stream that reports its tokens (ids or logprobs) as it selects them,
    or says how many it had selected (`decodespec.selected`), shows when each chunk went out
    (Streamed.timeline): 'AB' sent with token 1 alone is a stop prefix sent early; the same chunks
    without reports are not judged."""
    _, exp = _expected("stop/hold-back/001")

    def sse(with_reports):
        chunks = [("AB", [101], ["AB"], 1), ("", [102], ["CD"], 2), ("CD", [], [], 2)]
        lines = [{"id": "c", "choices": [{"index": 0, "text": t, "finish_reason": None,
                                          **(report(ids, pieces, k) if with_reports else {})}]}
                 for t, ids, pieces, k in chunks]
        lines.append({"id": "c", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        return parse_sse("".join(f"data: {json.dumps(x)}\n\n" for x in lines) + "data: [DONE]\n\n")

    answer = {"id": "c", "choices": [{"index": 0, "text": "ABCD", "finish_reason": "length"}],
              "usage": {"completion_tokens": 2}}
    found = {f.symptom for f in judge_observed(exp, observe(200, answer, json.dumps(answer), sse(True)))[0]}
    assert "stop_prefix_sent" in found, found
    found, not_checked = judge_observed(exp, observe(200, answer, json.dumps(answer), sse(False)))
    assert "stop_prefix_sent" not in {f.symptom for f in found} and any("hold-back" in m for m in not_checked)
    reported = observe(200, answer, json.dumps(answer), sse(False), reported=sse(True))
    assert "stop_prefix_sent" in {f.symptom for f in judge_observed(exp, reported)[0]}  # the stream sent again


def test_a_stop_prefix_sent_early_is_named_by_the_bytes_the_reference_held():
    """§4.6: the finding names the bytes the engine sent where the reference still held back, even
    when the reference's output ends before them (they began the stop that won): 'o', not b''."""
    _, exp = _expected("stop/cross-token/002")
    chunks = (b"", b"hello", b"")
    early = Observed(text=b"hello", finish_reason="stop", completion_tokens=2, chunks=chunks,
                     timeline=Timeline(chunks, selected=(1, 1, 2)), stream_finish_reasons=("stop",))
    found = [f for f in judge_observed(exp, early)[0] if f.symptom == "stop_prefix_sent"]
    assert len(found) == 1 and "still held b'o' there" in found[0].message, found


def test_a_result_with_nothing_observed_passes_nothing():
    """A case none of whose checks could be observed is n/a with the reason, never PASS."""
    from decodespec.properties.conformance.adapters.base import Outcome
    from decodespec.properties.conformance.runner import Verdict, judge

    res = judge(CASES["detok/utf8-split/001"], Outcome(), "empty", frozenset())
    assert res.verdict is Verdict.SKIP and "showed none" in res.reason


@pytest.mark.parametrize("case_id", ["finish/ignore-eos/001", "finish/min-tokens/001", "finish/min-tokens/002"])
def test_an_eos_that_a_guard_turns_off_is_named_when_it_ends_the_run(case_id):
    """§4.3, D31: with ignore_eos, or before min_tokens, the script's EOS is passed over; an engine
    that stops there breaks eos_guards_respected, whatever reason it reports, also where a later
    EOS ends the reference's run (min_tokens: the reference's reason is 'eos' too)."""
    _, exp = _expected(case_id)
    assert exp.guard_passed
    stopped = Observed(text=exp.output[:1], finish_reason="stop", completion_tokens=exp.eos_at,
                       chunks=(exp.output[:1],), stream_finish_reasons=("stop",))
    found, _ = judge_observed(exp, stopped)
    assert found and found[0].invariant == "eos_guards_respected", [(f.invariant, f.message) for f in found]


def test_a_streams_length_is_judged_with_the_streams_own_count():
    """§4.6, D4: vLLM on detok/after-stop/001 selects a token past the stop (3 of max_tokens 3) and
    reports 'length' both ways. The stream's usage chunk says 3, so its 'length' is right for its run
    and the token after the stop leads; only a stream with no count is left to say it ended early."""
    _, exp = _expected("detok/after-stop/001")
    answer = {"text": b"E", "finish_reason": "length", "completion_tokens": 3, "chunks": (b"E", b""),
              "stream_finish_reasons": ("length",)}
    counted, _ = judge_observed(exp, Observed(**answer, stream_completion_tokens=3))
    assert [f.symptom for f in counted][0] == "token_after_stop" and "early_length" not in {f.symptom for f in counted}
    assert any("stream: usage.completion_tokens is 3" in f.message for f in counted), counted
    uncounted, _ = judge_observed(exp, Observed(**answer))
    assert "early_length" in {f.symptom for f in uncounted}


@pytest.mark.parametrize(("case_id", "cut", "symptom"), [
    ("stop/include-stop/001", 1, "stop_not_kept"),  # 'A' of 'ABC': the kept stop 'BC' cut as if not kept
    ("stop/flush-tail/001", 0, "held_not_released"),  # '' of 'AB': 'B' held for 'BCD', never sent at the end
    ("detok/utf8-split/001", 0, "bytes_lost"),  # no stop to hold for: just bytes never sent
])
def test_a_missing_tail_is_named_for_what_it_is(case_id, cut, symptom):
    """§4.6, D33: text that ends early says whether its missing tail is the stop the request keeps,
    bytes held for a stop that never completes (released at the end), or neither."""
    _, exp = _expected(case_id)
    found = compare_text(exp, exp.output[:cut], "stream")
    assert [(f.invariant, f.symptom) for f in found] == [("detok_concat_equals_batch", symptom)], found


def test_a_stop_ids_text_kept_rests_on_d33():
    """§4.6, D33: include_stop_str_in_output keeps a stop string; the stop id 'E' that ends
    stop/include-stop/002 is no text either way. vLLM keeps the id's text ('ABE'): named for that,
    resting on D33 (engines differ there), where text past the stop token stays the chapter's."""
    case, exp = _expected("stop/include-stop/002")
    assert exp.kept and exp.stop_id_text == b"E"
    [kept] = compare_text(exp, b"ABE", "stream")
    assert (kept.symptom, basis_of(kept, case).ref) == ("stop_id_kept", "D33"), kept
    assert [f.symptom for f in compare_text(exp, b"ABEF", "stream")] == ["text_after_stop"]
    _, plain = _expected("stop/token-ids/002")  # not kept: the same text is text after the stop
    assert [f.symptom for f in compare_text(plain, b"ABE", "stream")] == ["text_after_stop"]


def test_a_special_token_sent_as_text_is_named_not_a_script_left():
    """§4.5, D33: '<unk>' is special on the SentencePiece fixture, so detok/special-skipped/001's
    '<unk>', ' the', '<unk>' is ' the'. vLLM's chat endpoint (its parsers turn skip_special_tokens
    off) sends '<unk> the<unk>': the engine followed the script (no D27 ERROR) and sent a special
    token as text (special_sent), where other put-in bytes stay what they are."""
    case, exp = _expected("detok/special-skipped/001")
    assert exp.special_texts == (b"<unk>",)
    assert [f.symptom for f in compare_text(exp, b"<unk> the<unk>", "stream")] == ["special_sent"]
    assert [f.symptom for f in compare_text(exp, b"<unk> the", "stream")] == ["special_sent"]
    assert [f.symptom for f in compare_text(exp, b"%unk% the", "stream")] != ["special_sent"]
    tok = case_tokenizer(case)
    prog = Program(case.id, 0, case_prompt(case, tok), case_script(case, tok))
    assert deviation(prog, tok, tok.eos_id, Returned(text="<unk> the<unk>"), end=3) is None
    assert deviation(prog, tok, tok.eos_id, Returned(text="<unk> thy<unk>"), end=3) is not None


def test_a_passed_over_eos_sent_as_text_is_named():
    """§4.5, D31: under ignore_eos the EOS is a token like any other but still special, so it has no
    bytes under skip_special_tokens; vLLM's chat endpoint (its parsers turn skip_special_tokens off)
    sends 'E</s>F</s>' for 'EF'. Other replaced bytes stay bytes_replaced."""
    _, exp = _expected("finish/ignore-eos/001")
    assert [f.symptom for f in compare_text(exp, b"E</s>F</s>", "stream")] == ["special_sent"]
    assert [f.symptom for f in compare_text(exp, b"E%F%", "stream")] == ["bytes_replaced"]


@pytest.mark.parametrize(("got", "symptom", "words"), [
    (b"world", "bytes_dropped", "leaves out ' ' at byte 0"),  # transformers' streamer strips the word's space
    (b"  world", "bytes_inserted", "puts ' ' in at byte 1"),
    (b" w0rld", "bytes_replaced", "differs from byte 2"),
])
def test_a_text_that_leaves_out_or_puts_in_bytes_mid_text_says_which(got, symptom, words):
    """§4.5: a text that is the reference's with bytes left out (or put in) at one place, the rest
    as the reference sends it, names those bytes; other differences stay "bytes replaced"."""
    _, exp = _expected("detok/leading-space/001")
    [found] = compare_text(exp, got, "stream")
    assert (found.invariant, found.symptom) == ("detok_concat_equals_batch", symptom) and words in found.message, found


def test_an_answer_that_follows_the_script_where_the_fields_move_the_reference_names_the_fields():
    """D30, D32: logit_bias -100 on F makes the reference write 'EIGH' where the script has 'EFGH';
    an engine that accepts the field and writes 'EFGH' (transformers serve) ignored it: the lead is
    the refinement of the request (its fields had no effect), not the detokenizer's invariant. Other
    bytes in that place stay bytes_replaced."""
    _, exp = _expected("finish/logit-bias/001")
    [found] = compare_text(exp, b"EFGH", "stream")
    assert (found.invariant, found.symptom) == ("refinement", "fields_ignored") and "'FGH'" in found.message
    assert [f.symptom for f in compare_text(exp, b"EF", "stream")] == ["fields_ignored"]  # cut by the limit too
    assert [f.symptom for f in compare_text(exp, b"EXGH", "stream")] == ["bytes_replaced"]
    assert compare_text(exp, b"EIGH", "stream") == []


@pytest.mark.parametrize(("case_id", "text", "banned"), [
    ("finish/ignore-eos/001", b"E%F%", b"%"),  # llama-server: the EOS banned, its runner-up written
    ("finish/ignore-eos/002", b"E%F", b"%"),  # the same under skip_special_tokens false
    ("finish/ignore-eos/001", b"E</s>F</s>", None),  # passed over, sent as text: special_sent judges it
    ("finish/ignore-eos/002", b"E</s>F", None),  # the reference's own answer
    ("finish/ignore-eos/001", b"E", None),  # ended on the EOS: the guard ignored, the case's FAIL
    ("finish/ignore-eos/002", b"EF", None),  # passed over, its text lost: the case's FAIL
    ("finish/min-tokens/001", b"E%F%", None),  # the reference masks that EOS itself (D32): no ban to name
])
def test_a_guarded_eos_the_engine_banned_is_an_error_naming_what_it_wrote(case_id, text, banned):
    """D31, D66: where the reference passes over a guarded EOS as a token and the engine writes its
    runner-up there (llama.cpp bans end-of-generation tokens under ignore_eos), the guard the case is
    about never ran: the run is an ERROR naming the token and what was written, never a FAIL of the
    detokenizer's invariant; every other answer is left to the case."""
    exp, script, ref = _reference(CASES[case_id])
    message = banned_eos(exp, script, ref, text)
    if banned is None:
        assert message is None, message
    else:
        assert message is not None and f"token {exp.eos_at}: it wrote {banned!r}" in message, message


@pytest.mark.parametrize(("text", "banned"), [
    (b"<unk></s>", None),  # vLLM: <unk>'s text, then the EOS passed over and sent as text (special_sent judges both)
    (b"</s>", None),
    (b"<unk>#", b"#"),  # a runner-up in the EOS's place, after <unk>'s text
])
def test_a_special_tokens_text_before_a_guarded_eos_is_not_written_in_its_place(text, banned):
    """D31, D33, D66: the script <unk> then the EOS under ignore_eos; the reference sends no text for
    either and passes over the EOS. `<unk>` sent as text is that token's (a special_sent finding), not
    a token the engine wrote where the EOS stands (vLLM's chat answer is `<unk></s>`)."""
    exp, script, ref = _inline({"script": [{"token": "<unk>"}, {"eos": True}], "max_tokens": 2,
                                "request": {"ignore_eos": True}})
    assert exp.special_texts == (b"<unk>",) and exp.guard_passed
    message = banned_eos(exp, script, ref, text)
    if banned is None:
        assert message is None, message
    else:
        assert message is not None and f"it wrote {banned!r}" in message, message


# Answers in the API's shape with any field, at any depth, of another JSON type now and then.
_junk = st.one_of(st.none(), st.booleans(), st.integers(-2, 300), st.floats(allow_nan=False, allow_infinity=False),
                  st.text(max_size=4), st.just([]), st.just({}), st.just([1, "a"]), st.just({"a": 1}))


def _or_junk(good):
    return st.one_of(good, good, good, _junk)


def _obj(**fields):
    return _or_junk(st.fixed_dictionaries({}, optional={k: _or_junk(v) for k, v in fields.items()}))


_count = st.integers(0, 20)
_call = _obj(index=st.integers(0, 2), function=_obj(name=st.text(max_size=3), arguments=st.text(max_size=6)))
_delta = _obj(content=st.text(max_size=4), reasoning=st.text(max_size=4), reasoning_content=st.text(max_size=4),
              tool_calls=st.lists(_call, max_size=2))
_logprobs = _obj(tokens=st.lists(st.text(max_size=3), max_size=3),
                 content=st.lists(_obj(token=st.text(max_size=3), bytes=st.lists(st.integers(0, 300), max_size=3)),
                                  max_size=3))
_choice = _obj(index=st.integers(0, 1), text=st.text(max_size=4), delta=_delta, message=_delta,
               finish_reason=st.sampled_from(["stop", "length", "tool_calls"]), logprobs=_logprobs,
               token_ids=st.lists(st.integers(0, 300), max_size=3))
_answer = st.fixed_dictionaries({}, optional={"id": _or_junk(st.text(max_size=3)), "choices": _or_junk(st.lists(_choice, max_size=2)),
                                              "usage": _obj(completion_tokens=_count, prompt_tokens=_count)})


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(chunks=st.lists(_answer, max_size=4), message=_answer, status=st.sampled_from([200, 200, 400]),
       case_id=st.sampled_from(["stop/cross-token/001", "stop/n-choices/001", "finish/length/003", "detok/utf8-split/001"]))
@example(chunks=[], message={"choices": [{"index": []}]}, status=200, case_id="stop/n-choices/001")  # an index of no int
def test_an_answer_of_any_shape_is_judged_and_never_breaks_the_judge(chunks, message, status, case_id):
    """Every reader of an engine's answer (completions, chat, per-token reports) judges whatever
    JSON comes: a field of another type is a wire finding naming it, never a crash that turns the
    case into an ERROR with a Python traceback for a message."""
    case, exp = _expected(case_id)
    st_ = parse_sse("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")
    found = judge_exchange(case, exp, status, message, json.dumps(message), st_)[0]
    assert all(f.invariant and f.message for f in found)
    symptoms = {f.symptom for f in found}
    off_shape = [c for c in chunks if shape_error(c, CHUNK) is not None]  # each left out and named
    assert len(st_.chunks) == len(chunks) - len(off_shape) and ("malformed" in symptoms) == bool(off_shape)
    assert ("answer_shape" in symptoms) == (status == 200 and shape_error(message, ANSWER) is not None)
    judge_chat(ChatExpected("a", "b", (("f", {}),), "stop", 3, False), observe_message(status, message), "answer")
    judge_chat(ChatExpected("a", "", (), "length", 3, False), observe_stream(st_), "stream")
    chunk_reports(st_), message_report(message, True), message_report(message, False)


def test_a_field_of_another_type_is_named_where_it_is():
    """The wire finding says which field and which type, for a chunk and for a whole answer."""
    st_ = parse_sse('data: {"id":"c","choices":[{"index":0,"delta":["x"]}]}\n\ndata: [DONE]\n\n')
    assert [f.message.split(": {")[0] for f in wire_findings(st_)] == [
        "data lines that are not chunks of the API's shape: ['choices[0].delta is a list, not an object"]
    case, exp = _expected("stop/cross-token/001")
    answer = {"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}], "usage": {"completion_tokens": "2"}}
    found = judge_exchange(case, exp, 200, answer, json.dumps(answer), parse_sse("data: [DONE]\n\n"))[0]
    [shape] = [f for f in found if f.symptom == "answer_shape"]
    assert shape.family == WIRE and "usage.completion_tokens is a string, not an integer" in shape.message


_SCRIPT_CASES = [c for c in sorted(CASES) if CASES[c].kind is CaseKind.SCRIPT
                 and {"fixture", "table"} & set(CASES[c].inputs.get("tokenizer", {}))]


def _semantic(exp, **fields):
    found, _ = judge_observed(exp, Observed(**fields))
    return [f for f in found if f.family != WIRE]


@pytest.mark.parametrize("case_id", _SCRIPT_CASES)
def test_the_references_answer_passes_and_any_one_change_to_it_fails(case_id):
    """§4.3-§4.10: the judge can fail. The reference's own answer (whole, one chunk) has no finding;
    a byte added or removed anywhere in the non-streamed text or in the stream, another finish reason
    on either, or another token count in the answer or in the stream's usage chunk has at least one,
    whatever the case."""
    case, exp = _expected(case_id)
    if exp.reason is None:
        pytest.skip("the reference fails this run: its judgement is the error's, tested apart")
    out, why = exp.output, exp.wire_reason
    ok = {"text": out, "finish_reason": why, "completion_tokens": exp.selected, "stream_completion_tokens": exp.selected,
          "chunks": (out,) if out else (), "stream_finish_reasons": (why,)}
    assert _semantic(exp, **ok) == []
    rng = random.Random(case_id)
    changed = {out[:k] + bytes([rng.choice(b"aZ ")]) + out[k:] for k in range(len(out) + 1)}
    changed |= {out[:k] + out[k + 1:] for k in range(len(out))}
    for text in changed:
        assert _semantic(exp, **{**ok, "text": text}), ("non-streamed", text)
        assert _semantic(exp, **{**ok, "chunks": (text,)}), ("stream", text)
    for other in {"stop", "length", "content_filter", "tool_calls"} - {why}:
        assert _semantic(exp, **{**ok, "finish_reason": other}), ("non-streamed", other)
        assert _semantic(exp, **{**ok, "stream_finish_reasons": (other,)}), ("stream", other)
    counted = {exp.selected, exp.selected - 1} if exp.reason == "eos" else {exp.selected}  # D15: the EOS or not
    for n in set(range(exp.max_tokens + 3)) - counted:
        assert _semantic(exp, **{**ok, "completion_tokens": n}), ("completion_tokens", n)
        assert _semantic(exp, **{**ok, "stream_completion_tokens": n}), ("stream usage", n)


_CHAT_CASES = sorted(c.id for c in with_chat(load_cases()) if c.id.startswith("chat")
                     and {"fixture", "table"} & set(c.inputs.get("tokenizer", {})))
_CHATS = {c.id: c for c in with_chat(load_cases())}


def _chat_answer(content: str, reasoning: str, calls: list, finish: str | None, n: int) -> tuple[dict, str]:
    """One chat answer both ways, as the API gives it: the message, and a stream of a chunk for each
    channel and call (arguments as JSON text, or as given where a test changed their text)."""
    wire_calls = [{"id": f"call_{i}", "type": "function", "function": {
        "name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}} for i, (name, args) in enumerate(calls)]
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if wire_calls:
        message["tool_calls"] = wire_calls
    usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
    answer = {"id": "a", "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
    deltas = [{"role": "assistant", "content": ""}] + ([{"reasoning_content": reasoning}] if reasoning else [])
    deltas += ([{"content": content}] if content else [])
    deltas += [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(wire_calls)]
    chunks = [{"id": "a", "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks += [{"id": "a", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
               {"id": "a", "choices": [], "usage": usage}]
    return answer, "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


@pytest.mark.parametrize(("case_id", "answer", "lead"), [
    # llama-server: the call cut by max_tokens reported as half a call, its text gone from the content
    ("chat/tool-call/cut-by-length/001", {"content": "", "reasoning": "", "calls": [("get_weather", "{")],
                                          "finish": "length", "n": 2}, ("calls_only_when_closed", "chat_half_call")),
    # ... and one that parsed it whole though no </tool_call> closed it
    ("chat/tool-call/cut-by-length/001", {"content": "", "reasoning": "", "finish": "length", "n": 2,
                                          "calls": [("get_weather", {"city": "Paris"})]},
     ("calls_only_when_closed", "chat_call_unclosed")),
    # a server with no reasoning parser: the tags go out as content, the reasoning with them
    ("chat/reasoning/special-tags/001", {"content": "<think>Let me check</think>Hi!", "reasoning": "", "calls": [],
                                         "finish": "stop", "n": 6}, ("think_tags_never_text", "chat_tag_leaked")),
])
@pytest.mark.parametrize("way", ["message", "stream"])
def test_a_chat_finding_that_says_where_the_text_went_leads(case_id, answer, lead, way):
    """§4.7, D45, D47: text missing from a channel because it went into half a call, into a call
    reported before it closed, or out as tag text is led by that finding (chat.EXPLAINING), in a
    whole message and in a stream alike, not by the content difference it causes."""
    case = _CHATS[case_id]
    tok = case_tokenizer(case)
    exp = split_reference(case, chat_reference(case, tok, case_prompt(case, tok), case_script(case, tok)))
    data, sse = _chat_answer(**answer)
    obs = observe_message(200, data) if way == "message" else observe_stream(parse_sse(sse))
    found = leading(merge(judge_chat(exp, obs, way)))
    assert "pieces_once" in {f.invariant for f in found}, found
    assert (found[0].invariant, found[0].symptom) == lead, found


@pytest.mark.parametrize("case_id", _CHAT_CASES)
def test_the_references_chat_answer_passes_and_any_one_change_to_it_fails(case_id):
    """§4.5-§4.7, D45-D47: the chat judge can fail, as run_chat judges (chat.judge_answers: by the
    completions rules where nothing is split off the content). The reference's own chat answer, as
    a message and as a stream, has no finding; a character added or removed in the content or the
    reasoning, a character moved across their boundary, a call renamed, dropped, doubled or with a
    character added to its arguments, another finish reason, or another token count has at least
    one, in the changed answer alone (the other the reference's; stream against non-stream left out)."""
    case = _CHATS[case_id]
    tok = case_tokenizer(case)
    prompt, script = case_prompt(case, tok), case_script(case, tok)
    res = chat_reference(case, tok, prompt, script)
    exp = split_reference(case, res)
    as_text = None if splits(case) else expected_of(case, tok, prompt, script, res)
    if exp.finish_reason is None:
        pytest.skip("the reference fails this run: its judgement is the error's, tested apart")
    ok = {"content": exp.content, "reasoning": exp.reasoning, "calls": list(exp.calls),
          "finish": exp.finish_reason, "n": exp.selected}

    def judged(message: dict, stream: dict) -> list:
        data, sse = _chat_answer(**message)[0], parse_sse(_chat_answer(**stream)[1])
        found, _ = judge_answers(exp, as_text, (200, data, json.dumps(data), sse), observe_message(200, data),
                                 observe_stream(sse))
        return [f for f in found if f.family != WIRE and f.symptom != "stream_vs_batch"]

    def findings(**change):
        """(with the message changed, with the stream changed)"""
        return [judged({**ok, **change}, ok), judged(ok, {**ok, **change})]

    assert findings() == [[], []]
    rng = random.Random(case_id)
    changes = []
    for channel in ("content", "reasoning"):
        text = ok[channel]
        changes += [{channel: text[:k] + rng.choice("aZ ") + text[k:]} for k in range(len(text) + 1)]
        changes += [{channel: text[:k] + text[k + 1:]} for k in range(len(text))]
    c, r = exp.content, exp.reasoning
    if c and r:
        changes += [{"reasoning": r[:-1], "content": r[-1] + c}, {"reasoning": r + c[0], "content": c[1:]}]
    elif c or r:
        changes.append({"reasoning": c, "content": r})
    for i, (name, args) in enumerate(exp.calls):
        text = json.dumps(args)
        changes += [{"calls": [*exp.calls[:i], (name + "x", args), *exp.calls[i + 1:]]},
                    {"calls": [*exp.calls[:i], *exp.calls[i + 1:]]},
                    {"calls": [*exp.calls[: i + 1], *exp.calls[i:]]}]
        changes += [{"calls": [*exp.calls[:i], (name, text[:k] + "a" + text[k:]), *exp.calls[i + 1:]]}
                    for k in range(len(text) + 1)]
    changes += [{"finish": other} for other in {"stop", "length", "tool_calls", "content_filter"} - {exp.finish_reason}]
    counted = {exp.selected, exp.selected - 1} if exp.finish_reason == "stop" else {exp.selected}
    counted |= {exp.selected + 1} if exp.by_tool_token else set()
    changes += [{"n": n} for n in set(range(exp.selected + 3)) - counted]
    for change in changes:
        message, stream = findings(**change)
        assert message and stream, (change, message, stream)


def test_a_length_where_the_text_ends_at_the_references_stop_is_named():
    """D4 (§4.10): a stream whose text ends where the reference's stop ends it, before max_tokens, but
    says 'length' broke length_respected either way: it ended there and says otherwise, or it ran on
    selecting tokens it never sent. Without a token count nothing else could say so."""
    case, exp = _expected("stop/cross-token/001")
    assert exp.wire_reason == "stop" and exp.selected < exp.max_tokens
    found = _semantic(exp, text=exp.output, finish_reason="stop", completion_tokens=exp.selected,
                      chunks=(exp.output,), stream_finish_reasons=("length",))
    assert [(f.symptom, f.invariant) for f in found] == [("early_length", "length_respected")]
    assert "its text ends where the reference's" in found[0].message
