"""stream_tokens_aligned (§4.5-§4.7, DECISIONS D59): per-token reports (logprobs, vLLM's token ids)
go with the text of each stream chunk. The reference server reports each token with the chunk that
sends its first byte; the judge (properties/conformance/alignment.py) passes it on every case over
HTTP, accepts an engine whose tokens lead its held text (vLLM's way), and names the invariant on
recorded broken exchanges; a stream with no per-token reports leaves the case n/a."""

from __future__ import annotations

import json

import attrs
import httpx
import pytest

from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.alignment import (
    INVARIANT,
    Want,
    chunk_reports,
    judge_alignment,
    message_report,
    run_alignment,
)
from decodespec.properties.conformance.cases import load_cases
from decodespec.properties.conformance.checkpoints import build_group, group_of, http_blocker, with_chat
from decodespec.properties.conformance.runner import Verdict, run_cases
from decodespec.properties.conformance.wire import Streamed, parse_sse
from decodespec.runtime import ByteTableTokenizer, ScriptedModel
from decodespec.runtime.engine import Engine
from decodespec.runtime.openai_schema import FIELDS, IMPLEMENTED
from decodespec.runtime.server import create_app

TABLE = {1: b"> ", 101: b"AB", 102: b"CD", 103: b"E", 104: b"F", 105: b"G", 110: b"</s>",
         111: bytes.fromhex("e4b8"), 112: bytes.fromhex("ad"), 121: b"a"}
TOK = ByteTableTokenizer(TABLE, eos_id=110)
NOT_TEXT = frozenset({110})


def _stream(base: str, body: dict) -> Streamed:
    r = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200, r.text
    return parse_sse(r.text)


@pytest.fixture(scope="module")
def scripted(app_server):
    """`start(script) -> url`: decodespec serve over a scripted model and the byte table above."""
    return lambda script: app_server(create_app(Engine(ScriptedModel(script, vocab_size=130), TOK, poll_s=0.001),
                                                model_name="m"))


def test_logprobs_and_token_ids_are_implemented_fields():
    """D30 amended by D59: logprobs, top_logprobs and vLLM's return_token_ids act; none is answered with null."""
    for chat in (False, True):
        assert FIELDS[chat]["logprobs"].status == IMPLEMENTED
        assert FIELDS[chat]["return_token_ids"].status == IMPLEMENTED
    assert FIELDS[True]["top_logprobs"].status == IMPLEMENTED


