"""Generative conformance (`decodespec fuzz`, properties/conformance/fuzz): generated examples are
script cases of the suite's format (completions and chat, over the byte table and the three fixture
tokenizers), drawn the same from the same seed; a failure shrinks to the smallest example failing
with the same symptom and basis; and the reference, judged as `conform` judges it, fails none of
them, in process and over HTTP (§4.3-§4.10)."""

from __future__ import annotations

import json
import os

import click
import pytest

from decodespec.cli_fuzz import parse_budget
from decodespec.properties.conformance.adapters.base import Finding
from decodespec.properties.conformance.fuzz.session import draw_examples, fuzz, write_run
from decodespec.properties.conformance.fuzz.shrink import candidates, failure_key, shrink_all, size
from decodespec.properties.conformance.fuzz.strategies import (
    CHAT_TABLE,
    TABLE,
    Menu,
    case_of,
    settled,
    spelled,
    table_spec,
    well_posed,
)
from decodespec.properties.conformance.runner import CaseResult, Verdict, grade

pytest.importorskip("transformers")


def test_the_seed_decides_the_examples_and_each_is_a_case_of_the_suites_format():
    first, again, other = draw_examples(15, 7), draw_examples(15, 7), draw_examples(15, 8)
    assert first == again and first != other
    for i, ex in enumerate(first):
        case = case_of(f"fuzz/t/{i + 1:03d}", ex)
        assert case.kind.value == "script" and case.inputs == ex
        assert 1 <= ex["max_tokens"] <= len(spelled(ex).ids)  # nothing forced past the script (§4.3)


def test_an_engine_draws_what_it_serves(tmp_path):
    """A server loading GGUF files never draws WordPiece (llama.cpp's converter refuses it); a -chat
    preset's server draws chat examples only, a plain one completions only, the reference in
    process (its parsers on) both."""
    from decodespec.properties.conformance.fuzz.batch import InProcess, Launched, Module, menu_of

    gguf = Launched("llama-server -m {gguf} --port {port}", tmp_path)
    plain = Launched("decodespec serve --port {port} --model {model}", tmp_path)
    chat = Launched("decodespec serve --port {port} --model {model} --reasoning-parser think", tmp_path, chat=True)
    assert "wordpiece" not in gguf.menu.tokenizers and "wordpiece" in plain.menu.tokenizers
    assert (plain.menu.completions, plain.menu.chat, chat.menu.completions, chat.menu.chat) == (True, False, False, True)
    assert InProcess().menu.completions and InProcess().menu.chat and not Module("m:f").menu.chat
    assert menu_of(object()) == Menu()  # an engine naming no menu: every completions example
    drawn = draw_examples(40, 3, gguf.menu)
    assert drawn and all(ex["tokenizer"].get("fixture") != "wordpiece" and "chat" not in ex for ex in drawn)
    with pytest.raises(ValueError, match="no tokenizer 'bert'"):
        Menu(("bert",))


def test_chat_examples_are_chat_cases_over_the_channels_shapes():
    """Chat examples (D45-D47) are chat cases of the suite's format: the BOS template on the byte
    table only, no field a chat request lacks (echo, n), per-token reports only where no channel
    splits the answer, think tags only where reasoning is asked (the server's parser is the
    server's); and across a few dozen, reasoning and calls split across tokens, calls whose JSON
    holds a multi-byte character, stops and limits inside a channel."""
    drawn = [ex for ex in draw_examples(120, 5, Menu(completions=False, chat=True))]
    assert all("chat" in ex for ex in drawn)
    for i, ex in enumerate(drawn):
        case = case_of(f"fuzz/t/{i + 1:03d}", ex)
        chat, req = ex["chat"], ex.get("request", {})
        assert case.inputs["chat"] == chat and well_posed(ex)
        assert chat["template"] == "chatml" or "table" in ex["tokenizer"]
        assert not {"echo", "n"} & set(req)
        assert "logprobs" not in req or not (chat.get("reasoning") or chat.get("tools"))
    texts = [(ex, spelled(ex).text) for ex in drawn if "table" in ex["tokenizer"]]
    split_tag = [ex for ex, _ in texts if any(CHAT_TABLE[t] == b"<th" for t in ex["script"])]
    multi_byte_call = [ex for ex, t in texts if b"<tool_call>" in t and ("中".encode() in t or "ü".encode() in t)]
    inside = [ex for ex, t in texts if b"<think>" in t and any(s.encode() in t.split(b"</think>")[0] for s in ex.get("stop", ()))]
    assert split_tag and multi_byte_call and inside
    assert any(ex["max_tokens"] < len(ex["script"]) and ex["chat"].get("tools") for ex, _ in texts)


