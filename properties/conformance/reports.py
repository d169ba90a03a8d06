"""Conformance reports per engine: JSON, JUnit XML, Markdown and HTML (issue 7 item 3).

Each row: case, anchor, grade, verdict, the first violated invariant, and a minimal reproducer (the
case's inputs with the expected and the observed outcome), with a link to the machine's diagram.
"""

from __future__ import annotations

import html
import json
import os
import platform
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .cases import Grade
from .runner import CaseResult, Verdict

REPORT_FILES = ("report.json", "junit.xml", "report.md", "report.html")


def summary(results: Sequence[CaseResult]) -> dict[str, Any]:
    """Counts by verdict, and by grade for failures; `must_all_pass` over the cases that ran."""
    by = Counter(r.verdict.value for r in results)
    must_fail = sum(1 for r in results if r.failed and r.case.grade is Grade.MUST)
    must_ran = sum(1 for r in results if r.case.grade is Grade.MUST and r.verdict is not Verdict.SKIP)
    return {
        "total": len(results), **{v.value: by.get(v.value, 0) for v in Verdict},
        "must_failed": must_fail, "should_failed": sum(1 for r in results if r.failed) - must_fail,
        "must_ran": must_ran, "must_all_pass": must_fail == 0,
    }


def _expected(r: CaseResult) -> dict[str, Any]:
    return dict(r.expected) if r.expected is not None else r.case.to_json()["expect"]


def reproducer(r: CaseResult) -> dict[str, Any]:
    """What a reader needs to rerun the case by hand: inputs, expected, observed."""
    obs = {k: v for k, v in r.observed.items() if v not in (None, [], {}) and k not in ("exchanges", "reference")}
    out = {"inputs": dict(r.case.inputs), "recipe": r.case.recipe, "expected": _expected(r), "observed": obs}
    # Over HTTP: the exact requests sent with the raw answers, and the reference's answer to the same.
    for key in ("exchanges", "reference"):
        if r.observed.get(key):
            out[key] = r.observed[key]
    return out


def to_json(results: Sequence[CaseResult], engine: str, wall_s: float | None = None) -> dict[str, Any]:
    return {
        "engine": engine,
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "summary": summary(results),
        **({"wall_seconds": round(wall_s, 1)} if wall_s is not None else {}),
        "cases": [
            {
                "id": r.case.id, "anchor": r.case.anchor, "grade": r.case.grade.value,
                "invariant": r.case.invariant, "description": r.case.description,
                "verdict": r.verdict.value, "first_violated_invariant": r.first_invariant,
                "failures": [{"invariant": f.invariant, "message": f.message} for f in r.failures],
                "not_checked": list(r.not_checked), "reason": r.reason, "seconds": round(r.seconds, 4),
                "notes": list(r.observed.get("notes") or []),
                "diagram": r.case.diagram, **({"reproducer": reproducer(r)} if r.failed else {}),
            }
            for r in results
        ],
    }


def to_junit(results: Sequence[CaseResult], engine: str) -> str:
    s = summary(results)
    suite = ET.Element("testsuite", name=f"decodespec-conformance[{engine}]", tests=str(s["total"]),
                       failures=str(s["FAIL"]), errors=str(s["ERROR"]), skipped=str(s["SKIP"]),
                       time=f"{sum(r.seconds for r in results):.3f}")
    for r in results:
        tc = ET.SubElement(suite, "testcase", classname=f"{engine}.{r.case.id.split('/')[0]}",
                           name=f"{r.case.id} [{r.case.grade.value} {r.case.anchor}]", time=f"{r.seconds:.4f}")
        if r.verdict is Verdict.SKIP:
            ET.SubElement(tc, "skipped", message=r.reason)
        elif r.verdict is Verdict.ERROR:
            ET.SubElement(tc, "error", message=r.reason).text = json.dumps(reproducer(r), ensure_ascii=False, indent=1)
        elif r.verdict is Verdict.FAIL:
            msg = f"{r.first_invariant}: {r.failures[0].message}"
            ET.SubElement(tc, "failure", message=msg, type=r.first_invariant or "").text = (
                "\n".join(f"{f.invariant}: {f.message}" for f in r.failures)
                + "\n\nreproducer:\n" + json.dumps(reproducer(r), ensure_ascii=False, indent=1))
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def _diagram_link(r: CaseResult, out_dir: Path, diagrams_dir: Path | None) -> str | None:
    if diagrams_dir is None:
        return None
    return os.path.relpath(diagrams_dir / f"{r.case.diagram}.svg", out_dir).replace(os.sep, "/")


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(results: Sequence[CaseResult], engine: str, *, out_dir: Path, diagrams_dir: Path | None) -> str:
    s = summary(results)
    verdict = "passes every MUST case it ran" if s["must_all_pass"] else f"fails {s['must_failed']} MUST case(s)"
    lines = [
        f"# Conformance report: `{engine}`", "",
        f"{s['total']} cases: {s['PASS']} pass, {s['FAIL']} fail, {s['ERROR']} error, {s['SKIP']} skipped. "
        f"The engine **{verdict}** ({s['must_ran']} MUST cases ran; {s['should_failed']} SHOULD failure(s)).", "",
        "| case | anchor | grade | verdict | first violated invariant | note | diagram |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        note = r.failures[0].message if r.failures else r.reason or (
            f"not checked: {', '.join(r.not_checked)}" if r.not_checked else "")
        link = _diagram_link(r, out_dir, diagrams_dir)
        lines.append("| " + " | ".join(_md_cell(c) for c in (
            f"`{r.case.id}`", r.case.anchor, r.case.grade.value, r.verdict.value, r.first_invariant or "",
            note[:240], f"[{r.case.diagram}]({link})" if link else r.case.diagram)) + " |")
    failed = [r for r in results if r.failed]
    if failed:
        lines += ["", "## Failures and reproducers", ""]
        for r in failed:
            lines += [f"### `{r.case.id}` ({r.case.grade.value}, {r.case.anchor})", "", r.case.description, ""]
            lines += [f"- **{f.invariant}**: {_md_cell(f.message)}" for f in r.failures] or [f"- error: {r.reason}"]
            lines += ["", "```json", json.dumps(reproducer(r), ensure_ascii=False, indent=1), "```", ""]
    return "\n".join(lines) + "\n"


