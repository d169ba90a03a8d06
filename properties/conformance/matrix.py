"""One page across engines, Autobahn-style: rows are cases grouped by section, columns engines.

    python -m decodespec.properties.conformance.matrix reports/     # writes reports/matrix.{md,html}

It reads every `reports/<engine>/report.json` and shows, per engine, its findings counted by severity,
and per case and engine the verdict and the lead finding (the most severe: its severity, symptom
and, when not the chapter's rule, the decision or ignored field it rests on; a SKIP shows its reason
on hover); a cell links to the case in that engine's HTML report. A gateway's column (a report read
against its worker judged directly, attribution.py) counts its own findings apart from the worker's,
and a cell names the findings only the gateway adds. The columns follow MATRIX_ORDER, then the rest
by name.
"""

from __future__ import annotations

import html
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .attribution import owned, split_line
from .reports import section_key

MATRIX_ORDER = ("reference", "decodespec-serve", "decodespec-serve-bf16", "decodespec-serve-f16",
                "decodespec-serve-overlap", "vllm", "vllm-fp16", "vllm-bf16", "llama-server", "llama-server-f16", "llama-server-bf16", "llama-cpp-python", "decodespec-serve-life", "llama-server-life",
                "llama-cpp-python-life", "transformers-serve", "hf-generate", "decode-stream",
                "decodespec-serve-chat", "vllm-chat", "llama-server-chat", "llama-cpp-python-chat",
                "vllm-router", "smg", "litellm-vllm", "litellm-llama-server")
_CELL = {"PASS": "#cfc", "FAIL": "#f99", "DIFFERS": "#fc9", "ERROR": "#f66", "SKIP": "#eee"}
_SEVERITY_WORDS = {"text": "text", "ending": "ending", "accounting": "accounting", "stream_shape": "stream-shape",
                   "wire": "wire"}


def load_reports(folder: Path) -> dict[str, Mapping[str, Any]]:
    found = {p.parent.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*/report.json"))}
    order = [e for e in MATRIX_ORDER if e in found] + sorted(e for e in found if e not in MATRIX_ORDER)
    return {e: found[e] for e in order}


def _rows(reports: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, str, dict[str, Mapping[str, Any]]]]:
    """(anchor, case id, grade, {engine: case entry}) sorted by section number, then id."""
    cases: dict[str, dict[str, Any]] = {}
    meta: dict[str, tuple[str, str]] = {}
    for engine, rep in reports.items():
        for c in rep["cases"]:
            cases.setdefault(c["id"], {})[engine] = c
            meta[c["id"]] = (c["anchor"], c["grade"])
    return [(meta[cid][0], cid, meta[cid][1], cases[cid])
            for cid in sorted(cases, key=lambda cid: (section_key(meta[cid][0]), cid))]


def _count(rep: Mapping[str, Any]) -> str:
    """An engine's run: cases run, findings by severity, verdicts."""
    s = rep["summary"]
    ran = s["total"] - s["SKIP"]
    found = ", ".join(f"{n} {_SEVERITY_WORDS[k]}" for k, n in s.get("findings", {}).items() if n) or "no findings"
    wide = "".join(f"; engine-wide: field_ignored: {w['field']} ({w['cases']} cases)" for w in s.get("engine_wide", ()))
    return (f"{ran} of {s['total']} ran; {found}{wide}; {s['PASS']} pass, {s['FAIL']} fail, {s.get('DIFFERS', 0)} "
            f"differ, {s['ERROR']} error")


def _gateway_count(rep: Mapping[str, Any]) -> str:
    """A gateway's split (attribution.py), '' for an engine judged directly."""
    a = rep.get("attribution")
    return f"; behind a gateway: {split_line(a)}" if a else ""


def _gateway_own(rep: Mapping[str, Any]) -> dict[str, list[str]]:
    """Per case, the symptoms of the findings only the gateway adds (none for an engine judged directly)."""
    out: dict[str, list[str]] = {}
    for f in owned(rep["attribution"], "gateway") if rep.get("attribution") else ():
        out.setdefault(f["case"], []).append(f["symptom"])
    return out


def _gateway_mark(c: Mapping[str, Any], own: Mapping[str, Sequence[str]]) -> str:
    """' · gateway's own: a, b' for a case where the gateway adds findings."""
    return f" · gateway's own: {', '.join(own[c['id']])}" if c["id"] in own else ""


def _basis_tag(f: Mapping[str, Any]) -> str:
    """A finding's basis when it is not the chapter's rule: 'D31', 'field_ignored: min_tokens', 'wire'."""
    b = f.get("basis") or {}
    return {"decision": b.get("ref", ""), "field_ignored": f"field_ignored: {b.get('ref', '')}", "wire": "wire"}.get(
        b.get("kind", ""), "")


def _symptom(c: Mapping[str, Any]) -> str:
    """A cell's text for a case with findings: the lead (most severe) finding's severity and symptom,
    and its basis when not the chapter's, not the case's invariant."""
    lead = (c.get("failures") or [{}])[0]
    what = c.get("lead_symptom") or c.get("first_violated_invariant") or ""
    sev = c.get("lead_severity")
    tag = _basis_tag(lead)
    return (f"[{_SEVERITY_WORDS.get(sev, sev)}] " if sev else "") + what + (f" ({tag})" if tag else "")


