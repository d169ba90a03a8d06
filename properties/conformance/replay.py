"""Judge a script case again from the exchanges a report recorded, offline (§4.3-§4.10).

A failing case of a report.json keeps every request it sent with the raw answer
(`reproducer.exchanges`). `rejudge(case, exchanges)` runs http_script.run_script, the live judge,
on a server that answers from them (adapters/recorded.Recording), against the reference on the
case's own tokenizer; the limits and probes the recording left out are listed as not checked.

    python -m decodespec.properties.conformance.replay reports/vllm/report.json [--case ID ...]

prints each failing completions script case's verdict and lead then and now.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .adapters.recorded import Recording
from .cases import Case, CaseError, load_cases
from .reports import read_report
from .runner import CaseResult, grade_run, run_case


def rejudge(case: Case, exchanges: Sequence[Mapping[str, Any]], engine: str = "replay") -> CaseResult:
    """The verdict on `case` from its recorded exchanges, as runner.run_case gives it live; a
    CaseError where the case cannot be replayed or run_script asked for a request the recording
    does not hold (adapters/recorded.Unrecorded, naming it)."""
    recording = Recording(case, exchanges, engine)
    res = run_case(recording, case)
    if recording.missing is not None:
        raise recording.missing
    return res


def _lead(symptom: str | None, message: str | None) -> str:
    return f"{symptom or '-'}: {(message or '')[:140]}" if symptom or message else "-"


def main(argv: Sequence[str] | None = None) -> int:
    """Print, for each failing case of a report that can be replayed, its verdict and lead then and now."""
    parser = argparse.ArgumentParser(prog="python -m decodespec.properties.conformance.replay",
                                     description="Judge a report's failing script cases again from their recorded "
                                                 "exchanges, offline.")
    parser.add_argument("report", type=Path, help="a report.json written by decodespec conform")
    parser.add_argument("--case", action="append", default=[], metavar="ID", help="only this case (repeatable)")
    args = parser.parse_args(argv)
    try:
        report = read_report(args.report)
    except CaseError as exc:
        parser.error(str(exc))
    known = {c.id: c for c in load_cases()}
    if bad := sorted(set(args.case) - {c["id"] for c in report["cases"]}):
        parser.error(f"the report has no case {', '.join(bad)}")
    judged: list[tuple[str, CaseResult]] = []
    for entry in report["cases"]:
        exchanges = (entry.get("reproducer") or {}).get("exchanges")
        if (args.case and entry["id"] not in args.case) or not exchanges or entry["id"] not in known:
            continue
        first = (entry.get("failures") or [{}])[0]
        was = f"{entry['id']}: {entry['verdict']} ({_lead(first.get('symptom'), first.get('message') or entry.get('reason'))})"
        try:
            judged.append((was, rejudge(known[entry["id"]], exchanges)))
        except CaseError as exc:
            print(f"{was}; not judged again: {exc}")
    # the replayed cases graded as one run: a field ignored in all of them is one cause (D71)
    for (was, _), now in zip(judged, grade_run([r for _, r in judged]), strict=True):
        lead = now.lead
        print(f"{was}\n  now {now.verdict.value} ({_lead(lead.symptom, lead.message) if lead else _lead(None, now.reason)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
