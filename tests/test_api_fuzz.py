"""API fuzz (Hypothesis) against the ASGI app in process: whatever the body, headers or ids, the
server answers with a 2xx or a 4xx JSON error naming the field, never a 5xx (DECISIONS D9), and a
refused request starts nothing."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from _engine_kit import ascii_tokenizer, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from decodespec.runtime.engine import Engine
from decodespec.runtime.server import create_app

MODEL_NAME = "tiny"
_SETTINGS = settings(deadline=None, max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def http():
    engine = Engine(tiny_model(), ascii_tokenizer(), poll_s=0.001)
    with TestClient(create_app(engine, model_name=MODEL_NAME), raise_server_exceptions=True) as client:
        client.engine = engine
        yield client


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
_FIELD_VALUES = {
    "model": st.sampled_from([MODEL_NAME, "other", ""]) | json_values,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-2, 200), max_size=5) | json_values,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                "content": st.text(max_size=20)}), max_size=3) | json_values,
    "max_tokens": st.integers(-5, 300) | json_values,
    "max_completion_tokens": st.integers(-5, 300),
    "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | json_values,
    "n": st.integers(0, 3),
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "stop": st.text(max_size=6) | st.lists(st.text(max_size=6), max_size=6) | json_values,
    "seed": st.integers(-(2**64), 2**64) | json_values,
    "logprobs": st.integers(-1, 7) | st.booleans(),
    "top_logprobs": st.integers(-1, 25),
    "user": st.text(max_size=5) | json_values,
    "echo": st.booleans(),
}
bodies = st.fixed_dictionaries({}, optional=_FIELD_VALUES).map(lambda d: {"model": MODEL_NAME, **d}
                                                                 if "model" not in d else d)


def _assert_no_5xx(resp) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert err["message"] and err["type"] and "param" in err


@_SETTINGS
@given(body=bodies, chat=st.booleans())
def test_structured_bodies_never_5xx(http, body, chat):
    """Field-wise random bodies (right and wrong types, ranges, unknown fields) on both endpoints."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _assert_no_5xx(http.post(path, content=json.dumps(body)))


@_SETTINGS
@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()), chat=st.booleans())
def test_arbitrary_bytes_never_5xx(http, raw, chat):
    """Any bytes at all (invalid UTF-8, truncated JSON, arrays, scalars): 400, never 5xx."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = http.post(path, content=raw)
    _assert_no_5xx(resp)


@_SETTINGS
@given(rid=st.text(min_size=1, max_size=20),
       last=st.none() | st.text(max_size=12))
def test_replay_and_cancel_with_arbitrary_ids_never_5xx(http, rid, last):
    """Unknown request ids and malformed Last-Event-ID headers get a 4xx, never a 5xx."""
    headers = {} if last is None else {"Last-Event-ID": last.encode("ascii", "ignore").decode()}
    quoted = urllib.parse.quote(rid, safe="")
    _assert_no_5xx(http.get(f"/v1/requests/{quoted}/events", headers=headers))
    _assert_no_5xx(http.post(f"/v1/requests/{quoted}/cancel"))
    _assert_no_5xx(http.get(f"/v1/{quoted}"))  # routing errors use the same JSON error shape


def test_fuzz_left_the_engine_idle(http):
    """After the fuzz every accepted request has ended and the gauges are zero."""
    engine = http.engine
    http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "end", "max_tokens": 2})
    s = engine.stats()
    assert (s.live_requests, s.queue_depth, s.active_slots, s.cache_tokens_in_use) == (0, 0, 0, 0)


_surrogate_text = st.lists(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.characters(max_codepoint=0x7F),
                           min_size=1, max_size=6).map("".join).filter(
    # lone after JSON decoding: a high surrogate before a low one is a valid pair (U+10000 and up) there
    lambda t: any("\ud800" <= c <= "\udfff" for c in json.loads(json.dumps(t))))
hostile = st.one_of(
    # a lone surrogate in any field's value, or in a field's name
    st.sampled_from(["prompt", "stop", "model", "user"]).flatmap(
        lambda f: _surrogate_text.map(lambda t: json.dumps({"model": MODEL_NAME, "prompt": "hi", f: t}).encode())),
    _surrogate_text.map(lambda t: json.dumps({"model": MODEL_NAME, "prompt": "hi", t: 1}).encode()),
    _surrogate_text.map(lambda t: json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": t}]}).encode()),
    # integers past Python's 4300-digit conversion limit, in any numeric field
    st.tuples(st.sampled_from(["max_tokens", "seed", "temperature", "n"]), st.integers(4301, 6000)).map(
        lambda fd: b'{"model":"tiny","prompt":"hi","' + fd[0].encode() + b'":' + b"7" * fd[1] + b"}"),
    # nesting far past the recursion limit, as a field value or as the whole body
    st.integers(2_000, 120_000).map(lambda n: b'{"model":"tiny","prompt":' + b"[" * n + b"]" * n + b"}"),
    st.integers(2_000, 120_000).map(lambda n: b"{\"a\":" * n + b"1" + b"}" * n),
)


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(raw=hostile, chat=st.booleans())
def test_hostile_bodies_never_5xx(http, raw, chat):
    """Lone surrogates anywhere, huge integers and deep nesting get a 400 naming the
    problem, never a 5xx, on both endpoints."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400, (resp.status_code, resp.text[:300])
    _assert_no_5xx(resp)
