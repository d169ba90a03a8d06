"""Model checker throughput: distinct states per second of `decodespec check` (DESIGN, Performance).

Configurations, each exhausted several times (median reported), with the bounds `check` uses by
default (machine/checker.default_config):

- one request (max_output_tokens 2, pause and buffer policies, every byte outcome, one
  preemption: ~49k states). Its time is mostly building the one-request transition relation
  (done once per distinct request tuple), so its rate is low and says little;
- two requests sharing one batch place (max_output_tokens 1, pause, plain text, preemption:
  ~660k states), where the product search dominates: the figure to compare (TLC: roughly
  45k-65k distinct states/s on several cores);
- with --large, once each: three requests sharing two places (spec/sequence.toml: preempt,
  resume, cancel, deadline, errors; ~10M states, issue 16's bound: under 120 s) and two requests
  with every byte outcome (~5M states).

Run: .venv/bin/python benchmarks/bench_checker.py [--rounds N] [--large]
"""

from __future__ import annotations

import argparse
import statistics

import attrs

from decodespec.machine.checker import check, default_config

CONFIGS = {
    "1 request": (1, 1, default_config(1)),
    "2 requests, 1 place": (2, 1, default_config(2)),
}
LARGE = {
    "3 requests, 2 places": (3, 2, default_config(3)),
    "2 requests, 1 place, every byte outcome": (2, 1, attrs.evolve(default_config(2), byte_choices=True)),
}


def measure(requests: int, slots: int, config, rounds: int) -> dict:
    runs = [check(requests=requests, slots=slots, config=config) for _ in range(rounds)]
    r = runs[0]
    assert r.violations == () and r.missing_witnesses == (), "the shipped tables must pass"
    seconds = statistics.median(x.seconds for x in runs)
    return {"states": r.states, "transitions": r.transitions, "depth": r.max_depth,
            "seconds": seconds, "states_per_s": r.states / seconds}


def run(rounds: int = 3, large: bool = False) -> dict:
    """{configuration: {states, transitions, depth, seconds (median), states_per_s}}."""
    out = {name: measure(req, slots, cfg, rounds) for name, (req, slots, cfg) in CONFIGS.items()}
    if large:
        out.update({name: measure(req, slots, cfg, 1) for name, (req, slots, cfg) in LARGE.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--large", action="store_true", help="also three requests on two places, and two with every byte outcome")
    args = ap.parse_args()
    print(f"{'configuration':48} {'states':>11} {'transitions':>12} {'depth':>5} {'s (median)':>10} {'states/s':>10}")
    for name, r in run(args.rounds, args.large).items():
        print(f"{name:48} {r['states']:>11,} {r['transitions']:>12,} {r['depth']:>5} {r['seconds']:>10.2f} "
              f"{r['states_per_s']:>10,.0f}")


if __name__ == "__main__":
    main()
