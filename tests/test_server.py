"""The OpenAI-compatible server (runtime/server.py) on a real uvicorn socket, driven with httpx and
the official `openai` client: SSE ids and replay (§4.7), finish reasons (§4.10), cancel (§4.9),
disconnects (DECISIONS D5) and every bad-input class (D9)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from _engine_kit import ascii_tokenizer, serve_in_thread, slow_model

from decodespec.runtime.engine import Engine
from decodespec.runtime.events import EventKind
from decodespec.runtime.openai_schema import MAX_STOP_STRINGS
from decodespec.runtime.server import create_app

MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def server():
    engine = Engine(slow_model(delay_s=0.002), ascii_tokenizer(), detach_timeout_s=30.0, poll_s=0.001)
    app = create_app(engine, model_name=MODEL_NAME)
    with serve_in_thread(app) as base:
        yield base, engine


@pytest.fixture
def client(server):
    base, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


def _frames(lines):
    """Parse SSE lines into (id, event, data) frames."""
    frame: dict = {}
    for line in lines:
        if not line:
            if frame:
                yield frame.get("id"), frame.get("event"), frame.get("data")
            frame = {}
            continue
        key, _, value = line.partition(": ")
        frame[key] = value


def _delta_text(frame_data: str) -> str:
    return json.loads(frame_data)["choices"][0]["text"]


def test_non_stream_completion_body_and_request_id(server):
    """A plain completion: OpenAI body, usage always present, precise reason alongside, X-Request-Id."""
    base, engine = server
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 6,
                                                    "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and choice["decodespec"]["finish_reason"]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] <= 6
    rid = r.headers["x-request-id"]
    assert engine.get(rid).result().text == choice["text"]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_and_non_stream_agree_for_the_same_seed(client, chat):
    """§4.7: the streamed text, concatenated, equals the non-streamed text, with the same finish
    reason, for the same seed (sampled, temperature 0.8), through the official client."""
    common = dict(model=MODEL_NAME, max_tokens=24, temperature=0.8, seed=11)
    if chat:
        msgs = [{"role": "user", "content": "Say something"}]
        full = client.chat.completions.create(messages=msgs, **common)
        parts = list(client.chat.completions.create(messages=msgs, stream=True, **common))
        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        want, want_reason = full.choices[0].message.content, full.choices[0].finish_reason
    else:
        full = client.completions.create(prompt="Once upon", **common)
        parts = list(client.completions.create(prompt="Once upon", stream=True, **common))
        text = "".join(p.choices[0].text for p in parts if p.choices)
        want, want_reason = full.choices[0].text, full.choices[0].finish_reason
    reasons = [p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason]
    assert text == want and reasons == [want_reason]


def test_openai_client_stream_with_stop_string_never_shows_it(client):
    """§4.6 over HTTP: the client streams with a stop string taken from the model's own output and
    receives the text before it, never the stop; finish_reason stop, precise reason stop_sequence."""
    base = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=30, temperature=0).choices[0].text
    stop = base[10:13]
    parts = list(client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=30, temperature=0,
                                           stop=[stop], stream=True, stream_options={"include_usage": True}))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert stop not in text and text == base[: base.index(stop)]
    last_choice = [p for p in parts if p.choices][-1].choices[0]
    assert last_choice.finish_reason == "stop"
    assert last_choice.model_extra["decodespec"] == {"finish_reason": "stop_sequence", "stop": stop}
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens >= 1


def test_sse_frames_carry_seq_ids_and_done_once(server):
    """§4.7 rules 1 and 3: each delta frame's id is its seq (0, 1, 2, ...), the finish frame takes
    the next one, the usage chunk follows, and `data: [DONE]` comes exactly once, last."""
    base, _ = server
    body = {"model": MODEL_NAME, "prompt": "ids", "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-request-id"]
        frames = list(_frames(r.iter_lines()))
    ids = [int(i) for i, _, _ in frames if i is not None]
    assert ids == list(range(len(ids)))
    assert [d for _, _, d in frames].count("[DONE]") == 1 and frames[-1][2] == "[DONE]"
    assert "usage" in json.loads(frames[-2][2])


def test_reconnect_with_last_event_id_replays_without_duplicates(server):
    """§4.7 rule 4, DECISIONS D5: a client that drops the connection after a few deltas and
    reconnects with Last-Event-ID gets exactly the missed events; the pieces join to the full text.
    The disconnect is recorded as a transport fact, not a cancel and not EOS."""
    base, engine = server
    body = {"model": MODEL_NAME, "prompt": "reconnect", "max_tokens": 100, "temperature": 0}
    want = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    got: dict[int, str] = {}
    with httpx.stream("POST", f"{base}/v1/completions", json=body | {"stream": True}, timeout=30) as r:
        rid = r.headers["x-request-id"]
        for i, _, data in _frames(r.iter_lines()):
            if i is not None:
                got[int(i)] = _delta_text(data)
            if len(got) == 5:
                break
    last_seen = max(got)
    replayed = []
    with httpx.stream("GET", f"{base}/v1/requests/{rid}/events", headers={"Last-Event-ID": str(last_seen)},
                      timeout=30) as r2:
        assert r2.status_code == 200
        frames = list(_frames(r2.iter_lines()))
    for i, _, data in frames:
        if i is not None:
            replayed.append(int(i))
            choice = json.loads(data)["choices"][0]
            got.setdefault(int(i), choice["text"])
    assert replayed and min(replayed) == last_seen + 1 and len(replayed) == len(set(replayed))
    assert "".join(got[k] for k in sorted(got)) == want and frames[-1][2] == "[DONE]"
    run = engine.get(rid)
    transports = [e.data["what"] for e in run.trace.events if e.kind == EventKind.TRANSPORT]
    assert "disconnect" in transports and run.state == "FINISHED"
    assert not any(e.kind == EventKind.CANCEL_REQUESTED for e in run.trace.events)


def test_cancel_endpoint_ends_the_stream_with_an_error_event(server):
    """§4.9 over HTTP: POST /v1/requests/{id}/cancel ends a running request at its next safe point;
    its stream ends with `event: error` (finish_reason cancelled) and no [DONE], never a fake stop."""
    base, engine = server
    body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 120, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        first = next(lines)
        c = httpx.post(f"{base}/v1/requests/{rid}/cancel", timeout=10)
        assert c.status_code == 200 and c.json()["cancelled"] is True
        frames = list(_frames([first, *lines]))
    assert frames[-1][1] == "error"
    err = json.loads(frames[-1][2])["error"]
    assert err["code"] == "cancelled" and err["decodespec"]["finish_reason"] == "cancelled"
    assert all(d != "[DONE]" for _, _, d in frames)
    assert engine.get(rid).state == "CANCELLED"
    assert httpx.post(f"{base}/v1/requests/nope/cancel", timeout=10).status_code == 404


def test_disconnect_is_recorded_and_the_request_runs_on(server):
    """DECISIONS D5: a client that leaves mid-stream is recorded as transport(disconnect); the
    request is not cancelled and not ended as EOS: it runs on to its own finish reason."""
    base, engine = server
    body = {"model": MODEL_NAME, "prompt": "leave", "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        rid = r.headers["x-request-id"]
        next(r.iter_lines())
    run = engine.get(rid)
    deadline = time.monotonic() + 10
    while not run.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.state == "FINISHED" and run.reason.value in ("max_output_tokens", "eos")
    kinds = [(e.kind, e.data.get("what")) for e in run.trace.events]
    assert (EventKind.TRANSPORT, "disconnect") in kinds or len(run.tokens) == 40
    assert not any(k == EventKind.CANCEL_REQUESTED for k, _ in kinds)


def _bad(status, param, fragment, body, path="/v1/completions", raw=None):
    return pytest.param(path, body, raw, status, param, fragment, id=f"{param}-{fragment}"[:40])


_OK = {"model": MODEL_NAME, "prompt": "x"}
BAD_INPUTS = [
    _bad(400, None, "not valid JSON", None, raw=b'{"model": "tiny", "prompt": '),
    _bad(400, None, "not valid UTF-8", None, raw=b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    _bad(400, None, "must be a JSON object", None, raw=b"[1, 2]"),
    _bad(400, "max_tokens", "must be an integer", _OK | {"max_tokens": "10"}),
    _bad(400, "max_tokens", "between 1 and", _OK | {"max_tokens": -3}),
    _bad(400, "max_tokens", "between 1 and", _OK | {"max_tokens": 10**9}),
    _bad(400, "stop", "entry 0 is empty", _OK | {"stop": ""}),
    _bad(400, "stop", f"1 to {MAX_STOP_STRINGS}", _OK | {"stop": ["a", "b", "c", "d", "e"]}),
    _bad(400, "stop", "1 to", _OK | {"stop": []}),
    _bad(400, "stop", "characters", _OK | {"stop": "x" * 300}),
    _bad(400, "prompt", "does not fit the context", _OK | {"prompt": "y" * 500}),
    _bad(400, "prompt", "outside the vocabulary", _OK | {"prompt": [1, 2, 100000]}),
    _bad(400, "prompt", "must not be empty", _OK | {"prompt": ""}),
    _bad(400, "prompt", "is required", {"model": MODEL_NAME}),
    _bad(404, "model", "does not exist", _OK | {"model": "gpt-9"}),
    _bad(400, "frequency_penalty", "[-2, 2]", _OK | {"frequency_penalty": 2.5}),
    _bad(400, "n", "between 1 and 16", _OK | {"n": 17}),
    _bad(400, "suffix", "not supported", _OK | {"suffix": "!"}),
    _bad(400, "frequency_pen", "unknown field", _OK | {"frequency_pen": 0}),
    _bad(400, "temperature", "must be a number", _OK | {"temperature": "hot"}),
    _bad(400, "temperature", "between 0 and 2", _OK | {"temperature": 3}),
    _bad(400, "top_p", "(0, 1]", _OK | {"top_p": 0}),
    _bad(400, "stream", "must be a boolean", _OK | {"stream": "yes"}),
    _bad(400, "stream_options", "only allowed with stream", _OK | {"stream_options": {"include_usage": True}}),
    _bad(400, "seed", "between 0 and", _OK | {"seed": -1}),
    _bad(400, "messages", "must not be empty", {"model": MODEL_NAME, "messages": []}, path="/v1/chat/completions"),
    _bad(400, "messages[0].role", "must be one of", {"model": MODEL_NAME, "messages": [{"role": "robot",
                                                                                        "content": "hi"}]},
         path="/v1/chat/completions"),
    _bad(400, "prompt", "unknown field", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                          "prompt": "x"}, path="/v1/chat/completions"),
]


@pytest.mark.parametrize(("path", "body", "raw", "status", "param", "fragment"), BAD_INPUTS)
def test_bad_input_is_a_4xx_naming_the_field_and_starts_nothing(server, path, body, raw, status, param, fragment):
    """DECISIONS D9: malformed input gets a 4xx JSON error naming the field, and no request starts."""
    base, engine = server
    before = engine.stats()
    content = raw if raw is not None else json.dumps(body).encode()
    r = httpx.post(f"{base}{path}", content=content, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"] and err["type"] == "invalid_request_error"
    after = engine.stats()
    assert after.requests_total == before.requests_total and after.queue_depth == 0


def test_openai_client_sees_a_bad_request_error(client):
    """The official client raises BadRequestError for a 400 (its message names the field)."""
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="nope", prompt="x")


def test_metrics_health_models_and_openapi(server):
    """/metrics exposes the counters in Prometheus text; /health, /v1/models and /openapi.json answer."""
    base, _ = server
    httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "m", "max_tokens": 2}, timeout=10)
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for name in ("decodespec_queue_depth", "decodespec_active_slots", "decodespec_cache_tokens_in_use",
                 "decodespec_cache_bytes_in_use", "decodespec_preemptions_total", "decodespec_requests_total{"):
        assert name in text
    assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"
    assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"] == MODEL_NAME
    doc = httpx.get(f"{base}/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.") and "/v1/requests/{request_id}/events" in doc["paths"]
    r = httpx.get(f"{base}/v1/requests/unknown/events", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "request_id"


def test_a_checkpoints_chat_template_renders_the_messages():
    """Chat requests use the checkpoint's own Jinja template (sandboxed) when it has one, the default
    role-tagged one otherwise; a template that does not compile is refused at start, by name."""
    from decodespec.runtime.openai_schema import compile_chat_template, default_chat_template

    msgs = [{"role": "user", "content": "hi"}]
    assert compile_chat_template(None) is default_chat_template
    assert default_chat_template(msgs) == "<|user|>\nhi\n<|assistant|>\n"
    render = compile_chat_template("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                                   "{% if add_generation_prompt %}>{% endif %}")
    assert render(msgs) == "[user]hi>"
    with pytest.raises(ValueError, match="chat_template does not compile"):
        compile_chat_template("{% for m in messages %}")


def _check_delivery(ids: list[int], first: int) -> None:
    """§4.7 on one reader's delivery: seqs strictly increasing, no gap, from `first`."""
    assert ids == list(range(first, first + len(ids))), ids


