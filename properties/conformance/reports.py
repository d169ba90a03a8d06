"""Conformance reports per engine: JSON, JUnit XML, Markdown and HTML (issues 7, 13, 15).

Every format leads with what is wrong. A one-line headline gives the pass rate over the cases that
ran; the failures come first, grouped by section of chapter 4 (h2spec's tree), each with the
statement of the invariant it breaks, its findings and a reproducer (for HTTP cases the exact
requests sent, the raw answers and the reference's answer); then the passes by section, a pass
that could not check everything marked *partial* with what it missed; the cases the engine cannot
run are folded away with their reasons. The HTML page is self-contained: the state diagrams the
failures name are embedded as SVG. report.json carries REPORT_VERSION and follows
report.schema.json, shipped beside this module.
"""

from __future__ import annotations

import functools
import html
import json
import platform
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ...spec.invariants import load_invariants
from .adapters.base import Finding
from .cases import CaseError, Grade
from .contract import CONTRACT_VERSION
from .runner import CaseResult, Verdict
from .symptoms import CHAT_STATEMENTS, WIRE, WIRE_STATEMENTS, label

REPORT_FILES = ("report.json", "junit.xml", "report.md", "report.html")
REPORT_VERSION = 3
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")


@functools.cache
def read_report(path: Path, fields: tuple[str, ...] = ("id",)) -> dict[str, Any]:
    """A report.json whose every case is an object with a string at each of `fields` (re-running a
    report on its own cases, comparing two runs of it); a file that is not one is a CaseError naming
    what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CaseError(f"{path}: not a readable report.json ({exc})") from None
    cases = data.get("cases") if isinstance(data, dict) else None
    if not isinstance(cases, list) or not all(isinstance(c, dict) and all(isinstance(c.get(f), str) for f in fields)
                                              for c in cases):
        raise CaseError(f"{path}: not a report.json (no 'cases' list of objects with "
                        f"{' and '.join(repr(f) for f in fields)})")
    return data


def case_ids_of(path: Path) -> list[str]:
    """The case ids of a report.json, in its order (CaseError: not a report)."""
    return [c["id"] for c in read_report(path)["cases"]]


def _statements() -> dict[str, str]:
    return {name: inv.statement for name, inv in load_invariants().items()}


def statement(invariant: str | None) -> str:
    """What the invariant (spec/invariants.toml) or wire convention (symptoms.WIRE_STATEMENTS) says."""
    key = invariant or ""
    return _statements().get(key, "") or CHAT_STATEMENTS.get(key, "") or WIRE_STATEMENTS.get(key, "")


def anchor_of(invariant: str) -> str:
    """The invariant's section (its wire convention says 'OpenAI API' instead)."""
    inv = load_invariants().get(invariant)
    if inv is not None:
        return inv.anchor
    return "§4.7" if invariant in CHAT_STATEMENTS else "OpenAI API" if invariant in WIRE_STATEMENTS else ""


def short(f: Finding) -> str:
    """A finding in a few words for a matrix cell: its symptom's label, else its invariant."""
    return label(f.symptom) or f.invariant


def causes(results: Sequence[CaseResult]) -> list[dict[str, Any]]:
    """The distinct causes of a run's findings: (invariant, symptom) with the cases they cover,
    chapter-4 ones first (most cases first), then the wire conventions."""
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        for f in r.failures:
            key = (f.invariant, f.symptom)
            c = by.setdefault(key, {"invariant": f.invariant, "symptom": f.symptom, "label": short(f),
                                    "family": f.family, "anchor": anchor_of(f.invariant),
                                    "statement": statement(f.invariant), "cases": [], "lead_in": []})
            if r.case.id not in c["cases"]:
                c["cases"].append(r.case.id)
            if r.lead is f and r.case.id not in c["lead_in"]:
                c["lead_in"].append(r.case.id)
    return sorted(by.values(), key=lambda c: (c["family"] == WIRE, -len(c["cases"]), c["invariant"], c["symptom"]))