def test_a_stop_ending_where_a_token_runs_on_into_an_unfinished_character_is_drawn():
    """§4.3, §4.6: a token that completes a character and begins the next (`a`+e2, c3 then a9+e4b8)
    offers that character as a stop, completed with bytes pending past it; a U+FFFD of invalid bytes
    is never offered; and the generator draws such stops with a token after them."""
    ids = {p: i for i, p in TABLE.items()}

    def pending(*pieces):
        script = [ids[p] for p in pieces]
        return spelled(_example([101, *script], [])).pending_stops()

    assert pending(b"a\xe2", b"\x82\xac", b"\xc3", b"\xa9\xe4\xb8", b"\xad") == ["a", "aa", "é", "€é"]
    assert pending(b"\xff", b"\xe2", b"\x82\xac") == [] and pending(b"\xff\xe2"[:1], b"a\xe2") == ["a", "�a"]
    drawn = [(ex, spelled(ex)) for ex in draw_examples(400, 11, Menu(("byte_table",)))]
    hit = [ex for ex, sp in drawn for s in ex.get("stop", ()) if s in sp.pending_stops()
           and (k := sp.completes(s)) is not None and k < ex["max_tokens"]]
    assert hit


def test_min_tokens_is_drawn_on_the_token_that_completes_a_stop():
    """D31: min_tokens reaching the token that completes a stop (a stop string still ends the run
    there) is drawn, with max_tokens letting the run go past it."""
    drawn = [(ex, spelled(ex)) for ex in draw_examples(400, 12, Menu(("byte_table",)))]
    reach = [ex for ex, sp in drawn for s in ex.get("stop", ())
             if (k := sp.completes(s)) is not None and k <= ex.get("request", {}).get("min_tokens", 0) < ex["max_tokens"]]
    assert len(reach) >= 3


def test_a_stop_rests_on_d3_where_it_spans_the_prompt_and_the_output_not_inside_the_prompt():
    """D3: stops match output only; an engine that also matches across the prompt sees a stop that
    starts in the prompt and ends in the output. One wholly inside the prompt ends no sequence, so
    the case rests on no decision for it."""
    ids = {p: i for i, p in TABLE.items()}
    ex = {"tokenizer": table_spec([ids[b"A"], ids[b"a"], ids[b"b"]]), "prompt": [ids[b"A"]], "script": [ids[b"a"], ids[b"b"]],
          "max_tokens": 2}
    assert "D3" not in case_of("fuzz/t/001", {**ex, "stop": ["A"]}).decisions
    assert "D3" in case_of("fuzz/t/002", {**ex, "stop": ["Aa"]}).decisions
    assert "D3" not in case_of("fuzz/t/003", {**ex, "stop": ["ab"]}).decisions
    assert "D3" not in case_of("fuzz/t/004", {**ex, "stop": ["ab", "z"]}).decisions  # one of two can match
    assert "D3" in case_of("fuzz/t/005", {**ex, "stop": ["a", "b"]}).decisions


