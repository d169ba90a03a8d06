"""Timing helpers shared by the benchmarks (docs/performance.md).

Contenders are timed side by side: every round runs each of them once, in the same order, so a
change of load on the machine falls on all of them alike. A figure is the median over rounds with
its spread, never a single sample.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def stat(samples: list[float]) -> dict[str, Any]:
    """Median of `samples` with its spread: min, max and (max - min) / median in percent."""
    if not samples:
        raise ValueError("stat() needs at least one sample")
    med = statistics.median(samples)
    lo, hi = min(samples), max(samples)
    return {
        "median": med,
        "min": lo,
        "max": hi,
        "spread_pct": 100.0 * (hi - lo) / med if med else 0.0,
        "n": len(samples),
    }


def interleaved(contenders: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, dict[str, Any]]:
    """Run every contender once per round, in turn; each call returns its own figure (e.g. µs per
    token, measured inside so set-up stays outside). Returns `stat()` of each contender's figures."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            gc.collect()  # each starts from a clean heap: no contender pays for another's garbage
            samples[name].append(fn())
    return {name: stat(v) for name, v in samples.items()}


def per_item_us(fn: Callable[[], Any], items: int) -> float:
    """Wall time of one `fn()` call in µs per item (perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / items * 1e6


def ratio(num: Mapping[str, Any], den: Mapping[str, Any]) -> float:
    """Ratio of two `stat()` medians."""
    return num["median"] / den["median"]


def in_checkout(checkout: Path, script: str, *args: str, python: Path | None = None) -> Any:
    """Run `script` (Python source) in another checkout with its own .venv (or `python`), from its
    root, and return the JSON its last line of output prints: the code before a change, for
    `--baseline`."""
    python = python or checkout / ".venv/bin/python"
    if not python.is_file():
        raise SystemExit(f"--baseline {checkout}: no {python} (run `make setup` there)")
    done = subprocess.run([str(python), "-c", script, *args], cwd=checkout, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
