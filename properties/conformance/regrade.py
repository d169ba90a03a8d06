"""Re-grade stored reports without running the engine again: severity, basis and verdict from their findings.

    python -m decodespec.properties.conformance.regrade reports/            # every reports/*/report.json, then the matrix
    python -m decodespec.properties.conformance.regrade reports/vllm [--profile chapter]
    python -m decodespec.properties.conformance.regrade reports/vllm-router --worker vllm --worker vllm-chat

A finding's severity and basis are table data (symptoms.SYMPTOMS, decisions.DECISIONS, a case's
declared decisions), so they follow from each stored finding's symptom and its case; the verdict
follows from them (runner.grade), and a field the engine ignored in the whole run is one cause of
the run, not a verdict per case (runner.grade_run, D71). Every stream the report recorded is held to §4.7's one terminal
again (wire.unterminated), and one that ignored a field the wire shows alone (stream_options.include_usage) gets
its finding (engine_wide.wire_findings): the two judgements made from the stored exchanges. The report's four
files are rewritten, and each says which run produced it and that it was re-graded, not re-run. A run
behind a gateway is read again against its worker's direct reports (attribution.py): those it names,
or the folders given with --worker (beside it: reports/vllm for reports/vllm-router).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ...checkout import default_diagrams_dir
from .adapters.base import Finding
from .cases import Case, CaseError, load_cases
from .checkpoints import with_chat
from .engine_wide import wire_findings
from .reports import Grading, read_report, worker_reports, write_reports
from .runner import PROFILES, CaseResult, Verdict, grade, grade_run
from .symptoms import FIELD_BASIS, by_severity, merge
from .wire import unterminated

SELF = "python -m decodespec.properties.conformance.regrade"


def _observed(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What the stored case kept of the engine's answer, in CaseResult.observed's shape."""
    kept = entry.get("reproducer") or entry.get("evidence") or {}
    seen = dict(kept.get("observed") or {k: kept[k] for k in ("output", "chunks", "finish_reason", "state") if k in kept})
    for key in ("exchanges", "reference", "server"):
        if kept.get(key):
            seen[key] = kept[key]
    seen["notes"] = list(entry.get("notes") or [])
    return seen


def _fields(stored: Mapping[str, Any]) -> tuple[str, ...]:
    """The request fields a stored finding names as ignored (its basis field_ignored: 'a, b')."""
    basis = stored.get("basis") or {}
    return tuple(basis["ref"].split(", ")) if basis.get("kind") == FIELD_BASIS and basis.get("ref") else ()


def result_of(entry: Mapping[str, Any], case: Case, engine: str, profile: str) -> CaseResult:
    """One stored case entry as a CaseResult, re-graded: its findings (and a recorded stream without
    its terminal or ignoring a field it sent, D71), most severe first; SKIP and ERROR as stored."""
    seen = _observed(entry)
    kept = entry.get("reproducer") or {}
    found = [Finding(f["invariant"], f["message"], symptom=f.get("symptom", ""), family=f.get("family", "semantics"),
                     fields=_fields(f)) for f in entry.get("failures") or []]
    verdict = Verdict(entry["verdict"])
    if verdict not in (Verdict.SKIP, Verdict.ERROR):
        have = {f.symptom for f in found}
        kept_exchanges = seen.get("exchanges") or []
        found += [f for f in unterminated(kept_exchanges) + wire_findings(kept_exchanges) if f.symptom not in have]
    res = CaseResult(case, engine, verdict if verdict in (Verdict.SKIP, Verdict.ERROR) else Verdict.PASS,
                     tuple(by_severity(merge(found))), tuple(entry.get("not_checked") or ()), reason=entry.get("reason", ""),
                     observed=seen, seconds=float(entry.get("seconds") or 0.0),
                     expected=kept.get("expected") if kept.get("expected") else None)
    return grade(res, profile)


def regrade(folder: Path, cases: Mapping[str, Case], profile: str | None = None,
            workers: Sequence[str] = ()) -> list[Path]:
    """Rewrite folder/report.json (and its junit.xml, report.md, report.html) re-graded; `profile`
    None keeps the report's own; `workers` the worker reports to attribute its findings against
    (default: the ones it names, if any). A case id the suite no longer has is a CaseError naming it."""
    path = folder / "report.json"
    data = read_report.__wrapped__(path, ("id", "verdict"))  # uncached: this rewrites the file it reads
    gone = [c["id"] for c in data["cases"] if c["id"] not in cases]
    if gone:
        raise CaseError(f"{path}: the suite has no case {', '.join(gone[:5])}; re-run the engine instead")
    stored = data.get("grading") or {}
    profile = profile or stored.get("profile") or "project"
    engine = str(data.get("engine") or folder.name)
    results = grade_run([result_of(c, cases[c["id"]], engine, profile) for c in data["cases"]], profile,
                        frozenset(stored.get("declared") or ()))
    run = data.get("generated", "an unknown date")
    first = stored.get("provenance", "")
    origin = first.split("; re-graded")[0] if first else f"Run of {run} (report version {data.get('version')})"
    today = datetime.now(UTC).date().isoformat()
    provenance = (f"{origin}; re-graded on {today} by `{SELF}` from its stored findings and exchanges (severity, "
                  "basis, the §4.7 terminal of every recorded stream); the engine was not run again")
    named = workers or (data.get("attribution") or {}).get("workers") or ()
    return write_reports(results, engine, folder, diagrams_dir=default_diagrams_dir(), wall_s=data.get("wall_seconds"),
                         grading=Grading(profile, frozenset(stored.get("declared") or ()), provenance),
                         generated=run, workers=worker_reports(folder, named))


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog=SELF, description=__doc__.strip().splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="a report folder, or a folder of them (then the matrix too)")
    ap.add_argument("--profile", choices=list(PROFILES), default=None, help="default: the report's own")
    ap.add_argument("--worker", action="append", default=[], metavar="NAME",
                    help="a report of the gateway's worker judged directly, by its folder beside the report's "
                         "(repeatable; default: the ones the report names)")
    args = ap.parse_args(argv)
    cases = {c.id: c for c in with_chat(load_cases())}
    for given in args.folders:
        folders = [given] if (given / "report.json").is_file() else sorted(p.parent for p in given.glob("*/report.json"))
        if not folders:
            print(f"{SELF}: {given} holds no report.json", file=sys.stderr)
            return 2
        for folder in folders:
            try:
                regrade(folder, cases, args.profile, args.worker)
            except CaseError as exc:
                print(f"{SELF}: {exc}", file=sys.stderr)
                return 2
            print(f"re-graded {folder}")
        if folders != [given]:
            from .matrix import write_matrix

            for p in write_matrix(given):
                print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