def test_a_request_field_names_its_decision_only_where_it_can_change_the_run():
    """D31, D33: ignore_eos rests on D31 over a scripted EOS within the limit only, min_tokens over
    an end it turns off (the EOS, a stop string, a stop token id within min_tokens); skip_special_tokens
    on D33 where the script selects a special token; include_stop_str_in_output where there is a stop
    to keep; echo always. A field that cannot change the run leaves its findings on the chapter."""
    ids = {p: i for i, p in TABLE.items()}
    plain = {"tokenizer": table_spec([ids[b"A"], ids[b"a"], ids[b"b"]]), "prompt": [ids[b"A"]],
             "script": [ids[b"a"], ids[b"b"]], "max_tokens": 2}
    with_eos = {**plain, "script": [ids[b"a"], 100, ids[b"b"]], "max_tokens": 3}

    def rests(ex, decision, **req):
        return decision in case_of("fuzz/t/010", {**ex, "request": req}).decisions

    assert not rests(plain, "D31", ignore_eos=True) and rests(with_eos, "D31", ignore_eos=True)
    # as llama-server's fuzz seed 3 stop-sent/029: the EOS past the limit, which ignore_eos turns nothing off
    assert not rests({**with_eos, "max_tokens": 1}, "D31", ignore_eos=True)
    assert not rests(plain, "D31", min_tokens=1) and not rests(with_eos, "D31", min_tokens=1)
    assert rests(with_eos, "D31", min_tokens=2) and rests({**plain, "stop": ["a"]}, "D31", min_tokens=1)
    assert rests({**plain, "stop_token_ids": [[ids[b"b"]]]}, "D31", min_tokens=2)
    assert not rests({**plain, "stop": ["b"]}, "D31", min_tokens=1)
    assert not rests(plain, "D33", skip_special_tokens=False) and rests(with_eos, "D33", skip_special_tokens=False)
    assert not rests(plain, "D33", include_stop_str_in_output=True)
    assert rests({**plain, "stop": ["b"]}, "D33", include_stop_str_in_output=True) and rests(plain, "D33", echo=True)


def test_settled_keeps_max_tokens_within_the_script_and_min_tokens_within_max_tokens():
    ex = {"tokenizer": table_spec([101, 102]), "prompt": [101], "script": [101, 102], "max_tokens": 9,
          "request": {"min_tokens": 5}}
    assert settled(ex)["max_tokens"] == 2 and settled(ex)["request"]["min_tokens"] == 2


def test_where_min_tokens_masks_a_scripted_eos_a_biased_script_token_stands_in():
    """D31: the masked EOS leaves every unscripted token of the forced checkpoint at one logit, a tie;
    a script token biased by logit_bias is greedy's choice there (as the hand-written cases do), and
    where the script has none, min_tokens stops short of the first masked token."""
    ex = {"tokenizer": table_spec([101, 100]), "prompt": [101], "script": [101, 100], "max_tokens": 2,
          "request": {"min_tokens": 2}}
    assert settled(ex)["request"] == {"min_tokens": 2, "logit_bias": {"101": 5}}
    only_eos = {**ex, "script": [101, 100], "stop_token_ids": [[101]]}
    assert "request" not in settled(only_eos)  # the stop id is token 1: no min_tokens holds it
    assert settled({**ex, "request": {"min_tokens": 1}})["request"] == {"min_tokens": 1}  # the EOS comes after


def _example(script, stops, **more):
    return settled({"tokenizer": table_spec(script), "prompt": [101], "script": script, "max_tokens": len(script),
                    **({"stop": stops} if stops else {}), **more})


def test_every_candidate_is_smaller_and_runs_on_the_reference():
    ex = _example([101, 106, 113, 100], ["bB", "b"], request={"n": 2})
    cands = candidates(ex)
    assert cands and all(size(c) < size(ex) for c in cands)
    assert cands == sorted(cands, key=size)


KEY_ID = next(i for i, b in TABLE.items() if b == "€".encode())


def _sends_stops(ex):
    """An engine's fault: it sends a stop's bytes whenever the script holds € and a stop is asked."""
    return KEY_ID in ex["script"] and ex.get("stop")


STOP_SENT = Finding("stop_bytes_never_emitted", "sent", symptom="stop_sent")


