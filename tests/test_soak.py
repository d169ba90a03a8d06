"""Soak: hundreds of concurrent requests with random cancels, deadlines, disconnects, slow readers,
overflowing buffers, preemption and injected model faults, on the Engine in process and over HTTP;
in process the requests also echo, keep their stops, stop on token ids, guard EOS and ask for logprobs.
Every trace must satisfy every invariant (check_trace), every request must end in exactly one
terminal state with nothing after it, every resource released once (§4.10), and every gauge must be
back at zero (§4.8)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _engine_kit import ascii_tokenizer, serve_in_thread, slow_model, tiny_model

from decodespec.properties import check_trace
from decodespec.runtime import Fault, FaultPlan, Request
from decodespec.runtime.engine import Engine, QueueFull, UnknownRequest
from decodespec.runtime.events import TERMINAL_KINDS, EventKind
from decodespec.runtime.server import create_app

TOK = ascii_tokenizer()
_FAULTS = (
    lambda k: Fault("decode.started", k, "model_error"),
    lambda k: Fault("token.selected", k, "decoding_error"),
    lambda k: Fault("response.delta", k, "transport_error"),
    lambda k: Fault("decode.completed", k, "cancel"),
    lambda k: Fault("token.selected", k, "deadline"),
    lambda k: Fault("prefill.started", 0, "model_error"),
)


def _random_request(rng: random.Random, i: int) -> tuple[Request, FaultPlan, str]:
    """A request, its faults, and what its client does: read, read slowly, cancel or leave."""
    kw: dict = dict(prompt=f"soak {i} {'z' * rng.randrange(30)}", max_output_tokens=rng.randint(1, 40),
                    temperature=rng.choice([0.0, 0.8]), seed=i, request_id=f"soak-{i}")
    if rng.random() < 0.2:
        kw["stop"] = [rng.choice(["a", "e ", "xy", "Q", "~~", "ab", "  "]) for _ in range(rng.randint(1, 3))]
        kw["include_stop_str_in_output"] = rng.random() < 0.3  # D33: the output ends with the winning stop's bytes
    # what the output holds and what ends it (D31, D33, D4, D59): each in some requests, together in a few
    if rng.random() < 0.2:
        kw["echo"] = True
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [[rng.randrange(96)] for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.2:
        kw["min_tokens"] = min(kw["max_output_tokens"], rng.randint(0, 5))
    if rng.random() < 0.1:
        kw["ignore_eos"] = True
    if rng.random() < 0.1:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.05:
        kw["finish_tokens"] = {"tool_call": [rng.randrange(96)]}
    if rng.random() < 0.15:
        kw["deadline_s"] = rng.uniform(0.0, 0.05)
    policy = rng.choice(["pause", "pause", "pause", "buffer", "fail"])
    kw["policy"] = policy
    if policy == "buffer":
        kw["max_buffer_bytes"] = rng.randint(4, 64)
    else:
        kw["max_buffer_events"] = rng.randint(1, 16)
    faults = [rng.choice(_FAULTS)(rng.randint(1, 10))] if rng.random() < 0.15 else []
    client = rng.choices(["read", "slow", "cancel", "leave"], weights=[6, 2, 1, 1])[0]
    return Request(**kw), FaultPlan(faults), client


def _client(run, action: str, rng: random.Random, engine: Engine) -> None:
    """Play one client: read everything (maybe slowly), cancel part-way, or disconnect."""
    if action == "leave":
        time.sleep(rng.uniform(0, 0.01))
        run.disconnect()
        return
    got = []
    for ev in run.stream:
        got.append(ev)
        if action == "slow":
            time.sleep(0.002)
        if action == "cancel" and len(got) == 2:
            with contextlib.suppress(UnknownRequest):  # already ended and no longer retained
                engine.cancel(run.request.request_id)
    seqs = [ev.seq for ev in got if ev.seq is not None]
    assert seqs == list(range(len(seqs))), run.request.request_id
    assert got[-1].terminal and sum(ev.terminal for ev in got) == 1


def _check_all(runs, engine: Engine) -> None:
    for run in runs:
        assert run.done, (run.request.request_id, run.state)
        events = run.trace.events
        terminals = [i for i, e in enumerate(events) if e.kind in TERMINAL_KINDS]
        assert len(terminals) == 1, run.request.request_id
        violations = check_trace(events, tokenizer=TOK)
        assert violations == [], [str(v) for v in violations[:5]]
    s = engine.stats()
    gauges = (s.queue_depth, s.active_slots, s.parked, s.swapped, s.cache_tokens_in_use, s.cache_bytes_in_use,
              s.swapped_bytes, s.live_requests)
    assert gauges == (0,) * 8, s
    assert sum(s.requests_total.values()) == len(runs)


def _soak(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    engine = Engine(tiny_model(), TOK, max_batch=24, max_queue=n, cache_budget_tokens=900,
                    detach_timeout_s=0.05, poll_s=0.001)
    engine.start()
    runs, errors = [], []
    try:
        with ThreadPoolExecutor(max_workers=48) as pool:
            futures = []
            for i in range(n):
                request, faults, action = _random_request(rng, i)
                run = engine.submit(request, faults=faults)
                runs.append(run)
                futures.append(pool.submit(_client, run, action, random.Random(i), engine))
                if i % 25 == 0:
                    time.sleep(0.002)
            for f in futures:
                try:
                    f.result(timeout=120)
                except AssertionError as exc:
                    errors.append(exc)
        deadline = time.monotonic() + 60
        while not engine.idle and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert not errors, errors[:3]
    _check_all(runs, engine)
    return engine.stats().requests_total


def test_soak_engine_in_process():
    """A few hundred requests of every kind at once; all invariants hold on every trace and every
    gauge returns to zero (§4.8, §4.9, §4.10). The mix reaches every terminal state."""
    totals = _soak(300, seed=1)
    states = {state for state, _ in totals}
    reasons = {reason for _, reason in totals}
    assert states == {"FINISHED", "CANCELLED", "FAILED"}
    assert {"cancelled", "model_error", "transport_error", "max_output_tokens"} <= reasons


@pytest.mark.slow
def test_soak_engine_long():
    """The same soak, longer (a few thousand requests)."""
    _soak(3000, seed=2)


def test_soak_over_http():
    """Dozens of concurrent HTTP clients (stream and not) that read, cancel or drop the connection;
    afterwards every request's trace conforms and the gauges are zero (DECISIONS D5: dropped
    clients are detached, their paused requests fail with transport_error after the timeout)."""
    engine = Engine(slow_model(0.001), TOK, max_batch=16, detach_timeout_s=0.2, poll_s=0.001)
    app = create_app(engine, model_name="tiny", max_buffer_events=4)
    rng = random.Random(5)
    with serve_in_thread(app) as base:
        def client(i: int) -> None:
            r = random.Random(i)
            body = {"model": "tiny", "prompt": f"http soak {i}", "max_tokens": r.randint(1, 60),
                    "temperature": r.choice([0, 0.8]), "seed": i}
            action = r.choice(["json", "stream", "stream", "cancel", "leave", "resume"])
            with httpx.Client(base_url=base, timeout=30) as http:
                if action == "json":
                    assert http.post("/v1/completions", json=body).status_code in (200, 500)
                    return
                with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
                    rid = resp.headers["x-request-id"]
                    lines = resp.iter_lines()
                    seen: list[str] = []
                    first = _ids_until(lines, r.randint(1, 4), seen)
                    if action == "cancel":
                        http.post(f"/v1/requests/{rid}/cancel")
                    if action == "resume":  # a second reader while the first is still open (D5)
                        after = first[-1] if first else None
                        headers = {} if after is None else {"Last-Event-ID": str(after)}
                        with http.stream("GET", f"/v1/requests/{rid}/events", headers=headers) as again:
                            second = list(again.iter_lines())
                        _check_reader(_ids_until(iter(second)), 0 if after is None else after + 1, second)
                    if action != "leave":
                        rest = seen + list(lines)
                        assert rest.count("data: [DONE]") <= 1
                        _check_reader(_ids_until(iter(rest)), 0, rest)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(rng.randint(40, 50))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        deadline = time.monotonic() + 30
        while not engine.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        runs = list(engine.runs())
    assert runs
    _check_all(runs, engine)  # the per-reader delivery traces included (reader_delivery_complete)
    resumed = [e for run in runs for e in run.trace.events if e.kind == EventKind.READER_OPENED and e.data["resume"]]
    assert resumed, "no client resumed: the per-reader checks saw one reader per request"


def _ids_until(lines, n: int | None = None, seen: list[str] | None = None) -> list[int]:
    """The SSE `id:` seqs read from `lines` (at most n of them); `seen` keeps the lines consumed."""
    out: list[int] = []
    for line in lines:
        if seen is not None:
            seen.append(line)
        if line.startswith("id:"):
            out.append(int(line[3:]))
            if n is not None and len(out) == n:
                break
    return out


def _check_reader(ids: list[int], first: int, tail: list[str]) -> None:
    """§4.7 on one reader's delivery: contiguous seqs from `first`, no duplicate, and it ends with a
    terminal ([DONE] after a finish, or an error event)."""
    assert ids == list(range(first, first + len(ids))), ids
    assert "data: [DONE]" in tail or "event: error" in tail, tail[-4:]


def test_queue_full_under_load_starts_nothing():
    """Admission under load: past max_queue, submit raises QueueFull and the refused request leaves
    no trace in the counters (the server's 429)."""
    engine = Engine(tiny_model(), TOK, max_queue=5)
    accepted = [engine.submit(Request("q", max_output_tokens=3)) for _ in range(5)]
    with pytest.raises(QueueFull):
        engine.submit(Request("q"))
    engine.run_until_idle()
    _check_all(accepted, engine)