def partial(r: CaseResult) -> bool:
    """A pass that could not check everything its case expects (the rest is in `not_checked`)."""
    return r.verdict is Verdict.PASS and bool(r.not_checked)


def summary(results: Sequence[CaseResult]) -> dict[str, Any]:
    """Counts by verdict and grade; the pass rate over the cases that ran; `must_all_pass`."""
    by = Counter(r.verdict.value for r in results)
    must_fail = sum(1 for r in results if r.failed and r.case.grade is Grade.MUST)
    must_ran = sum(1 for r in results if r.case.grade is Grade.MUST and r.verdict is not Verdict.SKIP)
    ran = len(results) - by.get("SKIP", 0)
    return {
        "total": len(results), **{v.value: by.get(v.value, 0) for v in Verdict},
        "ran": ran, "pass_rate": round(by.get("PASS", 0) / ran, 4) if ran else None,
        "partial": sum(partial(r) for r in results),
        "wire": sum(1 for r in results if r.wire),
        "must_failed": must_fail, "should_failed": sum(1 for r in results if r.failed) - must_fail,
        "must_ran": must_ran, "must_all_pass": must_fail == 0,
    }


def headline(results: Sequence[CaseResult], engine: str) -> str:
    """One line: `vllm: 48/55 pass (87%); 7 fail and 0 error (6 MUST, 1 SHOULD); 9 n/a`."""
    s = summary(results)
    rate = f" ({s['pass_rate']:.0%})" if s["pass_rate"] is not None else ""
    return (f"{engine}: {s['PASS']}/{s['ran']} pass{rate}; {s['FAIL']} fail and {s['ERROR']} error "
            f"({s['must_failed']} MUST, {s['should_failed']} SHOULD); {s['SKIP']} n/a"
            + (f"; {s['partial']} partial" if s["partial"] else "")
            + (f"; {s['wire']} with wire-convention findings" if s["wire"] else ""))


def section_key(anchor: str) -> int:
    """'§4.10' -> 10, so sections sort as chapter 4 numbers them (§4.10 after §4.9)."""
    return int(anchor.split(".")[1])


def by_section(results: Iterable[CaseResult]) -> list[tuple[str, list[CaseResult]]]:
    """Results grouped by their § anchor, §4.1 first (§4.10 after §4.9), ids sorted within."""
    groups: dict[str, list[CaseResult]] = {}
    for r in results:
        groups.setdefault(r.case.anchor, []).append(r)
    return [(a, sorted(groups[a], key=lambda r: r.case.id)) for a in sorted(groups, key=section_key)]


def _expected(r: CaseResult) -> dict[str, Any]:
    return dict(r.expected) if r.expected is not None else r.case.to_json()["expect"]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def is_http(exchange: Any) -> bool:
    """Whether a recorded exchange is an HTTP request (its `request` has a path and a body); an
    in-house engine's calls (contract.py) and a dropped connection are not."""
    req = exchange.get("request") if isinstance(exchange, Mapping) else None
    return isinstance(req, Mapping) and isinstance(req.get("path"), str) and isinstance(req.get("body"), Mapping)


def curl(exchange: Mapping[str, Any]) -> str:
    """One recorded HTTP request (is_http) as a curl line against $URL (streamed requests with -N)."""
    req = exchange["request"]
    body = json.dumps(req["body"], ensure_ascii=False, separators=(",", ":"))
    flags = "-sS -N" if req["body"].get("stream") else "-sS"
    return f"curl {flags} \"$URL{req['path']}\" -H 'Content-Type: application/json' -d {_quote(body)}"


