"""Requests sent side by side, each with its raw answer and timings, and the engine's gauges.

A `Job` is one request (path, body, streamed or not, where to cut a stream). `send` runs it once,
never again on a failed connection (the failure is the answer: a finding, never a silent retry),
and keeps what a reproducer needs: the body, the status, the raw answer (trimmed in the middle),
when it was sent, when its first delta came and when it ended. `burst` starts many at the same
instant on their own connections. `Gauges` samples /metrics (or a router's /engine_metrics: running
or processing gauges, preemption counters) and llama-server's /slots while a burst runs: supporting
evidence (§4.8, §4.10), never a verdict on its own.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import attrs
import httpx

from ..wire import (
    Streamed,
    StreamOverrun,
    Watch,
    body_ended,
    feed,
    first_choice,
    sse_lines,
    token_count,
    trim_middle,
    whole_answer,
)

_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$")
RUNNING = re.compile(r"running|processing|active_slots|in_flight|inflight")
PREEMPTED = re.compile(r"preempt")
# Counters an engine moves at every decode step, by the tokens that step wrote (a counter moved only
# when a request ends, llama-server's tokens_predicted_total, says nothing of work still going on).
DECODED_PER_STEP = ("decodespec_decode_tokens_total", "vllm:generation_tokens_total")
_ID = re.compile(r"\b(?:req|cmpl|chatcmpl)?-?[0-9a-f]{12,}\b")
ABORTED = re.compile(r'finished_reason="abort"|state="CANCELLED"')


@attrs.frozen
class Job:
    """One request: `name` is the program it runs; a stream is closed after `cut_after` deltas."""

    name: str
    path: str
    body: Mapping[str, Any]
    stream: bool
    cut_after: int | None = None
    headers: Mapping[str, str] = attrs.field(factory=dict)
    method: str = "POST"  # a resume is a GET of /v1/requests/{id}/events (no body)


@attrs.define
class Exchange:
    """One sent Job and what came back, with monotonic times (seconds)."""

    job: Job
    status: int = 0
    raw: str = ""
    data: Any = None
    streamed: Streamed | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    sent: float = 0.0
    first: float | None = None  # the first non-empty delta (a stream), or the answer (not streamed)
    cut: float | None = None  # when the client closed a stream it cut
    done: float | None = None
    failed: str | None = None  # the connection failed: no answer, and nothing sent again

    @property
    def answer(self) -> tuple[Any, ...]:
        """What must be the same whatever runs beside it: status, text, finish reasons, token count."""
        if self.failed:
            return ("failed",)
        if self.streamed is not None:
            st = self.streamed
            return (self.status, st.text, tuple(st.finish_reasons), _error_kind(st.error), st.error_events, st.done)
        choice = first_choice(self.data)
        usage = self.data.get("usage") if isinstance(self.data, dict) else None
        return (self.status, choice.get("text"), choice.get("finish_reason"), token_count(usage, "completion_tokens"))

    def record(self) -> dict[str, Any]:
        """The exchange as a report keeps it (the request, the status, the raw answer, the timings)."""
        out: dict[str, Any] = {"request": {"path": self.job.path, "body": dict(self.job.body), "method": self.job.method},
                               "status": self.status,
                               "sse" if self.job.stream else "response": trim_middle(self.raw)}
        if self.job.headers:
            out["request"]["headers"] = dict(self.job.headers)
        if self.failed:
            out["connection_failed"] = self.failed
        out["timing_s"] = {k: round(v - self.sent, 3) for k, v in
                           (("first", self.first), ("cut", self.cut), ("done", self.done)) if v is not None}
        return out


def _error_kind(error: str | None) -> str | None:
    """An in-band error without the ids in its text (a message may name its request, which differs)."""
    return None if error is None else _ID.sub("<id>", error)


def client(url: str, connections: int, timeout_s: float) -> httpx.Client:
    """A client of its own for a burst: as many connections as requests, a long read timeout."""
    return httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0),
                        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


def send(c: httpx.Client, job: Job, at_delta: Callable[[int], None] | None = None) -> Exchange:
    """Run `job` once (see module); `at_delta`, where given, is told the count of deltas after each
    one a stream reads (it may hold the reader there)."""
    ex = Exchange(job, sent=time.monotonic())
    raw: list[str] = []
    try:
        if not job.stream:
            r = whole_answer(c, "POST", job.path, json=dict(job.body), headers=dict(job.headers))
            ex.status, ex.raw, ex.headers = r.status_code, r.text, dict(r.headers)
            ex.first = ex.done = time.monotonic()
            try:
                ex.data = r.json()
            except ValueError:
                ex.data = None
            return ex
        st = ex.streamed = Streamed()
        body: dict[str, Any] = {"json": dict(job.body)} if job.method == "POST" else {}
        with c.stream(job.method, job.path, headers=dict(job.headers), **body) as r:
            ex.status, ex.headers = r.status_code, dict(r.headers)
            st.status = r.status_code
            if r.status_code != 200:
                st.error = r.read().decode("utf-8", "replace")[:500]
                raw.append(st.error)
            else:
                watch = Watch.of(job.body, c.timeout.read or 60.0)
                for line in sse_lines(r.iter_text()):
                    raw.append(line)
                    feed(st, line)
                    watch.check(st)
                    if ex.first is None and st.deltas:
                        ex.first = time.monotonic()
                    if at_delta is not None and st.deltas:
                        at_delta(len(st.deltas))
                    if job.cut_after is not None and len(st.deltas) >= job.cut_after:
                        ex.cut = time.monotonic()
                        break  # leaving the block closes the connection mid-stream
                else:
                    body_ended(st)
        if ex.cut is None:
            ex.done = time.monotonic()
    except (httpx.HTTPError, StreamOverrun) as exc:
        ex.failed = f"{type(exc).__name__}: {exc}"
    ex.raw = "\n".join(raw) if job.stream else ex.raw
    return ex


def burst(url: str, jobs: Sequence[Job], *, timeout_s: float) -> list[Exchange]:
    """Every job at the same instant (a barrier), each on its own connection; in job order."""
    if not jobs:
        return []
    gate = threading.Barrier(len(jobs))
    with client(url, len(jobs) + 2, timeout_s) as c, ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        def one(job: Job) -> Exchange:
            gate.wait()
            return send(c, job)

        return list(pool.map(one, jobs))


def overlap(exchanges: Sequence[Exchange]) -> int:
    """The most streams that were sending deltas at one instant (first delta to end or cut)."""
    edges = sorted(e for x in exchanges if x.streamed is not None and x.first is not None
                   for e in ((x.first, 1), (x.done or x.cut or x.first, -1)))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


# Where a server offers its engine's Prometheus text: its own /metrics, else a router's copy of its
# workers' (SGLang's gateway, smg: /engine_metrics, each sample labelled with its worker), else a
# gateway's pass-through of its worker's (/worker/metrics: scripts/peers/litellm.sh routes LiteLLM's so).
METRICS_PATHS = ("/metrics", "/engine_metrics", "/worker/metrics")


def read_metrics(c: httpx.Client) -> dict[str, float] | None:
    """Each sample of the first of METRICS_PATHS the server answers, summed over its labels (over a
    router's workers too; `name` or `name{reason}` for the abort counters); None where it has none."""
    for path in METRICS_PATHS:
        try:
            r = whole_answer(c, "GET", path, timeout=5)
        except httpx.HTTPError:
            return None
        if r.status_code == 200:
            break
    else:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        m = _LINE.match(line)
        if not m or m.group(1).endswith("_created") or m.group(3) == "NaN":
            continue
        name = m.group(1) + (" abort" if ABORTED.search(m.group(2) or "") else "")
        out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def busy_slots(c: httpx.Client) -> int | None:
    """llama-server's /slots: how many slots are processing; None where there is no such list."""
    try:
        r = whole_answer(c, "GET", "/slots", timeout=5)
        data = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(data, list) or not all(isinstance(s, dict) for s in data):
        return None
    return sum(bool(s.get("is_processing")) for s in data)


def running(sample: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in sample.items() if RUNNING.search(k) and not k.endswith("_total")}


def decoded(sample: Mapping[str, float]) -> float | None:
    """The tokens the engine has decoded so far, by its DECODED_PER_STEP counters; None where it has none."""
    found = [sample[k] for k in DECODED_PER_STEP if k in sample]
    return sum(found) if found else None


def preemptions(sample: Mapping[str, float] | None) -> dict[str, float]:
    """The preemption counters (a histogram's buckets, count and sum left out)."""
    return {k: v for k, v in (sample or {}).items() if PREEMPTED.search(k) and not k.endswith(("_bucket", "_count", "_sum"))}


@attrs.define
class Gauges:
    """The peaks and last values of the engine's running gauges (and /slots) while sampling runs."""

    url: str
    every_s: float = 0.25
    peak: dict[str, float] = attrs.field(factory=dict)
    last: dict[str, float] = attrs.field(factory=dict)
    samples: int = 0
    slots: bool = True  # the server answers /slots (asked until it does not)

    @contextmanager
    def sampling(self) -> Iterator[Gauges]:
        stop = threading.Event()

        def loop() -> None:
            with client(self.url, 2, 10) as c:
                while not stop.is_set():
                    self.take(c)
                    stop.wait(self.every_s)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        try:
            yield self
        finally:
            stop.set()
            t.join(timeout=15)

    def take(self, c: httpx.Client) -> dict[str, float]:
        now = running(read_metrics(c) or {})
        if self.slots and (busy := busy_slots(c)) is not None:
            now["/slots is_processing"] = float(busy)
        else:
            self.slots = False
        self.samples += 1
        self.last = now
        for k, v in now.items():
            self.peak[k] = max(self.peak.get(k, v), v)
        return now

    def note(self) -> str:
        if not self.peak:
            return "the server offers no running gauge (/metrics, /engine_metrics) nor /slots"
        return "peaks of the engine's own gauges: " + ", ".join(f"{k} {v:g}" for k, v in sorted(self.peak.items()))
