"""Several readers of one request (§4.7, §4.8, DECISIONS D5): only the reader holding the
primary role counts as the client for backpressure and --on-disconnect, a newer reader that leaves
hands the role back to one still connected, a HEAD makes no reader, readers per request are capped,
and a replay costs one trace entry, not one per event."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from _engine_kit import ascii_tokenizer, serve_in_thread, slow_model, tiny_model

from decodespec.properties import check_trace
from decodespec.runtime import Request
from decodespec.runtime.engine import Engine
from decodespec.runtime.events import EventKind
from decodespec.runtime.server import create_app

MODEL = "tiny"
# 120 tokens (no EOS before at temperature 0 from this prompt), 4 unread events at most: a reader
# that stops reading pauses the request at once.
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 120, "stream": True, "temperature": 0}


def _seqs(lines: list[str]) -> list[int]:
    return [int(ln[4:]) for ln in lines if ln.startswith("id: ")]


def _app(**kw):
    engine = Engine(slow_model(delay_s=0.002), ascii_tokenizer(), detach_timeout_s=1.0, stall_timeout_s=3.0,
                    poll_s=0.001)
    return engine, create_app(engine, model_name=MODEL, max_buffer_events=4, **kw)


def _first_stream_survives_a_second_reader(url: str, second) -> list[str]:
    """Open the stream, read a few events, let `second(url, rid)` come and go, read the rest."""
    with httpx.stream("POST", f"{url}/v1/completions", json=BODY, timeout=30) as r:
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]
        second(url, rid)
        got += list(lines)
    return got


def _reads_two_and_leaves(url: str, rid: str) -> None:
    with httpx.stream("GET", f"{url}/v1/requests/{rid}/events", headers={"Last-Event-ID": "0"}, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(4):  # two events (id + data lines)
            next(lines)


@pytest.mark.parametrize("on_disconnect", ["continue", "cancel"])
def test_a_second_reader_that_leaves_never_ends_the_first_readers_stream(on_disconnect):
    """D5: a resume that reads two events and closes hands the primary role back to the first
    connection, which gets every event and [DONE] (main stalled it, then failed it with
    transport_error after the detach timeout, or cancelled it at once with --on-disconnect cancel)."""
    engine, app = _app(on_disconnect=on_disconnect)
    with serve_in_thread(app) as url:
        lines = _first_stream_survives_a_second_reader(url, _reads_two_and_leaves)
    seqs = _seqs(lines)
    assert lines[-2] == "data: [DONE]", lines[-6:]
    assert seqs == list(range(len(seqs))) and len(seqs) > 100
    assert all(check_trace(run.trace, tokenizer=ascii_tokenizer()) == [] for run in engine.runs())


def test_a_head_on_the_events_of_a_request_makes_no_reader():
    """A HEAD of /events sends no body: it makes no reader, so it cannot take the primary role
    from the live connection and stall it (main's did)."""
    _, app = _app()
    with serve_in_thread(app) as url:
        def head(url: str, rid: str) -> None:
            assert httpx.head(f"{url}/v1/requests/{rid}/events", timeout=30).status_code == 200

        lines = _first_stream_survives_a_second_reader(url, head)
    assert lines[-2] == "data: [DONE]", lines[-6:]


def test_readers_per_request_are_capped():
    """D5: past `max_readers` open readers of one request a resume is a 429 naming the cap."""
    engine, app = _app(max_readers=2)
    with serve_in_thread(app) as url, httpx.stream("POST", f"{url}/v1/completions", json=BODY, timeout=30) as first:
        rid = first.headers["x-request-id"]
        first_lines = first.iter_lines()  # kept: a dropped iterator closes its connection
        next(first_lines)
        with httpx.stream("GET", f"{url}/v1/requests/{rid}/events", timeout=30) as second:
            second_lines = second.iter_lines()
            next(second_lines)
            third = httpx.get(f"{url}/v1/requests/{rid}/events", timeout=30)
            assert third.status_code == 429, third.text
            assert third.json()["error"]["code"] == "too_many_readers"
        engine.cancel(rid)


def test_a_replay_costs_one_trace_entry_not_one_per_event():
    """D5: each reader's deliveries are one stream.delivered entry (first, last, count), so 20
    replays of a finished request of about 60 events add 40 trace entries (main: one per event,
    about 1,200), and the per-reader check still holds."""
    engine = Engine(tiny_model(), ascii_tokenizer())
    run = engine.submit(Request("hi", max_output_tokens=60))
    engine.run_until_idle()
    before = len(run.trace)

    async def replay() -> int:
        n = 0
        reader = run.stream.reader(None, resume=True)
        async for _ in reader:
            n += 1
        return n

    counts = [asyncio.run(replay()) for _ in range(20)]
    assert counts == [len(run.stream.events)] * 20 and counts[0] > 50
    assert len(run.trace) - before == 40  # reader_opened + one delivered each
    assert check_trace(run.trace.events, tokenizer=ascii_tokenizer()) == []
    delivered = [e for e in run.trace.events if e.kind is EventKind.DELIVERED]
    assert {json.dumps([e.data["first"], e.data["seq"], e.data["count"]]) for e in delivered} == {
        json.dumps([None, counts[0] - 2, counts[0]])}


def test_a_resume_after_a_seq_never_sent_is_a_400_and_changes_nothing():
    """D5, D42: on a request still running, a Last-Event-ID past the last event sent names an event
    the client cannot have had; resuming after it would send ids at or below it. It is a 400 that
    names both seqs, and no reader is made; once the request has ended, the same resume gets the
    terminal event again. In process, `reader(after, resume=True)` refuses it the same way."""
    engine, app = _app()
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=BODY) as r:
            rid = r.headers["x-request-id"]
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # the start chunk, then ids 0 and 1 (the producer pauses)
            run = engine.get(rid)
            readers = run.stream.open_readers
            past = run.stream.next_seq + 5
            bad = http.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": str(past)})
            assert bad.status_code == 400 and f"seq {past} was never sent" in bad.json()["error"]["message"]
            assert run.stream.open_readers == readers
            with pytest.raises(ValueError, match="never sent"):
                run.stream.reader(past, resume=True)
            assert run.stream.open_readers == readers
            rest = got + list(lines)
        assert "data: [DONE]" in rest
        ended = http.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": str(past + 500)})
        assert ended.status_code == 200 and _seqs(ended.text.splitlines()) == [run.stream.next_seq - 1]
    assert check_trace(run.trace.events, tokenizer=ascii_tokenizer()) == []


