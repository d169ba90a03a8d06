"""Concurrent streams with slow readers: peak memory against the cap (§4.8; DESIGN "Performance").

Two parts, each for N concurrent requests (N = 8, 32, 128) of TOKENS tokens, pause policy with a
buffer cap of CAP events:
- engine: N reader threads read their request's stream, sleeping READ_DELAY_S after each event, so
  the producer outpaces them. A sampler records the largest unread buffer of any stream (must stay
  <= CAP: the §4.8 bound) and tracemalloc's peak; the ratio peak/N shows memory per stream stays
  flat as N grows (the unread buffers are capped, the parked requests wait).
- http: the same through `decodespec serve`'s app on uvicorn (127.0.0.1), N streaming httpx clients
  that sleep between SSE frames; reports wall time, peak RSS of the process and the largest unread
  buffer. (Between the server and a slow client the kernel's socket buffers hold some frames too.)

Run: .venv/bin/python benchmarks/bench_server.py [--tokens N] [--threads N]
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
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _engine_kit import serve_in_thread  # the same uvicorn-in-a-thread helper the tests use

    eng = _engine(model, tok, n)
    app = create_app(eng, max_buffer_events=CAP)

    async def client(base: str, i: int) -> int:
        body = {"model": eng.model_name, "prompt": f"Story {i}:", "max_tokens": tokens, "stream": True,
                "temperature": 0}
        frames = 0
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
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


QUICK = {"tokens": 16}  # `decodespec bench --quick`: a smoke run


def run(tokens: int = 120) -> dict[str, Any]:
    model = TinyLM.default()
    tok = HFTokenizer(ASSETS / "tokenizer.json")
    out: dict[str, Any] = {"cap_events": CAP, "tokens": tokens, "engine": {}, "http": {}}
    for n in STREAMS:
        out["engine"][n] = engine_part(model, tok, n, tokens)
    for n in STREAMS:
        out["http"][n] = http_part(model, tok, n, tokens)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args.tokens)
    print(f"slow readers ({READ_DELAY_S * 1000:.0f} ms per event), {res['tokens']} tokens each, "
          f"pause policy, cap {res['cap_events']} unread events per stream")
    print(f"{'engine N':>9} {'wall s':>8} {'max unread':>11} {'tracemalloc MB':>15} {'KB/stream':>10}")
    for n, r in res["engine"].items():
        print(f"{n:>9} {r['wall_s']:>8.2f} {r['max_unread']:>11} {r['tracemalloc_peak_mb']:>15.2f} "
              f"{r['per_stream_kb']:>10.1f}")
    print(f"{'http N':>9} {'wall s':>8} {'max unread':>11} {'peak RSS MB':>15} {'frames':>10}")
    for n, r in res["http"].items():
        print(f"{n:>9} {r['wall_s']:>8.2f} {r['max_unread']:>11} {r['peak_rss_mb']:>15.1f} {r['frames']:>10}")


if __name__ == "__main__":
    main()
