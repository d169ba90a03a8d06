"""Conformance reports per engine: JSON, JUnit XML, Markdown and HTML.

Every format leads with what the run judged and what is wrong. A line names what was run (the
engine's recorded version, the checkpoints served and their hashes, when, the launch commands). A
one-line headline says how many cases ran and why the rest did not (first of all when most could
not: such a run judged nothing), the findings counted by severity (symptoms.SEVERITIES: text,
ending, accounting, stream shape, wire) and the verdicts; then the findings by severity, split by
their basis, the error cases with their reason, and the causes, most severe first, each with
its basis: a rule of chapter 4 with its section and statement, a project decision with what common
engines do instead (decisions.DECISIONS), a request field that had no effect, or a wire convention.
The cases that fail the chapter come next, grouped by section (h2spec's tree), with their findings,
each with its severity and basis, and a reproducer (for HTTP cases the exact requests sent, the raw
answers and the reference's answer); then the cases that differ only on a decision or an ignored
field; the passes by section (partial ones say what they missed, findings that fail nothing are
listed); the cases the engine cannot run are folded away with their reasons. The HTML page is
self-contained: the state diagrams the failures name are embedded as SVG. report.json carries
REPORT_VERSION and follows report.schema.json, shipped beside this module.
"""

from __future__ import annotations

import functools
import html
import json
import platform
import re
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs

from ...spec.invariants import load_invariants
from . import replay_script as replay_script_module
from .adapters.base import Finding
from .attribution import Group, attribution_json, grouped, hidden_groups, lost_groups, split_line
from .cases import CaseError, Grade
from .contract import CONTRACT_VERSION
from .decisions import decision_line
from .engine_wide import ignored_engine_wide
from .replay_script import FLOWS
from .runner import CaseResult, Verdict
from .symptoms import (
    CHAPTER_BASIS,
    CHAT_STATEMENTS,
    DECISION_BASIS,
    FIELD_BASIS,
    SEVERITIES,
    WIRE_BASIS,
    WIRE_STATEMENTS,
    Basis,
    Severity,
    label,
    severity_of,
)

REPORT_FILES = ("report.json", "junit.xml", "report.md", "report.html")
REPORT_VERSION = 4
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


