"""One page across engines, Autobahn-style: rows are cases grouped by section, columns engines.

    python -m decodespec.properties.conformance.matrix reports/     # writes reports/matrix.{md,html}

It reads every `reports/<engine>/report.json` and shows, per engine, its findings counted by severity,
and per case and engine the verdict and the lead finding (the most severe: its severity, symptom
and, when not the chapter's rule, the decision or ignored field it rests on; a SKIP shows its reason
on hover); a cell links to the case in that engine's HTML report. A gateway (a report read against
its worker judged directly, attribution.py) has two columns: the findings only the gateway adds and
the worker's (shown directly too), each cell that layer's most severe finding, coloured by what it
weighs; its head counts each layer's causes and cases. The columns follow MATRIX_ORDER, then the rest
by name.
"""

from __future__ import annotations

import html
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .attribution import Group, grouped
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


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _gateway_count(rep: Mapping[str, Any]) -> str:
    """A gateway's split by layer (attribution.grouped): causes and cases of each, '' for an engine
    judged directly."""
    a = rep.get("attribution")
    if not a:
        return ""
    by = grouped(a, rep["causes"])
    said = [f"{word} {_plural(len(by[o]), 'cause')} in {_plural(len({c for g in by[o] for c in g.cases}), 'case')}"
            if by[o] else f"{word} none" for o, word in _LAYER_WORDS.items() if by[o] or o != "unjudged"]
    return f"; behind a gateway, against {', '.join(a['workers'])}: {'; '.join(said)}"


# A gateway's layers as its columns say them; the unjudged (no direct run of the case) beside the worker's.
_LAYER_WORDS = {"gateway": "own", "worker": "the worker's", "unjudged": "no direct run:"}
_COLUMNS = (("gateway",), ("worker", "unjudged"))  # the layers each of a gateway's two columns shows


def _layers(rep: Mapping[str, Any]) -> dict[str, dict[str, list[Group]]] | None:
    """A gateway's findings per case and layer, most severe first ({case: {owner: groups}}); None
    for an engine judged directly."""
    a = rep.get("attribution")
    if not a:
        return None
    out: dict[str, dict[str, list[Group]]] = {}
    for owner, groups in grouped(a, rep["causes"]).items():
        for g in groups:
            for cid in g.cases:
                out.setdefault(cid, {}).setdefault(owner, []).append(g)
    return out


def _group_tag(g: Group, cid: str) -> str:
    """'[accounting] token count too low (D31)': a layer's finding in a case as a cell says it."""
    if not g.severity:
        return "ERROR"
    part = g.basis_of(cid)
    tag = _basis_tag({"basis": {"kind": part.kind, "ref": part.ref}}) if part else ""
    return f"[{_SEVERITY_WORDS[g.severity]}] {g.label}" + (f" ({tag})" if tag else "")


def _layer_cell(groups: Sequence[Group], cid: str) -> str:
    """A layer's findings in a case: the most severe, '+N' for the rest; '—' for none."""
    if not groups:
        return "—"
    return _group_tag(groups[0], cid) + (f" +{len(groups) - 1}" if len(groups) > 1 else "")


def _layer_colour(groups: Sequence[Group], cid: str) -> str:
    """What a layer's most severe finding weighs: an error; red, the chapter broken (text, ending,
    accounting); orange, only a decision or an ignored field; pale, stream shape, wire or a field
    ignored engine-wide (D71); white, nothing."""
    if not groups:
        return "#fff"
    g = groups[0]
    part = g.basis_of(cid)
    if not g.severity:
        return _CELL["ERROR"]
    if g.severity in ("stream_shape", "wire") or (part is not None and part.engine_wide):
        return "#ffd"
    return _CELL["DIFFERS"] if part is not None and part.kind in ("decision", "field_ignored") else _CELL["FAIL"]


def _column_groups(per_case: Mapping[str, Sequence[Group]], owners: Sequence[str]) -> list[Group]:
    return [g for o in owners for g in per_case.get(o, ())]


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


def _engine_cell_md(c: Mapping[str, Any], wide: frozenset[str]) -> str:
    if c["verdict"] in ("FAIL", "ERROR", "DIFFERS"):
        return f"**{c['verdict']}** {_symptom(c)}".strip()
    mark = _pass_mark(c, wide)
    return "n/a" if c["verdict"] == "SKIP" else c["verdict"] + (f" ({mark})" if mark else "")


def _gateway_cells(c: Mapping[str, Any] | None, per_case: Mapping[str, Sequence[Group]]) -> list[tuple[str, str]]:
    """A gateway's two cells of one case, (text, colour) each: its layers' findings (_COLUMNS); a case
    not run, n/a or passed without findings says so in both."""
    if c is None:
        return [("", "#fff")] * len(_COLUMNS)
    if c["verdict"] == "SKIP" or not per_case:
        word = {"SKIP": "n/a"}.get(c["verdict"], c["verdict"])
        return [(word, _CELL[c["verdict"]])] * len(_COLUMNS)
    out = []
    for owners in _COLUMNS:
        groups = _column_groups(per_case, owners)
        prefix = f"{_LAYER_WORDS['unjudged']} " if groups and groups[0].owner == "unjudged" else ""
        out.append((prefix + _layer_cell(groups, c["id"]), _layer_colour(groups, c["id"])))
    return out


