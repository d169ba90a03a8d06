"""`decodespec serve` answers chat with reasoning_content and tool_calls in OpenAI's shapes, split
by spec/channels.toml (§4.7; DECISIONS D45-D47), streamed and not, agreeing."""

from __future__ import annotations

import json

import httpx
import pytest

from decodespec.runtime import ByteTableTokenizer, Engine, ScriptedModel
from decodespec.runtime.server import create_app

# Every byte a token (the chat template's text), plus the tags and pieces the script uses.
TABLE = {**{100 + b: bytes([b]) for b in range(256)}, 1: b"<think>", 2: b"hm", 3: b"</think>", 5: b"", 6: b"Hi ",
         7: b"<tool_call>", 8: b'{"name": "f", "arguments": {"x": 1}}', 9: b"</tool_call>", 10: b"<th", 11: b"ink>"}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _serve(app_server, script, **kw):
    tok = ByteTableTokenizer(TABLE, eos_id=5)
    return app_server(create_app(Engine(ScriptedModel(script, vocab_size=400), tok), **kw))


def _ask(url, **body):
    body = {"model": "scripted", "messages": [{"role": "user", "content": "x"}], "max_tokens": 12, "temperature": 0,
            **body}
    whole = httpx.post(url + "/v1/chat/completions", json=body).json()
    text = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return whole["choices"][0], [c["choices"][0] for c in chunks]


def _streamed(chunks, field):
    return "".join(c["delta"].get(field) or "" for c in chunks)


def test_reasoning_content_and_tool_calls_come_in_openai_shapes(app_server):
    url = _serve(app_server, [1, 2, 3, 6, 7, 8, 9, 5], reasoning_parser=True, tool_parser=True)
    choice, chunks = _ask(url, tools=TOOLS)
    msg = choice["message"]
    assert (msg["reasoning_content"], msg["content"], choice["finish_reason"]) == ("hm", "Hi ", "tool_calls")
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "f"
    assert json.loads(call["function"]["arguments"]) == {"x": 1}
    assert _streamed(chunks, "reasoning_content") == "hm" and _streamed(chunks, "content") == "Hi "
    [streamed_call] = [t for c in chunks for t in c["delta"].get("tool_calls") or []]
    assert streamed_call["index"] == 0 and streamed_call["function"] == call["function"]
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["tool_calls"]


def test_a_think_tag_split_across_tokens_never_reaches_a_chunk(app_server):
    url = _serve(app_server, [10, 11, 2, 3, 6, 5], reasoning_parser=True)
    choice, chunks = _ask(url)
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == ("hm", "Hi ")
    assert not any("<" in (c["delta"].get("content") or "") + (c["delta"].get("reasoning_content") or "")
                   for c in chunks)


@pytest.mark.parametrize("max_tokens", [5, 6])
def test_a_call_cut_by_the_limit_is_length_and_no_call(app_server, max_tokens):
    """D47: the budget ends inside the call (after <tool_call> or after its JSON, before the close):
    finish length, no tool_calls, the call's text is content."""
    url = _serve(app_server, [1, 2, 3, 6, 7, 8, 9, 5], reasoning_parser=True, tool_parser=True)
    choice, chunks = _ask(url, tools=TOOLS, max_tokens=max_tokens)
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("Hi <tool_call>")
    assert not any(c["delta"].get("tool_calls") for c in chunks)
    assert _streamed(chunks, "content") == choice["message"]["content"]


def test_without_the_parsers_every_tag_is_content_and_tools_are_refused(app_server):
    url = _serve(app_server, [1, 2, 3, 5])
    choice, _ = _ask(url)
    assert choice["message"] == {"role": "assistant", "content": "<think>hm</think>"}
    refused = httpx.post(url + "/v1/chat/completions", json={"model": "scripted", "messages": [{"role": "user", "content": "x"}],
                                                             "tools": TOOLS})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_chat_template_kwargs_reach_the_checkpoints_template():
    """D48: the request's chat_template_kwargs are passed to the template, as transformers passes them."""
    from decodespec.runtime.openai_schema import compile_chat_template

    render = compile_chat_template("{{ bos_token }}{% if enable_thinking is false %}no{% endif %}{{ messages[0]['content'] }}",
                                   {"bos_token": "<s>"})
    assert render([{"role": "user", "content": "x"}], {"enable_thinking": False}) == "<s>nox"
    assert render([{"role": "user", "content": "x"}]) == "<s>x"
