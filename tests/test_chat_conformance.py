"""Script cases on /v1/chat/completions (§4.3-§4.7, DECISIONS D45-D47): chat checkpoints
carry a chat template (ChatML; one with a BOS and a generation prompt), their programs are placed by
transformers' apply_chat_template and proved with transformers generate on the templated prompt,
and `decodespec serve` with its parsers passes every chat case, reasoning and tool calls included."""

from __future__ import annotations

import json

import pytest

from decodespec.properties.conformance.adapters.base import case_prompt, case_script, reference_on, table_tokenizer
from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.cases import load_cases
from decodespec.properties.conformance.chat import (
    ChatExpected,
    expected_chat,
    judge_chat,
    observe_message,
    observe_stream,
)
from decodespec.properties.conformance.chat_cases import TEMPLATES
from decodespec.properties.conformance.checkpoints import (
    build_group,
    group_of,
    http_blocker,
    prove,
    served_context,
    with_chat,
)
from decodespec.properties.conformance.reports import partial
from decodespec.properties.conformance.runner import Verdict, run_cases
from decodespec.properties.conformance.script_server import not_observable
from decodespec.properties.conformance.wire import parse_sse

# The chapter's cases CI runs on chat (every HTTP-runnable one runs in `decodespec conform` on the
# built set): stops across tokens, split characters, invalid bytes, the limit inside a character, EOS.
CHAPTER = ("stop/cross-token/001", "stop/multi-byte/001", "stop/overlap/001", "stop/last-token/001",
           "detok/utf8-split/001", "detok/invalid/002", "finish/eos-hidden/001", "finish/length/001",
           "usage/stop/001", "stop/hold-back/001", "finish/context-limit/001", "finish/ignore-eos/001")


@pytest.fixture(scope="module")
def chat_set(tmp_path_factory):
    """The two byte-table chat checkpoints: ChatML (the chat case files and the chapter cases above)
    and the BOS template (the chapter cases), each proved by transformers generate."""
    cases = with_chat(load_cases(["chat/", *CHAPTER]))
    picked = [c for c in cases if http_blocker(c) is None and (c.id.startswith(("chat/reasoning", "chat/tool-call"))
                                                               or c.id.removeprefix("chat-bos/").removeprefix("chat/") in CHAPTER)
              and c.id != c.id.removeprefix("chat")]
    out = tmp_path_factory.mktemp("chat")
    groups = {}
    for c in picked:
        groups.setdefault(group_of(c), []).append(c)
    return {g: (build_group(g, cs, out / g, long=False), cs) for g, cs in sorted(groups.items())}


def test_chat_programs_are_placed_by_the_template_and_proved_by_transformers(chat_set):
    """Every chat program's prompt is apply_chat_template's from the marker on, behind the template's
    opening (a BOS for the second), and transformers generate follows it on the whole templated prompt."""
    assert set(chat_set) == {"byte_table-chatml", "byte_table-bos"}
    for group, (ck, cases) in chat_set.items():
        tok = ck.tokenizer
        bos = TEMPLATES[group.rsplit("-", 1)[1]].bos
        for c in cases:
            info = ck.chat[c.id]
            ids = info["ids"]
            assert ids[-len(ck.programs[c.id].prompt):] == list(ck.programs[c.id].prompt)
            assert len(ids) > len(ck.programs[c.id].prompt)  # the template's opening stands before the marker
            assert (tok.id_to_token(ids[0]) == bos) if bos else tok.id_to_token(ids[0]) == "<|im_start|>"
        assert "followed exactly" in prove(ck, ("float32",))


def test_the_case_files_chat_expectations_are_the_references_split():
    """D15 for chat: each chat case file's stated answer (content, reasoning, calls, finish) is the
    reference's on the case's own tokenizer, split by spec/channels.toml."""
    for case in load_cases(["chat/"]):
        tok = table_tokenizer(case.tokenizer_spec)
        exp = expected_chat(case, tok, case_prompt(case, tok), case_script(case, tok))
        want = json.loads(case.path.read_text(encoding="utf-8"))["expect"]["chat"]
        got = {"content": exp.content, "reasoning": exp.reasoning,
               "tool_calls": [{"name": n, "arguments": a} for n, a in exp.calls], "finish_reason": exp.finish_reason}
        assert got == want, case.id


@pytest.fixture(scope="module")
def served(chat_set, app_server):
    from decodespec.runtime.engine import Engine
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.server import create_app
    from decodespec.runtime.tokenizers import HFTokenizer

    def start(group: str, **parsers) -> str:
        ck = chat_set[group][0]
        return app_server(create_app(Engine(HFModel(ck.folder), HFTokenizer(ck.folder)), **parsers))

    return start


