"""Connections and auth of the reference server (RFC 9112 §6.1, §9.6, RFC 9110 §11.1):
an answer sent before the body arrived closes the connection (no unsolicited second answer) after
reading what the client still sends (so that every client reads it),
Content-Length with Transfer-Encoding is refused and closed, the Bearer scheme is
case-insensitive, an empty API key is a start-up error, and no key reaches a log line."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request

import httpx
import pytest
from _engine_kit import ascii_tokenizer, serve_in_thread, slow_model
from click.testing import CliRunner

from decodespec.cli import main
from decodespec.runtime.engine import Engine
from decodespec.runtime.server import create_app

MODEL = "tiny"


@pytest.fixture(scope="module")
def url():
    engine = Engine(slow_model(delay_s=0.001), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL, max_body_bytes=2048, body_timeout_s=1.0),
                         header_timeout_s=1.0) as base:
        yield base


def _exchange(base: str, raw: bytes, wait_s: float = 2.5) -> tuple[bytes, bool]:
    """Send `raw`, read for up to `wait_s`: (everything received, whether the server closed)."""
    host, port = base.removeprefix("http://").split(":")
    got = b""
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(raw)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                part = sock.recv(65536)
            except TimeoutError:
                return got, False
            if not part:
                return got, True
            got += part
    return got, False


def _head(length: int, ctype: str = "application/json", extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n"
            % (ctype.encode(), length, extra))


@pytest.mark.parametrize(("raw", "status"), [
    (_head(1 << 20) + b'{"model"', b"413"),  # declared past the cap: answered before the body
    (_head(500, "text/plain") + b"hello", b"415"),  # a browser's content type
    (_head(500) + b'{"model": "tiny",', b"408"),  # the body never completes
], ids=["413", "415", "408"])
def test_an_answer_sent_before_the_body_arrived_closes_the_connection(url, raw, status):
    """RFC 9112 §9.6: the rest of an unread body would be read as the next request; main kept the
    connection open and later sent an unsolicited second "408 headers did not arrive" on it."""
    got, closed = _exchange(url, raw)
    assert got.startswith(b"HTTP/1.1 " + status), got[:80]
    assert closed and got.count(b"HTTP/1.1 ") == 1, got


def test_an_early_413_reaches_a_client_that_sends_its_whole_body_first(url):
    """A client that sends all of its body before it reads (urllib, requests) reads the 413 and its
    JSON error: the server reads and discards the rest of the body before it closes (a lingering
    close); closed with that body unread, the connection is reset and the client sees only that."""
    body = b'{"model":"tiny","prompt":"' + b"x" * (16 << 20) + b'"}'  # far past the 2048-byte cap
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("head, status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nNot A Header\r\nContent-Length: 9000000\r\n\r\n", b"400"),
    (_head(9_000_000), b"413"),
], ids=["400", "413"])
def test_an_early_answer_reaches_a_client_still_sending(url, head, status):
    """An answer before the body (bad headers, a body past the cap) is readable after the client
    has sent all of its 9 MB: the server reads and discards it before closing (no reset)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + b"x" * 9_000_000)
        assert sock.recv(64).startswith(b"HTTP/1.1 " + status)


def test_content_length_with_transfer_encoding_is_refused_and_closed(url):
    """RFC 9112 §6.1: both framings at once is refused (400 naming it) and the connection closed."""
    body = b'{"model":"tiny","prompt":"hi","max_tokens":1}'
    raw = _head(len(body), extra=b"Transfer-Encoding: chunked\r\n") + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    got, closed = _exchange(url, raw)
    assert got.startswith(b"HTTP/1.1 400") and b"invalid_framing" in got, got[:200]
    assert closed


def test_the_bearer_scheme_is_case_insensitive():
    """RFC 9110 §11.1: `bearer KEY` and `BEARER KEY` are the same credentials (main refused them)."""
    engine = Engine(slow_model(delay_s=0.001), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name=MODEL, api_key="s3cret")) as base:
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.get(f"{base}/v1/models", headers={"Authorization": f"{scheme} s3cret"}, timeout=10)
            assert r.status_code == 200, (scheme, r.text)
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Basic s3cret"}, timeout=10).status_code == 401


def test_an_empty_api_key_is_a_start_up_error(monkeypatch):
    """An empty key must not turn auth off silently (main served without auth)."""
    engine = Engine(slow_model(delay_s=0.001), ascii_tokenizer())
    with pytest.raises(ValueError, match="api_key"):
        create_app(engine, api_key="")
    for args, env in ((["serve", "--api-key", ""], {}), (["serve"], {"DECODESPEC_API_KEY": "  "})):
        result = CliRunner().invoke(main, args, env=env)
        assert result.exit_code == 2 and "empty" in result.output, result.output


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_no_key_reaches_a_log_line():
    """A key sent in the query string is refused (401) and the access log shows the path only."""
    engine = Engine(slow_model(delay_s=0.001), ascii_tokenizer(), poll_s=0.001)
    seen = _Lines()
    access = logging.getLogger("uvicorn.access")
    with serve_in_thread(create_app(engine, model_name=MODEL, api_key="s3cret-key"), access_log=True,
                         log_level="info") as base:
        access.addHandler(seen)  # uvicorn's access logger does not propagate
        try:
            assert httpx.get(f"{base}/v1/models?api_key=s3cret-key", timeout=10).status_code == 401
            assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer s3cret-key"},
                             timeout=10).status_code == 200
        finally:
            access.removeHandler(seen)
    assert sum("/v1/models" in line for line in seen.lines) == 2, seen.lines
    assert not any("s3cret" in line for line in seen.lines), seen.lines