def test_a_resume_while_the_old_connection_is_open_gets_every_later_event(server):
    """DECISIONS D5: each connection reads through its own cursor. A client whose
    first connection stalls (still open) resumes with Last-Event-ID: it gets every event after that
    id, then the terminal and [DONE]; the stalled connection, read later, still has its own
    complete view; neither sees a duplicate or a gap."""
    base, _ = server
    body = {"model": MODEL_NAME, "prompt": "resume", "max_tokens": 60, "temperature": 0, "stream": True}
    for _trial in range(3):
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as first:
            rid = first.headers["x-request-id"]
            lines = first.iter_lines()
            seen: list[int] = []
            for i, _, _ in _frames(lines):
                if i is not None:
                    seen.append(int(i))
                if len(seen) == 3:
                    break  # stop reading; the connection stays open
            with httpx.stream("GET", f"{base}/v1/requests/{rid}/events",
                              headers={"Last-Event-ID": str(seen[-1])}, timeout=30) as second:
                frames = list(_frames(second.iter_lines()))
            resumed = [int(i) for i, _, _ in frames if i is not None]
            _check_delivery(resumed, seen[-1] + 1)
            assert frames[-1][2] == "[DONE]" and '"finish_reason":"length"' in frames[-2][2]
            rest = [int(i) for i, _, _ in _frames(lines) if i is not None]  # the stalled connection, read now
            _check_delivery(seen + rest, 0)
            assert rest[-1] == resumed[-1]


def test_resuming_a_finished_request_at_its_end_still_ends_it(server):
    """Resuming at or past the last id of a finished request yields its terminal and [DONE]."""
    base, _ = server
    body = {"model": MODEL_NAME, "prompt": "done", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        rid = r.headers["x-request-id"]
        ids = [int(i) for i, _, _ in _frames(r.iter_lines()) if i is not None]
    for after in (ids[-1], ids[-1] + 5):
        with httpx.stream("GET", f"{base}/v1/requests/{rid}/events", headers={"Last-Event-ID": str(after)},
                          timeout=30) as again:
            frames = list(_frames(again.iter_lines()))
        assert frames and frames[-1][2] == "[DONE]" and '"finish_reason"' in frames[-2][2], frames


@pytest.mark.parametrize("bad", ["+3", "3_0", "1e3", "-1", "3.0", "x"])
def test_last_event_id_is_parsed_strictly(server, bad):
    base, _ = server
    body = {"model": MODEL_NAME, "prompt": "strict", "max_tokens": 2, "temperature": 0}
    rid = httpx.post(f"{base}/v1/completions", json=body, timeout=30).headers["x-request-id"]
    r = httpx.get(f"{base}/v1/requests/{rid}/events", headers={"Last-Event-ID": bad}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
