"""What moved between two runs of one report: the review of a refresh (a judge change, a new build).

    python -m decodespec.properties.conformance.report_diff OLD/report.json NEW/report.json

A case moved when its verdict, its lead symptom (what its report leads with) or its partial flag
differs, or when it is in one run only; each moved case is one line, then a count of the unmoved.
The old run of a committed report is `git show HEAD:reports/ENGINE/report.json`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

Key = tuple[str, str | None, bool]  # verdict, lead symptom, partial


@attrs.frozen
class Moved:
    """One case whose (verdict, lead symptom, partial) differs between the runs; None: not in that run."""

    case: str
    old: Key | None
    new: Key | None


def _key(entry: Mapping[str, Any]) -> Key:
    return entry["verdict"], entry.get("lead_symptom"), bool(entry.get("partial"))


def _cases(report: Mapping[str, Any], where: str) -> dict[str, Mapping[str, Any]]:
    cases = report.get("cases") if isinstance(report, Mapping) else None
    if not isinstance(cases, list) or not all(isinstance(c, Mapping) and isinstance(c.get("id"), str)
                                              and isinstance(c.get("verdict"), str) for c in cases):
        raise ValueError(f"{where}: not a report.json (no 'cases' list of objects with an 'id' and a 'verdict')")
    return {c["id"]: c for c in cases}


def moved(old: Mapping[str, Any], new: Mapping[str, Any],
          names: tuple[str, str] = ("the old report", "the new report")) -> tuple[list[Moved], int]:
    """The moved cases in id order, and how many cases are in both runs unmoved; a run that is no
    report is a ValueError naming it (`names`)."""
    a, b = _cases(old, names[0]), _cases(new, names[1])
    out = [Moved(i, _key(a[i]) if i in a else None, _key(b[i]) if i in b else None) for i in sorted(set(a) | set(b))]
    moves = [m for m in out if m.old != m.new]
    return moves, len(out) - len(moves)


def _show(k: Key | None) -> str:
    if k is None:
        return "(not run)"
    verdict, lead, partial = k
    return verdict + (f" [{lead}]" if lead else "") + (" partial" if partial else "")


def to_text(moves: Sequence[Moved], same: int, old_headline: str, new_headline: str) -> str:
    lines = [f"old: {old_headline}", f"new: {new_headline}"]
    lines += [f"  {m.case}: {_show(m.old)} -> {_show(m.new)}" for m in moves]
    lines.append(f"{len(moves)} case(s) moved, {same} unmoved")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    runs = []
    for p in argv:
        try:
            runs.append(json.loads(Path(p).read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            print(f"report_diff: {p}: not a readable report.json ({exc})", file=sys.stderr)
            return 2
    old, new = runs
    try:
        moves, same = moved(old, new, (argv[0], argv[1]))
    except ValueError as exc:
        print(f"report_diff: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(to_text(moves, same, str(old.get("headline", "")), str(new.get("headline", ""))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