def _fake_run(calls, fails=_sends_stops, found=STOP_SENT):
    """A judge of an engine whose answer to an example shows `found` wherever `fails(example)`."""
    def run(exs, tag):
        calls.append(len(exs))
        return [grade(CaseResult(case_of(f"fuzz/{tag}/{i + 1:03d}", ex), "fake", Verdict.PASS,
                                 (found,) if fails(ex) else ())) for i, ex in enumerate(exs)]
    return run


def test_a_failure_shrinks_to_the_smallest_example_with_the_same_symptom_and_basis():
    ex = _example([101, 102, KEY_ID, 106, 113], ["€."], request={"include_stop_str_in_output": True})
    calls: list[int] = []
    [first] = _fake_run(calls)([ex], "g001")
    assert failure_key(first) == ("stop_sent", "chapter", "stop_bytes_never_emitted")
    [done] = shrink_all([(ex, first)], _fake_run(calls))
    assert done.proved and done.key == failure_key(first)
    assert done.minimal["script"] == [KEY_ID] and done.minimal["max_tokens"] == 1
    assert len(done.minimal["stop"]) == 1 and len(done.minimal["stop"][0]) == 1
    assert "request" not in done.minimal
    assert shrink_all([(ex, first)], _fake_run([])) == [done]  # deterministic


_CID = {b: i for i, b in CHAT_TABLE.items()}


def _chat_run(calls):
    """A judge of an engine that loses a tool call whose JSON holds 中, wherever tools are on."""
    return _fake_run(calls, lambda ex: (ex.get("chat") or {}).get("tools") and "中".encode() in spelled(ex).text,
                     Finding("calls_only_when_closed", "lost", symptom="chat_tool_calls"))


def test_a_chat_failure_shrinks_to_fewer_tokens_shorter_channels_and_fewer_settings():
    """A failing chat example (a reasoning section, a call split across tokens, the BOS template)
    shrinks to the one token the failure needs under the one setting it needs: the reasoning
    section and its setting gone (the think tags first: never a tag under reasoning off), the
    call's tags and the rest of its JSON gone, the template ChatML."""
    ids = [_CID[b] for b in (b"<th", b"ink>", b"Let me", b"</think>", b"<tool", b"_call>", b'{"name": "get_weather", ',
                              b'"arguments": {"city": "', "中".encode(), b'"}}', b"</tool_call>")]
    ex = settled({"tokenizer": table_spec([*ids, 101], CHAT_TABLE), "prompt": [101], "script": [*ids, 100],
                  "max_tokens": len(ids) + 1, "stop": ["Let"], "chat": {"template": "bos", "reasoning": True, "tools": True}})
    assert all(well_posed(c) for c in candidates(ex))
    [first] = _chat_run([])([ex], "g001")
    [done] = shrink_all([(ex, first)], _chat_run([]), max_rounds=40)
    assert done.proved and done.key == ("chat_tool_calls", "decision", "D47")
    assert done.minimal["script"] == [_CID["中".encode()]] and done.minimal["max_tokens"] == 1
    assert done.minimal["chat"] == {"template": "chatml", "tools": True} and "stop" not in done.minimal


def test_a_minimal_chat_case_file_says_the_references_split_answer():
    """As the chat case files do (D45-D47): content, reasoning, calls and the wire finish reason."""
    from decodespec.properties.conformance.fuzz.session import case_json

    ids = [_CID[b] for b in (b"<think>", b"Let me", b"</think>", b"Hi!")]
    ex = {"tokenizer": table_spec([*ids, 101], CHAT_TABLE), "prompt": [101], "script": [*ids, 100], "max_tokens": 5,
          "chat": {"template": "chatml", "reasoning": True}}
    got = case_json(case_of("fuzz-minimal/chat-content/001", ex))
    assert got["expect"]["chat"] == {"content": "Hi!", "reasoning": "Let me", "tool_calls": [], "finish_reason": "stop"}
    assert "chat" not in case_json(case_of("fuzz/t/001", _example([101], None)))["expect"]


