"""Servers side by side on one forced checkpoint: tokens/s at concurrency 1, 16 and 64.

Every engine serves the same one-layer forced checkpoint (benchmarks/: a 128-token script, so each
request's output is known and is checked), started on 127.0.0.1 by the command in
scripts/peers/engines.py, and stopped by its PID at the end. Every server stays up through the run,
but only the one measured runs: the others' process groups are stopped (SIGSTOP) for each
measurement and continued after it. An idle vLLM's threads wake about 1500 times a second, each
one taking a core from whoever is measured. The run goes round by round: in each, every engine at
each concurrency c, back to back, the order of
the engines turned by one each round. c client threads send non-streamed greedy requests of
max_tokens 128 until 2c (at least 4) are done; the figure is completion tokens per second of wall
time, an engine's best round in `c<c>` with every round in `all`. Ratios are decodespec serve's rate
over the peer's in the same round, their median over the rounds (`serve_over_by_round` lists them):
a change of load on this shared machine falls on both sides of a pair. Start-up time is reported
apart and not in the rates. Read the ratios, not the absolute rates.

    .venv/bin/python benchmarks/bench_peers.py [--engines decodespec-serve,vllm,llama-server] [--rounds 2]
        [--baseline CHECKOUT] [--out benchmarks/results/serve_vs_peers.json]

`--baseline` also measures the `decodespec serve` of another checkout (its own .venv), in the same
run, as `decodespec-serve@baseline` (the code before a change, side by side). The figures are
written to `--out` with `serve_over_<peer>_c<c>`: decodespec serve's tokens/s over the peer's,
and printed as a Markdown table. An engine that is not installed (scripts/peers/<engine>.sh
install) is reported as missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from decodespec.properties.conformance.cases import parse_case
from decodespec.properties.conformance.checkpoints import TABLE_GROUP, Checkpoint, build_group
from decodespec.properties.conformance.launch import launched

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "peers"))
from engines import ENGINES

ROOT = Path(__file__).resolve().parents[1]

TOKENS = 128
CONCURRENCY = (1, 16, 64)
BASELINE = "decodespec-serve@baseline"
SERVE_THREADS = 2
RESULTS = ROOT / "benchmarks" / "results" / "serve_vs_peers.json"
QUICK = {"rounds": 1, "engines": "decodespec-serve", "concurrency": (1, 4)}
TEXT = ("the quick brown fox jumps over the lazy dog " * 4)[:TOKENS]


def bench_checkpoint(folder: Path) -> Checkpoint:
    """A byte-table checkpoint whose one program writes TEXT, one byte a token."""
    case = parse_case({
        "id": "bench/long/001", "anchor": "§4.3", "grade": "MUST", "invariant": "length_respected",
        "description": "benchmark program", "kind": "script",
        "inputs": {"tokenizer": {"table": {"1": "> ", "2": "</s>"}, "eos": 2}, "prompt": [1],
                   "script": [{"text": TEXT}], "max_tokens": TOKENS},
    })
    return build_group(TABLE_GROUP, [case], folder)


def _installed(engine: str) -> bool:
    install = ENGINES[engine]["install"]
    vllm, server = ".cache/peers/vllm/venv/bin/python", ".cache/peers/llama.cpp/build/bin/llama-server"
    probe = {"vllm": vllm, "vllm-fp16": vllm, "vllm-bf16": vllm, "llama-server": server, "llama-server-f16": server,
             "llama-server-bf16": server, "llama-cpp-python": ".cache/peers/llama.cpp/venv/bin/python"}.get(engine)
    return not install or probe is None or (ROOT / probe).exists()


def _gguf(ck: Checkpoint, outtype: str) -> None:
    """llama.cpp's conversion of `ck` to `outtype`, named as scripts/peers/conform.sh names it."""
    out = ck.folder / ("model.gguf" if outtype == "f32" else f"model-{outtype}.gguf")
    if not out.is_file():
        subprocess.run(["scripts/peers/llama_cpp.sh", "convert", str(ck.folder), str(out), outtype],
                       cwd=ROOT, check=True, capture_output=True)