@pytest.mark.parametrize("group", ["byte_table-chatml", "byte_table-bos"])
def test_decodespec_serve_passes_every_chat_case(chat_set, served, group):
    """Content, reasoning_content and tool calls, streamed and not, every limit swept for the
    reasoning and tool cases, usage.prompt_tokens as transformers counts the templated prompt."""
    ck, cases = chat_set[group]
    cases = [c for c in cases if "context_limit" not in c.inputs]  # on a server of their own: below
    url = served(group, reasoning_parser=True, tool_parser=True)
    results = run_cases(OpenAIAdapter(url, checkpoint=ck), cases)
    assert [r.verdict for r in results] == [Verdict.PASS] * len(cases), [
        (r.case.id, r.verdict.value, r.reason, [f.message for f in r.failures]) for r in results if r.verdict is not Verdict.PASS]
    # partial where the completions twin is: what no HTTP answer shows (a state, an internal event) is not checked
    assert all(set(not_observable(r.case)) <= set(r.not_checked) for r in results)
    assert sum(partial(r) for r in results) >= sum(bool(not_observable(r.case)) for r in results) > 0


@pytest.mark.parametrize("group", ["byte_table-chatml", "byte_table-bos"])
def test_a_chat_context_limit_case_runs_on_a_context_that_holds_the_templated_prompt(chat_set, group, tmp_path):
    """§4.3 (D10) on chat: the served context is the case's, widened by every token before the case's
    prompt, the template's included (transformers' count of the templated prompt), so as many output
    tokens fit as in the case; the reference runs the program with the same room. Counting the
    program's tokens alone made a context the templated prompt did not fit in, and the case judged a
    refusal (decodespec serve 'passed' by refusing; llama-server 'failed' by answering)."""
    import sys

    from decodespec.properties.conformance.launch import run_launched

    ck, cases = chat_set[group]
    [case] = [c for c in cases if "context_limit" in c.inputs]
    room = int(case.inputs["context_limit"]) - len(case_prompt(case, ck.tokenizer))
    assert served_context(case, ck) == ck.chat[case.id]["prompt_tokens"] + room
    serve = f"{sys.executable} -m decodespec serve --port {{port}} --model {{model}}"
    [res] = run_launched([case], [ck.folder], serve, log_dir=tmp_path, context_command=serve + " --context-limit {context}")
    assert res.verdict is Verdict.PASS, (res.reason, [f.message for f in res.failures])
    assert res.observed["reference"]["finish_reason"] == "length" and res.observed["reference"]["selected_tokens"] == room


def test_a_server_without_the_parsers_fails_the_reasoning_and_tool_cases(chat_set, served):
    """The cases can fail: with every tag left in the content, reasoning and calls are missing, and
    the lead is the tags sent as text, which is where the reasoning went (chat.EXPLAINING)."""
    ck, cases = chat_set["byte_table-chatml"]
    mine = [c for c in cases if c.id in ("chat/reasoning/special-tags/001", "chat/tool-call/text-before/001")]
    results = {r.case.id: r for r in run_cases(OpenAIAdapter(served("byte_table-chatml"), checkpoint=ck, sweep=False), mine)}
    assert results["chat/reasoning/special-tags/001"].first_invariant == "think_tags_never_text"
    assert {f.invariant for f in results["chat/reasoning/special-tags/001"].failures} >= {"reasoning_is_bracketed",
                                                                                          "pieces_once"}
    assert results["chat/tool-call/text-before/001"].verdict is Verdict.SKIP  # tools refused: n/a, with the reason


def test_a_chat_engine_that_leaves_the_script_is_an_error_naming_the_position_not_a_fail(chat_set, app_server,
                                                                                         tmp_path):
    """D27 on chat: with the lm_head row of token 104 ('F') pushed far down, the served model writes
    another token where the script has F; the chat case is an ERROR that names the position (read
    from the message's content), never a FAIL of the case."""
    import shutil

    from safetensors.torch import load_file, save_file

    from decodespec.properties.conformance.checkpoints import Checkpoint
    from decodespec.runtime.engine import Engine
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.server import create_app
    from decodespec.runtime.tokenizers import HFTokenizer

    ck, cases = chat_set["byte_table-chatml"]
    bent = tmp_path / "bent"
    shutil.copytree(ck.folder, bent)
    weights = load_file(bent / "model.safetensors")
    weights["lm_head.weight"][104] = -50.0  # one weight row changed: F never wins
    save_file(weights, bent / "model.safetensors")
    [case] = [c for c in cases if c.id == "chat/finish/length/001"]  # script E, F, G, H with max_tokens 3
    url = app_server(create_app(Engine(HFModel(bent), HFTokenizer(bent))))
    [res] = run_cases(OpenAIAdapter(url, checkpoint=Checkpoint.load(bent), sweep=False), [case])
    assert res.verdict is Verdict.ERROR and not res.failures, (res.verdict, res.failures)
    assert "did not follow the forced script at token 2" in res.reason, res.reason