def test_a_chat_run_the_reference_fails_is_judged_not_skipped_as_a_refused_field(tmp_path):
    """D12 on chat: an invalid byte fails the run, so a server's error answer to a request with fields
    is the reference's own answer, judged (PASS for decodespec serve), not a refusal of the fields."""
    from decodespec.properties.conformance.fuzz.batch import InProcess, run_batch

    ff = next(i for i, b in TABLE.items() if b == b"\xff")
    ex = {"tokenizer": table_spec([101, ff], CHAT_TABLE), "prompt": [101], "script": [101, ff, 100], "max_tokens": 3,
          "chat": {"template": "chatml", "tools": True}, "request": {"min_tokens": 1}}
    [r] = run_batch([ex], "t001", InProcess(), tmp_path).results
    assert r.verdict is Verdict.PASS, (r.verdict, r.reason, [f.message for f in r.failures])


@pytest.mark.parametrize(("pieces", "chat"), [
    ((b"<tool_call>", b'{"name": "get_weather", ', b'"arguments": {"city": "', b"Z", b"\xc3"), {"tools": True}),
    ((b" think", b"<th", b"\xc3"), {"reasoning": True}),
], ids=["call-held", "tag-piece-held"])
def test_a_failed_chat_run_owes_nothing_the_splitter_held(tmp_path, pieces, chat):
    """§4.10, D12, D45, D47: a run that ends inside a character fails; what the split still held (a
    call not closed, a piece of a tag) was never sent, so the stream's content before the error
    owes none of it (the judge flushed it as a finished run's; found by decodespec fuzz as a FAIL of
    decodespec serve's stream, shrunk, confirmed by hand on the exchange)."""
    from decodespec.properties.conformance.fuzz.batch import InProcess, run_batch

    ids = [_CID[b] for b in pieces]
    ex = {"tokenizer": table_spec([*ids, 101], CHAT_TABLE), "prompt": [101], "script": ids, "max_tokens": len(ids),
          "chat": {"template": "chatml", **chat}}
    [r] = run_batch([ex], "t001", InProcess(), tmp_path).results
    assert r.verdict is Verdict.PASS, (r.verdict, r.reason, [f.message for f in r.failures])


@pytest.mark.parametrize(("args", "said"), [
    ([], "give one of --preset NAME, --launch CMD or --engine"),
    (["--engine", "reference", "--launch", "x {port}"], "(got --launch, --engine)"),
    (["--engine", "openai:http://127.0.0.1:1"], "reference or module:factory"),
    (["--engine", "reference", "--budget", "soon"], "no duration"),
])
def test_the_command_refuses_a_run_it_cannot_start_and_says_why(args, said):
    from click.testing import CliRunner

    from decodespec.cli import main

    done = CliRunner().invoke(main, ["fuzz", *args])
    assert done.exit_code == 2 and said in done.output, done.output


def test_budget_reads_seconds_minutes_and_hours_and_refuses_the_rest():
    assert [parse_budget(t) for t in ("90", "90s", "10m", "1h")] == [90, 90, 600, 3600]
    with pytest.raises(click.BadParameter, match="no duration"):
        parse_budget("ten minutes")
class _SendsStops:
    """An engine that sends a stop's bytes whenever the script holds € and a stop is asked; its
    answers say the checkpoint they were given, as the HTTP adapters' do."""

    label = "sends-stops"

    def __call__(self, cases, checkpoints, on_result):
        from decodespec.properties.conformance.checkpoints import digest

        out = []
        for ck in checkpoints:
            for case in (c for c in cases if c.id in ck.programs):
                bad = KEY_ID in case.inputs["script"] and case.inputs.get("stop")
                found = (Finding("stop_bytes_never_emitted", "sent", symptom="stop_sent"),) if bad else ()
                server = {"checkpoint": {"group": ck.group, "sha256": digest(ck.folder)}}
                sent = {"request": {"path": "/v1/completions", "body": {"prompt": list(ck.programs[case.id].prompt)}},
                        "status": 200}
                out.append(CaseResult(case, self.label, Verdict.PASS, found,
                                      observed={"server": server, "exchanges": [sent]}))
        return [grade(r) for r in out]


