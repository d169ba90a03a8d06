"""The reference keeps the rules it enforces on others: a stop-id cut never splits a
UTF-8 character (§4.6, D24), the UTF-8 guard changes no greedy success and covers every byteless
finish token (§4.5, D22), the content policy judges the bytes the drain flushes (§4.10, D11, D23),
and the grammar sees the text the decoder consumed, withheld bytes included (§4.3, §4.6, D23)."""

from __future__ import annotations

from decodespec.properties import check_trace
from decodespec.runtime import ByteTableTokenizer, Engine, Request, ScriptedModel, generate
from decodespec.runtime.stream_events import StreamEventKind
from decodespec.spec import FinishReason

# 0 "a", 1 the lead byte of "é", 2 its continuation byte, 3 EOS, 4 "Q", 5 "Z" + a lead byte, 6 "w".
TABLE = {0: b"a", 1: b"\xc3", 2: b"\xa9", 3: b"", 4: b"Q", 5: b"Z\xc3", 6: b"w"}
EOS = 3


def _tok() -> ByteTableTokenizer:
    return ByteTableTokenizer(TABLE, eos_id=EOS)


def _gen(script: list[int], **kw):
    return generate(Request([0], **kw), model=ScriptedModel(script, vocab_size=len(TABLE)), tokenizer=_tok())


def _deltas(run) -> list[bytes]:
    return [ev.data for ev in run.stream.events if ev.kind is StreamEventKind.DELTA]


def test_a_stop_id_cut_never_splits_a_character():
    """D24: the stop id 2 completes "é" begun by token 1: the cut drops the unfinished character
    instead of returning its lead byte (main returned b"a\\xc3", invalid UTF-8)."""
    res = _gen([0, 1, 2, 0], max_output_tokens=4, stop_token_ids=[(2,)])
    assert res.finish_reason is FinishReason.STOP_SEQUENCE
    assert res.output == b"a"
    assert check_trace(res.trace, tokenizer=_tok()) == []


def test_a_partial_stop_id_match_never_sends_half_a_character():
    """D24: while (2, 6) may still match, the bytes of 2 are withheld: the withheld part starts at a
    character boundary, so every delta is whole UTF-8 (a resumed reader never sees U+FFFD for a
    character the first reader saw whole)."""
    engine = Engine(ScriptedModel([0, 1, 2, 0, EOS], vocab_size=len(TABLE)), _tok())
    run = engine.submit(Request([0], max_output_tokens=8, stop_token_ids=[(2, 6)]))
    engine.run_until_idle()
    assert run.output == "aéa".encode() and run.reason is FinishReason.EOS
    for delta in _deltas(run):
        delta.decode("utf-8")  # raises on half a character


def test_the_guard_leaves_a_greedy_stop_run_unchanged():
    """D22: unguarded, greedy "a", "Q", "Z\\xc3" ends at the stop "QZ" (the lead byte lies past the
    cut): a success. The guard must not refuse "Z\\xc3" for leaving a character unfinished on the
    last allowed token (main's guard did, and the run ended by length with other text)."""
    plain = _gen([0, 4, 5, 0], max_output_tokens=3, stop=["QZ"])
    guarded = _gen([0, 4, 5, 0], max_output_tokens=3, stop=["QZ"], utf8_guard=True)
    assert plain.finish_reason is FinishReason.STOP_SEQUENCE and plain.output == b"a"
    assert (guarded.finish_reason, guarded.output, guarded.tokens) == (plain.finish_reason, plain.output, plain.tokens)


def test_the_guard_refuses_a_token_check_id_inside_a_character():
    """D22: a token finish check's id (byteless, like EOS; here the shipped tool-call check, D47)
    selected while "é" is half decoded would end the run inside it; the guard refuses it until the
    character is whole (main let it end the run and dropped the lead byte)."""
    tok = ByteTableTokenizer({0: b"a", 1: b"\xc3", 2: b"\xa9", 3: b"", 7: b""}, eos_id=3)
    req = Request([0], max_output_tokens=4, finish_tokens={"tool_call": [7]}, utf8_guard=True)
    r = generate(req, model=ScriptedModel([1, 7, 2, 7], vocab_size=8), tokenizer=tok)
    # 7 refused while "é" is half done; 2 finishes it; 2 is then invalid and "a" (lowest id) stands in.
    assert (r.finish_reason, r.output, r.tokens) == (FinishReason.TOOL_CALLS, b"\xc3\xa9a", (1, 2, 0, 7))


def test_the_content_policy_judges_the_flushed_tail():
    """D23 (D11): the stop prefix "Q" held to the end is flushed by the drain; the policy sees that
    chunk before it is sent and may refuse it: not sent, the request ends content_interrupted (main
    sent it unseen)."""
    seen: list[bytes] = []

    def policy(so_far: bytes, chunk: bytes) -> bool:
        seen.append(chunk)
        return chunk == b"Q"

    res = _gen([0, 4, 0], max_output_tokens=2, stop=["QZ"], content_policy=policy)
    assert seen == [b"a", b"Q"]
    assert res.finish_reason is FinishReason.CONTENT_INTERRUPTED and res.output == b"a"
    assert check_trace(res.trace, tokenizer=_tok()) == []


def test_the_grammar_sees_what_the_decoder_consumed():
    """D23 (§4.3 grammar_requires_termination(decoder.grammar_state)): after "a", "Q" the decoder has
    consumed "aQ" though the stop matcher still holds "Q"; the grammar "aQ" completes there and the
    output is "aQ" (main showed the grammar only "a" and ran on to "aQa")."""
    res = _gen([0, 4, 0, 0], max_output_tokens=4, stop=["QZ"], grammar="aQ")
    assert res.finish_reason is FinishReason.GRAMMAR_COMPLETE and res.output == b"aQ"
    assert check_trace(res.trace, tokenizer=_tok()) == []