def test_a_chat_server_that_bans_a_guarded_eos_is_an_error_naming_what_it_wrote(chat_set, served):
    """D31, D66 on chat: a server that bans EOS under ignore_eos writes its runner-up in the message's
    content where the reference passes over the EOS: an ERROR naming it, never a FAIL of the case."""
    from _engine_kit import eos_banned_under_ignore_eos

    ck, cases = chat_set["byte_table-chatml"]
    [case] = [c for c in cases if c.id == "chat/finish/ignore-eos/001"]
    adapter = OpenAIAdapter(served("byte_table-chatml"), checkpoint=ck, sweep=False)
    with eos_banned_under_ignore_eos(ck.eos_id):
        [res] = run_cases(adapter, [case])
    assert res.verdict is Verdict.ERROR and not res.failures, (res.verdict, res.failures)
    assert "did not pass over the guarded EOS at token 2: it wrote" in res.reason, res.reason


def test_a_server_declared_without_a_parser_has_its_cases_na_and_the_rest_judged(chat_set, served):
    """`--without reasoning` / `tool_calls` (without.WITHOUT): a parser the engine does not have is
    its choice, not a broken rule, so those cases are n/a with the reason; every other chat case is
    still judged on the same server. An unknown name is refused before anything is sent."""
    ck, cases = chat_set["byte_table-chatml"]
    mine = [c for c in cases if c.id in ("chat/reasoning/special-tags/001", "chat/tool-call/text-before/001",
                                         "chat/stop/cross-token/001")]
    assert len(mine) == 3
    adapter = OpenAIAdapter(served("byte_table-chatml"), checkpoint=ck, sweep=False,
                            without=frozenset({"reasoning", "tool_calls"}))
    results = {r.case.id: r for r in run_cases(adapter, mine)}
    assert results["chat/reasoning/special-tags/001"].verdict is Verdict.SKIP
    assert results["chat/reasoning/special-tags/001"].reason.startswith("the server has no reasoning parser")
    assert results["chat/reasoning/special-tags/001"].reason.endswith("(--without reasoning)")
    assert results["chat/tool-call/text-before/001"].reason.endswith("(--without tool_calls)")
    assert results["chat/stop/cross-token/001"].verdict is Verdict.PASS
    with pytest.raises(ValueError, match="tool_parser is not something a server can lack here; known: stop_token_ids"):
        OpenAIAdapter("http://127.0.0.1:9", checkpoint=ck, without=frozenset({"tool_parser"}))


