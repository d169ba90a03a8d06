"""Concurrent streams with slow readers: peak memory against the cap (§4.8; docs/performance.md).

Two parts, each for N concurrent requests (N = 8, 32, 128) of TOKENS tokens, pause policy with a
buffer cap of CAP events:
- engine: N reader threads read their request's stream, sleeping READ_DELAY_S after each event, so
  the producer outpaces them. A sampler records the largest unread buffer of any stream (must stay
  <= CAP: the §4.8 bound) and tracemalloc's peak; the ratio peak/N shows memory per stream stays
  flat as N grows (the unread buffers are capped, the parked requests wait).
- http: the same through `decodespec serve`'s app on uvicorn (127.0.0.1), N streaming httpx clients
  that sleep between SSE frames; reports wall time, peak RSS of the process and the largest unread
  buffer. (Between the server and a slow client the kernel's socket buffers hold some frames too.)

- mixed: MIXED concurrent HTTP streams whose readers are fast, slow, silent (connected
  but not reading: the stall timeout frees their slots), leaving, resuming while the first
  connection is still open, or cancelling; three measured rounds, then one whose every trace is
  checked (check_trace, the per-reader deliveries included). Reports the throughput ratio to the
  same requests one at a time, the gauges after each round (all must be 0), the process's RSS after
  each round (flat once the retained set, one round's requests, is full) and the violations (0).
- health: /health latency (p50, p99) while a 10 MB prompt is being rejected (413 before parsing).

Run: .venv/bin/python benchmarks/bench_server.py [--tokens N] [--threads N] [--mixed N]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import torch

from decodespec.runtime import Request
from decodespec.runtime.engine import Engine
from decodespec.runtime.server import create_app
from decodespec.runtime.tinylm import ASSETS, TinyLM
from decodespec.runtime.tokenizers import HFTokenizer

STREAMS = (8, 32, 128)
CAP = 8
READ_DELAY_S = 0.02
MIXED = 256
STALL_S = 1.0  # the mixed part's stall timeout
READERS = ("fast", "slow", "silent", "leave", "resume", "cancel")


class _Sampler:
    """Samples the largest unread buffer of any live stream while a part runs."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.max_unread, self._stop = engine, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.002):
            for run in self.engine.runs():
                self.max_unread = max(self.max_unread, run.stream.unread[0])

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class _Busy:
    """Records when the engine last had live requests (polled every 5 ms from a thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.last, self._done = engine, time.perf_counter(), threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.wait(0.005):
            if not self.engine.idle:
                self.last = time.perf_counter()

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.last


def _serve_in_thread() -> Any:
    """The tests' uvicorn-in-a-thread helper (tests/_engine_kit.py), configured as `serve` is."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _engine_kit import serve_in_thread

    return serve_in_thread


def _engine(model: TinyLM, tok: Any, n: int) -> Engine:
    return Engine(model, tok, max_batch=n, max_queue=n, poll_s=0.0005)


def engine_part(model: TinyLM, tok: Any, n: int, tokens: int) -> dict[str, float]:
    eng = _engine(model, tok, n)
    eng.start()
    tracemalloc.start()
    t0 = time.perf_counter()
    with _Sampler(eng) as sampler:
        runs = [eng.submit(Request(f"Story {i}:", max_output_tokens=tokens, max_buffer_events=CAP)) for i in range(n)]

        def read(run: Any) -> None:
            for _ in run.stream:
                time.sleep(READ_DELAY_S)

        readers = [threading.Thread(target=read, args=(r,)) for r in runs]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
    wall = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    eng.stop()
    return {"wall_s": wall, "max_unread": sampler.max_unread, "tracemalloc_peak_mb": peak / 2**20,
            "per_stream_kb": peak / n / 1024}


def http_part(model: TinyLM, tok: Any, n: int, tokens: int) -> dict[str, float]:
    serve_in_thread = _serve_in_thread()

    eng = _engine(model, tok, n)
    app = create_app(eng, max_buffer_events=CAP)

    async def client(base: str, i: int) -> int:
        body = {"model": eng.model_name, "prompt": f"Story {i}:", "max_tokens": tokens, "stream": True,
                "temperature": 0}
        frames = 0
        async with (httpx.AsyncClient(base_url=base, timeout=120) as http,
                    http.stream("POST", "/v1/completions", json=body) as resp):
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    frames += 1
                    await asyncio.sleep(READ_DELAY_S)
        return frames

    async def all_clients(base: str) -> list[int]:
        return await asyncio.gather(*(client(base, i) for i in range(n)))

    with serve_in_thread(app) as base, _Sampler(eng) as sampler:
        t0 = time.perf_counter()
        frames = asyncio.run(all_clients(base))
        wall = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"wall_s": wall, "max_unread": sampler.max_unread, "peak_rss_mb": rss_mb, "frames": sum(frames)}