def _heads(reports: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The column names: an engine's name, a gateway's two (name: own, name: the worker's)."""
    return [f"{e}: {_LAYER_WORDS[cols[0]]}" if reports[e].get("attribution") else e
            for e in reports for cols in (_COLUMNS if reports[e].get("attribution") else _COLUMNS[:1])]


def to_markdown(reports: Mapping[str, Mapping[str, Any]]) -> str:
    engines = list(reports)
    heads = _heads(reports)
    lines = ["# Conformance matrix", "",
             "Each cell: the verdict and, for a case with findings, the most severe one: [severity] symptom, and in "
             "parentheses what it rests on when not a rule of chapter 4 (a project decision D, a request field that "
             "had no effect). FAIL: the chapter is broken; DIFFERS: only a project decision or an ignored field; "
             "PASS (stream-shape) or PASS (wire): only such findings. n/a: the engine cannot run the case (its "
             "report gives the reason). A gateway (read against its worker judged directly) has two columns: "
             "`own`, the findings only the gateway adds, and `the worker's`, those the worker shows directly "
             "too; each the most severe of that layer, +N for the rest, — for none.", "",
             "| engine | cases |", "|---|---|",
             *[f"| {e} | {_count(reports[e])}{_gateway_count(reports[e])} |" for e in engines], "",
             "| § | case | grade | " + " | ".join(heads) + " |", "|---|---|---|" + "---|" * len(heads)]
    layers = {e: _layers(reports[e]) for e in engines}
    for anchor, cid, grade, per in _rows(reports):
        cells = []
        for e in engines:
            c = per.get(e)
            by_layer = layers[e]
            if by_layer is not None:
                cells += [_md_cell(text) for text, _ in _gateway_cells(c, by_layer.get(cid, {}))]
            else:
                cells.append("" if c is None else _engine_cell_md(c, _wide(reports[e])))
        lines.append(f"| {anchor} | `{cid}` | {grade} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def to_html(reports: Mapping[str, Mapping[str, Any]]) -> str:
    e = html.escape
    engines = list(reports)
    layers = {name: _layers(reports[name]) for name in engines}
    split = any(v is not None for v in layers.values())  # a second header row names a gateway's columns
    span = {True: f" colspan={len(_COLUMNS)}", False: " rowspan=2" if split else ""}
    head = "".join(
        f"<th{span[layers[name] is not None]} id='col-{e(name)}'>"
        f"<a href='{e(name)}/report.html'>{e(name)}</a><br><small>"
        f"{e(_count(reports[name]) + _gateway_count(reports[name]))}</small></th>" for name in engines)
    sub = "".join(f"<th class='layer'>{e(_LAYER_WORDS[cols[0]])}</th>" for name in engines if layers[name] is not None
                  for cols in _COLUMNS)
    width = 2 + len(_heads(reports))
    body, last = [], None
    for anchor, cid, grade, per in _rows(reports):
        if anchor != last:
            body.append(f"<tr class='sec'><td colspan='{width}'>{e(anchor)}</td></tr>")
            last = anchor
        cells = []
        for name in engines:
            c = per.get(name)
            if c is None:
                cells.append("<td></td>" * (len(_COLUMNS) if layers[name] is not None else 1))
                continue
            v = c["verdict"]
            tip = c.get("reason") or "; ".join(f["message"] for f in c.get("failures", []))[:400]
            link = f"{name}/report.html#{cid}"
            by_layer = layers[name]
            if by_layer is not None:
                tip = f"verdict behind the gateway: {v}; {tip}"
                pair = _gateway_cells(c, by_layer.get(cid, {}))
                same = len(set(pair)) == 1  # n/a or a clean pass: one cell across the gateway's columns
                cells += [f"<td{f' colspan={len(pair)}' if same else ''} class='layer' style='background:{colour}' "
                          f"title='{e(tip)}'><a href='{e(link)}'>{e(text)}</a></td>" for text, colour in pair[:1 if same else None]]
                continue
            label = {"SKIP": "n/a"}.get(v, v)
            inv = (f"<br><small title='{e(c.get('first_violated_invariant') or '')}'>{e(_symptom(c))}</small>"
                   if v in ("FAIL", "ERROR", "DIFFERS") else
                   f"<br><small>{e(_pass_mark(c, _wide(reports[name])))}</small>" if c.get("failures") else "")
            link = link if v in ("FAIL", "ERROR", "DIFFERS") else f"{name}/report.html"
            cells.append(f"<td style='background:{_CELL[v]}' title='{e(tip)}'><a href='{e(link)}'>{label}</a>{inv}</td>")
        body.append(f"<tr><td><code>{e(cid)}</code></td><td>{grade}</td>{''.join(cells)}</tr>")
    css = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #bbb;"
           "padding:3px 8px;font-size:13px;text-align:center}td:first-child{text-align:left}a{color:#000;"
           "text-decoration:none}tr.sec td{background:#335;color:#fff;text-align:left;font-weight:bold}"
           "th.layer{font-size:12px;background:#eef}td.layer{min-width:7em}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>decodespec conformance matrix</title>"
            f"<style>{css}</style></head><body><h1>Conformance matrix</h1>"
            "<p>Rows: cases grouped by section of chapter 4; columns: engines, each on the same forced checkpoints. "
            "A cell links to the engine's report (a failure to its reproducer); hover for the reason. A cell names the "
            "most severe finding ([text] &gt; [ending] &gt; [accounting] &gt; [stream-shape] &gt; [wire]) and, in "
            "parentheses, a project decision (D) or an ignored field it rests on. DIFFERS (orange): only such "
            "findings. A gateway (read against its worker judged directly) has two columns: <b>own</b>, the findings "
            "only the gateway adds, and <b>the worker's</b>, those the worker shows directly too; each names that "
            "layer's most severe finding (+N for the rest, — for none), red where it breaks the chapter, orange where "
            "it rests on a decision or an ignored field, pale for stream shape or wire only; hover for the verdict.</p>"
            f"<table><tr><th{span[False]}>case</th><th{span[False]}>grade</th>{head}</tr>"
            f"{f'<tr>{sub}</tr>' if split else ''}{''.join(body)}"
            "</table></body></html>\n")


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