def _pass_mark(c: Mapping[str, Any], wide: frozenset[str] = frozenset()) -> str:
    """What a pass with findings had: the most severe class among them ('stream-shape', 'wire', ...),
    as 'engine-wide: field_ignored: F' where that lead rests on a field ignored in the whole run (D71)."""
    lead = (c.get("failures") or [{}])[0]
    b = lead.get("basis") or {}
    if b.get("kind") == "field_ignored" and set(str(b.get("ref", "")).split(", ")) <= wide:
        return f"engine-wide: field_ignored: {b['ref']}"
    return _SEVERITY_WORDS.get(c.get("lead_severity") or "", "wire") if c.get("failures") else ""


def _wide(rep: Mapping[str, Any]) -> frozenset[str]:
    """The fields a report states as ignored engine-wide (D71)."""
    return frozenset(w["field"] for w in rep["summary"].get("engine_wide", ()))


def to_markdown(reports: Mapping[str, Mapping[str, Any]]) -> str:
    engines = list(reports)
    lines = ["# Conformance matrix", "",
             "Each cell: the verdict and, for a case with findings, the most severe one: [severity] symptom, and in "
             "parentheses what it rests on when not a rule of chapter 4 (a project decision D, a request field that "
             "had no effect). FAIL: the chapter is broken; DIFFERS: only a project decision or an ignored field; "
             "PASS (stream-shape) or PASS (wire): only such findings. n/a: the engine cannot run the case (its "
             "report gives the reason).", "",
             "| engine | cases |", "|---|---|",
             *[f"| {e} | {_count(reports[e])}{_gateway_count(reports[e])} |" for e in engines], "",
             "| § | case | grade | " + " | ".join(engines) + " |", "|---|---|---|" + "---|" * len(engines)]
    own = {e: _gateway_own(reports[e]) for e in engines}
    for anchor, cid, grade, per in _rows(reports):
        cells = []
        for e in engines:
            c = per.get(e)
            if c is None:
                cells.append("")
            elif c["verdict"] in ("FAIL", "ERROR", "DIFFERS"):
                cells.append(f"**{c['verdict']}** {_symptom(c)}".strip() + _gateway_mark(c, own[e]))
            else:
                mark = _pass_mark(c, _wide(reports[e]))
                cells.append("n/a" if c["verdict"] == "SKIP" else
                             c["verdict"] + (f" ({mark})" if mark else "") + _gateway_mark(c, own[e]))
        lines.append(f"| {anchor} | `{cid}` | {grade} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_html(reports: Mapping[str, Mapping[str, Any]]) -> str:
    e = html.escape
    engines = list(reports)
    head = "".join(f"<th><a href='{e(name)}/report.html'>{e(name)}</a><br><small>"
                   f"{e(_count(reports[name]) + _gateway_count(reports[name]))}</small></th>" for name in engines)
    own = {name: _gateway_own(reports[name]) for name in engines}
    body, last = [], None
    for anchor, cid, grade, per in _rows(reports):
        if anchor != last:
            body.append(f"<tr class='sec'><td colspan='{2 + len(engines)}'>{e(anchor)}</td></tr>")
            last = anchor
        cells = []
        for name in engines:
            c = per.get(name)
            if c is None:
                cells.append("<td></td>")
                continue
            v = c["verdict"]
            tip = c.get("reason") or "; ".join(f["message"] for f in c.get("failures", []))[:400]
            label = {"SKIP": "n/a"}.get(v, v)
            inv = (f"<br><small title='{e(c.get('first_violated_invariant') or '')}'>{e(_symptom(c))}</small>"
                   if v in ("FAIL", "ERROR", "DIFFERS") else
                   f"<br><small>{e(_pass_mark(c, _wide(reports[name])))}</small>" if c.get("failures") else "")
            inv += f"<br><small><b>{e(_gateway_mark(c, own[name]).lstrip(' ·'))}</b></small>" if c["id"] in own[name] else ""
            link = f"{name}/report.html#{cid}" if v in ("FAIL", "ERROR", "DIFFERS") else f"{name}/report.html"
            cells.append(f"<td style='background:{_CELL[v]}' title='{e(tip)}'><a href='{e(link)}'>{label}</a>{inv}</td>")
        body.append(f"<tr><td><code>{e(cid)}</code></td><td>{grade}</td>{''.join(cells)}</tr>")
    css = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #bbb;"
           "padding:3px 8px;font-size:13px;text-align:center}td:first-child{text-align:left}a{color:#000;"
           "text-decoration:none}tr.sec td{background:#335;color:#fff;text-align:left;font-weight:bold}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>decodespec conformance matrix</title>"
            f"<style>{css}</style></head><body><h1>Conformance matrix</h1>"
            "<p>Rows: cases grouped by section of chapter 4; columns: engines, each on the same forced checkpoints. "
            "A cell links to the engine's report (a failure to its reproducer); hover for the reason. A cell names the "
            "most severe finding ([text] &gt; [ending] &gt; [accounting] &gt; [stream-shape] &gt; [wire]) and, in "
            "parentheses, a project decision (D) or an ignored field it rests on. DIFFERS (orange): only such "
            "findings.</p>"
            f"<table><tr><th>case</th><th>grade</th>{head}</tr>{''.join(body)}</table></body></html>\n")


def write_matrix(folder: str | Path) -> Sequence[Path]:
    folder = Path(folder)
    reports = load_reports(folder)
    if not reports:
        raise SystemExit(f"no */report.json under {folder}")
    out = [folder / "matrix.md", folder / "matrix.html"]
    out[0].write_text(to_markdown(reports), encoding="utf-8")
    out[1].write_text(to_html(reports), encoding="utf-8")
    return out


if __name__ == "__main__":
    for path in write_matrix(sys.argv[1] if len(sys.argv) > 1 else "reports"):
        print(f"wrote {path}")
