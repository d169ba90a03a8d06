"""Compiled stepper against the `transitions` backend on the same random walk (docs/performance.md).

The walk is precomputed from the table: from the current state a uniformly random allowed event
(rows and ignores), and a restart at the initial state whenever a terminal state is reached (a
fresh compiled stepper; the transitions instance put back with its library's `set_state`).
Only `fire` calls are timed (each run of events between two restarts is timed as one block, so
the timer's own cost falls on every backend alike and makes the compiled figure look slower, not
faster). Each round runs every backend once, in turn; the figure is the median µs per event.
LockedMachine is ~10x slower again, so it walks a tenth of the events.

Run: .venv/bin/python benchmarks/bench_stepper.py [--rounds N] [--steps N] [--machine NAME]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

from common import interleaved, ratio

from decodespec.machine import compile_table
from decodespec.machine.transitions_backend import TransitionsMachine
from decodespec.spec import Table, load_spec

TARGET_RATIO = 30.0


def random_walk(table: Table, steps: int, seed: int = 0) -> list[list[str]]:
    """`steps` allowed events cut into runs, each from the initial state to a terminal (or the end)."""
    rng = random.Random(seed)
    runs: list[list[str]] = [[]]
    state = table.initial
    for _ in range(steps):
        event = rng.choice(table.allowed_events(state))
        runs[-1].append(event)
        state = table.decision(state, event).target
        if table.is_terminal(state):
            runs.append([])
            state = table.initial
    return [r for r in runs if r]


def _timed_walk(restart: Callable[[], Any], runs: list[list[str]], events: int) -> Callable[[], float]:
    """A round: each run fired on an instance put back at the initial state by `restart()`;
    returns µs per event over the fire calls only."""

    def one_round() -> float:
        clock = time.perf_counter
        total = 0.0
        for run in runs:
            fire = restart().fire
            t0 = clock()
            for event in run:
                fire(event)
            total += clock() - t0
        return total / events * 1e6

    return one_round


def _restart_in_place(tm: TransitionsMachine) -> Callable[[], TransitionsMachine]:
    """Reposition one instance with the library's own set_state (building a Machine costs ~0.3 ms)."""
    initial = tm.table.State[tm.table.initial]

    def restart() -> TransitionsMachine:
        tm.machine.set_state(initial, model=tm.model)
        return tm

    return restart


QUICK = {"rounds": 1, "steps": 20_000}  # `decodespec bench --quick`: a smoke run


def run(rounds: int = 5, steps: int = 200_000, machine: str = "lifecycle", seed: int = 0) -> dict[str, Any]:
    """Median µs per event of each backend on one walk, and each one's ratio to the compiled stepper."""
    table = load_spec(machine)
    runs = random_walk(table, steps, seed)
    short = random_walk(table, max(1, steps // 10), seed)
    plain, locked = TransitionsMachine(table), TransitionsMachine(table, locked=True)
    contenders = {
        "compiled": _timed_walk(compile_table(table).new, runs, steps),
        "transitions": _timed_walk(_restart_in_place(plain), runs, steps),
        "transitions_locked": _timed_walk(_restart_in_place(locked), short, sum(map(len, short))),
    }
    stats = interleaved(contenders, rounds)
    return {
        "machine": machine,
        "steps": steps,
        "rounds": rounds,
        "restarts": len(runs) - 1,
        "us_per_event": stats,
        "ratio_vs_compiled": {k: ratio(v, stats["compiled"]) for k, v in stats.items() if k != "compiled"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--machine", default="lifecycle")
    args = parser.parse_args()
    result = run(args.rounds, args.steps, args.machine)
    print(f"{result['machine']}: {result['steps']} events, {result['restarts']} restarts, {result['rounds']} rounds")
    for name, s in result["us_per_event"].items():
        print(f"  {name:<20} {s['median']:8.3f} µs/event (spread {s['spread_pct']:.0f}%)")
    for name, r in result["ratio_vs_compiled"].items():
        print(f"  {name} / compiled = {r:.1f}x")
    verdict = "meets" if result["ratio_vs_compiled"]["transitions"] >= TARGET_RATIO else "MISSES"
    print(f"compiled stepper {verdict} the >= {TARGET_RATIO:.0f}x target against transitions")


if __name__ == "__main__":
    main()