def test_a_run_files_each_minimal_case_judged_alone_with_a_reproducer_that_rebuilds_its_checkpoint(tmp_path):
    """The minimal case is judged again in a batch of the minimal cases alone; its reproducer builds
    that batch's checkpoint from the case files (`checkpoints build --cases`), to the same hash."""
    from click.testing import CliRunner

    from decodespec.cli import main
    from decodespec.properties.conformance.checkpoints import digest
    from decodespec.properties.conformance.fuzz.batch import judge_cases
    from decodespec.properties.conformance.fuzz.session import FuzzRun, filed_case

    ex = _example([101, KEY_ID, 106], ["€."])
    [first] = _fake_run([])([ex], "g001")
    [done] = shrink_all([(ex, first)], _fake_run([]))
    case = filed_case(done, 1, 1, _SendsStops.label)
    [alone] = judge_cases([case], _SendsStops(), tmp_path / "minimal")
    run = FuzzRun(1, _SendsStops.label, 1, 2, {failure_key(first): (ex, first)}, 1, (), (done,), 1.0, ((done, alone),))
    write_run(run, tmp_path / "out")
    assert case.id == "fuzz-minimal/stop-sent/001" and (tmp_path / "out/cases/fuzz-minimal/stop-sent--001.json").is_file()
    report = json.loads((tmp_path / "out/report.json").read_text(encoding="utf-8"))
    assert report["cases"][0]["id"] == case.id and report["cases"][0]["verdict"] == "FAIL"
    replay = report["cases"][0]["reproducer"]["replay"]
    assert f"decodespec checkpoints build --cases {tmp_path / 'out/cases'} --out ckpt --group byte_table" in replay
    done_cli = CliRunner().invoke(main, ["checkpoints", "build", "--cases", str(tmp_path / "out/cases"), "--out",
                                         str(tmp_path / "ckpt"), "--no-prove"])
    assert done_cli.exit_code == 0, done_cli.output
    assert digest(tmp_path / "ckpt/byte_table") == digest(tmp_path / "minimal/byte_table")


def test_a_run_shrinks_each_failure_and_judges_its_minimal_case_again_alone(tmp_path):
    run = fuzz(_SendsStops(), tmp_path, budget_s=600, seed=1, batch=20, max_batches=1, menu=Menu(("byte_table",)))
    assert run.failures and run.minimal
    for s, alone in run.minimal:
        assert failure_key(alone) == s.key and alone.case.id.startswith("fuzz-minimal/stop-sent/")
        # a stop_sent resting on D3 keeps two stops (or one across the prompt): fewer is another basis
        stops = alone.case.inputs["stop"]
        assert alone.case.inputs["script"] == [KEY_ID] and len(stops) == (2 if s.key[2] == "D3" else 1), (s.key, stops)


@pytest.mark.parametrize("fields", [{"echo": True, "logprobs": 1}, {"logprobs": 1}])
def test_decodespec_serve_passes_a_stop_inside_a_token_with_per_token_reports(tmp_path, fields):
    """A minimal case the fuzz shrank against decodespec serve (a judge's blind spot, D59, D33): one
    token ' hello' completes the stop 'e' inside itself; the chunk sending ' h' reports it, after
    the echoed prompt where asked, and its cut bytes are owed to no chunk."""
    from decodespec.properties.conformance.fuzz.batch import InProcess, run_batch

    ex = {"tokenizer": {"fixture": "sentencepiece_byte_fallback"}, "prompt": [{"text": "The"}],
          "script": [{"text": "hello"}], "max_tokens": 1, "stop": ["e"], "request": fields}
    [r] = run_batch([ex], "t001", InProcess(), tmp_path).results
    assert r.verdict is Verdict.PASS and not r.failures, [f.message for f in r.failures]