def replay(r: CaseResult) -> str:
    """A shell snippet that replays an HTTP case by hand: rebuild just its checkpoint, start the
    engine as the run did, send the same requests; what the reference requires and answers follows."""
    server = r.observed.get("server") or {}
    exchanges = [e for e in r.observed.get("exchanges") or [] if is_http(e)]
    ck = server.get("checkpoint")
    lines = [f"# {r.case.id} on {r.engine}" + (f" (version {server['version']})" if server.get("version") else "")]
    if ck:
        lines += [f"# checkpoint {ck['group']}, sha256 {ck['sha256']}: rebuild just it, and check the hash",
                  f"decodespec checkpoints build --out ckpt --group {ck['group']}",
                  f"decodespec checkpoints digest ckpt/{ck['group']}"]
    if server.get("launch"):
        lines += ["# the engine, started as the run started it ({model} is the checkpoint folder, {port} a port):",
                  f"#   {server['launch']}"]
    lines.append(f"URL=${{URL:-{server.get('url', 'http://127.0.0.1:8000')}}}")
    lines += [curl(e) for e in exchanges]
    for f in r.failures:
        where = anchor_of(f.invariant)
        lines.append(f"# requires {f.invariant}{f' ({where})' if where else ''}: {statement(f.invariant)}")
        lines.append(f"#   seen: {f.message[:400]}")
    ref = r.observed.get("reference")
    if ref:
        lines.append("# the reference's answer on the same checkpoint: " + json.dumps(
            {k: ref.get(k) for k in ("state", "output", "finish_reason", "wire_finish_reason", "selected_tokens")},
            ensure_ascii=False))
    return "\n".join(lines) + "\n"


def written(kept: Callable[[CaseResult], dict[str, Any]]) -> Callable[[Callable[[CaseResult], dict[str, Any]]],
                                                                   Callable[[CaseResult], dict[str, Any]]]:
    """A case's rendering made safe: what it returns when that renders as JSON, else `kept(r)` (what
    the case file alone gives) with `writer_error` naming what failed, so an odd value an adapter
    recorded costs that case its detail, never the report."""

    def wrap(build: Callable[[CaseResult], dict[str, Any]]) -> Callable[[CaseResult], dict[str, Any]]:
        @functools.wraps(build)
        def safe(r: CaseResult) -> dict[str, Any]:
            try:
                out = build(r)
                json.dumps(out, ensure_ascii=False)
                return out
            except Exception as exc:  # an adapter's record of any shape: the error is the case's, named
                said = f"{type(exc).__name__}: {exc}"
            return {**kept(r), "writer_error": f"the report's {build.__name__} of this case failed ({said}); "
                                               "what the engine showed is left out"}

        return safe

    return wrap


@written(lambda r: {"inputs": dict(r.case.inputs), "recipe": r.case.recipe, "expected": {}, "observed": {}})
def reproducer(r: CaseResult) -> dict[str, Any]:
    """What a reader needs to rerun the case by hand. Over HTTP: the replay snippet (rebuild, launch,
    curl), the server, the exchanges with their raw answers and the reference's answer; the case's
    inline tokenizer is left out (the checkpoint's hash names it). In process: inputs, expected,
    observed."""
    obs = {k: v for k, v in r.observed.items()
           if v not in (None, [], {}) and k not in ("exchanges", "reference", "server")}
    http = any(is_http(e) for e in r.observed.get("exchanges") or [])
    inputs = {k: v for k, v in r.case.inputs.items() if not (http and k == "tokenizer")}
    out: dict[str, Any] = {"inputs": inputs, "recipe": r.case.recipe, "expected": _expected(r), "observed": obs}
    if http:
        out = {"replay": replay(r), **out}
    for key in ("server", "exchanges", "reference"):
        if r.observed.get(key):
            out[key] = r.observed[key]
    return out


@written(lambda r: {})
def evidence(r: CaseResult) -> dict[str, Any]:
    """What a pass keeps so it can be audited: the requests and raw answers (or the outputs seen)."""
    if r.observed.get("exchanges"):
        return {"exchanges": r.observed["exchanges"], **({"reference": r.observed["reference"]}
                                                         if r.observed.get("reference") else {})}
    return {k: r.observed[k] for k in ("output", "chunks", "finish_reason", "state") if r.observed.get(k) is not None}