def _rss_mb() -> float:
    """The process's resident memory now (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _gauges(eng: Engine) -> dict[str, float]:
    s = eng.stats()
    return {"queue_depth": s.queue_depth, "active_slots": s.active_slots, "parked": s.parked, "swapped": s.swapped,
            "cache_tokens_in_use": s.cache_tokens_in_use, "live_requests": s.live_requests}


async def _mixed_client(http: httpx.AsyncClient, model: str, i: int, kind: str, tokens: int) -> str:
    """One client of the mixed part; returns how its request ended as the client saw it."""
    body = {"model": model, "prompt": f"Story {i}:", "max_tokens": tokens, "stream": True, "temperature": 0.8,
            "seed": i}
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        rid, lines, last = resp.headers["x-request-id"], resp.aiter_lines(), None
        async for line in lines:
            if line.startswith("id:"):
                last = int(line[3:])
            if line in ("data: [DONE]", "event: error"):
                return line
            if kind == "slow":
                await asyncio.sleep(READ_DELAY_S / 4)
            if last is not None and last >= 1 and kind not in ("fast", "slow"):
                break
        if kind == "silent":  # connected, not reading: only the stall timeout frees the slot
            await asyncio.sleep(2 * STALL_S)
            return "silent"
        if kind == "leave":
            return "left"
        if kind == "cancel":
            await http.post(f"/v1/requests/{rid}/cancel")
        if kind == "resume":  # a second reader while the first connection is still open
            async with http.stream("GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": str(last)}) as again:
                async for line in again.aiter_lines():
                    if line in ("data: [DONE]", "event: error"):
                        break
        async for line in lines:
            if line in ("data: [DONE]", "event: error"):
                return line
    return "eof"


def mixed_part(model: TinyLM, tok: Any, n: int, tokens: int, rounds: int = 3) -> dict[str, Any]:
    """MIXED streams with mixed readers against the same requests one at a time (see the docstring)."""
    from decodespec.properties import check_trace

    serve_in_thread = _serve_in_thread()

    # One round's requests stay retained (max_retained = n): a round's traces are all checked, and
    # what the server keeps is bounded, so RSS after round 2 shows any growth beyond that bound.
    eng = Engine(model, tok, max_batch=64, max_queue=n, poll_s=0.0005, stall_timeout_s=STALL_S, detach_timeout_s=0.5,
                 retain_s=600, max_retained=n)
    app = create_app(eng, max_buffer_events=CAP)
    out: dict[str, Any] = {"streams": n, "tokens": tokens, "rounds": []}

    async def concurrent(base: str) -> list[str]:
        limits = httpx.Limits(max_connections=2 * n + 8, max_keepalive_connections=2 * n)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(_mixed_client(http, eng.model_name, i, READERS[i % len(READERS)], tokens)
                                          for i in range(n)))

    async def one_at_a_time(base: str, count: int) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            for i in range(count):
                await _mixed_client(http, eng.model_name, i, "fast", tokens)

    def settle() -> None:
        deadline = time.monotonic() + 30
        while not eng.idle and time.monotonic() < deadline:
            time.sleep(0.01)

    with serve_in_thread(app) as base:
        solo = max(8, n // 16)
        before = eng.stats().decode_tokens_total
        t0 = time.perf_counter()
        asyncio.run(one_at_a_time(base, solo))
        out["one_at_a_time_tok_s"] = (eng.stats().decode_tokens_total - before) / (time.perf_counter() - t0)
        settle()
        # The measured rounds read no trace (reading one builds and keeps its Events, which then
        # weigh on every garbage collection of the next round); one more round checks them all.
        for k in range(rounds + 1):
            checked = k == rounds
            before = eng.stats().decode_tokens_total
            busy = _Busy(eng)
            t0 = time.perf_counter()
            seen = asyncio.run(concurrent(base))
            wall = time.perf_counter() - t0
            settle()
            # Throughput over the engine's busy time: silent clients keep their sockets open past it.
            tok_s = (eng.stats().decode_tokens_total - before) / (busy.stop() - t0)
            runs = list(eng.runs())
            violations = sum(len(check_trace(r.trace.events, tokenizer=tok)) for r in runs) if checked else None
            out["rounds"].append({"checked_round": checked, "wall_s": wall, "tok_s": tok_s, "ratio": tok_s / out["one_at_a_time_tok_s"],
                                  "gauges": _gauges(eng), "rss_mb": _rss_mb(), "violations": violations,
                                  "clients": {k: seen.count(k) for k in sorted(set(seen))},
                                  "checked": len(runs)})
        out["outcomes"] = {f"{st}/{why}": c for (st, why), c in sorted(eng.stats().requests_total.items())}
    return out


def health_part(model: TinyLM, tok: Any, probes: int = 200) -> dict[str, Any]:
    """/health latency while a 10 MB prompt is sent and rejected (413 before any parsing)."""
    serve_in_thread = _serve_in_thread()

    eng = Engine(model, tok, max_batch=8, poll_s=0.0005)
    big = b'{"model":"m","prompt":"' + b"a" * (10 << 20) + b'"}'
    with serve_in_thread(create_app(eng)) as base:
        status: list[int] = []

        def send() -> None:
            status.append(httpx.post(f"{base}/v1/completions", content=big, timeout=120,
                                     headers={"content-type": "application/json"}).status_code)

        sender = threading.Thread(target=send)
        lat: list[float] = []
        with httpx.Client(base_url=base, timeout=30) as http:
            sender.start()
            for _ in range(probes):
                t = time.perf_counter()
                http.get("/health")
                lat.append((time.perf_counter() - t) * 1000)
                time.sleep(0.002)
        sender.join()
    lat.sort()
    return {"big_prompt_status": status[0], "health_p50_ms": lat[len(lat) // 2],
            "health_p99_ms": lat[int(len(lat) * 0.99) - 1], "probes": probes}


QUICK = {"tokens": 16, "mixed": 24, "rounds": 1}  # `decodespec bench --quick`: a smoke run


def run(tokens: int = 120, mixed: int = MIXED, rounds: int = 3) -> dict[str, Any]:
    model = TinyLM.default()
    tok = HFTokenizer(ASSETS / "tokenizer.json")
    out: dict[str, Any] = {"cap_events": CAP, "tokens": tokens, "engine": {}, "http": {}}
    for n in STREAMS:
        out["engine"][n] = engine_part(model, tok, n, tokens)
    for n in STREAMS:
        out["http"][n] = http_part(model, tok, n, tokens)
    out["mixed"] = mixed_part(model, tok, mixed, min(tokens, 32), rounds)
    out["health"] = health_part(model, tok)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mixed", type=int, default=MIXED, help="concurrent streams of the mixed-reader part")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args.tokens, args.mixed)
    print(f"slow readers ({READ_DELAY_S * 1000:.0f} ms per event), {res['tokens']} tokens each, "
          f"pause policy, cap {res['cap_events']} unread events per stream")
    print(f"{'engine N':>9} {'wall s':>8} {'max unread':>11} {'tracemalloc MB':>15} {'KB/stream':>10}")
    for n, r in res["engine"].items():
        print(f"{n:>9} {r['wall_s']:>8.2f} {r['max_unread']:>11} {r['tracemalloc_peak_mb']:>15.2f} "
              f"{r['per_stream_kb']:>10.1f}")
    print(f"{'http N':>9} {'wall s':>8} {'max unread':>11} {'peak RSS MB':>15} {'frames':>10}")
    for n, r in res["http"].items():
        print(f"{n:>9} {r['wall_s']:>8.2f} {r['max_unread']:>11} {r['peak_rss_mb']:>15.1f} {r['frames']:>10}")
    m = res["mixed"]
    print(f"mixed readers ({', '.join(READERS)}): {m['streams']} streams of {m['tokens']} tokens; "
          f"one at a time {m['one_at_a_time_tok_s']:.0f} tok/s")
    for k, r in enumerate(m["rounds"], 1):
        checked = f"; {r['violations']} violations in {r['checked']} traces" if r["checked_round"] else ""
        print(f"  round {k}: {r['wall_s']:.1f} s, {r['tok_s']:.0f} tok/s = {r['ratio']:.2f}x one at a time; "
              f"RSS {r['rss_mb']:.0f} MB; gauges {r['gauges']}{checked}")
        print(f"           clients saw {r['clients']}")
    print(f"  outcomes (all rounds): {m['outcomes']}")
    h = res["health"]
    print(f"/health while a 10 MB prompt is rejected ({h['big_prompt_status']}): p50 {h['health_p50_ms']:.1f} ms, "
          f"p99 {h['health_p99_ms']:.1f} ms over {h['probes']} probes")


if __name__ == "__main__":
    main()