@pytest.mark.parametrize("ex", [
    {"tokenizer": {"fixture": "wordpiece"}, "prompt": [{"text": " café"}], "script": [{"token": "[UNK]"}, {"eos": True}],
     "max_tokens": 1},
    {"tokenizer": {"fixture": "sentencepiece_byte_fallback"}, "prompt": [{"text": "The"}],
     "script": [{"text": "hello"}, {"token": "<unk>"}, {"eos": True}, {"text": " world"}], "max_tokens": 4,
     "request": {"ignore_eos": True}},
], ids=["wordpiece-unk", "sentencepiece-unk-and-passed-eos"])
def test_decodespec_serve_passes_special_tokens_kept_as_text_with_per_token_reports(tmp_path, ex):
    """A minimal case the fuzz shrank against decodespec serve (a judge's blind spot, D33, D59): with
    skip_special_tokens false a special token is text (` [UNK]` after a WordPiece word, `<unk>`, an
    EOS that ignore_eos passes over), and the token reported with it spells that text."""
    from decodespec.properties.conformance.fuzz.batch import InProcess, run_batch

    req = {**ex.get("request", {}), "skip_special_tokens": False, "logprobs": 1}
    [r] = run_batch([{**ex, "request": req}], "t001", InProcess(), tmp_path).results
    assert r.verdict is Verdict.PASS and not r.failures, [f.message for f in r.failures]


def test_decodespec_serve_passes_a_failed_run_whose_last_tokens_were_held_for_a_stop(tmp_path):
    """A minimal case the fuzz shrank against decodespec serve (a judge's blind spot, §4.6, D12, D59):
    'é' twice under the stop 'é€', then a lone c3 at the limit: the run fails with the second 'é'
    still held for the stop, so its tokens (and the c3) were never sent and the stream reports the
    first 'é's alone."""
    from decodespec.properties.conformance.fuzz.batch import InProcess, run_batch

    ex = {"tokenizer": {"fixture": "byte_level_bpe"}, "prompt": [{"text": " café"}],
          "script": [{"text": "é"}, {"bytes": "c3"}, {"bytes": "a9"}, {"bytes": "c3"}], "max_tokens": 5,
          "stop": ["é€"], "request": {"logprobs": 1}}
    [r] = run_batch([ex], "t001", InProcess(), tmp_path).results
    assert r.verdict is Verdict.PASS and not r.failures, [f.message for f in r.failures]


# ---- CI: a short fuzz of the reference (a failure is a bug of the reference or of the judge) -------


def _short(engine, tmp_path, seed, batch=45):
    run = fuzz(engine, tmp_path / "work", budget_s=600, seed=seed, batch=batch, max_batches=1)
    bad = [(r.case.id, r.verdict.value, r.reason, [f.message for f in r.failures], r.case.inputs)
           for _, r in run.failing.values()] + [(r.case.id, r.reason) for r in run.errors]
    return run, bad


def test_a_short_fuzz_of_decodespec_serve_in_process_finds_nothing(tmp_path):
    """Completions and chat examples (its parsers on: reasoning and tool calls split off, D45-D47)."""
    from decodespec.properties.conformance.fuzz.batch import InProcess

    run, bad = _short(InProcess(), tmp_path, seed=46, batch=60)
    assert run.examples >= 50 and not bad, bad
    written = write_run(run, tmp_path / "out")
    assert {p.name for p in written} >= {"report.json", "report.md", "fuzz.json"}


def test_a_short_fuzz_of_decodespec_serve_over_http_finds_nothing(tmp_path):
    from decodespec.properties.conformance.fuzz.batch import Launched
    from decodespec.properties.conformance.presets import engine_path

    serve = Launched("decodespec serve --port {port} --model {model}", tmp_path / "logs", jobs=4,
                     env={**os.environ, "PATH": engine_path()})  # the decodespec beside this Python
    run, bad = _short(serve, tmp_path, seed=47)
    assert run.examples >= 30 and not bad, bad