def test_the_chatml_template_renders_reasoning_calls_and_tools_as_parsers_derive_them():
    """What llama.cpp's differential autoparser (common/chat-diff-analyzer.cpp) renders to find its
    parsers, rendered here as transformers renders it: an assistant turn with reasoning_content adds
    exactly `<think>R</think>`, one with tool_calls exactly a Hermes call (`<tool_call>{"name": ...,
    "arguments": ...}</tool_call>`, with object or string arguments), `tools` a system turn naming
    them; one user message without tools stays plain ChatML, as the chapter's chat cases need."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from decodespec.properties.conformance.chat_cases import TOOLS

    src = TEMPLATES["chatml"].source

    def render(messages, tools=None, gen=False):
        return render_jinja_template(conversations=[messages], tools=tools, chat_template=src,
                                     add_generation_prompt=gen)[0][0]

    user = {"role": "user", "content": "U"}
    assert render([user], gen=True) == "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    listed = render([user], tools=TOOLS, gen=True)
    assert listed.startswith("<|im_start|>system\n") and '{"name": "get_weather"}' in listed
    assert listed.endswith("<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    plain = render([user, {"role": "assistant", "content": "A"}])
    thought = render([user, {"role": "assistant", "content": "A", "reasoning_content": "R"}])
    assert thought == plain.replace("assistant\nA", "assistant\n<think>R</think>A")
    for args in ({"city": "Paris"}, '{"city": "Paris"}'):
        call = {"type": "function", "function": {"name": "get_weather", "arguments": args}}
        called = render([user, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=TOOLS)
        assert called.endswith('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": '
                               '{"city": "Paris"}}</tool_call><|im_end|>\n')


@pytest.mark.parametrize("names", [("reasoning",), ("reasoning_content",), ("reasoning", "reasoning_content")],
                         ids=["new-name", "old-name", "both-names"])
def test_a_reasoning_delta_counts_once_whichever_names_carry_it(names):
    """§4.7 (D45): a reasoning piece is sent once. A server that keeps the old field name beside the
    new one (the same text under both, as some do for older clients) still sent it once."""
    pieces = ["<think>", "Let me", " see", "</think>"]
    chunks = [{"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    chunks += [{"id": "c", "choices": [{"index": 0, "delta": dict.fromkeys(names, p), "finish_reason": None}]}
               for p in pieces]
    chunks += [{"id": "c", "choices": [{"index": 0, "delta": {"content": "Hi", "reasoning": None}, "finish_reason": None}]},
               {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    obs = observe_stream(parse_sse(body))
    assert obs.reasoning == "".join(pieces) and obs.content == "Hi" and obs.finish_reason == "stop"
    assert [field for field, _ in obs.leaks] == [names[-1] if len(names) == 1 else "reasoning_content"] * 2


def test_a_chat_answer_that_splits_nothing_is_judged_by_the_completions_rules():
    """§4.3-§4.6 on chat (D45): where nothing is split off the content (no reasoning, no tools), the
    answer is a completions answer in a chat envelope and is judged as one (judgement.observe reads
    the message's content and the deltas' content; the role chunk opens the stream). An empty content
    chunk mid-stream is an empty delta, a held stop prefix sent early is named (where the logprobs
    with each chunk show the token boundaries), and the reference's own answer passes; the chat
    judge alone, by the whole content, saw neither."""
    from decodespec.properties.conformance import http_script
    from decodespec.properties.conformance.judgement import judge_observed, observe

    case, exp = next((c, http_script.expected_of(c, tok, case_prompt(c, tok), case_script(c, tok),
                                                   reference_on(c, tok, case_prompt(c, tok), case_script(c, tok))))
                     for c in load_cases(["stop/hold-back/001"]) for tok in [table_tokenizer(c.tokenizer_spec)])
    text, why = exp.output.decode(), exp.wire_reason

    def answer(*deltas: str, reports: tuple[int, ...] = ()) -> tuple:
        """The answer both ways; `reports`: the logprobs entries each delta carries (none: no logprobs)."""
        message = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": why}],
                   "usage": {"completion_tokens": exp.selected}}
        logprobs = [{"logprobs": {"content": [{"token": "t", "logprob": 0.0}] * n}} for n in reports] or [{}] * len(deltas)
        chunks = [{"delta": {"role": "assistant", "content": ""}},
                  *({"delta": {"content": d}, **lp} for d, lp in zip(deltas, logprobs))]
        sse = "".join(f"data: {json.dumps({'id': 'c', 'choices': [{'index': 0, **d, 'finish_reason': None}]})}\n\n"
                      for d in chunks)
        sse += f"data: {json.dumps({'id': 'c', 'choices': [{'index': 0, 'delta': {}, 'finish_reason': why}]})}\n\ndata: [DONE]\n\n"
        return observe(200, message, json.dumps(message), parse_sse(sse))

    assert judge_observed(exp, answer(*[p.decode() for p in _released(exp)]))[0] == []
    found = {f.symptom for f in judge_observed(exp, answer(text[:1], "", text[1:]))[0]}
    assert "empty_delta" in found
    assert exp.output == b"ABCD" and exp.released == (1, 4)  # 'B' held after 'AB': it may begin the stop 'BX'
    # 'AB' with token 1 alone, from an engine that reports tokens as it selects them ('CD' before its text)
    early = {f.symptom for f in judge_observed(exp, answer("AB", "", "CD", reports=(1, 1, 0)))[0]}
    assert "stop_prefix_sent" in early, early
    assert "stop_prefix_sent" not in {f.symptom for f in judge_observed(exp, answer("AB", "CD"))[0]}  # no boundaries


def _released(exp) -> list[bytes]:
    """The reference's deltas: the bytes it had sent after each selected token, as chunks."""
    out, sent = [], 0
    for n in exp.released:
        if n > sent:
            out.append(exp.output[sent:n])
            sent = n
    return out + ([exp.output[sent:]] if sent < len(exp.output) else [])


def test_tool_call_arguments_sent_as_an_object_are_a_wire_finding_not_a_crash():
    """D47: the call is judged by its name and arguments; arguments given as a JSON object where the
    API gives JSON text (a server that does so in either answer) compare as the value they hold,
    and the form is named as a wire finding, never an ERROR of the run."""
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    exp = ChatExpected("", "", (("get_weather", {"city": "Paris"}),), "tool_calls", 9, True)
    message = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": call}]}}],
        "usage": {"completion_tokens": 9, "prompt_tokens": 5}}
    chunks = [{"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": call}]},
                                       "finish_reason": None}]},
              {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
    stream = parse_sse("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")
    for where, obs in (("message", observe_message(200, message)), ("stream", observe_stream(stream))):
        assert obs.calls == exp.calls, where
        found = judge_chat(exp, obs, where)
        assert [(f.symptom, f.family) for f in found] == [("call_arguments", "wire")], (where, found)
        assert "arguments given as a JSON dict" in found[0].message
