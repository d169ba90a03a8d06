"""Model checker throughput: distinct states per second of `decodespec check` (DESIGN, Performance).

Configurations, each exhausted several times (median reported):

- one request (max_output_tokens 2, pause and buffer policies: ~20k states). Its time is mostly
  building the one-request transition relation (done once per distinct request tuple), so its
  rate is low and says little;
- two requests sharing one batch slot (max_output_tokens 1, pause: ~1.7M states), where the
  product search dominates: this is the figure to compare (TLC: roughly 45k-65k distinct
  states/s on several cores);
- with --large, two requests with both policies (several million states, one round).

Run: .venv/bin/python benchmarks/bench_checker.py [--rounds N] [--large]
"""

from __future__ import annotations

import argparse
import statistics

from decodespec.machine.checker import check
from decodespec.machine.checker_model import ModelConfig

CONFIGS = {
    "1 request, max 2 tokens, pause+buffer": (1, ModelConfig()),
    "2 requests, 1 slot, max 1 token, pause": (2, ModelConfig(max_output_tokens=1, policies=("pause",))),
}
LARGE = {"2 requests, 1 slot, max 1 token, pause+buffer": (2, ModelConfig(max_output_tokens=1))}


def measure(requests: int, config: ModelConfig, rounds: int) -> dict:
    runs = [check(requests=requests, config=config) for _ in range(rounds)]
    r = runs[0]
    assert r.violations == () and r.missing_witnesses == (), "the shipped tables must pass"
    seconds = statistics.median(x.seconds for x in runs)
    return {"states": r.states, "transitions": r.transitions, "depth": r.max_depth,
            "seconds": seconds, "states_per_s": r.states / seconds}


def run(rounds: int = 3, large: bool = False) -> dict:
    """{configuration: {states, transitions, depth, seconds (median), states_per_s}}."""
    out = {name: measure(req, cfg, rounds) for name, (req, cfg) in CONFIGS.items()}
    if large:
        out.update({name: measure(req, cfg, 1) for name, (req, cfg) in LARGE.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--large", action="store_true", help="also the two-policy two-request model")
    args = ap.parse_args()
    print(f"{'configuration':48} {'states':>11} {'transitions':>12} {'depth':>5} {'s (median)':>10} {'states/s':>10}")
    for name, r in run(args.rounds, args.large).items():
        print(f"{name:48} {r['states']:>11,} {r['transitions']:>12,} {r['depth']:>5} {r['seconds']:>10.2f} "
              f"{r['states_per_s']:>10,.0f}")


if __name__ == "__main__":
    main()
