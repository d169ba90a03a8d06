"""The server under hostile and unlucky clients: no input gives a 5xx,
error bodies stay small, bodies are capped before parsing, parsing never blocks the event loop,
browser-shaped and unauthenticated requests are refused, ids cannot be guessed."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import threading
import time

import httpx
import pytest
from _engine_kit import ascii_tokenizer, serve_in_thread, slow_model

from decodespec.runtime import ByteTableTokenizer
from decodespec.runtime.engine import Engine
from decodespec.runtime.server import create_app

MODEL = "tiny"


@pytest.fixture(scope="module")
def base():
    engine = Engine(slow_model(delay_s=0.001), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL, max_body_bytes=1 << 20)) as url:
        yield url


def _post(base: str, raw: bytes, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=raw, headers={"content-type": "application/json", **headers},
                      timeout=60)


@pytest.mark.parametrize("raw, where", [
    (b'{"model":"tiny","prompt":"\\ud800"}', "prompt"),
    (b'{"model":"tiny","prompt":"hi","stop":["a","\\udc00"]}', "stop[1]"),
    (b'{"model":"tiny","prompt":"hi","\\ud83d":1}', "<key>"),
    (b'{"model":"tiny","prompt":"hi","max_tokens":' + b"9" * 5000 + b"}", None),
    (b"[" * 100_000 + b"]" * 100_000, None),
], ids=["surrogate-prompt", "surrogate-stop", "surrogate-field-name", "5000-digit-int", "nested-100000"])
def test_no_input_gets_a_5xx_only_a_400_naming_the_problem(base, raw, where):
    r = _post(base, raw)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == where and err["code"] in ("invalid_text", "invalid_json")


def test_chat_content_with_a_lone_surrogate_is_a_400(base):
    r = _post(base, b'{"model":"tiny","messages":[{"role":"user","content":"\\udfff"}]}', "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


def test_an_error_never_echoes_a_huge_name(base):
    r = _post(base, b'{"model":"tiny","prompt":"hi","' + b"x" * 500_000 + b'":1}')
    assert r.status_code == 400 and len(r.content) < 1000 and "500000 characters" in r.text


def test_a_body_past_the_cap_is_413_before_parsing(base):
    r = _post(base, b'{"model":"tiny","prompt":"' + b"a" * (2 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_health_stays_responsive_while_a_long_prompt_is_tokenized(base):
    """Parsing and tokenizing run on a worker thread: /health answers within 100 ms (p99) while a
    prompt just under the cap is being tokenized and refused."""
    prompt = ("word " * 200_000)[: (1 << 20) - 100]
    done = threading.Event()

    def big() -> None:
        _post(base, ('{"model":"tiny","prompt":"' + prompt + '"}').encode())
        done.set()

    threading.Thread(target=big, daemon=True).start()
    lat = []
    with httpx.Client(base_url=base, timeout=10) as c:
        while not done.is_set() and len(lat) < 200:
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            lat.append(time.perf_counter() - t0)
    assert lat and sorted(lat)[int(0.99 * (len(lat) - 1))] < 0.1, statistics.quantiles(lat, n=20) if len(lat) > 2 else lat


def _counting_tokenizer() -> tuple[ByteTableTokenizer, list[tuple[str, bool]]]:
    """ascii_tokenizer, and the list its encode appends to: each text, and whether it was encoded
    on a thread running an event loop."""
    tok, calls = ascii_tokenizer(), []
    encode = tok.encode

    def counted(text: str) -> list[int]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            calls.append((text, False))
        else:
            calls.append((text, True))
        return encode(text)

    tok.encode = counted
    return tok, calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_prompt_is_tokenized_once_off_the_event_loop(stream):
    """A text prompt is tokenized once per request, on a worker thread: the parse's ids are the
    ones the engine runs (a second encode would run on the event loop, under the engine's lock)."""
    tok, calls = _counting_tokenizer()
    engine = Engine(slow_model(delay_s=0.001), tok, poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL)) as url:
        r = _post(url, json.dumps({"model": MODEL, "prompt": "tokenize me once", "max_tokens": 2,
                                   "stream": stream}).encode())
    assert r.status_code == 200, r.text
    assert [c for c in calls if c[0] == "tokenize me once"] == [("tokenize me once", False)], calls


def test_browser_shaped_requests_are_refused(base):
    """A web page can send text/plain or form bodies cross-origin without a preflight: refused (415);
    a foreign Origin is refused (403)."""
    body = b'{"model":"tiny","prompt":"hi","max_tokens":1}'
    assert _post(base, body, **{"content-type": "text/plain"}).status_code == 415
    assert _post(base, body, **{"content-type": "application/x-www-form-urlencoded"}).status_code == 415
    r = _post(base, body, origin="https://evil.example")
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_refused"
    assert _post(base, body).status_code == 200


