"""/health latency while many readers follow one live request (§4.7: every reader gets every event).

Each round: one streaming completion (max_tokens TOKENS, ignore_eos) and READERS - 1 more readers
of it (GET /v1/requests/{id}/events from its start, each reading as fast as it can), while
PROBERS probers GET /health every PROBE_S, each on a connection of its own; the round ends when every reader has
its [DONE]. Reports /health's p50 and p99 over the rounds and the median time to deliver a round.

With `--old TREE` (a checkout of an earlier commit, e.g. a git worktree) both servers run side by
side, `decodespec serve` of TREE and of this checkout, each in a process of its own on the same
Python, their rounds alternating (the other loads on a shared machine fall on both alike).

Run: .venv/bin/python benchmarks/bench_readers.py [--old TREE] [--readers 200] [--rounds 3]
                                                 [--json benchmarks/results/readers_health.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
READERS = 200
TOKENS = 200
ROUNDS = 3
PROBE_S = 0.01
PROBERS = 4  # /health probers, each on its own connection (more samples from a slow server)
PROMPT = "Once upon a time"


def link_tree(tree: Path, into: Path) -> Path:
    """`tree`'s packages laid out as they install (setup.PACKAGE_DIR), as links under `into`: a
    folder to put first on sys.path to import that checkout's decodespec."""
    spec = importlib.util.spec_from_file_location("setup_of_tree", tree / "setup.py")
    assert spec is not None and spec.loader is not None, tree
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    mapping: dict[str, str] = setup.PACKAGE_DIR
    top = into / "decodespec"
    top.mkdir(parents=True)
    for source in (tree / mapping["decodespec"]).glob("*.py"):
        (top / source.name).symlink_to(source)
    for package, folder in mapping.items():
        if package != "decodespec":
            (top / package.rpartition(".")[2]).symlink_to(tree / folder, target_is_directory=True)
    return into


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(tree: Path, into: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`decodespec serve` of `tree` (the embedded model, one torch thread) on a free port."""
    path = link_tree(tree, into)
    port = free_port()
    code = (f"import sys; sys.path.insert(0, {str(path)!r}); import decodespec.cli as c; "
            "assert c.__file__.startswith(sys.path[0]), c.__file__; sys.argv[0] = 'decodespec'; c.main()")
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port", str(port), "--threads", "1",
                             "--max-readers", str(READERS + 8), "--log-level", "warning"],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, port
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the server of {tree} exited ({proc.returncode})") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server of {tree} did not start")


async def _http(port: int, head: str, body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode() + body)
    await writer.drain()
    return reader, writer


async def _until_done(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read an SSE response until its [DONE] (or the connection's end), keeping nothing."""
    tail = b""
    try:
        while chunk := await reader.read(1 << 16):
            if b"data: [DONE]" in tail + chunk:
                return
            tail = chunk[-16:]
    finally:
        writer.close()


async def _probe(port: int, stop: asyncio.Event, lat: list[float]) -> None:
    """GET /health every PROBE_S on one keep-alive connection; each answer's latency."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            lat.append(time.perf_counter() - t0)
            await asyncio.sleep(PROBE_S)
    finally:
        writer.close()


async def one_round(port: int, model: str, n: int, lat: list[float]) -> float:
    """One request read by `n` readers, /health probed meanwhile; the seconds until all had [DONE]."""
    rid = f"bench-{time.monotonic_ns()}"
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    stop = asyncio.Event()
    probes = [asyncio.ensure_future(_probe(port, stop, lat)) for _ in range(PROBERS)]
    t0 = time.perf_counter()
    first = await _http(port, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              f"X-Request-Id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n", body)
    await first[0].readuntil(b"\r\n\r\n")  # the response's head: the request is known to the server
    others = await asyncio.gather(*[_http(port, f"GET /v1/requests/{rid}/events HTTP/1.1\r\nHost: x\r\n\r\n")
                                    for _ in range(n - 1)])
    await asyncio.gather(*[_until_done(r, w) for r, w in [first, *others]])
    took = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*probes)
    return took


def _model_name(port: int) -> str:
    import httpx

    return str(httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"])


def _commit(tree: Path) -> str:
    """The commit `tree` is checked out at (with "+changes" when its tracked files differ from it)."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "diff", "--quiet", "HEAD"]).returncode != 0
    return head.stdout.strip() + (" +changes" if dirty else "")


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, default=None, help="a checkout of the code to compare with")
    ap.add_argument("--readers", type=int, default=READERS)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    trees = {"new": ROOT} | ({"old": args.old.resolve()} if args.old else {})
    with tempfile.TemporaryDirectory(prefix="bench-readers-") as tmp:
        servers = {name: start(tree, Path(tmp) / name) for name, tree in trees.items()}
        try:
            ports = {name: port for name, (_, port) in servers.items()}
            models = {name: _model_name(port) for name, port in ports.items()}
            lat: dict[str, list[float]] = {name: [] for name in trees}
            took: dict[str, list[float]] = {name: [] for name in trees}

            async def run() -> None:
                for name, port in ports.items():  # a warm-up round of a few readers each
                    await one_round(port, models[name], 4, [])
                for _ in range(args.rounds):
                    for name in sorted(ports, reverse=True):  # old first, then new, each round
                        took[name].append(await one_round(ports[name], models[name], args.readers, lat[name]))

            asyncio.run(run())
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    out: dict[str, Any] = {"readers": args.readers, "tokens": TOKENS, "rounds": args.rounds, "probe_s": PROBE_S, "probers": PROBERS,
                           "commits": {n: _commit(t) for n, t in trees.items()},
                           "load_average_after": [round(x, 1) for x in os.getloadavg()]}
    print(f"/health with {args.readers} readers of one request ({TOKENS} tokens), {args.rounds} rounds "
          f"(load average after: {out['load_average_after']}):")
    print("| code | /health p50 ms | /health p99 ms | probes | delivery s (median) |")
    print("|---|---|---|---|---|")
    for name in sorted(trees, reverse=True):
        xs = lat[name]
        row = {"p50_ms": round(1000 * quantile(xs, 0.5), 1), "p99_ms": round(1000 * quantile(xs, 0.99), 1),
               "probes": len(xs), "delivery_s": round(statistics.median(took[name]), 2)}
        out[name] = row
        print(f"| {name} | {row['p50_ms']} | {row['p99_ms']} | {row['probes']} | {row['delivery_s']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