def test_each_chunk_reports_the_tokens_whose_first_byte_it_sends(scripted):
    """§4.6's fixture with a longer stop: 'AB' goes with the chunk that sends 'A' (its 'B' held for
    'BCDE'), 'CD' sends nothing while held and goes with the chunk that releases 'BCDF', the EOS with
    the finish chunk; ids, logprob tokens and text offsets agree, streamed and not."""
    base = scripted([121, 101, 102, 104, 105, 110])
    body = {"model": "m", "prompt": [1], "max_tokens": 8, "temperature": 0, "stop": ["BCDE"], "logprobs": 2,
            "return_token_ids": True}
    st = _stream(base, body)
    got = [(c.get("text"), c.get("token_ids"), (c.get("logprobs") or {}).get("tokens"),
            (c.get("logprobs") or {}).get("text_offset")) for c in st.choices() if c.get("token_ids") is not None]
    assert got == [("a", [121], ["a"], [0]), ("A", [101], ["AB"], [1]), ("BCDF", [102, 104], ["CD", "F"], [3, 5]),
                   ("G", [105], ["G"], [6]), ("", [110], ["</s>"], [7])]
    want = Want((121, 101, 102, 104, 105, 110), True, ("BCDE",), NOT_TEXT)
    assert judge_alignment(chunk_reports(st), want, TOK, "stream") == []
    whole = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()
    assert whole["choices"][0]["token_ids"] == list(want.tokens)
    assert whole["choices"][0]["logprobs"]["token_logprobs"] == [0.0] * 6
    assert len(whole["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    assert judge_alignment([message_report(whole, False)], want, TOK, "non-streamed answer") == []


def test_a_split_character_and_a_stop_cut_go_with_the_right_chunks(scripted):
    """中 split across two tokens goes out whole with both its tokens; with the stop '中E' both and
    'E' send nothing and are reported by the finish chunk (their bytes never become text)."""
    base = scripted([121, 111, 112, 103, 104, 110])
    plain = _stream(base, {"model": "m", "prompt": [1], "max_tokens": 4, "temperature": 0, "return_token_ids": True})
    assert [(c.get("text"), c.get("token_ids")) for c in plain.choices() if c.get("token_ids")] == [
        ("a", [121]), ("中", [111, 112]), ("E", [103])]
    cut = _stream(base, {"model": "m", "prompt": [1], "max_tokens": 6, "temperature": 0, "stop": ["中E"], "logprobs": 0})
    reports = chunk_reports(cut)
    assert [(r.text, r.pieces) for r in reports if r.pieces] == [
        (b"a", ("a",)), (b"", ("bytes:\\xe4\\xb8", "bytes:\\xad", "E"))]
    assert judge_alignment(reports, Want((121, 111, 112, 103), False, ("中E",), NOT_TEXT), TOK, "stream") == []


def test_each_chunk_says_how_many_tokens_were_selected_when_it_went_out(scripted):
    """§4.6, §4.7: with stops 'BX' and 'CDY', 'B' (held after 'AB') goes out once 'CD' is selected,
    and all of 'CD' is held: that chunk reports no token (none of its text is CD's) but says two
    were selected (`decodespec.selected`), the timeline hold-back is judged by; a stream that asks
    for no reports says nothing."""
    base = scripted([101, 102, 103, 110])
    body = {"model": "m", "prompt": [1], "max_tokens": 3, "temperature": 0, "stop": ["BX", "CDY"]}
    st = _stream(base, {**body, "return_token_ids": True})
    got = [(c["text"], c.get("token_ids"), c.get("decodespec")) for c in st.choices() if not c.get("finish_reason")]
    assert got == [("", None, None), ("A", [101], {"selected": 1}), ("B", [], {"selected": 2}),
                   ("CDE", [102, 103], {"selected": 3})]  # the opening chunk, then the deltas
    assert st.timeline().selected == (0, 1, 2, 3) and st.timeline().reported == (0, 1, 1, 3)
    assert all("decodespec" not in c for c in _stream(base, body).choices() if not c.get("finish_reason"))


SERVED = {  # the reference's own streams: script, request, what it selected
    "stop held across tokens": ([121, 101, 102, 104, 105, 110], {"max_tokens": 8, "stop": ["BCDE"]},
                                Want((121, 101, 102, 104, 105, 110), True, ("BCDE",), NOT_TEXT)),
    "split character": ([121, 111, 112, 103, 104, 110], {"max_tokens": 4}, Want((121, 111, 112, 103), False, (), NOT_TEXT)),
    "stop cut in a character": ([121, 111, 112, 103, 104, 110], {"max_tokens": 6, "stop": ["中E"]},
                                Want((121, 111, 112, 103), False, ("中E",), NOT_TEXT)),
}


@pytest.mark.parametrize("name", sorted(SERVED))
def test_the_references_entries_pass_and_any_one_moved_later_lost_doubled_or_changed_fails(scripted, name):
    """D59: the judge can fail. In the reference's own stream each token's entry goes with the chunk
    that sends its first byte, and passes; the entry of a token that is text moved to a later chunk
    (the text then runs ahead of it), any entry but a last not-text one left out, any entry sent
    twice, or any id changed, is a finding."""
    script, fields, want = SERVED[name]
    st = _stream(scripted(script), {"model": "m", "prompt": [1], "temperature": 0, "return_token_ids": True, **fields})
    good = [attrs.evolve(r, pieces=None) for r in chunk_reports(st)]  # judged on the ids alone
    assert judge_alignment(good, want, TOK, "stream") == []
    at = [(c, j) for c, r in enumerate(good) for j in range(len(r.ids or ()))]
    assert [good[c].ids[j] for c, j in at] == list(want.tokens)

    def changed(c: int, j: int, into: int | None = None, ids: tuple[int, ...] = ()) -> list:
        """The reports with entry j of chunk c taken out, `ids` put at its place (or into chunk `into`, first)."""
        out = [attrs.evolve(r) for r in good]
        left = out[c].ids[:j] + (ids if into is None else ()) + out[c].ids[j + 1:]
        out[c] = attrs.evolve(out[c], ids=left)
        if into is not None:
            out[into] = attrs.evolve(out[into], ids=ids + out[into].ids)
        return out

    for k, (c, j) in enumerate(at):
        tid = good[c].ids[j]
        mutants = {"doubled": changed(c, j, ids=(tid, tid)), "changed": changed(c, j, ids=(104 if tid != 104 else 105,))}
        if k < len(at) - 1 or tid not in NOT_TEXT:
            mutants["lost"] = changed(c, j)
        if tid not in NOT_TEXT and TOK.token_bytes(tid) and good[c].text:
            later = next((d for d in range(c + 1, len(good)) if good[d].ids is not None), None)
            if later is not None:
                mutants["moved later"] = changed(c, j, into=later, ids=(tid,))
        for kind, reports in mutants.items():
            assert judge_alignment(reports, want, TOK, "stream"), (kind, k, [(r.text, r.ids) for r in reports])


def test_chat_logprobs_content_carries_each_tokens_bytes(app_server):
    """Chat: logprobs.content entries with token, logprob, bytes (null for EOS) and top_logprobs."""
    tok = ByteTableTokenizer({i: bytes([32 + i]) for i in range(95)} | {95: b"\n", 96: b"", 97: bytes.fromhex("e4b8"),
                                                                          98: bytes.fromhex("ad")}, eos_id=96)
    base = app_server(create_app(Engine(ScriptedModel([33, 97, 98, 96], vocab_size=100), tok, poll_s=0.001),
                                 model_name="m"))
    r = httpx.post(f"{base}/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
        "stream": True, "logprobs": True, "top_logprobs": 1}, timeout=30)
    st = parse_sse(r.text)
    content = [((c.get("delta") or {}).get("content"), [(e["token"], e["bytes"]) for e in c["logprobs"]["content"]])
               for c in st.choices() if c.get("logprobs")]
    assert content == [("A", [("A", [65])]), ("中", [("bytes:\\xe4\\xb8", [228, 184]), ("bytes:\\xad", [173])]),
                       (None, [("", None)])]
    assert all(len(e["top_logprobs"]) == 1 for c in st.choices() if c.get("logprobs") for e in c["logprobs"]["content"])
    bad = httpx.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                         "top_logprobs": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


# ---- the judge on recorded exchanges -------------------------------------------------------------
# The §4.6 fixture with stop "BCDE": script a, AB, CD, E; the run ends at the stop, text "aA".
STOP_WANT = Want((121, 101, 102, 103), False, ("BCDE",), NOT_TEXT)


def _sse(*chunks: tuple[str, list[int] | None, list | None, str | None]) -> Streamed:
    """A completions stream: (text, token_ids, logprob tokens, finish_reason) per chunk."""
    lines = []
    for text, ids, toks, finish in chunks:
        choice = {"index": 0, "text": text, "finish_reason": finish,
                  "logprobs": None if toks is None else {"tokens": toks}}
        if ids is not None:
            choice["token_ids"] = ids
        lines.append("data: " + json.dumps({"id": "x", "choices": [choice]}, ensure_ascii=False))
    return parse_sse("\n\n".join(lines + ["data: [DONE]"]))


RECORDED = {
    # vLLM's way: each step's tokens in its chunk, the text held back by a fixed stop buffer (3
    # characters for a 4-character stop), the stop's tokens in the finish chunk: allowed (D59 rule 3).
    "tokens lead the held text": (_sse(("", [121], ["a"], None), ("", [101], ["AB"], None), ("aA", [102], ["CD"], None),
                                       ("", [103], ["E"], "stop")), None),
    # A chunk whose text the stop held back was not sent, and its tokens with it.
    "held chunk dropped": (_sse(("a", [121], ["a"], None), ("A", [101], ["AB"], None), ("", [103], ["E"], "stop")),
                           "tokens_lost"),
    "token twice": (_sse(("a", [121], ["a"], None), ("A", [101, 101], ["AB", "AB"], None),
                         ("", [102, 103], ["CD", "E"], "stop")), "tokens_extra"),
    "another token": (_sse(("a", [121], ["a"], None), ("A", [101], ["AB"], None), ("", [102, 104], ["CD", "F"], "stop")),
                      "tokens_wrong"),
    # The text of 'AB' sent with the first token's entry, before 'AB' was reported.
    "text before its token": (_sse(("aA", [121], ["a"], None), ("", [101], ["AB"], None),
                                   ("", [102, 103], ["CD", "E"], "stop")), "text_before_token"),
    # Every token reported in the first chunk, far ahead of the text a 4-character stop can hold.
    "tokens far ahead": (_sse(("", [121, 101, 102, 103], ["a", "AB", "CD", "E"], None), ("aA", [], [], "stop")),
                         "tokens_ahead"),
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_judge_on_recorded_exchanges(name):
    st, symptom = RECORDED[name]
    found = judge_alignment(chunk_reports(st), STOP_WANT, TOK, "stream")
    if symptom is None:
        assert found == []
    else:
        assert [f.symptom for f in found][:1] == [symptom], [f.message for f in found]
        assert found[0].invariant == INVARIANT


def test_per_token_bytes_that_do_not_spell_the_text_fail():
    """Chat `bytes` of U+FFFD for each half of a split character (the tokens' bytes are e4 b8 | ad)."""
    fffd = list("\ufffd".encode())
    chunk = {"index": 0, "delta": {"content": "中"}, "finish_reason": None, "logprobs": {"content": [
        {"token": "\ufffd", "bytes": fffd, "logprob": 0.0}, {"token": "\ufffd", "bytes": fffd, "logprob": 0.0}]}}
    end = {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": {"content": []}}
    st = parse_sse("\n\n".join("data: " + json.dumps({"id": "x", "choices": [c]}) for c in (chunk, end)))
    found = judge_alignment(chunk_reports(st), Want((111, 112), False, (), NOT_TEXT), TOK, "stream")
    assert [f.symptom for f in found] == ["token_bytes_differ"]


def test_the_last_not_text_token_may_be_left_out():
    """D15: the EOS that ended the run may be reported or not; any other missing token is lost."""
    want = Want((121, 110), True, (), NOT_TEXT)
    assert judge_alignment(chunk_reports(_sse(("a", [121], ["a"], None), ("", [], [], "stop"))), want, TOK, "s") == []
    assert judge_alignment(chunk_reports(_sse(("a", [121], ["a"], None), ("", [110], ["</s>"], "stop"))),
                           want, TOK, "s") == []


def test_tokens_a_failed_run_never_sent_may_be_left_out():
    """D59, D12: a run that fails on bytes no token completes (e4 b8 at the end) sent nothing of its
    last tokens; leaving them out of the reports is no lost token, leaving out a sent one is."""
    sent = chunk_reports(_sse(("a", [121], ["a"], None)))
    assert judge_alignment(sent, Want((121, 111), False, (), NOT_TEXT, unsent=1), TOK, "s") == []
    assert [f.symptom for f in judge_alignment(sent, Want((121, 111), False, (), NOT_TEXT), TOK, "s")] == ["tokens_lost"]


def test_a_token_a_stop_cuts_inside_may_be_reported_with_the_text_it_sends():
    """D59, §4.6: the token 'AB' completes the stop 'B' inside itself; the chunk that sends its 'A'
    reports it, and its 'B', cut by the stop, is never text the stream owes."""
    reports = chunk_reports(_sse(("A", [101], ["AB"], None), ("", [], [], "stop")))
    assert judge_alignment(reports, Want((101,), False, ("B",), NOT_TEXT, sent=1), TOK, "s") == []
    found = judge_alignment(reports, Want((101,), False, ("B",), NOT_TEXT), TOK, "s")
    assert [f.symptom for f in found] == ["tokens_ahead"]


def test_the_echoed_prompt_is_text_before_the_first_token():
    """D33, D59: with echo the stream first sends the prompt's text, which no selected token spells."""
    reports = chunk_reports(_sse(("", [], [], None), ("> ", [], [], None), ("a", [121], ["a"], None),
                                 ("", [], [], "length")))
    assert judge_alignment(reports, Want((121,), False, (), NOT_TEXT, echo=b"> "), TOK, "s") == []
    found = judge_alignment(reports, Want((121,), False, (), NOT_TEXT), TOK, "s")
    assert [f.symptom for f in found] == ["text_before_token"]


@pytest.mark.parametrize("bad", [10**6, -5])
def test_a_token_id_outside_the_vocabulary_is_a_finding_not_an_error(bad):
    """D59 rule 1: an id the tokenizer has not is the wrong token, named; the judge does not fail on it."""
    want = Want((121, 110), True, (), NOT_TEXT)
    found = judge_alignment(chunk_reports(_sse(("a", [bad], None, None), ("", [110], None, "stop"))), want, TOK, "s")
    assert found and found[0].symptom == "tokens_wrong" and f"id {bad}" in found[0].message


class _NoReports:
    """A ScriptServer whose streams carry no logprobs and no token ids (logprobs: null)."""

    def stream_body(self, path, body, **kw):
        return _sse(("a", None, None, None), ("A", None, None, "stop"))

    def post(self, path, body, log=None):
        return 200, {}, "{}"


def test_a_stream_without_per_token_reports_is_not_applicable():
    found, na = run_alignment(_NoReports(), None, {"model": "m"}, "/v1/completions", chat=False)
    assert found == [] and "no logprobs or token ids" in na


# ---- the cases over HTTP against decodespec serve ------------------------------------------------


@pytest.fixture(scope="module")
def aligned_set(tmp_path_factory):
    """The byte-table checkpoints of the stream/tokens-aligned cases and their chat variants."""
    cases = [c for c in with_chat(load_cases(["stream/tokens-aligned/"])) if http_blocker(c) is None
             and group_of(c) in ("byte_table", "byte_table-chatml")]
    out = tmp_path_factory.mktemp("aligned")
    groups: dict[str, list] = {}
    for c in cases:
        groups.setdefault(group_of(c), []).append(c)
    return {g: (build_group(g, cs, out / g, long=False), cs) for g, cs in sorted(groups.items())}


@pytest.mark.parametrize("group", ["byte_table", "byte_table-chatml"])
def test_decodespec_serve_passes_the_alignment_cases(aligned_set, app_server, group):
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.tokenizers import HFTokenizer

    ck, cases = aligned_set[group]
    assert len(cases) == 4
    url = app_server(create_app(Engine(HFModel(ck.folder), HFTokenizer(ck.folder))))
    results = run_cases(OpenAIAdapter(url, checkpoint=ck, sweep=False), cases)
    assert [r.verdict for r in results] == [Verdict.PASS] * len(cases), [
        (r.case.id, r.verdict.value, r.reason, [f.message for f in r.failures]) for r in results]


def test_with_echo_the_entries_are_the_outputs_tokens_and_offsets_count_the_prompt(scripted):
    """D59 with echo (D33): no prompt logprobs; the output's tokens, their offsets in the whole text."""
    base = scripted([121, 101, 110])
    r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 4, "temperature": 0,
                                                   "echo": True, "logprobs": 0}, timeout=30).json()["choices"][0]
    assert r["text"] == "> aAB"
    assert r["logprobs"]["tokens"] == ["a", "AB", "</s>"] and r["logprobs"]["text_offset"] == [2, 3, 5]


def test_a_chat_delta_the_split_holds_back_passes_its_tokens_to_the_next_chunk(app_server):
    """With the reasoning parser (D45) a held tag prefix sends no chunk: its tokens' entries go with
    the next chunk sent, so the stream still reports every token once and in order."""
    tok = ByteTableTokenizer({i: bytes([32 + i]) for i in range(95)} | {95: b"\n", 96: b""}, eos_id=96)
    script = [ord(c) - 32 for c in "<think>hm</think>ok"] + [96]
    base = app_server(create_app(Engine(ScriptedModel(script, vocab_size=100), tok, poll_s=0.001), model_name="m",
                                 reasoning_parser=True))
    r = httpx.post(f"{base}/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0,
        "stream": True, "return_token_ids": True}, timeout=30)
    chunks = [c for c in parse_sse(r.text).choices() if c.get("token_ids") is not None]
    assert [i for c in chunks for i in c["token_ids"]] == script
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hm"
    assert "".join(d.get("content", "") for d in deltas) == "ok"
    assert all(c["token_ids"] for c in chunks)  # no chunk was sent for the held tag pieces alone