def worker_reports(folder: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The reports of a gateway's worker judged directly, named by their folders beside `folder` (the
    gateway run's), by name (attribution.py); a missing or malformed one is a CaseError naming it."""
    return {n: read_report.__wrapped__(folder.parent / n / "report.json", ("id", "verdict")) for n in names}


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


@attrs.frozen
class Grading:
    """How a run's results were graded, as its reports say: the profile (runner.PROFILES), the
    decisions the engine declared its own (--declare), and where the results come from when they
    were not judged just now (`provenance`: re-graded from a stored report.json)."""

    profile: str = "project"
    declared: frozenset[str] = frozenset()
    provenance: str = ""


SEVERITY_WORDS: Mapping[Severity, str] = {Severity.TEXT: "text", Severity.ENDING: "ending",
                                          Severity.ACCOUNTING: "accounting", Severity.STREAM_SHAPE: "stream-shape",
                                          Severity.WIRE: "wire"}
_BASIS_ORDER = ("chapter", "decision", "field_ignored", "wire")


def basis_text(b: Basis) -> str:
    """A finding's basis in one line: the chapter's rule with its section and statement, the
    decision with what engines do instead, the fields that had no effect, or the wire convention."""
    if b.kind == "decision":
        return decision_line(b.ref)
    if b.kind == "field_ignored":
        return f"field_ignored: {b.ref} (the engine took the field and it had no effect)"
    where = anchor_of(b.ref)
    said = statement(b.ref)
    return f"{'wire' if b.kind == 'wire' else 'chapter'} {where} {b.ref}" + (f": {said}" if said else "")


def basis_tag(b: Basis) -> str:
    """A basis in a few words, for tables: '§4.6', 'D31', 'field_ignored: min_tokens', 'wire'."""
    return {"chapter": anchor_of(b.ref) or "chapter", "decision": b.ref, "field_ignored": f"field_ignored: {b.ref}",
            "wire": "wire"}[b.kind]


def _cause_tag(cause: Mapping[str, Any], b: Basis) -> str:
    """A cause's basis for the causes table, 'engine-wide' added where the run states it once (D71)."""
    return basis_tag(b) + (" (engine-wide: in every case that could show it)" if cause.get("engine_wide") else "")


def finding_json(r: CaseResult, f: Finding) -> dict[str, Any]:
    """One finding as report.json keeps it: what was seen, its severity and what it rests on."""
    b = r.basis(f)
    return {"invariant": f.invariant, "symptom": f.symptom, "family": f.family, "severity": severity_of(f).value,
            "basis": {"kind": b.kind, "ref": b.ref, "text": basis_text(b)}, "message": f.message}


def causes(results: Sequence[CaseResult]) -> list[dict[str, Any]]:
    """The distinct causes of a run's findings: (severity, basis, invariant, symptom) with the cases
    they cover, most severe first; within a severity the chapter's before decisions, ignored fields
    and wire conventions, then the cause that leads the most cases (what to fix first), then the
    most cases. A cause resting only on fields ignored engine-wide (D71) says so (`engine_wide`)."""
    by: dict[tuple[str, str, str, str, str], dict[str, Any]] = {}
    wide = {w.field for w in ignored_engine_wide(results)}
    for r in results:
        for f in r.failures:
            b, sev = r.basis(f), severity_of(f)
            key = (sev.value, b.kind, b.ref, f.invariant, f.symptom)
            c = by.setdefault(key, {"severity": sev.value, "basis": {"kind": b.kind, "ref": b.ref, "text": basis_text(b)},
                                    "invariant": f.invariant, "symptom": f.symptom, "label": short(f),
                                    "family": f.family, "anchor": anchor_of(f.invariant),
                                    "statement": statement(f.invariant), "cases": [], "lead_in": []})
            if b.kind == FIELD_BASIS and set(b.ref.split(", ")) <= wide:
                c["engine_wide"] = True
            if r.case.id not in c["cases"]:
                c["cases"].append(r.case.id)
            if r.lead is f and r.case.id not in c["lead_in"]:
                c["lead_in"].append(r.case.id)
    return sorted(by.values(), key=lambda c: (SEVERITIES.index(Severity(c["severity"])),
                                              _BASIS_ORDER.index(c["basis"]["kind"]), -len(c["lead_in"]),
                                              -len(c["cases"]), c["invariant"], c["symptom"]))


def partial(r: CaseResult) -> bool:
    """A pass that could not check everything its case expects (the rest is in `not_checked`)."""
    return r.verdict is Verdict.PASS and bool(r.not_checked)


# Why cases did not run, in a few words, from their n/a reasons (the first row whose text the reason
# holds); `declared` rows are the engine's own word (--declare, --without), not a limit of the run.
_NOT_RUN: tuple[tuple[str, str, bool], ...] = (
    ("only on a forced checkpoint", "need this project's forced checkpoints (see `decodespec conform --preset`)", False),
    ("runs the programs of a forced checkpoint", "need this project's forced checkpoints (see `decodespec conform "
                                                 "--preset`)", False),
    ("(--declare ", "rest on a decision the engine declares its own", True),
    ("(--without ", "need a field or parser the server is run without", True),
    ("compiled into the forced checkpoints", "are not compiled into the checkpoints served", False),
    ("compiled into the ", "are compiled into a checkpoint this run did not serve", False),
    ("cannot run over HTTP", "check what a black box cannot show (internal events, faults, token-id stops)", False),
    ("context length of", "need a server started at the case's own context length (--launch-context)", False),
    ("concurrency limited", "need the tight server (--launch-tight)", False),
    ("refuses the request field", "use a request field the server refuses", False),
    ("prompt tokens of", "need a prompt the server places as the checkpoint does", False),
    (" cannot run ", "need what this engine lacks", False),
)


def _agreeing(why: str, cases: int) -> str:
    """A _NOT_RUN phrase (its verb first, plural) with the verb agreeing with `cases`."""
    verb, _, rest = why.partition(" ")
    return why if cases != 1 else f"{'is' if verb == 'are' else verb + 's'} {rest}"


def not_run(results: Sequence[CaseResult]) -> list[dict[str, Any]]:
    """The n/a cases by why, most cases first: [{'why', 'cases', 'declared'}]. A reason no row of
    _NOT_RUN knows is its own group, in its first clause."""
    groups: dict[tuple[str, bool, bool], int] = {}
    for r in results:
        if r.verdict is Verdict.SKIP:
            row = next((row for row in _NOT_RUN if row[0] in r.reason), None)
            key = ((row[1], row[2], True) if row else
                   (r.reason.split(":")[0].split(" (")[0][:80] or "no reason given", False, False))
            groups[key] = groups.get(key, 0) + 1
    return [{"why": _agreeing(why, n) if known else why, "cases": n, "declared": declared}
            for (why, declared, known), n in sorted(groups.items(), key=lambda kv: -kv[1])]


def findings_by_severity(results: Iterable[CaseResult]) -> dict[str, int]:
    """How many findings (one per case and symptom) of each severity, every class listed."""
    by = Counter(severity_of(f).value for r in results for f in r.failures)
    return {s.value: by.get(s.value, 0) for s in SEVERITIES}


def summary(results: Sequence[CaseResult], grading: Grading = Grading()) -> dict[str, Any]:
    """Counts by verdict and grade; the findings by severity (and how many rest on a decision or an
    ignored field); the pass rate over the cases that ran; `partial_run` when most cases that the
    engine did not decline could not run (the run did not judge the engine)."""
    by = Counter(r.verdict.value for r in results)
    must_fail = sum(1 for r in results if r.failed and r.case.grade is Grade.MUST)
    must_ran = sum(1 for r in results if r.case.grade is Grade.MUST and r.verdict is not Verdict.SKIP)
    ran = len(results) - by.get("SKIP", 0)
    why = not_run(results)
    declined = sum(g["cases"] for g in why if g["declared"])
    return {
        "total": len(results), **{v.value: by.get(v.value, 0) for v in Verdict},
        "ran": ran, "pass_rate": round(by.get("PASS", 0) / ran, 4) if ran else None,
        "partial": sum(partial(r) for r in results),
        "wire": sum(1 for r in results if r.wire),
        "shape": sum(1 for r in results if r.shape),
        "must_failed": must_fail, "should_failed": sum(1 for r in results if r.failed) - must_fail,
        "must_differs": sum(1 for r in results if r.verdict is Verdict.DIFFERS and r.case.grade is Grade.MUST),
        "must_ran": must_ran, "must_all_pass": must_fail == 0,
        "findings": findings_by_severity(results),
        "on_decisions": sum(1 for r in results for f in r.failures if r.basis(f).kind in ("decision", "field_ignored")),
        "not_run": why, "partial_run": 2 * ran < len(results) - declined,
        "profile": grading.profile, "declared": sorted(grading.declared),
        "engine_wide": [w.to_json() for w in ignored_engine_wide(results)],
    }


def _severity_counts(found: Mapping[str, int]) -> str:
    said = [f"{n} {SEVERITY_WORDS[Severity(s)]}" for s, n in found.items() if n]
    return ", ".join(said) + (" finding" if sum(found.values()) == 1 else " findings") if said else "no findings"


def engine_wide_line(wide: Mapping[str, Any]) -> str:
    """A field ignored engine-wide (summary's `engine_wide` entry, D71) as the headline states it."""
    return (f"engine-wide: field_ignored: {wide['field']} in all {wide['cases']} cases that could show it "
            "(one cause, no case's verdict)")


def headline(results: Sequence[CaseResult], engine: str, grading: Grading = Grading()) -> str:
    """One line, what a run judged first: `vllm: 76 of 85 cases ran; 25 text, 7 ending, 13 stream-shape
    findings (12 on a project decision or an ignored field); 57 pass (75%), 15 fail the chapter
    (15 MUST, 0 SHOULD), 4 differ on a decision or an ignored field, 0 error; 9 n/a: ...`, a field
    ignored engine-wide named once before the verdicts (D71). A run in which most cases could not run
    says so, and why, before anything else."""
    s = summary(results, grading)
    why = ", ".join(f"{g['cases']} {g['why']}" for g in s["not_run"][:3])
    more = sum(g["cases"] for g in s["not_run"][3:])
    why += f", {more} for other reasons" if more else ""
    ran = f"{s['ran']} of {s['total']} cases ran" + (f", too few to judge the engine: {why}" if s["partial_run"] else "")
    decided = f" ({s['on_decisions']} on a project decision or an ignored field)" if s["on_decisions"] else ""
    apart = (f", {s['DIFFERS']} differ on a decision or an ignored field" if grading.profile != "chapter" else
             " (profile chapter: decisions and ignored fields not judged)")
    noted = sum(1 for r in results if r.verdict is Verdict.PASS and r.failures)
    pass_note = [f"{s['pass_rate']:.0%}"] if s["pass_rate"] is not None else []
    pass_note += [f"{s['partial']} partial"] if s["partial"] else []
    pass_note += [f"{noted} with only stream-shape or wire findings"
                  + (" or decisions" if grading.profile == "chapter" else "")
                  + (" or the engine-wide ones" if s["engine_wide"] else "")] if noted else []
    must = sum(1 for r in results if r.verdict is Verdict.FAIL and r.case.grade is Grade.MUST)
    grades = f" ({must} MUST, {s['FAIL'] - must} SHOULD)" if s["FAIL"] else ""
    verdicts = (f"{s['PASS']} pass" + (f" ({', '.join(pass_note)})" if pass_note else "")
                + f", {s['FAIL']} fail the chapter{grades}{apart}, {s['ERROR']} error")
    declared = f"; declared: {', '.join(s['declared'])}" if s["declared"] else ""
    na = f"; {s['SKIP']} n/a: {why}" if s["SKIP"] and not s["partial_run"] else ""
    wide = "".join(f"; {engine_wide_line(w)}" for w in s["engine_wide"])
    return f"{engine}: {ran}; {_severity_counts(s['findings'])}{decided}{wide}; {verdicts}{declared}{na}"


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
    body = req.get("body") or {}
    head = "".join(f" -H {_quote(f'{k}: {v}')}" for k, v in (req.get("headers") or {}).items())
    if req.get("method", "POST") != "POST":
        return f"curl -sS -N \"$URL{req['path']}\"{head}"
    flags = "-sS -N" if body.get("stream") else "-sS"
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"curl {flags} \"$URL{req['path']}\" -H 'Content-Type: application/json'{head} -d {_quote(data)}"


REPLAY_DIR = "ckpt"  # where a reproducer builds the checkpoint: ckpt/<group>
REPLAY_URL = "http://127.0.0.1:8000"
_GGUF_IN = re.compile(r"/(model(?:-(f16|bf16))?\.gguf)\b")


def _served(exchanges: Sequence[Mapping[str, Any]], served: str | None, folder: str) -> list[dict[str, Any]]:
    """The recorded requests, the model name each carried moved to `folder` where it was the served
    checkpoint's own path (an engine that loads the model a request names: transformers serve)."""
    def moved(e: Mapping[str, Any]) -> dict[str, Any]:
        body = e["request"].get("body") or {}
        if served and "/" in served and body.get("model") == served:
            return {**e, "request": {**e["request"], "body": {**body, "model": folder}}}
        return dict(e)

    return [moved(e) for e in exchanges if is_http(e)]


def replay_text(case_id: str, engine: str, server: Mapping[str, Any], exchanges: Sequence[Mapping[str, Any]],
                findings: Sequence[tuple[str, str]], reference: Mapping[str, Any] | None,
                script: bool = False) -> str:
    """A shell snippet that replays an HTTP case by hand from the report alone: build just its checkpoint
    and check its hash, convert it to GGUF where the engine loads one, start the engine as the run did
    (on port 8000), send the same requests with curl, or run the case's script (`script`: a request-life
    case, whose load curl cannot send), and stop the engine; what the chapter requires and what the
    reference answers follow."""
    from .presets import converter

    ck = server.get("checkpoint")
    group = ck["group"] if ck else ""
    folder = f"{REPLAY_DIR}/{group}"
    lines = [f"# {case_id} on {engine}" + (f" (version {server['version']})" if server.get("version") else "")]
    if ck:
        lines += [f"# the checkpoint {group}: build just it, then check that its hash is {ck['sha256']}",
                  f"decodespec checkpoints build{' --cases ' + ck['cases'] if ck.get('cases') else ''} "
                  f"--out {REPLAY_DIR} --group {group}",
                  f"decodespec checkpoints digest {folder}"]
    if server.get("launch"):
        launch = (server["launch"].replace("{gguf}", f"{folder}/model.gguf").replace("{model}", folder)
                  .replace("{name}", group).replace("{port}", REPLAY_URL.rsplit(":", 1)[1]))
        if ck and (m := _GGUF_IN.search(launch)):
            conv = converter()
            lines += [f"# the engine loads llama.cpp's GGUF of it: {conv.source} names a llama.cpp checkout "
                      "(its convert_hf_to_gguf.py); pip install 'decodespec[gguf]'",
                      f"{conv.source}=/path/to/llama.cpp "
                      + conv.shown(folder, f"{folder}/{m.group(1)}", m.group(2) or "f32")]
        lines += ["# the engine, started as the run started it:", f"{launch} > engine.log 2>&1 &", "ENGINE=$!"]
    lines += [f"URL=${{URL:-{REPLAY_URL if server.get('launch') else server.get('url', REPLAY_URL)}}}",
              'until curl -sf "$URL/v1/models" > /dev/null; do sleep 1; done']
    if script:
        lines += ["# the load curl cannot send: save this reproducer's `script` as replay.py (Python 3, stdlib only)",
                  'python3 replay.py "$URL"']
    else:
        lines += [curl(e) for e in _served(exchanges, server.get("model"), folder)]
    if server.get("launch"):
        lines.append("kill $ENGINE")
    for invariant, message in findings:
        where = anchor_of(invariant)
        lines.append(f"# requires {invariant}{f' ({where})' if where else ''}: {statement(invariant)}")
        lines.append(f"#   seen: {message[:400]}")
    if reference:
        lines.append("# the reference's answer on the same checkpoint: " + json.dumps(
            {k: reference.get(k) for k in ("state", "output", "finish_reason", "wire_finish_reason", "selected_tokens")},
            ensure_ascii=False))
    return "\n".join(lines) + "\n"


def replay_script(case_id: str, recipe: str, inputs: Mapping[str, Any], exchanges: Sequence[Mapping[str, Any]],
                  server: Mapping[str, Any]) -> str:
    """The standalone Python script (replay_script.py, stdlib only) that replays a request-life case:
    its flow, with the case's parameters and recorded requests put in."""
    ck = server.get("checkpoint")
    sent = _served(exchanges, server.get("model"), f"{REPLAY_DIR}/{ck['group']}" if ck else "")
    data = {"id": case_id, "recipe": recipe, "inputs": dict(inputs),
            "exchanges": [{k: e[k] for k in ("label", "request") if k in e} for e in sent]}
    source = Path(replay_script_module.__file__).read_text(encoding="utf-8")
    line = "CASE: dict = {}  # the reproducer puts the case's data here"
    return source.replace(line, f"CASE = json.loads({json.dumps(data, ensure_ascii=False)!r})")


def replay(r: CaseResult) -> str:
    """replay_text for a result (see there)."""
    return replay_text(r.case.id, r.engine, r.observed.get("server") or {}, r.observed.get("exchanges") or [],
                       [(f.invariant, f.message) for f in r.failures], r.observed.get("reference"),
                       script=r.case.recipe in FLOWS)


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
    """What a reader needs to rerun the case by hand. Over HTTP: the replay snippet (rebuild, convert,
    launch, curl), for a request-life case the script it runs, the server, the exchanges with their raw
    answers and the reference's answer; the case's inline tokenizer is left out (the checkpoint's hash
    names it). In process: inputs, expected, observed."""
    obs = {k: v for k, v in r.observed.items()
           if v not in (None, [], {}) and k not in ("exchanges", "reference", "server")}
    http = any(is_http(e) for e in r.observed.get("exchanges") or [])
    inputs = {k: v for k, v in r.case.inputs.items() if not (http and k == "tokenizer")}
    out: dict[str, Any] = {"inputs": inputs, "recipe": r.case.recipe, "expected": _expected(r), "observed": obs}
    if http:
        out = {"replay": replay(r), **out}
        if r.case.recipe in FLOWS:
            out["script"] = replay_script(r.case.id, r.case.recipe, inputs, r.observed["exchanges"],
                                          r.observed.get("server") or {})
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


def case_json(r: CaseResult) -> dict[str, Any]:
    """One case as report.json keeps it (regrade.result_of reads it back)."""
    lead = r.lead
    return {
        "id": r.case.id, "anchor": r.case.anchor, "grade": r.case.grade.value,
        "invariant": r.case.invariant, "statement": statement(r.case.invariant),
        "description": r.case.description, "decisions": list(r.case.decisions),
        "verdict": r.verdict.value, "partial": partial(r), "first_violated_invariant": r.first_invariant,
        "failures": [finding_json(r, f) for f in r.failures],
        "not_checked": list(r.not_checked), "reason": r.reason, "seconds": round(r.seconds, 4),
        "notes": list(r.observed.get("notes") or []),
        "lead_symptom": short(lead) if lead else None,
        "lead_severity": severity_of(lead).value if lead else None,
        "diagram": r.case.diagram,
        **({"reproducer": reproducer(r)} if r.failed or r.failures else
           {"evidence": evidence(r)} if r.verdict is Verdict.PASS else {}),
    }


def to_json(results: Sequence[CaseResult], engine: str, wall_s: float | None = None,
            grading: Grading = Grading()) -> dict[str, Any]:
    return {
        "version": REPORT_VERSION,
        "contract": CONTRACT_VERSION,  # the in-house adapter contract this judge speaks (contract.py)
        "engine": engine,
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "headline": headline(results, engine, grading),
        "grading": {"profile": grading.profile, "declared": sorted(grading.declared),
                    **({"provenance": grading.provenance} if grading.provenance else {})},
        "summary": summary(results, grading),
        "causes": causes(results),
        **({"wall_seconds": round(wall_s, 1)} if wall_s is not None else {}),
        "cases": [case_json(r) for r in results],
    }


def _finding_line(r: CaseResult, f: Finding) -> str:
    """'[text] stop bytes sent (stop_bytes_never_emitted; basis §4.6): message' for JUnit and logs."""
    return f"[{severity_of(f).value}] {short(f)} ({f.invariant}; basis {basis_tag(r.basis(f))}): {f.message}"


def to_junit(results: Sequence[CaseResult], engine: str, grading: Grading = Grading()) -> str:
    """JUnit XML: FAIL and DIFFERS are failures (typed by the lead's invariant, or 'decision'), ERROR
    an error, n/a skipped; a pass with stream-shape or wire findings lists them in system-out."""
    s = summary(results, grading)
    suite = ET.Element("testsuite", name=f"decodespec-conformance[{engine}]", tests=str(s["total"]),
                       failures=str(s["FAIL"] + s["DIFFERS"]), errors=str(s["ERROR"]), skipped=str(s["SKIP"]),
                       time=f"{sum(r.seconds for r in results):.3f}")
    ET.SubElement(suite, "properties").extend(
        ET.Element("property", name=k, value=v) for k, v in (("headline", headline(results, engine, grading)),
                                                              ("provenance", grading.provenance)) if v)
    for r in results:
        tc = ET.SubElement(suite, "testcase", classname=f"{engine}.{r.case.id.split('/')[0]}",
                           name=f"{r.case.id} [{r.case.grade.value} {r.case.anchor}]", time=f"{r.seconds:.4f}")
        if r.verdict is Verdict.SKIP:
            ET.SubElement(tc, "skipped", message=r.reason)
        elif r.verdict is Verdict.ERROR:
            ET.SubElement(tc, "error", message=r.reason).text = json.dumps(reproducer(r), ensure_ascii=False, indent=1)
        elif r.verdict in (Verdict.FAIL, Verdict.DIFFERS) and r.lead is not None:
            kind = r.first_invariant if r.verdict is Verdict.FAIL else f"decision: {basis_tag(r.basis(r.lead))}"
            ET.SubElement(tc, "failure", message=_finding_line(r, r.lead), type=kind or "").text = (
                f"{r.verdict.value}: {basis_text(r.basis(r.lead))}\n\n"
                + "\n".join(_finding_line(r, f) for f in r.failures)
                + "\n\nreproducer:\n" + json.dumps(reproducer(r), ensure_ascii=False, indent=1))
        elif r.failures:
            ET.SubElement(tc, "system-out").text = "\n".join(_finding_line(r, f) for f in r.failures)
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


# ---- Markdown ------------------------------------------------------------------------------------

_VERDICT_WORDS = {Verdict.FAIL: "fails the chapter", Verdict.DIFFERS: "differs on a decision or an ignored field",
                  Verdict.ERROR: "error", Verdict.PASS: "pass", Verdict.SKIP: "n/a"}
_DIFFERS_INTRO = ("Cases whose findings all rest on a choice this project made where engines legitimately differ "
                  "(spec/DECISIONS.md: the decision, and what common engines do instead) or on request fields the "
                  "engine took and that had no effect. Not a failure of chapter 4: `--profile chapter` leaves them "
                  "out, `--declare DNN` makes a documented choice n/a.")


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _pass_note(r: CaseResult) -> str:
    notes = [f"partial: not checked {', '.join(r.not_checked)}"] if partial(r) else []
    notes += [f"{severity_of(f).value}: {short(f)} ({basis_tag(r.basis(f))})" for f in r.failures]
    return "; ".join(notes)


def _severity_table(results: Sequence[CaseResult]) -> list[tuple[str, int, int, int, int, int]]:
    """Per severity: (word, findings, on the chapter, on a decision or an ignored field, on a wire
    convention, cases it leads); the three bases add up to the findings (symptoms.basis_of)."""
    rows = []
    for sev in SEVERITIES:
        kinds = Counter(r.basis(f).kind for r in results for f in r.failures if severity_of(f) is sev)
        leads = sum(1 for r in results if r.lead is not None and severity_of(r.lead) is sev)
        rows.append((SEVERITY_WORDS[sev], sum(kinds.values()), kinds[CHAPTER_BASIS],
                     kinds[DECISION_BASIS] + kinds[FIELD_BASIS], kinds[WIRE_BASIS], leads))
    return rows


_SEVERITY_HEAD = ("severity", "findings", "on the chapter", "on a decision or an ignored field",
                  "on a wire convention (OpenAI API)", "cases it leads")


def _gist(reason: str, most: int = 200) -> str:
    """A reason's first sentence, at most `most` characters (an error case's line on the first screen)."""
    first = reason.split(". ")[0].strip() or "no reason given"
    return first if len(first) <= most else first[:most - 1].rstrip() + "…"


def errors(results: Iterable[CaseResult]) -> list[CaseResult]:
    """The cases whose run failed before they could be judged (ERROR), by id."""
    return sorted((r for r in results if r.verdict is Verdict.ERROR), key=lambda r: r.case.id)


def run_line(results: Sequence[CaseResult], engine: str, generated: str | None = None) -> str:
    """What was run, from what the cases recorded of their server: the engine and its version, the
    checkpoints served (group and the first 12 hex digits of their sha256), when, and the launch
    commands (they name the weights' file and dtype). What no case recorded is said to be missing."""
    servers = [s for r in results if isinstance(s := r.observed.get("server"), Mapping) and s]
    versions = sorted({str(s["version"]) for s in servers if s.get("version")})
    cks = sorted({(str(ck.get("group")), str(ck.get("sha256", ""))[:12])
                  for s in servers if isinstance(ck := s.get("checkpoint"), Mapping)})
    launches = sorted({str(s["launch"]) for s in servers if s.get("launch")})
    said = [f"engine {engine}" + (f" {', '.join(versions)}" if versions else
                                  " (version not recorded)" if servers else "")]
    said += [f"checkpoints {', '.join(f'{g} (sha256 {h}…)' for g, h in cks)}"] if cks else []
    said += [f"generated {generated}"] if generated else []
    said += [f"launched as {'; '.join(f'`{x}`' for x in launches)}"] if launches else []
    return ", ".join(said)


def _md_first_screen(results: Sequence[CaseResult], with_causes: bool = True) -> list[str]:
    """The severity table, the error cases and (`with_causes`) the causes table: an engine's first
    screen; a gateway's has its causes split by layer before it instead (_md_attribution)."""
    lines = [f"| {' | '.join(_SEVERITY_HEAD)} |", "|---" * len(_SEVERITY_HEAD) + "|"]
    lines += [f"| {' | '.join(str(x) for x in row)} |" for row in _severity_table(results)]
    failed_to_run = errors(results)
    if failed_to_run:
        lines += ["", f"**Errors ({len(failed_to_run)})**, cases that could not be judged:", ""]
        lines += [f"- `{r.case.id}`: {_md_cell(_gist(r.reason))}" for r in failed_to_run]
    found = causes(results) if with_causes else []
    if not found:
        return lines + [""]
    lines += ["", f"## Causes ({len(found)})", "",
              "Each distinct thing the engine got wrong, most severe first, with what it rests on: a rule of "
              "chapter 4 (§), a project decision (D, with what engines do instead), a request field that had no "
              "effect, or a wire convention of the OpenAI API. Lead: the cases where it is the first finding.", "",
              "| severity | symptom | basis | invariant | cases | lead in |", "|---|---|---|---|---|---|"]
    for c in found:
        b = Basis(c["basis"]["kind"], c["basis"]["ref"])
        lines.append(f"| {SEVERITY_WORDS[Severity(c['severity'])]} | {_md_cell(c['label'])} | {_md_cell(_cause_tag(c, b))} | "
                     f"{c['invariant']} | {len(c['cases'])}: {', '.join(f'`{i}`' for i in c['cases'])} | "
                     f"{len(c['lead_in'])} |")
    return lines + [""]


def _failures_title(failed: Sequence[CaseResult]) -> str:
    errors = sum(1 for r in failed if r.verdict is Verdict.ERROR)
    return f"Failures of the chapter ({len(failed) - errors})" + (f" and errors ({errors})" if errors else "")


def _md_case(r: CaseResult) -> list[str]:
    lead = r.lead
    head = f"{r.verdict.value} ({r.case.grade.value})"
    if lead is not None:
        head += f", {severity_of(lead).value}: {short(lead)}"
    basis = basis_text(r.basis(lead)) if lead is not None else "(adapter error)"
    lines = [f"#### `{r.case.id}`: {head}", "", f"> {basis}", "", r.case.description, ""]
    lines += [f"- **{severity_of(f).value}** · {_md_cell(short(f))} · `{f.invariant}` · basis: "
              f"{_md_cell(basis_tag(r.basis(f)))}: {_md_cell(f.message)}" for f in r.failures] \
        or [f"- error: {_md_cell(r.reason)}"]
    rep = reproducer(r)
    if "replay" in rep:
        lines += ["", "Replay by hand:", "", "```sh", rep["replay"].rstrip(), "```"]
    if "script" in rep:
        lines += ["", "<details><summary>replay.py</summary>", "", "```python", rep["script"].rstrip(), "```", "",
                  "</details>"]
    return lines + ["", "<details><summary>reproducer</summary>", "", "```json",
                    json.dumps(rep, ensure_ascii=False, indent=1), "```", "", "</details>", ""]


def _parts_tag(g: Group) -> str:
    """A group's bases in a few words, each with its cases where there are several: '§4.10 (38), D31 (7)'."""
    tags = [basis_tag(Basis(p.kind, p.ref)) + (" engine-wide" if p.engine_wide else "") for p in g.parts if p.kind]
    return ", ".join(f"{t} ({len(p.cases)})" for t, p in zip(tags, g.parts)) if len(tags) > 1 else "".join(tags) or "—"


def _severity_word(g: Group) -> str:
    return SEVERITY_WORDS[Severity(g.severity)] if g.severity else "error"


def _group_badge(g: Group) -> str:
    """A group's severity badge; an error group's says error."""
    return _badge(g.severity) if g.severity else "<span class='sev sev-error'>error</span>"


# The layers of a gateway run's first screen, in order: (owner, title, what it holds, what none means).
_LAYERS = (("gateway", "The gateway's own findings", "Findings shown only behind the gateway: the same worker judged "
                                                     "directly does not show them in the same case.",
            "The worker judged directly shows each finding of this run it could judge, in the same case."),
           ("worker", "The worker's findings", "Findings shown directly too: the worker judged directly shows them in "
                                               "the same case.", "The worker judged directly shows none of them."),
           ("unjudged", "Findings no direct run can attribute", "Their case has no direct run that judged it.", ""))


def _layer_title(title: str, groups: Sequence[Group]) -> str:
    """'The gateway's own findings: 6 causes in 61 cases', or ': none'."""
    cases = len({c for g in groups for c in g.cases})
    return (f"{title}: {len(groups)} {'cause' if len(groups) == 1 else 'causes'} in {cases} "
            f"{'case' if cases == 1 else 'cases'}" if groups else f"{title}: none")


def _md_more(ids: Sequence[str]) -> str:
    """The cases after the first, folded (one click away)."""
    return (f" <details><summary>{len(ids)} more</summary>{', '.join(f'`{i}`' for i in ids)}</details>"
            if ids else "")


def _md_groups(groups: Sequence[Group]) -> list[str]:
    lines = ["| severity | symptom | basis | invariant | cases | open first |", "|---|---|---|---|---|---|"]
    return lines + [f"| {_severity_word(g)} | {_md_cell(g.label)} | {_md_cell(_parts_tag(g))} | {g.invariant or '—'} | "
                    f"{len(g.cases)} | `{g.first}`{_md_more([c for c in g.cases if c != g.first])} |" for g in groups]


def _md_attribution(attribution: Mapping[str, Any], found: Sequence[Mapping[str, Any]]) -> list[str]:
    """A gateway run's first screen (attribution.grouped): the gateway's own findings by cause, then
    the worker's, then (if any) the unattributed, each cause once with its cases counted and the case
    to open first; then what differs from the direct run without being a finding here."""
    by = grouped(attribution, found)
    lines = [f"Read against the worker judged directly, case by case: {split_line(attribution)}.", ""]
    for owner, title, what, none in _LAYERS:
        if owner == "unjudged" and not by[owner]:
            continue
        lines += [f"## {_layer_title(title, by[owner])}", "", what if by[owner] else none, ""]
        lines += [*_md_groups(by[owner]), ""] if by[owner] else []
    hidden, gone = hidden_groups(attribution), lost_groups(attribution, _lost_gist)
    lines += ["## Differences from the direct run that are not findings here", ""]
    lines += [f"- Shown directly, not through the gateway: {_md_cell(g.label)} ({_severity_word(g)}, "
              f"{g.invariant or 'error'}) in {len(g.cases)} {'case' if len(g.cases) == 1 else 'cases'}: "
              f"`{g.first}`{_md_more([c for c in g.cases if c != g.first])}" for g in hidden]
    lines += [f"- Judged directly, n/a through the gateway: {len(ids)} {'case' if len(ids) == 1 else 'cases'}, "
              f"{_md_cell(why)}: `{ids[0]}`{_md_more(ids[1:])}" for why, ids in gone]
    return lines + ([] if hidden or gone else ["None."]) + [""]


def _lost_gist(reason: str) -> str:
    return _gist(reason, 120)


def to_markdown(results: Sequence[CaseResult], engine: str, grading: Grading = Grading(),
                generated: str | None = None, attribution: Mapping[str, Any] | None = None) -> str:
    failed = [r for r in results if r.failed]
    differs = [r for r in results if r.verdict is Verdict.DIFFERS]
    passed = [r for r in results if r.verdict is Verdict.PASS]
    skipped = [r for r in results if r.verdict is Verdict.SKIP]
    lines = [f"# Conformance report: `{engine}`", "", run_line(results, engine, generated), ""]
    lines += [f"*{grading.provenance}*", ""] if grading.provenance else []
    lines += [f"**{headline(results, engine, grading)}**", ""]
    lines += _md_attribution(attribution, causes(results)) if attribution else []
    lines += _md_first_screen(results, with_causes=not attribution)
    lines += [f"## {_failures_title(failed)}", ""] if failed else ["No failure of the chapter.", ""]
    for anchor, rs in by_section(failed):
        lines += [f"### {anchor} ({len(rs)})", ""]
        for r in rs:
            lines += _md_case(r)
    if differs:
        lines += [f"## Differs on a project decision or an ignored field ({len(differs)})", "", _DIFFERS_INTRO, ""]
        for r in sorted(differs, key=lambda r: r.case.id):
            lines += _md_case(r)
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
        ".partial{background:#ffd}.FAIL{background:#fdd}.DIFFERS{background:#fec}.ERROR{background:#fbb}"
        ".SKIP{background:#eee}"
        "h1{margin-bottom:.2em}.headline{font-size:1.15em;font-weight:bold;padding:.4em .6em;border-left:6px solid}"
        ".bad{border-color:#c33;background:#fee}.good{border-color:#393;background:#efe}"
        ".warn{border-color:#c93;background:#ffe9cc}.provenance{color:#555;font-style:italic}"
        "blockquote{margin:.3em 0 .6em 0;padding:.2em .8em;border-left:4px solid #99c;color:#334}"
        ".case{border:1px solid #ddd;padding:.2em 1em;margin:.8em 0}pre{background:#f6f6f6;padding:8px;"
        "overflow:auto;max-height:30em;font-size:12px}summary{cursor:pointer;font-weight:bold}"
        ".sev{display:inline-block;min-width:6.5em;padding:0 .4em;border-radius:3px;font-size:12px;font-weight:bold;"
        "color:#fff;text-align:center}.sev-text{background:#b22}.sev-ending{background:#c60}"
        ".sev-accounting{background:#a80}.sev-stream_shape{background:#679}.sev-wire{background:#888}"
        ".sev-error{background:#700}"
        ".basis{color:#335;font-size:13px}.diagram svg{max-width:100%;height:auto}.run{color:#333;font-size:14px}"
        ".errors{border-left:6px solid #c33;background:#fbb;padding:.2em .8em;margin:.5em 0}")


