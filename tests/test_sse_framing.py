"""The stream as it comes over HTTP is read by the event-stream grammar (§4.7, DECISIONS D64).

A line ends at CRLF, LF or CR and nowhere else; an event is its `data:` lines joined by LF,
dispatched at a blank line. JSON carries U+2028, U+2029 and U+0085 unescaped (a server that writes
non-ASCII as itself sends them raw), so a reader that ends lines at them as well, as `str.splitlines`
and httpx's `iter_lines` do, cuts a model's text in two: a false "malformed" wire finding and a lost
delta. These tests hold the reader, whole and live in pieces, to the grammar.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from decodespec.cli import main
from decodespec.properties.conformance import adapter_for
from decodespec.properties.conformance.adapters.openai import OpenAIAdapter, ServerError
from decodespec.properties.conformance.life.exchange import Job, client, send
from decodespec.properties.conformance.wire import SseLines, parse_sse, terminal_findings, wire_findings

# text a model may write that JSON leaves raw and str.splitlines would cut at
SEPARATED = ["line\u2028separator", "para\u2029graph", "next\x85line", "tab\tand form\x0cfeed"]


def _chunk(text: str, finish: str | None = None) -> str:
    return json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": finish}]},
                      ensure_ascii=False, separators=(",", ":"))


def _body(texts: list[str], eol: str = "\n") -> str:
    events = [f"data: {_chunk(t)}" for t in texts] + [f"data: {_chunk('', 'stop')}", "data: [DONE]"]
    return "".join(e + eol + eol for e in events)


def _grammar_lines(text: str) -> list[str]:
    """The event-stream grammar's lines, said another way: every line break made LF, then cut at LF."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
def test_unicode_line_separators_in_a_text_reach_the_judge_whole(eol):
    """§4.7: every delta as the server sent it; raw U+2028/U+2029/U+0085 in a JSON string are text."""
    st_ = parse_sse(_body(SEPARATED, eol))
    assert st_.deltas == SEPARATED
    assert st_.finish_reasons == ["stop"] and st_.done
    assert wire_findings(st_) == [] and terminal_findings(st_) == []


pieces_of_text = st.text(alphabet=st.sampled_from("ab\r\n\u2028\x85:"), max_size=40)


@given(text=pieces_of_text, cuts=st.lists(st.integers(0, 40), max_size=6))
def test_lines_are_the_same_however_the_body_arrives_in_pieces(text, cuts):
    """A line ends at CRLF, LF or CR only, and a CRLF split across two pieces is one line break."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    lines = SseLines()
    got = [line for a, b in zip(bounds, bounds[1:]) for line in lines.push(text[a:b])] + lines.end()
    assert got == _grammar_lines(text)


def test_an_event_of_several_data_lines_is_one_chunk_joined_by_lf():
    """An event's data is its data lines joined by LF: a JSON object may span several (cut here
    between two members, where JSON allows the LF)."""
    obj = _chunk("spread")
    cut = obj.index(',"choices"') + 1
    head, tail = obj[:cut], obj[cut:]
    st_ = parse_sse(f"data: {head}\ndata: {tail}\n\n: a comment\n\ndata: {_chunk('', 'length')}\n\ndata: [DONE]\n\n")
    assert st_.deltas == ["spread"] and st_.finish_reasons == ["length"]
    assert wire_findings(st_) == []


def test_two_objects_in_one_event_are_malformed():
    """Two data lines with no blank line between are one event, whose data is not one JSON object."""
    st_ = parse_sse(f"data: {_chunk('a')}\ndata: {_chunk('b')}\n\ndata: {_chunk('', 'stop')}\n\ndata: [DONE]\n\n")
    assert [f.symptom for f in wire_findings(st_)] == ["malformed"]
    assert st_.deltas == []


def test_an_error_event_is_one_terminal_that_names_its_message():
    """§4.10: an `error` event ends the stream; its JSON's `error` member is what the report shows."""
    st_ = parse_sse(f"data: {_chunk('x')}\n\nevent: error\ndata: {{\"error\": {{\"message\": \"boom\"}}}}\n\n")
    assert st_.error_events == 1 and json.loads(st_.error) == {"message": "boom"}
    assert terminal_findings(st_) == [] and wire_findings(st_) == []


def test_the_last_event_counts_without_its_blank_line():
    """A body that ends right after `data: [DONE]` (no blank line) is still done."""
    st_ = parse_sse(f"data: {_chunk('x', 'stop')}\n\ndata: [DONE]")
    assert st_.done and st_.deltas == ["x"] and wire_findings(st_) == []


