"""Model checker throughput: distinct states per second of `decodespec check` (docs/performance.md).

Configurations, each exhausted several times (median reported), with the bounds `check` uses by
default (machine/checker.default_config):

- one request (max_output_tokens 2, pause and buffer policies, every byte outcome, one
  preemption: ~124k states). Its time is mostly building the one-request transition relation
  (done once per distinct request tuple), so its rate is low and says little;
- two requests sharing one batch place (max_output_tokens 1, pause, plain text, preemption:
  ~1.0M states), where the product search dominates: the figure to compare (TLC: roughly
  45k-65k distinct states/s on several cores);
- with --large, once each: three requests sharing two places (spec/sequence.toml: preempt,
  resume, cancel, deadline, errors; ~28M states, to finish in under 60 s) and two requests
  with every byte outcome (~9.7M states).

With `--baseline CHECKOUT` every configuration also runs on that checkout's checker (its own
.venv, on its own tables) and the ratio of the states/s is printed: the code before a change, side
by side in one session. Then both checkers run in fresh interpreters, round by round, and the one
that goes first alternates: a checker run again in one process reuses the memory its last run
freed, and the first run of a round tends to be the slower, which would each favour one side.
Where that checkout's tables differ, its state space does too: both sizes are printed, marked `*`,
and the ratio is of rates over different spaces.

Run: .venv/bin/python benchmarks/bench_checker.py [--rounds N] [--large] [--baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import attrs
from common import in_checkout

from decodespec.machine.checker import check, default_config

CONFIGS = {
    "1 request": (1, 1, default_config(1)),
    "2 requests, 1 place": (2, 1, default_config(2)),
}
LARGE = {
    "3 requests, 2 places": (3, 2, default_config(3)),
    "2 requests, 1 place, every byte outcome": (2, 1, attrs.evolve(default_config(2), byte_choices=True)),
}


HERE = Path(__file__).resolve().parent.parent

# Run in a checkout's own interpreter: one check, its figures as JSON.
_CHECK_RUN = """
import json, sys, attrs
from decodespec.machine.checker import check, default_config
req, slots, cfg = json.loads(sys.argv[1])
r = check(requests=req, slots=slots, config=attrs.evolve(default_config(req), **cfg))
print(json.dumps({"states": r.states, "transitions": r.transitions, "seconds": r.seconds, "max_depth": r.max_depth,
                  "violations": len(r.violations), "missing_witnesses": len(r.missing_witnesses)}))
"""


def _check_in(checkout: Path, requests: int, slots: int, config) -> dict:
    """One check by the checker of a checkout (its .venv; this one: this interpreter), in a fresh
    interpreter, with these bounds."""
    changed = {k: v for k, v in attrs.asdict(config, recurse=False).items()
               if v != getattr(default_config(requests), k)}
    python = Path(sys.executable) if checkout == HERE else None
    return in_checkout(checkout, _CHECK_RUN, json.dumps([requests, slots, changed]), python=python)


def measure(requests: int, slots: int, config, rounds: int, baseline: Path | None = None) -> dict:
    if baseline is None:
        runs = [attrs.asdict(check(requests=requests, slots=slots, config=config), recurse=False)
                for _ in range(rounds)]
    else:
        runs, base = [], []
        for i in range(rounds):  # in turn, so a change of load falls on both alike
            for side, checkout in ((runs, HERE), (base, baseline))[:: 1 if i % 2 == 0 else -1]:
                side.append(_check_in(checkout, requests, slots, config))
    r = runs[0]
    assert not r["violations"] and not r["missing_witnesses"], "the shipped tables must pass"
    seconds = statistics.median(x["seconds"] for x in runs)
    out = {"states": r["states"], "transitions": r["transitions"], "depth": r["max_depth"],
           "seconds": seconds, "states_per_s": r["states"] / seconds}
    if baseline is not None:
        spaces = {(b["states"], b["transitions"]) for b in base}
        assert len(spaces) == 1, "the baseline explored different state spaces from round to round"
        b_states = base[0]["states"]
        b_seconds = statistics.median(b["seconds"] for b in base)
        # a baseline with other tables (an older checkout's spec) explores another space: the rates
        # are compared then, and `same_space` says so
        out |= {"baseline_states": b_states, "baseline_seconds": b_seconds,
                "baseline_states_per_s": b_states / b_seconds, "same_space": spaces == {(r["states"], r["transitions"])},
                "ours_over_baseline": (r["states"] / seconds) / (b_states / b_seconds)}
    return out


def run(rounds: int = 3, large: bool = False, baseline: Path | None = None) -> dict:
    """{configuration: {states, transitions, depth, seconds (median), states_per_s[, baseline_*]}}."""
    out = {name: measure(req, slots, cfg, rounds, baseline) for name, (req, slots, cfg) in CONFIGS.items()}
    if large:
        out.update({name: measure(req, slots, cfg, 1, baseline) for name, (req, slots, cfg) in LARGE.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--large", action="store_true", help="also three requests on two places, and two with every byte outcome")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout whose checker runs side by side")
    args = ap.parse_args()
    base = "  baseline states baseline s  baseline st/s  ours/baseline" if args.baseline else ""
    print(f"{'configuration':48} {'states':>11} {'transitions':>12} {'depth':>5} {'s (median)':>10} {'states/s':>10}{base}")
    for name, r in run(args.rounds, args.large, args.baseline).items():
        tail = (f" {r['baseline_states']:>15,}{'' if r['same_space'] else '*'} {r['baseline_seconds']:>10.2f} "
                f"{r['baseline_states_per_s']:>14,.0f} {r['ours_over_baseline']:>13.2f}x" if args.baseline else "")
        print(f"{name:48} {r['states']:>11,} {r['transitions']:>12,} {r['depth']:>5} {r['seconds']:>10.2f} "
              f"{r['states_per_s']:>10,.0f}{tail}")


if __name__ == "__main__":
    main()