def _svg(diagrams_dir: Path | None, name: str) -> str | None:
    if diagrams_dir is None or not (diagrams_dir / f"{name}.svg").is_file():
        return None
    text = (diagrams_dir / f"{name}.svg").read_text(encoding="utf-8")
    return text[text.find("<svg"):] if "<svg" in text else None


def _code_spans(text: str) -> str:
    """Markdown's `code` spans of an escaped text as HTML <code>."""
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", text)


def _links(ids: Sequence[str]) -> str:
    return ", ".join(f"<a href='#{html.escape(i)}'>{html.escape(i)}</a>" for i in ids)


def _badge(sev: Severity | str) -> str:
    s = Severity(sev)
    return f"<span class='sev sev-{s.value}'>{html.escape(SEVERITY_WORDS[s])}</span>"


def _html_case(r: CaseResult, embedded: Mapping[str, str]) -> str:
    e = html.escape
    lead = r.lead
    diagram = (f" · diagram <a href='#diagram-{e(r.case.diagram)}'>{e(r.case.diagram)}</a>"
               if r.case.diagram in embedded else "")
    rep = reproducer(r)
    findings = "".join(f"<li>{_badge(severity_of(f))} <b>{e(short(f))}</b> <code>{e(f.invariant)}</code> "
                       f"<span class='basis'>basis: {e(basis_text(r.basis(f)))}</span><br>{e(f.message)}</li>"
                       for f in r.failures) or f"<li>error: {e(r.reason)}</li>"
    head = f"{e(r.case.id)}: {r.verdict.value} ({r.case.grade.value})"
    if lead is not None:
        head += f" {_badge(severity_of(lead))} {e(short(lead))}"
    return (f"<div class='case {r.verdict.value}' id='{e(r.case.id)}'><h4>{head}{diagram}</h4>"
            f"<blockquote>{e(basis_text(r.basis(lead))) if lead is not None else '(adapter error)'}</blockquote>"
            f"<p>{e(r.case.description)}</p><ul>{findings}</ul>"
            + (f"<p>Replay by hand:</p><pre>{e(rep['replay'])}</pre>" if "replay" in rep else "")
            + (f"<details><summary>replay.py</summary><pre>{e(rep['script'])}</pre></details>" if "script" in rep else "")
            + "<details><summary>reproducer</summary>"
            f"<pre>{e(json.dumps(rep, ensure_ascii=False, indent=1))}</pre></details></div>")