def test_an_event_is_rendered_once_however_many_readers_it_has(monkeypatch):
    """§4.7: readers from one point of a stream get the same events in the same order, so each
    event is rendered once for all of them (the first to reach it renders it) and every reader gets
    the same bytes: here the stream and three resumes from its start, all open together."""
    from decodespec.runtime import sse

    rendered: list[int | None] = []
    frames = sse.Renderer.frames

    def counted(self, ev):
        rendered.append(ev.seq)
        return frames(self, ev)

    monkeypatch.setattr(sse.Renderer, "frames", counted)
    engine, app = _app()
    with serve_in_thread(app) as url, contextlib.ExitStack() as stack:
        first = stack.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=BODY, timeout=30))
        rid = first.headers["x-request-id"]
        readers = [first] + [stack.enter_context(httpx.stream("GET", f"{url}/v1/requests/{rid}/events", timeout=30))
                             for _ in range(3)]
        bodies = [b"".join(r.iter_bytes()) for r in reversed(readers)]  # the newest (the primary) first
    events = engine.get(rid).stream.events
    assert len(events) > 100 and bodies[0].endswith(b"data: [DONE]\n\n")
    assert bodies == [bodies[0]] * 4
    assert sorted(rendered, key=lambda s: -1 if s is None else s) == [ev.seq for ev in events]