def test_request_ids_are_unguessable(base):
    ids = {_post(base, b'{"model":"tiny","prompt":"hi","max_tokens":1}').headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(re.fullmatch(r"req-[0-9a-f]{24}", i) for i in ids)


def test_an_api_key_guards_every_route_but_health():
    engine = Engine(slow_model(delay_s=0.001), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL, api_key="s3cret")) as url:
        body = b'{"model":"tiny","prompt":"hi","max_tokens":1}'
        assert httpx.get(f"{url}/health").status_code == 200
        r = _post(url, body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert _post(url, body, authorization="Bearer wrong").status_code == 401
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert _post(url, body, authorization="Bearer s3cret").status_code == 200


def test_a_full_queue_says_when_to_retry():
    engine = Engine(slow_model(delay_s=0.05), ascii_tokenizer(), max_batch=1, max_queue=1, poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL)) as url:
        body = b'{"model":"tiny","prompt":"hi","max_tokens":40}'
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: answers.append(_post(url, body))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        full = [r for r in answers if r.status_code == 429]
        assert full and all(r.headers.get("retry-after") == "1" for r in full)


def test_metrics_show_how_long_the_longest_parked_request_has_waited(base):
    text = httpx.get(f"{base}/metrics").text
    assert re.search(r"^decodespec_parked_longest_seconds [0-9.]+$", text, re.M), text[:400]


def _live_after(engine: Engine, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and engine.stats().live_requests:
        time.sleep(0.05)
    return engine.stats().live_requests


def _until(predicate, bound_s: float = 20.0) -> bool:
    """Poll `predicate` (the engine's state) until it holds or `bound_s` passes."""
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_abandoned_non_stream_request_is_cancelled():
    """A non-streamed client that leaves can never get its answer (its id was never sent), so the
    request is cancelled instead of running to its end. The test waits on the engine's state, not on sleeps: the client leaves once its request decodes, and the
    request (about 25 s of decoding) must end CANCELLED, however loaded the machine."""
    import socket

    engine = Engine(slow_model(delay_s=0.25), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL)) as url:
        host, port = url.removeprefix("http://").split(":")
        body = b'{"model":"tiny","prompt":"resume","max_tokens":100,"temperature":0}'  # greedy: no EOS before the cap
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert _until(lambda: any(run.tokens for run in engine.runs()))  # submitted and decoding
        # then the client leaves
        assert _until(lambda: engine.stats().live_requests == 0)
        assert [run.state for run in engine.runs()] == ["CANCELLED"]


def test_on_disconnect_cancel_stops_a_dropped_stream():
    engine = Engine(slow_model(delay_s=0.05), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL, on_disconnect="cancel")) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 120, "stream": True, "temperature": 0}  # no early EOS
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 4:
                    break
        assert _live_after(engine, 5) == 0
        assert any(state == "CANCELLED" for state, _ in engine.stats().requests_total)


def test_a_body_that_never_arrives_is_a_408():
    """A client that declares a body and sends part of it is answered 408 after the
    body timeout instead of holding the connection."""
    import socket

    engine = Engine(slow_model(delay_s=0.001), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL, body_timeout_s=0.5)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")
            answer = b""
            while b"body_timeout" not in answer and (part := s.recv(4096)):
                answer += part
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer


def test_headers_that_never_finish_are_a_408_and_the_socket_is_closed():
    """Slowloris: a connection trickling its headers is answered 408 and closed
    after the header timeout; uvicorn alone resets its keep-alive bound on every byte."""
    import socket

    engine = Engine(slow_model(delay_s=0.001), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL), header_timeout_s=0.6) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            t0 = time.monotonic()
            answer = b""
            for part in (b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\n", b"X-Slow: 1\r\n", b"X-Slow: 2\r\n"):
                try:
                    s.sendall(part)
                except OSError:
                    break
                time.sleep(0.25)
            while part := s.recv(4096):  # returns b"" once the server closed the socket
                answer += part
            waited = time.monotonic() - t0
        assert answer.startswith(b"HTTP/1.1 408") and b"header_timeout" in answer
        assert waited < 5
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # a normal client is served


def test_a_non_stream_client_that_names_its_id_can_cancel_before_the_answer():
    """The id is known before the body (the client's own X-Request-Id), so a
    non-streamed call can be cancelled from another connection; its answer is then the 409. The run
    cannot end first: ignore_eos keeps a sampled EOS (temperature defaults to 1) from ending it early."""
    engine = Engine(slow_model(delay_s=0.05), ascii_tokenizer(), poll_s=0.001)
    rid = "client-" + "7f3a9c" * 4
    with serve_in_thread(create_app(engine, model_name=MODEL)) as url:
        got: dict = {}

        def call() -> None:
            body = {"model": MODEL, "prompt": "resume", "max_tokens": 100, "ignore_eos": True}
            got["r"] = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=30)

        caller = threading.Thread(target=call)
        caller.start()
        deadline = time.monotonic() + 10
        while (c := httpx.post(f"{url}/v1/requests/{rid}/cancel", timeout=10)).status_code == 404:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        caller.join(30)
        assert c.json()["cancelled"] is True
        r = got["r"]
        assert r.status_code == 409 and r.json()["error"]["code"] == "cancelled"
        assert r.headers["X-Request-Id"] == rid
        again = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                           headers={"X-Request-Id": rid}, timeout=30)
        assert again.status_code == 409 and again.json()["error"]["code"] == "request_id_in_use"


