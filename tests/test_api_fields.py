"""Every field of OpenAI's completions and chat completions requests, and the documented engine
extensions, each tested (DECISIONS D30-D34): accepted at its neutral value without changing the
answer; a neutral-only field at another value refused with a 400 that names the field and the
value as not supported (never "unknown"); each implemented field shown to act; an unknown field
still refused; `--strict` accepts only the short list of STRICT_FIELDS. n choices and best_of (§4.7,
§4.10): one request per choice, each with its own finish, ended when all have."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from _engine_kit import ascii_tokenizer, serve_in_thread, tiny_model

from decodespec.properties import check_trace
from decodespec.runtime.engine import Engine
from decodespec.runtime.openai_schema import (
    FIELDS,
    IMPLEMENTED,
    INFORMATIONAL,
    NEUTRAL,
    NOT_REPORTED,
    STRICT_FIELDS,
)
from decodespec.runtime.server import IGNORED_HEADER, create_app

MODEL = "tiny"
BASE = {False: {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        True: {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}}
PATH = {False: "/v1/completions", True: "/v1/chat/completions"}


@pytest.fixture(scope="module")
def servers():
    engine = Engine(tiny_model(512), ascii_tokenizer(), poll_s=0.001)
    strict_engine = Engine(tiny_model(512), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL)) as base, \
            serve_in_thread(create_app(strict_engine, model_name=MODEL, strict=True)) as strict:
        yield {"base": base, "engine": engine, "strict": strict}


def post(servers, chat, extra, *, server="base"):
    return httpx.post(f"{servers[server]}{PATH[chat]}", json={**BASE[chat], **extra}, timeout=60)


def text(r, i=0):
    ch = r.json()["choices"][i]
    return ch["message"]["content"] if "message" in ch else ch["text"]


def _all(status=None):
    return [(chat, name) for chat in (False, True) for name, f in FIELDS[chat].items()
            if status is None or f.status == status]


def _ids(p):
    return f"{'chat' if p[0] else 'completions'}-{p[1]}"


# A neutral value for the fields that declare none (their "nothing asked" is null or the default).
NEUTRAL_OF = {"temperature": 0, "top_p": 1, "stream": False, "stream_options": None, "stop": None, "seed": None,
              "utf8_guard": None, "max_completion_tokens": None, "max_tokens": 4, "user": "u-1",
              "metadata": {"k": "v"}, "prompt_cache_key": "k", "prompt_cache_retention": None,
              "safety_identifier": "s", "audio": None, "prediction": None, "web_search_options": None,
              "truncate_prompt_tokens": None, "logprobs": None}
STRUCTURAL = {"model", "prompt", "messages"}  # the base body itself


@pytest.mark.parametrize("field", [p for p in _all() if p[1] not in STRUCTURAL], ids=_ids)
def test_every_field_is_accepted_at_its_neutral_value_and_changes_nothing(servers, field):
    """D30: each field at each of its neutral values is a 200 with the greedy answer of the body
    without it."""
    chat, name = field
    f = FIELDS[chat][name]
    want = text(post(servers, chat, {}))
    for value in [None, *f.neutral] if f.neutral else [NEUTRAL_OF[name]]:
        r = post(servers, chat, {name: value})
        assert r.status_code == 200, (name, value, r.text)
        assert text(r) == want, (name, value)


# A value each neutral-only field does not support.
OTHER = {"suffix": " end", "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
         "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
         "parallel_tool_calls": None, "functions": [{"name": "f"}], "function_call": {"name": "f"},
         "response_format": {"type": "json_object"}, "prediction": {"type": "content", "content": "x"},
         "reasoning_effort": "high", "verbosity": "low", "web_search_options": {}, "store": True,
         "service_tier": "flex", "spaces_between_special_tokens": False, "return_hidden_states": True,
         "use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 2, "truncate_prompt_tokens": 8,
         "typical_p": 0.5, "continue_final_message": True, "include_reasoning": None, "separate_reasoning": None,
         "stream_reasoning": None}


@pytest.mark.parametrize("field", _all(NEUTRAL), ids=_ids)
def test_a_neutral_only_field_at_another_value_is_a_400_naming_field_and_value(servers, field):
    """D30: not "unknown": the 400 says the field and its value are not supported, and what is."""
    chat, name = field
    value = OTHER[name]
    if value is None:  # every value of the field's type is neutral (no tools, no reasoning): nothing to refuse
        assert {True, False} <= set(FIELDS[chat][name].neutral)
        return
    r = post(servers, chat, {name: value})
    assert r.status_code == 400, (name, r.text)
    err = r.json()["error"]
    assert err["param"] == name and err["code"] == "unsupported_value"
    assert "not supported" in err["message"] and json.dumps(value)[:20] in err["message"]
    assert "unknown" not in err["message"]


@pytest.mark.parametrize("field", _all(INFORMATIONAL), ids=_ids)
def test_an_informational_field_is_accepted_and_named_nowhere(servers, field):
    chat, name = field
    r = post(servers, chat, {name: NEUTRAL_OF[name]})
    assert r.status_code == 200 and IGNORED_HEADER.lower() not in r.headers


REPORTED_VALUE = {"logprobs": {False: 2, True: True}, "top_logprobs": {True: 3}}


@pytest.mark.parametrize("field", [(False, "logprobs"), (True, "logprobs"), (True, "top_logprobs")], ids=_ids)
def test_logprobs_asked_for_are_reported(servers, field):
    """D59 (it supersedes D30's "not reported"): logprobs asked for are answered, one entry per
    selected token, and nothing is named in the ignored header; no field is NOT_REPORTED."""
    chat, name = field
    body = {name: REPORTED_VALUE[name][chat], **({"logprobs": True} if name == "top_logprobs" else {})}
    r = post(servers, chat, body)
    assert r.status_code == 200 and IGNORED_HEADER.lower() not in r.headers
    lp = r.json()["choices"][0]["logprobs"]
    entries = lp["content"] if chat else lp["tokens"]
    assert len(entries) == r.json()["usage"]["completion_tokens"]
    assert not _all(NOT_REPORTED)


# ---- what each implemented field does --------------------------------------------------------------


def _run(servers, r):
    return servers["engine"].get(r.headers["x-request-id"])


def _sampler(servers, r):
    return _run(servers, r).sampler.params


EFFECTS = {
    "presence_penalty": ({"presence_penalty": 1.5}, lambda s, r, base: _sampler(s, r).presence_penalty == 1.5),
    "frequency_penalty": ({"frequency_penalty": -0.5}, lambda s, r, base: _sampler(s, r).frequency_penalty == -0.5),
    "repetition_penalty": ({"repetition_penalty": 1.3}, lambda s, r, base: _sampler(s, r).repetition_penalty == 1.3),
    "min_p": ({"min_p": 0.2}, lambda s, r, base: _sampler(s, r).min_p == 0.2),
    "top_k": ({"top_k": 3}, lambda s, r, base: _sampler(s, r).top_k == 3),
    # a bias of 100 on "H" (id 40) makes every greedy choice H
    "logit_bias": ({"logit_bias": {"40": 100}}, lambda s, r, base: text(r) == "HHHH"),
    "min_tokens": ({"min_tokens": 3}, lambda s, r, base: _run(s, r).request.min_tokens == 3
                   and _sampler(s, r).min_tokens_ids == (96,)),
    "min_new_tokens": ({"min_new_tokens": 2}, lambda s, r, base: _run(s, r).request.min_tokens == 2),
    "ignore_eos": ({"ignore_eos": True, "max_tokens": 24}, lambda s, r, base: _run(s, r).request.ignore_eos
                   and r.json()["choices"][0]["decodespec"]["finish_reason"] == "max_output_tokens"),
    "skip_special_tokens": ({"skip_special_tokens": False}, lambda s, r, base: _run(s, r).detok._skip is False),
    # the first character of the greedy answer as a stop, kept at the end of the output
    "include_stop_str_in_output": (None, lambda s, r, base: text(r) == base[0]),
    "no_stop_trim": (None, lambda s, r, base: text(r) == base[0]),
    "echo": ({"echo": True}, lambda s, r, base: text(r) == "Hello" + base),
    "n": ({"n": 2}, lambda s, r, base: [c["index"] for c in r.json()["choices"]] == [0, 1]),
    # the default template reads no kwargs (the prompt is unchanged); a checkpoint's template does
    # (tests/test_server_chat.py)
    "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}},
                             lambda s, r, base: text(r) == base and _run(s, r).request.prompt is not None),
    # vLLM's extension: the selected tokens' ids with the text (D59)
    "return_token_ids": ({"return_token_ids": True}, lambda s, r, base: r.json()["choices"][0]["token_ids"]
                         == list(_run(s, r).result().tokens)),
    # usage counts every candidate (D34): three of max_tokens 4 each, EOS off so that no sampled
    # candidate ends early (without it the count was 12 only when none drew EOS)
    "best_of": ({"best_of": 3, "temperature": 1.0, "ignore_eos": True},
                lambda s, r, base: len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == 12),
}


@pytest.mark.parametrize("field", [p for p in _all(IMPLEMENTED) if p[1] not in STRICT_FIELDS[p[0]]], ids=_ids)
def test_each_field_issue_28_implements_acts(servers, field):
    """Every implemented field beyond those of before has an effect here; the sampler's shaping,
    the guards and the output fields are specified in test_sampling, test_finish_guards and
    test_output_fields."""
    chat, name = field
    base = text(post(servers, chat, {}))
    extra, check = EFFECTS[name]
    if extra is None:
        extra = {"stop": base[0], name: True}
    r = post(servers, chat, extra)
    assert r.status_code == 200, r.text
    assert check(servers, r, base), (name, r.json())


def test_an_unknown_field_is_refused_as_unknown(servers):
    for chat in (False, True):
        r = post(servers, chat, {"frequency_penality": 0})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unknown_field" and err["param"] == "frequency_penality"
        assert "/openapi.json" in err["message"]


def test_strict_accepts_only_the_strict_fields(servers):
    """--strict: every field outside STRICT_FIELDS, even at its neutral value, is unknown; n = 1 only."""
    for chat in (False, True):
        for name in sorted(set(FIELDS[chat]) - STRICT_FIELDS[chat]):
            r = post(servers, chat, {name: FIELDS[chat][name].neutral[0] if FIELDS[chat][name].neutral else None},
                     server="strict")
            assert r.status_code == 400 and r.json()["error"]["message"].endswith("unknown field (this server is strict)"), name
        assert post(servers, chat, {"n": 2}, server="strict").json()["error"]["message"].startswith("n: only n = 1")
        assert post(servers, chat, {"n": 1, "logprobs": None}, server="strict").status_code == 200


def test_the_openapi_document_lists_every_field_with_what_the_server_does(servers):
    doc = httpx.get(f"{servers['base']}/openapi.json", timeout=10).json()
    for chat in (False, True):
        props = doc["paths"][PATH[chat]]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        assert set(props) >= set(FIELDS[chat])
        assert "neutral" in props["return_hidden_states"]["description"]
        assert props["suffix" if not chat else "store"]["enum"] == [None, "" if not chat else False]


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("logit_bias", {"abc": 1}, "a key must be a token id"),
    ("logit_bias", {"99999": 1}, "outside the vocabulary"),
    ("logit_bias", {"5": 101}, "[-100, 100]"),
    ("presence_penalty", 3, "[-2, 2]"),
    ("repetition_penalty", 0, "(0, 10]"),
    ("min_p", 1.5, "[0, 1]"),
    ("top_k", -3, "positive int"),
    ("min_tokens", 99, "must not exceed max_output_tokens"),
    ("best_of", 0, "between n"),
    ("ignore_eos", "yes", "must be a boolean"),
])
def test_a_bad_value_of_an_implemented_field_names_it(servers, field, value, fragment):
    r = post(servers, False, {field: value})
    err = r.json()["error"]
    assert r.status_code == 400 and fragment in err["message"] and err["param"].split(".")[0] == field


def test_two_engine_names_of_one_field_must_agree(servers):
    """A router sends SGLang's name at its neutral value beside vLLM's: the one asked decides;
    two asked values that differ are a 400."""
    base = text(post(servers, False, {}))
    r = post(servers, False, {"stop": base[0], "include_stop_str_in_output": True, "no_stop_trim": False})
    assert r.status_code == 200 and text(r) == base[0]
    r = post(servers, False, {"min_tokens": 2, "min_new_tokens": 3})
    assert r.status_code == 400 and "contradicts min_tokens" in r.json()["error"]["message"]


def test_chat_messages_take_text_parts_a_developer_role_and_null_tool_fields(servers):
    want = text(post(servers, True, {"messages": [{"role": "user", "content": "Hello"}]}))
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
              "tool_calls": None, "refusal": None}]
    r = post(servers, True, {"messages": parts})
    assert r.status_code == 200 and text(r) == want
    assert post(servers, True, {"messages": [{"role": "developer", "content": "x"}, *BASE[True]["messages"]]}).status_code == 200
    r = post(servers, True, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    r = post(servers, True, {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]})
    assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]


# ---- n choices and best_of (D34) -------------------------------------------------------------------


def test_n_choices_are_separate_requests_each_with_its_own_finish(servers):
    """§4.10: each choice is its own request (seed + i); the answer has every choice, the usage counts
    them all and the prompt once, and the request id names the group: its cancel reaches each choice,
    its replay says where each choice's stream is."""
    r = post(servers, False, {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 6})
    body = r.json()
    rid = r.headers["x-request-id"]
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and all(c["finish_reason"] for c in choices)
    runs = [servers["engine"].get(f"{rid}.{i}") for i in range(3)]
    assert [run.request.seed for run in runs] == [7, 8, 9]
    assert [c["text"] for c in choices] == [run.result().text for run in runs]
    assert len({c["text"] for c in choices}) > 1  # three seeds, three samples
    assert body["usage"]["completion_tokens"] == sum(run.usage().selected_tokens for run in runs)
    assert body["usage"]["prompt_tokens"] == 5
    one = post(servers, False, {"temperature": 1.0, "seed": 8, "max_tokens": 6})
    assert text(one) == choices[1]["text"]  # choice 1 is the request with seed 8
    events = httpx.get(f"{servers['base']}/v1/requests/{rid}/events", timeout=10)
    assert events.status_code == 409 and f"{rid}.<index>" in events.json()["error"]["message"]
    cancel = httpx.post(f"{servers['base']}/v1/requests/{rid}/cancel", timeout=10).json()
    assert cancel["id"] == rid and cancel["state"] == ["FINISHED"] * 3


def test_a_stream_of_n_choices_ends_each_on_its_own_and_sends_done_once(servers):
    """§4.7: every choice's frames in order with its own index and finish (a stop may end one choice
    before another), the usage once after all (include_usage), then one [DONE]."""
    body = {**BASE[True], "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 12, "stream": True, "stop": ["e"],
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{servers['base']}/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    chunks = [json.loads(d) for d in data[:-1]]
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and chunks[-1] is usage[0]
    finishes = {}
    for c in chunks:
        for ch in c["choices"]:
            if ch["finish_reason"]:
                assert ch["index"] not in finishes
                finishes[ch["index"]] = ch["decodespec"]["finish_reason"]
    assert sorted(finishes) == [0, 1]
    ids = [line[4:] for line in lines if line.startswith("id: ")]
    assert ids and all(i.split(".")[0] in ("0", "1") for i in ids)
    assert usage[0]["usage"]["completion_tokens"] == sum(u["selected_tokens"] for u in usage[0]["usage"]["decodespec"]["choices"])


def test_a_client_leaving_a_stream_of_n_choices_closes_every_choice_reader(servers):
    """§4.7, D5: the client reads a few lines of a stream of two choices and leaves; each choice's
    reader is closed (its stream.delivered says so), each choice still ends once, and every trace
    passes the monitors (reader_delivery_complete blamed the readers left open before)."""
    body = {**BASE[False], "n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 40, "stream": True}
    with httpx.stream("POST", f"{servers['base']}/v1/completions", json=body, timeout=60) as r:
        rid = r.headers["x-request-id"]
        for n, _ in enumerate(r.iter_lines()):
            if n == 2:
                break
    engine = servers["engine"]
    runs = [engine.get(f"{rid}.{i}") for i in range(2)]

    def closed(run):
        return any(e.kind == "stream.delivered" and e.data.get("closed") for e in run.trace.events)

    deadline = time.monotonic() + 30
    while not all(run.done and closed(run) for run in runs) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(run.done and closed(run) for run in runs), [(run.state, closed(run)) for run in runs]
    for run in runs:
        assert check_trace(run.trace.events, tokenizer=ascii_tokenizer()) == []


def test_best_of_returns_the_candidates_with_the_highest_log_probability(servers):
    """D34: best_of candidates, each scored by the sum of its tokens' log-probabilities; the n best
    in order, not streamed; every candidate's tokens counted."""
    r = post(servers, False, {"n": 2, "best_of": 4, "temperature": 1.0, "seed": 5, "max_tokens": 6})
    rid = r.headers["x-request-id"]
    runs = [servers["engine"].get(f"{rid}.{i}") for i in range(4)]
    scores = [run.sampler.logprob_sum for run in runs]
    best = sorted(range(4), key=lambda i: -scores[i])[:2]
    assert [c["text"] for c in r.json()["choices"]] == [runs[i].result().text for i in best]
    assert all(s < 0 for s in scores) and len(set(scores)) == 4
    assert r.json()["usage"]["completion_tokens"] == 4 * 6
    s = post(servers, False, {"n": 1, "best_of": 2, "stream": True})
    assert s.status_code == 400 and "cannot be streamed" in s.json()["error"]["message"]
