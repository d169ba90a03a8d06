"""Instructions per token of bench_framework's `ours` path, counted by valgrind.

On a shared two-core machine bench_framework's timings spread 50-80 % from round to round, more
than most changes to the token path are worth. An instruction count repeats to about 0.1 %.
Cachegrind counts the instructions of this script's child run with no request and with `--runs`
requests of `--tokens` tokens (each built, prefilled and driven through `bench_framework.drive`);
the difference over runs × tokens is the figure: the token path with each request's set-up spread
over its tokens. It counts work, not time: memory stalls count nothing, and a lock or a clock read
weighs less than in time, so it complements the timed benchmark, never replaces it.

With `--baseline CHECKOUT` the same harness (this file and bench_framework, from this checkout)
drives the other checkout's decodespec, with its .venv's Python from its root: the code before a
change, counted the same way. The children run two at a time.

Run: .venv/bin/python benchmarks/count_framework.py [--runs N] [--tokens N] [--baseline CHECKOUT]
Needs valgrind (Debian: apt-get install valgrind); about a minute a child.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve()
# One thread for torch and its BLAS: a pool's spinning workers would be counted with the path.
ENV = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def child(runs: int, n_tokens: int) -> None:
    """`runs` requests of up to `n_tokens` ids each through the token path (what cachegrind
    counts); prints how many ids a request has (the corpus is cut at a character boundary)."""
    import bench_framework as bf

    from decodespec.properties import fixtures
    from decodespec.runtime.tokenizers import HFTokenizer

    with tempfile.TemporaryDirectory() as folder:
        tok = HFTokenizer(fixtures.byte_level_bpe(folder))
        prompt = tok.encode(bf.PROMPT)
        ids = bf.output_ids(tok, n_tokens)
        stops = bf.stop_strings(tok.decode_bytes(ids).decode(), random.Random(4_6))
        for _ in range(runs):
            run, cache, logits = bf.prefilled(tok, prompt, len(ids), stops)
            bf.drive(run, ids, cache, logits)
        print(len(ids))


def instructions(checkout: Path, runs: int, n_tokens: int) -> tuple[int, int]:
    """Instructions cachegrind counts for one child run in `checkout` (its .venv, from its root),
    and the ids of each of its requests."""
    done = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         str(checkout / ".venv/bin/python"), str(HERE), "--child", str(runs), "--tokens", str(n_tokens)],
        cwd=checkout, env={**os.environ, **ENV}, capture_output=True, text=True, check=False)
    found = _REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{checkout}: the counted child failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", "")), int(done.stdout.split()[-1])


def count(runs: int = 4, n_tokens: int = 2000, baseline: Path | None = None) -> dict[str, float]:
    """Instructions per token of this checkout (and of `baseline`): each checkout's child counted
    with `runs` requests less the same child with none."""
    if shutil.which("valgrind") is None:
        raise SystemExit("count_framework needs valgrind on PATH (Debian: apt-get install valgrind)")
    if runs < 1 or n_tokens < 1:
        raise SystemExit(f"--runs and --tokens must be at least 1, got {runs} and {n_tokens}")
    checkouts = {"ours": HERE.parent.parent}
    if baseline is not None:
        checkouts["baseline"] = baseline.resolve()
    for co in checkouts.values():  # before any child starts
        if not (co / ".venv/bin/python").is_file():
            raise SystemExit(f"{co}: no {co / '.venv/bin/python'} (run `make setup` there)")
    jobs = [(name, co, k) for name, co in checkouts.items() for k in (0, runs)]
    with ThreadPoolExecutor(2) as pool:
        counted = list(pool.map(lambda job: instructions(job[1], job[2], n_tokens), jobs))
    by = {(name, k): c for (name, _, k), c in zip(jobs, counted)}
    return {name: (by[name, runs][0] - by[name, 0][0]) / (runs * by[name, runs][1]) for name in checkouts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout, counted the same way")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.tokens)
        return
    per_token = count(args.runs, args.tokens, args.baseline)
    for name, n in per_token.items():
        print(f"  {name:9s} {n:9.0f} instructions a token")
    if "baseline" in per_token:
        print(f"  ours / baseline = {per_token['ours'] / per_token['baseline']:.3f}")


if __name__ == "__main__":
    main()