@pytest.mark.parametrize("rid", ["short", "has space in it 1234", "x" * 129, "ünïcödé-ünïcödé-ü"])
def test_a_client_request_id_must_be_long_and_plain(base, rid):
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                   headers={"X-Request-Id": rid.encode("utf-8")}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


def _lead_byte_server(**app_kw):
    """A model whose only wish is a lone lead byte (0 "a", 1 b"\\xc3", 2 EOS): unguarded, every
    answer is invalid UTF-8."""
    from decodespec.runtime import ByteTableTokenizer, ScriptedModel

    tok = ByteTableTokenizer({0: b"a", 1: b"\xc3", 2: b""}, eos_id=2)
    engine = Engine(ScriptedModel([1], vocab_size=3), tok, poll_s=0.001)
    return serve_in_thread(create_app(engine, model_name=MODEL, **app_kw))


@pytest.mark.parametrize("stream", [False, True])
def test_a_decoding_failure_says_what_happened_and_how_to_avoid_it(stream):
    """Invalid output bytes (§4.5, D12) are a 422 output_not_utf8 naming the guard,
    not a generic 500 that clients retry; in a stream, the same error in its error event."""
    with _lead_byte_server() as url:
        body = {"model": MODEL, "prompt": [0], "max_tokens": 1, "temperature": 0, "stream": stream}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        if stream:
            assert r.status_code == 200
            err = json.loads(r.text.split("event: error\ndata: ", 1)[1].split("\n", 1)[0])["error"]
        else:
            assert r.status_code == 422
            err = r.json()["error"]
        assert err["code"] == "output_not_utf8" and err["type"] == "invalid_output_error"
        assert "utf8_guard" in err["message"] and "not valid UTF-8" in err["message"]


@pytest.mark.parametrize(("default", "body", "text"), [
    ("sampled", {"temperature": 1.0}, "a"),          # sampled requests are guarded by default
    ("sampled", {"temperature": 0}, None),           # greedy ones are the strict reference
    ("sampled", {"temperature": 0, "utf8_guard": True}, "a"),
    ("always", {"temperature": 0}, "a"),
    ("never", {"temperature": 1.0}, None),
    ("always", {"temperature": 1.0, "utf8_guard": False}, None),
])
def test_the_utf8_guard_default_and_its_override(default, body, text):
    """DECISIONS D16: `--utf8-guard` picks which requests are guarded; the body's utf8_guard wins."""
    with _lead_byte_server(utf8_guard=default) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [0], "max_tokens": 1, **body},
                       timeout=30)
        if text is None:
            assert r.status_code == 422, r.text
        else:  # sampled, the guard leaves "a" and EOS equally likely: either is a valid answer
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] in ((text, "") if body["temperature"] else (text,))


def test_shutdown_sends_every_open_stream_its_terminal_event_within_the_bound():
    """D5: at shutdown, requests still live after half of --shutdown-timeout are
    cancelled, so a client connected but not reading still receives `event: error` (cancelled)
    instead of a cut connection, and the server is down within the bound."""
    import socket

    from decodespec.runtime.server import reference_server, uvicorn_config

    engine = Engine(slow_model(delay_s=0.02), ascii_tokenizer(), poll_s=0.001)
    app = create_app(engine, model_name=MODEL, max_buffer_events=4)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = reference_server(uvicorn_config(app, lifespan="on"), engine, shutdown_timeout_s=2.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    lines: list[str] = []
    paused = threading.Event()

    def client() -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 3:
                        paused.set()
                        time.sleep(1.5)  # connected, not reading, across the shutdown
        except httpx.HTTPError as exc:
            lines.append(f"cut: {exc!r}")

    reader = threading.Thread(target=client)
    reader.start()
    assert paused.wait(20)
    t0 = time.monotonic()
    server.should_exit = True  # what SIGTERM does
    thread.join(10)
    reader.join(10)
    sock.close()
    assert not thread.is_alive() and time.monotonic() - t0 < 2 + 1.5
    assert "event: error" in lines and not any(x.startswith("cut") for x in lines), lines[-4:]
    assert '"cancelled"' in lines[lines.index("event: error") + 1]


def test_a_client_that_leaves_mid_body_is_dropped_without_an_error_log(caplog):
    """A ClientDisconnect while the body is read is not a server error: nothing
    at ERROR in any log, and the server goes on serving."""
    import logging
    import socket

    engine = Engine(slow_model(delay_s=0.001), ascii_tokenizer(), poll_s=0.001)
    uvicorn_log = logging.getLogger("uvicorn")
    with caplog.at_level(logging.INFO), serve_in_thread(create_app(engine, model_name=MODEL)) as url:
        uvicorn_log.addHandler(caplog.handler)  # uvicorn's loggers, configured at start, do not propagate
        host, port = url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"model\":")
                time.sleep(0.1)
        time.sleep(0.3)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    uvicorn_log.removeHandler(caplog.handler)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