def to_json(results: Sequence[CaseResult], engine: str, wall_s: float | None = None) -> dict[str, Any]:
    return {
        "version": REPORT_VERSION,
        "contract": CONTRACT_VERSION,  # the in-house adapter contract this judge speaks (contract.py)
        "engine": engine,
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "headline": headline(results, engine),
        "summary": summary(results),
        "causes": causes(results),
        **({"wall_seconds": round(wall_s, 1)} if wall_s is not None else {}),
        "cases": [
            {
                "id": r.case.id, "anchor": r.case.anchor, "grade": r.case.grade.value,
                "invariant": r.case.invariant, "statement": statement(r.case.invariant),
                "description": r.case.description,
                "verdict": r.verdict.value, "partial": partial(r), "first_violated_invariant": r.first_invariant,
                "failures": [{"invariant": f.invariant, "symptom": f.symptom, "family": f.family, "message": f.message}
                             for f in r.failures],
                "not_checked": list(r.not_checked), "reason": r.reason, "seconds": round(r.seconds, 4),
                "notes": list(r.observed.get("notes") or []),
                "lead_symptom": short(r.lead) if r.lead else None,
                "diagram": r.case.diagram,
                **({"reproducer": reproducer(r)} if r.failed or r.wire else
                   {"evidence": evidence(r)} if r.verdict is Verdict.PASS else {}),
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
                f"{r.first_invariant}: {statement(r.first_invariant)}\n\n"
                + "\n".join(f"{f.invariant}: {f.message}" for f in r.failures)
                + "\n\nreproducer:\n" + json.dumps(reproducer(r), ensure_ascii=False, indent=1))
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


# ---- Markdown ------------------------------------------------------------------------------------


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _pass_note(r: CaseResult) -> str:
    notes = [f"partial: not checked {', '.join(r.not_checked)}"] if partial(r) else []
    notes += [f"wire: {short(f)} ({f.invariant})" for f in r.wire]
    return "; ".join(notes)


def _md_causes(results: Sequence[CaseResult]) -> list[str]:
    found = causes(results)
    if not found:
        return []
    lines = [f"## Causes ({len(found)})", "",
             "Each distinct thing the engine got wrong, with the cases that show it (lead: the cases where it is "
             "the first finding). Wire conventions are the OpenAI API's, not rules of chapter 4.", "",
             "| family | invariant | § | symptom | cases | lead in |", "|---|---|---|---|---|---|"]
    for c in found:
        lines.append(f"| {c['family']} | {c['invariant']} | {c['anchor']} | {_md_cell(c['label'])} | "
                     f"{len(c['cases'])}: {', '.join(f'`{i}`' for i in c['cases'])} | {len(c['lead_in'])} |")
    return lines + [""]


def to_markdown(results: Sequence[CaseResult], engine: str) -> str:
    failed = [r for r in results if r.failed]
    passed = [r for r in results if r.verdict is Verdict.PASS]
    skipped = [r for r in results if r.verdict is Verdict.SKIP]
    lines = [f"# Conformance report: `{engine}`", "", f"**{headline(results, engine)}**", ""]
    lines += _md_causes(results)
    lines += [f"## Failures ({len(failed)})", ""] if failed else ["No failures.", ""]
    for anchor, rs in by_section(failed):
        lines += [f"### {anchor} ({len(rs)})", ""]
        for r in rs:
            inv = r.first_invariant or r.case.invariant
            lead = f"{inv}: {short(r.lead)}" if r.lead else inv
            lines += [f"#### `{r.case.id}`: {r.verdict.value} ({r.case.grade.value}), {lead}", "",
                      f"> {statement(inv)}" if statement(inv) else "> (adapter error)", "", r.case.description, ""]
            lines += [f"- **{f.invariant}** ({short(f)}{', wire' if f.family == WIRE else ''}): {_md_cell(f.message)}"
                      for f in r.failures] or [f"- error: {_md_cell(r.reason)}"]
            rep = reproducer(r)
            if "replay" in rep:
                lines += ["", "Replay by hand:", "", "```sh", rep["replay"].rstrip(), "```"]
            lines += ["", "<details><summary>reproducer</summary>", "", "```json",
                      json.dumps(rep, ensure_ascii=False, indent=1), "```", "", "</details>", ""]
    lines += [f"## Passed ({len(passed)})", "", "| § | case | grade | invariant | note |", "|---|---|---|---|---|"]
    for anchor, rs in by_section(passed):
        lines += [f"| {anchor} | `{r.case.id}` | {r.case.grade.value} | {r.case.invariant} | {_md_cell(_pass_note(r))} |"
                  for r in rs]
    if skipped:
        lines += ["", f"<details><summary>Not applicable to this engine ({len(skipped)})</summary>", "",
                  "| § | case | reason |", "|---|---|---|"]
        lines += [f"| {a} | `{r.case.id}` | {_md_cell(r.reason)} |" for a, rs in by_section(skipped) for r in rs]
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


# ---- HTML ------------------------------------------------------------------------------------------

_CSS = ("body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;vertical-align:top;font-size:14px}.PASS{background:#dfd}"
        ".partial{background:#ffd}.FAIL{background:#fdd}.ERROR{background:#fbb}.SKIP{background:#eee}"
        "h1{margin-bottom:.2em}.headline{font-size:1.15em;font-weight:bold;padding:.4em .6em;border-left:6px solid}"
        ".bad{border-color:#c33;background:#fee}.good{border-color:#393;background:#efe}"
        "blockquote{margin:.3em 0 .6em 0;padding:.2em .8em;border-left:4px solid #99c;color:#334}"
        ".case{border:1px solid #ddd;padding:.2em 1em;margin:.8em 0}pre{background:#f6f6f6;padding:8px;"
        "overflow:auto;max-height:30em;font-size:12px}summary{cursor:pointer;font-weight:bold}"
        ".diagram svg{max-width:100%;height:auto}")


def _svg(diagrams_dir: Path | None, name: str) -> str | None:
    if diagrams_dir is None or not (diagrams_dir / f"{name}.svg").is_file():
        return None
    text = (diagrams_dir / f"{name}.svg").read_text(encoding="utf-8")
    return text[text.find("<svg"):] if "<svg" in text else None


def _links(ids: Sequence[str]) -> str:
    return ", ".join(f"<a href='#{html.escape(i)}'>{html.escape(i)}</a>" for i in ids)


def to_html(results: Sequence[CaseResult], engine: str, *, diagrams_dir: Path | None = None) -> str:
    e = html.escape
    failed = [r for r in results if r.failed]
    passed = [r for r in results if r.verdict is Verdict.PASS]
    skipped = [r for r in results if r.verdict is Verdict.SKIP]
    embedded = {d: svg for d in sorted({r.case.diagram for r in failed}) if (svg := _svg(diagrams_dir, d))}
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>decodespec conformance: {e(engine)}</title>"
             f"<style>{_CSS}</style></head><body><h1>Conformance report: {e(engine)}</h1>",
             f"<p class='headline {'bad' if failed else 'good'}'>{e(headline(results, engine))}</p>"]
    found = causes(results)
    if found:
        rows = "".join(
            f"<tr class='{'partial' if c['family'] == WIRE else 'FAIL'}'><td>{e(c['family'])}</td>"
            f"<td title='{e(c['statement'])}'>{e(c['invariant'])}</td><td>{e(c['anchor'])}</td><td>{e(c['label'])}</td>"
            f"<td>{len(c['cases'])}: {_links(c['cases'])}</td>"
            f"<td>{len(c['lead_in'])}</td></tr>" for c in found)
        parts.append(f"<h2>Causes ({len(found)})</h2><p>Each distinct thing the engine got wrong, with the cases "
                     "that show it. Wire conventions are the OpenAI API's, not rules of chapter 4.</p><table><tr>"
                     "<th>family</th><th>invariant</th><th>§</th><th>symptom</th><th>cases</th><th>lead in</th></tr>"
                     f"{rows}</table>")
    parts.append(f"<h2>Failures ({len(failed)})</h2>" if failed else "<p>No failures.</p>")
    for anchor, rs in by_section(failed):
        parts.append(f"<h3>{e(anchor)} ({len(rs)})</h3>")
        for r in rs:
            inv = r.first_invariant or r.case.invariant
            diagram = (f" · diagram <a href='#diagram-{e(r.case.diagram)}'>{e(r.case.diagram)}</a>"
                       if r.case.diagram in embedded else "")
            rep = reproducer(r)
            findings = "".join(f"<li><b>{e(f.invariant)}</b> ({e(short(f))}{', wire' if f.family == WIRE else ''}): "
                               f"{e(f.message)}</li>" for f in r.failures) or \
                f"<li>error: {e(r.reason)}</li>"
            parts.append(
                f"<div class='case {r.verdict.value}' id='{e(r.case.id)}'><h4>{e(r.case.id)}: {r.verdict.value} "
                f"({r.case.grade.value}), {e(inv)}{': ' + e(short(r.lead)) if r.lead else ''}{diagram}</h4>"
                f"<blockquote>{e(statement(inv)) or '(adapter error)'}</blockquote><p>{e(r.case.description)}</p>"
                f"<ul>{findings}</ul>"
                + (f"<p>Replay by hand:</p><pre>{e(rep['replay'])}</pre>" if "replay" in rep else "")
                + "<details><summary>reproducer</summary>"
                f"<pre>{e(json.dumps(rep, ensure_ascii=False, indent=1))}</pre></details></div>")
    rows = "".join(
        f"<tr class='{'partial' if partial(r) else 'PASS'}'><td>{e(a)}</td><td>{e(r.case.id)}</td>"
        f"<td>{r.case.grade.value}</td><td title='{e(statement(r.case.invariant))}'>{e(r.case.invariant)}</td>"
        f"<td>{e(_pass_note(r))}</td></tr>"
        for a, rs in by_section(passed) for r in rs)
    parts.append(f"<h2>Passed ({len(passed)})</h2><table><tr><th>§</th><th>case</th><th>grade</th><th>invariant</th>"
                 f"<th>note</th></tr>{rows}</table>")
    if skipped:
        rows = "".join(f"<tr class='SKIP'><td>{e(a)}</td><td>{e(r.case.id)}</td><td>{e(r.reason)}</td></tr>"
                       for a, rs in by_section(skipped) for r in rs)
        parts.append(f"<details><summary>Not applicable to this engine ({len(skipped)})</summary><table>"
                     f"<tr><th>§</th><th>case</th><th>reason</th></tr>{rows}</table></details>")
    for name, svg in embedded.items():
        parts.append(f"<details class='diagram' id='diagram-{e(name)}'><summary>diagram: {e(name)}</summary>{svg}</details>")
    return "".join(parts) + "</body></html>\n"


def write_reports(results: Sequence[CaseResult], engine: str, out_dir: str | Path,
                  *, diagrams_dir: str | Path | None = None, wall_s: float | None = None) -> list[Path]:
    """Write the four report files into `out_dir`; returns their paths. `wall_s`: the whole run's
    wall time (server start-ups included), kept in report.json. The HTML embeds the SVG diagrams
    of `diagrams_dir` its failures name, so the page stands alone."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ddir = Path(diagrams_dir).resolve() if diagrams_dir is not None else None
    texts = {
        "report.json": json.dumps(to_json(results, engine, wall_s), ensure_ascii=False, indent=1) + "\n",
        "junit.xml": to_junit(results, engine),
        "report.md": to_markdown(results, engine),
        "report.html": to_html(results, engine, diagrams_dir=ddir),
    }
    paths = []
    for name in REPORT_FILES:
        (out / name).write_text(texts[name], encoding="utf-8")
        paths.append(out / name)
    return paths