def _html_more(ids: Sequence[str]) -> str:
    """_md_more as HTML: the cases after the first, folded, each a link."""
    return f"<details><summary>{len(ids)} more</summary>{_links(ids)}</details>" if ids else ""


def _html_groups(groups: Sequence[Group]) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{_group_badge(g)}</td><td>{e(g.label)}</td>"
        f"<td title='{e('; '.join(basis_text(Basis(p.kind, p.ref)) for p in g.parts if p.kind))}'>{e(_parts_tag(g))}</td>"
        f"<td title='{e(statement(g.invariant))}'>{e(g.invariant or '—')}</td><td>{len(g.cases)}</td>"
        f"<td><a href='#{e(g.first)}'>{e(g.first)}</a>{_html_more([c for c in g.cases if c != g.first])}</td></tr>"
        for g in groups)
    return ("<table class='layer'><tr><th>severity</th><th>symptom</th><th>basis</th><th>invariant</th><th>cases</th>"
            f"<th>open first</th></tr>{rows}</table>")


def _html_attribution(attribution: Mapping[str, Any], found: Sequence[Mapping[str, Any]]) -> str:
    """_md_attribution as HTML."""
    e = html.escape
    by = grouped(attribution, found)
    parts = [f"<p>Read against the worker judged directly, case by case: {e(split_line(attribution))}.</p>"]
    for owner, title, what, none in _LAYERS:
        if owner == "unjudged" and not by[owner]:
            continue
        parts.append(f"<h2 class='layer-{owner}'>{e(_layer_title(title, by[owner]))}</h2>"
                     + (f"<p>{e(what)}</p>{_html_groups(by[owner])}" if by[owner] else f"<p>{e(none)}</p>"))
    hidden, gone = hidden_groups(attribution), lost_groups(attribution, _lost_gist)
    items = [f"<li>Shown directly, not through the gateway: <b>{e(g.label)}</b> ({_group_badge(g)} "
             f"{e(g.invariant or 'error')}) in {len(g.cases)} {'case' if len(g.cases) == 1 else 'cases'}: "
             f"<a href='#{e(g.first)}'>{e(g.first)}</a>{_html_more([c for c in g.cases if c != g.first])}</li>"
             for g in hidden]
    items += [f"<li>Judged directly, n/a through the gateway: {len(ids)} {'case' if len(ids) == 1 else 'cases'}, "
              f"{e(why)}: <a href='#{e(ids[0])}'>{e(ids[0])}</a>{_html_more(ids[1:])}</li>" for why, ids in gone]
    parts.append("<h2>Differences from the direct run that are not findings here</h2>"
                 + (f"<ul>{''.join(items)}</ul>" if items else "<p>None.</p>"))
    return "".join(parts)


