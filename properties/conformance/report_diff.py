"""What moved between two runs of one report: the review of a refresh (a judge change, a new build).

    python -m decodespec.properties.conformance.report_diff OLD/report.json NEW/report.json

A case moved when its verdict, its lead symptom (what its report leads with) or its partial flag
differs, or when it is in one run only; each moved case is one line, then a count of the unmoved.
The old run of a committed report is `git show HEAD:reports/ENGINE/report.json`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .cases import CaseError
from .reports import read_report

Key = tuple[str, str | None, bool]  # verdict, lead symptom, partial
FIELDS = ("id", "verdict")  # what every case of a compared report has


@attrs.frozen
class Moved:
    """One case whose (verdict, lead symptom, partial) differs between the runs; None: not in that run."""

    case: str
    old: Key | None
    new: Key | None


def _key(entry: Mapping[str, Any]) -> Key:
    return entry["verdict"], entry.get("lead_symptom"), bool(entry.get("partial"))


def _by_id(report: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c["id"]: c for c in report["cases"]}


def moved(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[Moved], int]:
    """The moved cases in id order, and how many cases are in both runs unmoved (two reports as
    reports.read_report gives them, with FIELDS)."""
    a, b = _by_id(old), _by_id(new)
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
    try:
        old, new = (read_report(Path(p), FIELDS) for p in argv)
    except CaseError as exc:
        print(f"report_diff: {exc}", file=sys.stderr)
        return 2
    moves, same = moved(old, new)
    sys.stdout.write(to_text(moves, same, str(old.get("headline", "")), str(new.get("headline", ""))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