def measure(url: str, model: str, prompt: list[int], c: int, n: int) -> dict[str, Any]:
    """n requests from c threads; tokens/s over the wall time; every answer checked against TEXT."""
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    lock, todo, wrong, tokens = threading.Lock(), [n], [], [0]
    # Each thread makes its client (about 36 ms of CPU each: an SSL context) before the clock
    # starts: 64 of them made inside the timed span took 2.3 s of this 2-core machine's CPU from
    # the server at the start of every c64 measurement.
    ready = threading.Barrier(c + 1)

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            ready.wait()
            while True:
                with lock:
                    if todo[0] == 0:
                        return
                    todo[0] -= 1
                try:
                    r = client.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:  # counted as a wrong answer, never a thread's traceback
                    with lock:
                        wrong.append(f"{type(exc).__name__}: {exc}")
                    continue
                data = r.json() if r.status_code == 200 else {}
                text = (data.get("choices") or [{}])[0].get("text")
                with lock:
                    tokens[0] += (data.get("usage") or {}).get("completion_tokens", 0)
                    if text != TEXT:
                        wrong.append(f"{r.status_code}: {str(text or r.text)[:80]!r}")

    threads = [threading.Thread(target=worker) for _ in range(c)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens[0] / wall, "requests": n, "wall_s": round(wall, 2), "wrong": len(wrong), "wrong_first": wrong[:3]}


@contextlib.contextmanager
def only(measured: str, groups: dict[str, int]) -> Iterator[None]:
    """Every server but `measured` stopped (its process group, SIGSTOP) for the block, then continued."""
    others = [pgid for engine, pgid in groups.items() if engine != measured]
    for pgid in others:
        os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pgid in others:
            os.killpg(pgid, signal.SIGCONT)