def to_html(results: Sequence[CaseResult], engine: str, *, diagrams_dir: Path | None = None,
            grading: Grading = Grading(), generated: str | None = None,
            attribution: Mapping[str, Any] | None = None) -> str:
    e = html.escape
    failed = [r for r in results if r.failed]
    differs = [r for r in results if r.verdict is Verdict.DIFFERS]
    passed = [r for r in results if r.verdict is Verdict.PASS]
    skipped = [r for r in results if r.verdict is Verdict.SKIP]
    s = summary(results, grading)
    embedded = {d: svg for d in sorted({r.case.diagram for r in failed + differs}) if (svg := _svg(diagrams_dir, d))}
    tone = "warn" if s["partial_run"] else "bad" if failed else "warn" if differs else "good"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>decodespec conformance: {e(engine)}</title>"
             f"<style>{_CSS}</style></head><body><h1>Conformance report: {e(engine)}</h1>",
             f"<p class='run'>{_code_spans(e(run_line(results, engine, generated)))}</p>",
             f"<p class='provenance'>{e(grading.provenance)}</p>" if grading.provenance else "",
             f"<p class='headline {tone}'>{e(headline(results, engine, grading))}</p>",
             _html_attribution(attribution, causes(results)) if attribution else ""]
    rows = "".join(f"<tr><td>{_badge(sev)}</td>" + "".join(f"<td>{x}</td>" for x in row[1:]) + "</tr>"
                   for sev, row in zip(SEVERITIES, _severity_table(results)))
    head = "".join(f"<th>{e(h)}</th>" for h in _SEVERITY_HEAD)
    parts.append(f"<table class='severities'><tr>{head}</tr>{rows}</table>")
    failed_to_run = errors(results)
    if failed_to_run:
        items = "".join(f"<li><a href='#{e(r.case.id)}'>{e(r.case.id)}</a>: {e(_gist(r.reason))}</li>"
                        for r in failed_to_run)
        parts.append(f"<div class='errors'><b>Errors ({len(failed_to_run)})</b>, cases that could not be judged:"
                     f"<ul>{items}</ul></div>")
    found = causes(results) if not attribution else []
    if found:
        rows = "".join(
            f"<tr><td>{_badge(c['severity'])}</td><td>{e(c['label'])}</td>"
            f"<td title='{e(c['basis']['text'])}'>{e(_cause_tag(c, Basis(c['basis']['kind'], c['basis']['ref'])))}</td>"
            f"<td title='{e(c['statement'])}'>{e(c['invariant'])}</td>"
            f"<td>{len(c['cases'])}: {_links(c['cases'])}</td><td>{len(c['lead_in'])}</td></tr>" for c in found)
        parts.append(f"<h2>Causes ({len(found)})</h2><p>Each distinct thing the engine got wrong, most severe first, "
                     "with what it rests on: a rule of chapter 4 (§), a project decision (D; hover for what engines do "
                     "instead), a request field that had no effect, or a wire convention of the OpenAI API.</p>"
                     "<table><tr><th>severity</th><th>symptom</th><th>basis</th><th>invariant</th><th>cases</th>"
                     f"<th>lead in</th></tr>{rows}</table>")
    parts.append(f"<h2>{e(_failures_title(failed))}</h2>" if failed else "<p>No failure of the chapter.</p>")
    for anchor, rs in by_section(failed):
        parts.append(f"<h3>{e(anchor)} ({len(rs)})</h3>")
        parts += [_html_case(r, embedded) for r in rs]
    if differs:
        parts.append(f"<h2>Differs on a project decision or an ignored field ({len(differs)})</h2>"
                     f"<p>{e(_DIFFERS_INTRO)}</p>")
        parts += [_html_case(r, embedded) for r in sorted(differs, key=lambda r: r.case.id)]
    rows = "".join(
        f"<tr class='{'partial' if partial(r) else 'PASS'}' id='{e(r.case.id)}'><td>{e(a)}</td><td>{e(r.case.id)}</td>"
        f"<td>{r.case.grade.value}</td><td title='{e(statement(r.case.invariant))}'>{e(r.case.invariant)}</td>"
        f"<td>{e(_pass_note(r))}</td></tr>"
        for a, rs in by_section(passed) for r in rs)
    parts.append(f"<h2>Passed ({len(passed)})</h2><table><tr><th>§</th><th>case</th><th>grade</th><th>invariant</th>"
                 f"<th>note</th></tr>{rows}</table>")
    if skipped:
        rows = "".join(f"<tr class='SKIP' id='{e(r.case.id)}'><td>{e(a)}</td><td>{e(r.case.id)}</td><td>{e(r.reason)}</td></tr>"
                       for a, rs in by_section(skipped) for r in rs)
        parts.append(f"<details><summary>Not applicable to this engine ({len(skipped)})</summary><table>"
                     f"<tr><th>§</th><th>case</th><th>reason</th></tr>{rows}</table></details>")
    for name, svg in embedded.items():
        parts.append(f"<details class='diagram' id='diagram-{e(name)}'><summary>diagram: {e(name)}</summary>{svg}</details>")
    return "".join(parts) + "</body></html>\n"


