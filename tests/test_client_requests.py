"""What real clients and routers send is answered (DECISIONS D30): the request bodies of
the openai Python client, LangChain's OpenAI and ChatOpenAI, and vllm-router in front of a server,
recorded offline (tests/fixtures/client_requests.json says how), each a 200 from `decodespec serve`
with a well-formed answer (§4.7: a stream ends with its finish and one [DONE]). LangChain's
completions carry frequency_penalty; vllm-router adds echo to every completions body it forwards,
and engine extensions (ignore_eos, no_stop_trim, return_hidden_states, ...) to every body."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from _engine_kit import ascii_tokenizer, serve_in_thread, tiny_model

from decodespec.runtime.engine import Engine
from decodespec.runtime.server import create_app

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "client_requests.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def base():
    # a context of 512: LangChain's OpenAI asks for max_tokens 256 by default
    with serve_in_thread(create_app(Engine(tiny_model(512), ascii_tokenizer(), poll_s=0.001), model_name="tiny")) as url:
        yield url


def test_the_fixtures_cover_each_client_and_both_endpoints():
    seen = {(r["client"].split()[0], r["path"]) for r in RECORDED["requests"]}
    for client in ("openai-python", "langchain-openai", "vllm-router"):
        assert {(client, "/v1/completions"), (client, "/v1/chat/completions")} <= seen


@pytest.mark.parametrize("rec", RECORDED["requests"], ids=lambda r: f"{r['client']}: {r['call']}")
def test_a_recorded_client_request_is_answered(base, rec):
    body = rec["body"]
    chat = rec["path"].endswith("chat/completions")
    if not body.get("stream"):
        r = httpx.post(base + rec["path"], json=body, timeout=120)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == body.get("n", 1) and all(c["finish_reason"] in ("stop", "length") for c in choices)
        assert all(isinstance(c["message"]["content"] if chat else c["text"], str) for c in choices)
        return
    with httpx.stream("POST", base + rec["path"], json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    finishes = [c["finish_reason"] for d in data[:-1] for c in json.loads(d)["choices"] if c["finish_reason"]]
    assert len(finishes) == body.get("n", 1)