def _serve(pieces: Iterable[bytes], gap_s: float = 0.02, kind: bytes = b"text/event-stream") -> tuple[str, threading.Thread]:
    """A one-request HTTP server on 127.0.0.1 sending `pieces` (of content type `kind`) as chunks,
    each flushed on its own, until they run out or the client leaves."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                while len(body) < length:
                    body += conn.recv(65536)
                try:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\n"
                                 b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" % kind)
                    for piece in pieces:
                        conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                        time.sleep(gap_s)
                    conn.sendall(b"0\r\n\r\n")
                except OSError:  # the client left
                    pass

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{port}", thread


def _awkward_pieces(body: bytes) -> Iterator[bytes]:
    """The body cut after every CR (so a CRLF's LF opens the next piece) and after every lead byte
    of a multi-byte character (so the character comes in two pieces)."""
    start = 0
    for i, byte in enumerate(body):
        if byte == 0x0D or byte >= 0xC0:
            yield body[start : i + 1]
            start = i + 1
    yield body[start:]


def test_a_live_stream_in_awkward_pieces_reads_as_the_whole_body():
    """The adapter's live reader sees what parse_sse sees: CRLF framing cut between CR and LF,
    characters cut between their bytes, U+2028 and U+0085 in the text."""
    body = _body(SEPARATED, "\r\n").encode()
    pieces = [p for p in _awkward_pieces(body) if p]
    assert len(pieces) > 12
    url, thread = _serve(pieces)
    log: list[dict] = []
    st_ = OpenAIAdapter(url, timeout=10, retries=0).stream_body("/v1/completions", {"prompt": "x", "stream": True},
                                                                 log=log)
    thread.join(10)
    assert st_.deltas == SEPARATED and st_.finish_reasons == ["stop"] and st_.done
    assert wire_findings(st_) == [] and terminal_findings(st_) == []
    assert parse_sse(log[0]["sse"]).deltas == SEPARATED  # the report re-judges what the run saw


KEEP_ALIVE = b": keep-alive\n\n"
RUN_ON = f"data: {_chunk('x')}\n\n".encode()


@pytest.mark.parametrize(("pieces", "gap_s", "says"), [
    (itertools.repeat(KEEP_ALIVE), 0.2, "EventTimeout: no event for"),
    (itertools.repeat(RUN_ON), 0.001, "no end, past the 320 its request can make"),
], ids=["keep-alives-only", "past-its-limit"])
def test_a_stream_that_never_ends_is_an_error_of_the_run_not_a_hang(pieces, gap_s, says):
    """§4.7: every stream ends with one terminal. A server that keeps a stream busy without events,
    or runs on past what its request can make, ends the case in ERROR (ServerError) within its
    bound: the run goes on and fails, where before it waited forever."""
    url, thread = _serve(pieces, gap_s)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=says):
        OpenAIAdapter(url, timeout=1, retries=0).stream_body("/v1/completions", {"max_tokens": 4, "stream": True})
    assert time.monotonic() - t0 < 10
    thread.join(10)
    assert not thread.is_alive()  # the reader left, so the server stopped sending


@pytest.mark.parametrize(("pieces", "gap_s", "says"), [
    (itertools.repeat(KEEP_ALIVE), 0.2, "EventTimeout"),
    (itertools.repeat(RUN_ON), 0.001, "StreamOverrun"),
], ids=["keep-alives-only", "past-its-limit"])
def test_a_request_life_exchange_that_never_ends_is_a_failed_exchange(pieces, gap_s, says):
    """The same bound under load (life/exchange.py): the exchange fails, named, and the burst goes on;
    a keep-alive stall reads as the read timeout it stands for."""
    url, thread = _serve(pieces, gap_s)
    with client(url, 2, 1.0) as c:
        ex = send(c, Job("p", "/v1/completions", {"max_tokens": 4, "stream": True}, True))
    assert ex.failed is not None and ex.failed.startswith(says), ex.failed
    assert ex.streamed is not None and not ex.streamed.finish_reasons
    thread.join(10)
    assert not thread.is_alive()


ANSWER_BODY = json.dumps({"choices": [{"index": 0, "text": "x\u2028y", "finish_reason": "stop"}]}).encode()


def test_a_non_streamed_answer_in_pieces_reads_whole():
    """The bound below reads the answer piece by piece: every piece, in order, makes the one answer."""
    url, thread = _serve([ANSWER_BODY[i : i + 7] for i in range(0, len(ANSWER_BODY), 7)], 0.01, b"application/json")
    status, data, raw = OpenAIAdapter(url, timeout=10, retries=0).post("/v1/completions", {"max_tokens": 4}, log=[])
    thread.join(10)
    assert (status, raw.encode(), data["choices"][0]["text"]) == (200, ANSWER_BODY, "x\u2028y")


WHITESPACE = itertools.repeat(b" ")  # what some proxies send before a JSON answer to keep it open


def test_a_non_streamed_answer_that_never_ends_is_an_error_of_the_run_not_a_hang():
    """§4.10: a non-streamed request is answered once. Bytes that trickle in without end (whitespace
    before the JSON) reset each read's timeout, so the whole answer is bounded by it instead: the
    case ends in ERROR within the bound, where before the run waited forever (D64)."""
    url, thread = _serve(WHITESPACE, 0.2, b"application/json")
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="/v1/completions: AnswerTimeout: the answer was not whole 1 s after the request"):
        OpenAIAdapter(url, timeout=1, retries=0).post("/v1/completions", {"max_tokens": 4})
    assert time.monotonic() - t0 < 10
    thread.join(10)
    assert not thread.is_alive()


def test_a_non_streamed_request_life_exchange_that_never_ends_is_a_failed_exchange():
    """The same bound under load: the exchange fails, named as the read timeout it stands for."""
    url, thread = _serve(WHITESPACE, 0.2, b"application/json")
    with client(url, 2, 1.0) as c:
        ex = send(c, Job("p", "/v1/completions", {"max_tokens": 4}, False))
    assert ex.failed is not None and ex.failed.startswith("AnswerTimeout"), ex.failed
    assert ex.status == 0 and ex.data is None
    thread.join(10)
    assert not thread.is_alive()


def test_the_wait_for_the_next_event_is_the_users_to_set_for_http_engines_only():
    """`--timeout` (`--decodespec-timeout`) sets that bound for a slow engine; elsewhere it is refused by name."""
    assert adapter_for("openai:http://127.0.0.1:9", timeout=3).timeout == 3
    out = CliRunner().invoke(main, ["conform", "--engine", "reference", "--timeout", "5"])
    assert out.exit_code == 2 and "--timeout" in out.output and "applies to openai engines" in out.output