def write_reports(results: Sequence[CaseResult], engine: str, out_dir: str | Path,
                  *, diagrams_dir: str | Path | None = None, wall_s: float | None = None,
                  grading: Grading = Grading(), generated: str | None = None,
                  workers: Mapping[str, Mapping[str, Any]] | None = None) -> list[Path]:
    """Write the four report files into `out_dir`; returns their paths. `wall_s`: the whole run's
    wall time (server start-ups included), kept in report.json; `generated`: when the run was
    (default now; a re-graded report keeps its run's); `workers`: for a run behind a gateway, the
    reports of its worker judged directly, by folder name (attribution.py: each finding the worker's
    or the gateway's, the gateway's first). The HTML embeds the SVG diagrams of `diagrams_dir` its
    failures name, so the page stands alone."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ddir = Path(diagrams_dir).resolve() if diagrams_dir is not None else None
    data = to_json(results, engine, wall_s, grading)
    if generated is not None:
        data["generated"] = generated
    if workers:
        data["attribution"] = attribution_json(data, workers)
    said = data.get("attribution")
    texts = {
        "report.json": json.dumps(data, ensure_ascii=False, indent=1) + "\n",
        "junit.xml": to_junit(results, engine, grading),
        "report.md": to_markdown(results, engine, grading, data["generated"], said),
        "report.html": to_html(results, engine, diagrams_dir=ddir, grading=grading, generated=data["generated"],
                               attribution=said),
    }
    paths = []
    for name in REPORT_FILES:
        (out / name).write_text(texts[name], encoding="utf-8")
        paths.append(out / name)
    return paths