def run(rounds: int = 2, engines: str = "decodespec-serve,vllm,llama-server",
        concurrency: tuple[int, ...] = CONCURRENCY, baseline: Path | None = None,
        partial: Path | None = None) -> dict[str, Any]:
    """The figures of every engine (module docstring); with `partial`, what was measured so far is
    written there after each round as well (a run stopped half-way keeps it)."""
    names = [e.strip() for e in engines.split(",") if e.strip()]
    if unknown := [e for e in names if e not in ENGINES]:
        raise SystemExit(f"unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    # decodespec serve's model gets SERVE_THREADS torch threads (module constant: 2, both cores, as
    # vLLM and llama-server use them; with the lean step (D58) two beat one side by side here, 2400-2620
    # vs 2080-2280 tokens/s at 64 clients, within noise at 1 and 16)
    engines_ = {**ENGINES, "decodespec-serve": {**ENGINES["decodespec-serve"],
                                                "launch": f"OMP_NUM_THREADS={SERVE_THREADS} " + ENGINES["decodespec-serve"]["launch"]}}
    if baseline is not None:
        serve = baseline.resolve() / ".venv/bin/decodespec"
        if not serve.is_file():
            raise SystemExit(f"--baseline {baseline}: no {serve} (run `make setup` there)")
        engines_[BASELINE] = {**ENGINES["decodespec-serve"],
                              "launch": f"OMP_NUM_THREADS={SERVE_THREADS} {serve} serve --port {{port}} --model {{model}}"}
        names.insert(names.index("decodespec-serve") + 1 if "decodespec-serve" in names else 0, BASELINE)
    folder = Path(tempfile.mkdtemp(prefix="decodespec-bench-peers-")) / "bench"
    ck = bench_checkpoint(folder)
    prompt = list(ck.programs["bench/long/001"].prompt)
    out: dict[str, Any] = {"tokens": TOKENS, "checkpoint": str(folder), "serve_threads": SERVE_THREADS,
                           "interleaved": True, "others_stopped": True, "engines": {}}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    with contextlib.ExitStack() as servers:
        up: dict[str, tuple[str, str]] = {}  # engine: (url, model)
        groups: dict[str, int] = {}  # engine: its server's process group
        for engine in names:
            if engine != BASELINE and not _installed(engine):
                out["engines"][engine] = {"missing": f"not installed: run {ENGINES[engine]['install']}"}
                continue
            if engines_[engine]["gguf"]:
                _gguf(ck, engines_[engine]["gguf"])
            t0 = time.perf_counter()
            log = ROOT / ".cache/peers/logs/bench" / f"{engine}.log"
            url = servers.enter_context(launched(engines_[engine]["launch"], ck, log,
                                                 on_start=lambda pid, e=engine: groups.__setitem__(e, pid)))
            out["engines"][engine] = {"startup_s": round(time.perf_counter() - t0, 1)}
            model = engines_[engine]["model"].format(model=ck.folder) or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            measure(url, model, prompt, 1, 1)  # warm-up
            up[engine] = (url, model)
            runs[engine] = {c: [] for c in concurrency}
        # Round by round, every engine at each c back to back, the order turned each round: a
        # change of load falls on all of them alike, and each round pairs the engines' figures.
        order = list(up)
        for r in range(rounds):
            turn = order[r % len(order):] + order[: r % len(order)] if order else []
            for c in concurrency:
                for engine in turn:
                    with only(engine, groups):
                        runs[engine][c].append(measure(*up[engine], prompt, c, max(4, 2 * c)))
            if partial is not None:
                partial.write_text(json.dumps({**out, "rounds_done": r + 1, "runs": runs}, indent=1) + "\n")
    for engine, per_c in runs.items():
        for c, rs in per_c.items():
            best = max(rs, key=lambda r: r["tokens_per_s"])
            out["engines"][engine][f"c{c}"] = {**best, "tokens_per_s": round(best["tokens_per_s"], 1),
                                               "all": [round(r["tokens_per_s"], 1) for r in rs]}
    base = runs.get("decodespec-serve")
    for engine, per_c in runs.items():
        if base is None or engine == "decodespec-serve":
            continue
        peer = engine.replace("-", "_").replace("@", "_")
        for c, rs in per_c.items():
            # the median over rounds of decodespec serve's rate over the peer's in the same round
            paired = [s["tokens_per_s"] / p["tokens_per_s"] for s, p in zip(base[c], rs) if p["tokens_per_s"]]
            fig = out["engines"][engine][f"c{c}"]
            fig["serve_over_by_round"] = [round(x, 2) for x in paired]
            if paired:
                out[f"serve_over_{peer}_c{c}"] = round(statistics.median(paired), 2)
                fig["vs_decodespec_serve"] = round(1 / statistics.median(paired), 2)
    return out


def table(out: dict[str, Any]) -> str:
    """The figures as Markdown: tokens/s per engine and concurrency, decodespec serve's ratio over each."""
    figs = {e: f for e, f in out["engines"].items() if "missing" not in f}
    cs = sorted({int(k[1:]) for f in figs.values() for k in f if k[:1] == "c" and k[1:].isdigit()})
    lines = ["| clients | " + " | ".join(figs) + " |", "|---|" + "---|" * len(figs)]
    for c in cs:
        cells = []
        for e, f in figs.items():
            v = f.get(f"c{c}", {})
            ratio = v.get("vs_decodespec_serve")
            cells.append(f"{v.get('tokens_per_s', '-')}" + ("" if e == "decodespec-serve" or ratio is None
                                                            else f" (serve {1 / ratio:.2f}x)"))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    starts = ", ".join(f"{e} {f['startup_s']} s" for e, f in figs.items())
    return "\n".join(lines) + f"\n\nStart-up: {starts}."


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="decodespec-serve,vllm,llama-server")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout whose decodespec serve runs too")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args.rounds, args.engines, baseline=args.baseline, partial=args.out.with_suffix(".partial.json"))
    result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                      text=True).stdout.strip()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(json.dumps(result, indent=1))
    print(table(result))