_CSS = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:4px 8px;vertical-align:top}.PASS{background:#dfd}.FAIL{background:#fdd}.ERROR{background:#fbb}"
        ".SKIP{background:#eee}pre{background:#f6f6f6;padding:8px;overflow:auto}")


def to_html(results: Sequence[CaseResult], engine: str, *, out_dir: Path, diagrams_dir: Path | None) -> str:
    s = summary(results)
    e = html.escape
    rows = []
    for r in results:
        link = _diagram_link(r, out_dir, diagrams_dir)
        note = r.failures[0].message if r.failures else r.reason
        anchor = f"<a href='#{e(r.case.id)}'>{e(r.case.id)}</a>" if r.failed else e(r.case.id)
        rows.append(
            f"<tr class='{r.verdict.value}'><td>{anchor}</td><td>{e(r.case.anchor)}</td><td>{r.case.grade.value}</td>"
            f"<td>{r.verdict.value}</td><td>{e(r.first_invariant or '')}</td><td>{e(note)}</td>"
            f"<td>{f'<a href={chr(39)}{e(link)}{chr(39)}>{e(r.case.diagram)}</a>' if link else e(r.case.diagram)}</td></tr>")
    details = [
        f"<h3 id='{e(r.case.id)}'>{e(r.case.id)} ({r.case.grade.value}, {e(r.case.anchor)})</h3><p>{e(r.case.description)}</p>"
        f"<ul>{''.join(f'<li><b>{e(f.invariant)}</b>: {e(f.message)}</li>' for f in r.failures) or f'<li>error: {e(r.reason)}</li>'}</ul>"
        f"<pre>{e(json.dumps(reproducer(r), ensure_ascii=False, indent=1))}</pre>"
        for r in results if r.failed
    ]
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>decodespec conformance: {e(engine)}</title>"
        f"<style>{_CSS}</style></head><body><h1>Conformance report: {e(engine)}</h1>"
        f"<p>{s['total']} cases: {s['PASS']} pass, {s['FAIL']} fail, {s['ERROR']} error, {s['SKIP']} skipped; "
        f"MUST failures: {s['must_failed']}, SHOULD failures: {s['should_failed']}.</p>"
        "<table><tr><th>case</th><th>anchor</th><th>grade</th><th>verdict</th><th>first violated invariant</th>"
        f"<th>note</th><th>diagram</th></tr>{''.join(rows)}</table>"
        f"{'<h2>Failures and reproducers</h2>' if details else ''}{''.join(details)}</body></html>\n"
    )


def write_reports(results: Sequence[CaseResult], engine: str, out_dir: str | Path,
                  *, diagrams_dir: str | Path | None = None, wall_s: float | None = None) -> list[Path]:
    """Write the four report files into `out_dir`; returns their paths. `wall_s`: the whole run's
    wall time (server start-ups included), kept in report.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ddir = Path(diagrams_dir).resolve() if diagrams_dir is not None else None
    texts = {
        "report.json": json.dumps(to_json(results, engine, wall_s), ensure_ascii=False, indent=1) + "\n",
        "junit.xml": to_junit(results, engine),
        "report.md": to_markdown(results, engine, out_dir=out.resolve(), diagrams_dir=ddir),
        "report.html": to_html(results, engine, out_dir=out.resolve(), diagrams_dir=ddir),
    }
    paths = []
    for name in REPORT_FILES:
        (out / name).write_text(texts[name], encoding="utf-8")
        paths.append(out / name)
    return paths
