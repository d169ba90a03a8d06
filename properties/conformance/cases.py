"""Conformance cases as language-neutral JSON data (§4.3-§4.10).

A case file holds one JSON object:

    {"id": "stop/cross-token/001", "anchor": "§4.6", "grade": "MUST",
     "invariant": "stop_bytes_never_emitted", "diagram": "stop_matcher",
     "description": "...", "kind": "script" | "blackbox",
     "inputs": {...}, "expect": {...}}

`script` cases are white-box: a tokenizer (`{"table": {"101": "AB", ...}, "eos": 0}` inline, or
`{"fixture": "byte_level_bpe"}` from properties/fixtures.py), a prompt, a forced token script whose
items are ids or symbols resolved by the engine's tokenizer (`{"text": ...}`, `{"byte": "e4"}`,
`{"token": "<0xE4>"}`, `{"eos": true}`), stop strings, stop token-id sequences, `max_tokens` and
faults. `expect` holds the output (`"text"` or `{"hex": ...}`), finish reason, state, error prefix,
usage subset and event constraints (see `EventConstraint`). `blackbox` cases carry a `recipe` name
and its parameters for HTTP engines.

The grade follows the seed's wording: 必须/不得/不能 give MUST, 应/建议 give SHOULD.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .decisions import DECISIONS

CASES_DIR = Path(__file__).resolve().parent.parent / "cases"
_ID = re.compile(r"^[a-z0-9-]+(/[a-z0-9-]+)+/\d{3}$")
_ANCHOR = re.compile(r"^§4\.\d+$")
# Event kinds an engine can show without an internal trace: the ordered stream of §4.7.
STREAM_KINDS = frozenset({"response.start", "response.delta", "response.completed", "response.cancelled",
                          "response.failed"})


class CaseError(ValueError):
    """A case file is malformed; the message names the file (or id) and the field."""


class Grade(enum.StrEnum):
    """MUST (必须/不得/不能 in the seed) or SHOULD (应/建议)."""

    MUST = "MUST"
    SHOULD = "SHOULD"


class CaseKind(enum.StrEnum):
    SCRIPT = "script"  # white-box: forced token script and tokenizer
    BLACKBOX = "blackbox"  # HTTP recipe against any OpenAI-compatible server


@attrs.frozen
class EventConstraint:
    """One check on the events of a run, named by the invariant it protects.

    - `exact`: the events of the kinds listed, in order, match the patterns one for one;
    - `absent`: no event matches the pattern;
    - `count`: exactly `n` events match the pattern.
    A pattern is `[kind, {field: value, ...}]`; `bytes` values are text or `{"hex": ...}`.
    """

    invariant: str
    op: str
    patterns: tuple[tuple[str, Mapping[str, Any]], ...]
    n: int | None = None

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.patterns)


@attrs.frozen
class Expect:
    """What a conforming engine returns for a script case."""

    output: bytes | None = None
    finish_reason: str | None = None
    state: str | None = None
    error: str | None = None  # a prefix of the error text, e.g. "decoding_error"
    usage: Mapping[str, int] = attrs.field(factory=dict)
    events: tuple[EventConstraint, ...] = ()


@attrs.frozen
class Case:
    """One conformance case (see the module docstring for the JSON shape)."""

    id: str
    anchor: str
    grade: Grade
    invariant: str
    description: str
    kind: CaseKind
    inputs: Mapping[str, Any]
    expect: Expect
    diagram: str = "lifecycle"
    recipe: str | None = None
    path: Path | None = attrs.field(default=None, eq=False)
    decisions: tuple[str, ...] = ()  # the decisions of spec/DECISIONS.md it rests on (decisions.DECISIONS)

    @property
    def tokenizer_spec(self) -> Mapping[str, Any]:
        return self.inputs.get("tokenizer", {})

    @property
    def fixture(self) -> str | None:
        """The properties/fixtures.py tokenizer the case names, if any."""
        return self.tokenizer_spec.get("fixture")

    @property
    def max_tokens(self) -> int:
        return int(self.inputs.get("max_tokens", 16))

    @property
    def requires(self) -> frozenset[str]:
        """The capabilities an engine needs to run this case at all (missing ones mean SKIP)."""
        if self.kind is CaseKind.BLACKBOX:
            return frozenset({"http"})
        need = {"forced_script"}
        inp = self.inputs
        need.add("byte_table" if "table" in self.tokenizer_spec else "fixture_tokenizer")
        if inp.get("stop"):
            need.add("stop_strings")
        if inp.get("stop_token_ids"):
            need.add("stop_token_ids")
        if inp.get("faults"):
            need.add("faults")
        if "context_limit" in inp:
            need.add("context_limit")
        script = inp.get("script", [])
        if any(isinstance(s, Mapping) and s.get("eos") for s in script):
            need.add("eos")
        if len(script) > self.max_tokens:
            need.add("length_limit")
        if any(not c.kinds <= STREAM_KINDS for c in self.expect.events):
            need.add("trace")
        return frozenset(need)

    def to_json(self) -> dict[str, Any]:
        raw = json.loads(self.path.read_text(encoding="utf-8")) if self.path else None
        return raw if raw is not None else _dump(self)


# ---- decoding --------------------------------------------------------------------------------


def as_bytes(value: Any, where: str) -> bytes:
    """`"text"` (UTF-8) or `{"hex": "e4b8"}` as bytes."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, Mapping) and isinstance(value.get("hex"), str):
        try:
            return bytes.fromhex(value["hex"])
        except ValueError:
            raise CaseError(f"{where}: {value['hex']!r} is not hex") from None
    raise CaseError(f"{where}: expected text or {{\"hex\": ...}}, got {value!r}")


def _constraint(obj: Any, where: str) -> EventConstraint:
    if not isinstance(obj, Mapping) or "invariant" not in obj:
        raise CaseError(f"{where}: an event constraint needs an 'invariant' and one of exact/absent/count")
    ops = [k for k in ("exact", "absent", "count") if k in obj]
    if len(ops) != 1:
        raise CaseError(f"{where}: exactly one of exact/absent/count, got {ops or 'none'}")
    op = ops[0]
    raw = obj[op] if op == "exact" else [obj[op]]
    pats = []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            p = [p, {}]
        if not (isinstance(p, Sequence) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], Mapping)):
            raise CaseError(f"{where}: pattern {i} must be \"kind\" or [kind, {{fields}}], got {p!r}")
        fields = {k: (as_bytes(v, f"{where} pattern {i}") if k == "bytes" else v) for k, v in p[1].items()}
        pats.append((p[0], fields))
    n = obj.get("n")
    if op == "count" and (not isinstance(n, int) or n < 0):
        raise CaseError(f"{where}: count needs 'n', a non-negative int")
    return EventConstraint(obj["invariant"], op, tuple(pats), n)


def parse_case(obj: Mapping[str, Any], *, path: Path | None = None) -> Case:
    """Validate one case object; a CaseError names the file and the field that is wrong."""
    where = str(path) if path else str(obj.get("id", "<case>"))
    _check_keys(obj, where)
    try:
        grade, kind = Grade(obj["grade"]), CaseKind(obj["kind"])
    except ValueError as exc:
        raise CaseError(f"{where}: {exc}") from None
    decisions = obj.get("decisions", [])
    if not isinstance(decisions, list) or not all(d in DECISIONS for d in decisions):
        raise CaseError(f"{where}: 'decisions' must list decisions of {sorted(DECISIONS)}, got {decisions!r}")
    inputs = obj.get("inputs", {})
    if not isinstance(inputs, Mapping):
        raise CaseError(f"{where}: 'inputs' must be an object")
    _check_kind(obj, kind, inputs, where)
    return Case(
        id=obj["id"], anchor=obj["anchor"], grade=grade, invariant=obj["invariant"],
        description=obj["description"], kind=kind, inputs=dict(inputs), expect=_expect(obj.get("expect", {}), where),
        diagram=obj.get("diagram", "lifecycle"), recipe=obj.get("recipe"), path=path, decisions=tuple(decisions),
    )


_REQUIRED = ("id", "anchor", "grade", "invariant", "description", "kind")
_KNOWN = frozenset({*_REQUIRED, "inputs", "expect", "diagram", "recipe", "decisions"})
# A key whose value has a form: its pattern and what the error says it must be.
_FORMS = {"id": (_ID, "must look like 'group/topic/001'"),
          "anchor": (_ANCHOR, "must be a chapter-4 section like '§4.6'")}


def _check_keys(obj: Mapping[str, Any], where: str) -> None:
    """Every required key a non-empty string, no unknown key, the id and the anchor in their form."""
    for key in _REQUIRED:
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise CaseError(f"{where}: '{key}' must be a non-empty string")
    if unknown := set(obj) - _KNOWN:
        raise CaseError(f"{where}: unknown keys {sorted(unknown)}")
    for key, (pattern, form) in _FORMS.items():
        if not pattern.match(obj[key]):
            raise CaseError(f"{where}: {key} {obj[key]!r} {form}")


def _check_kind(obj: Mapping[str, Any], kind: CaseKind, inputs: Mapping[str, Any], where: str) -> None:
    """A script case's tokenizer (a table or a fixture) and script; a blackbox case's recipe."""
    if kind is not CaseKind.SCRIPT:
        if not isinstance(obj.get("recipe"), str):
            raise CaseError(f"{where}: a blackbox case needs a 'recipe'")
        return
    tok = inputs.get("tokenizer")
    if not isinstance(tok, Mapping) or ("table" in tok) == ("fixture" in tok):
        raise CaseError(f"{where}: inputs.tokenizer needs exactly one of 'table' or 'fixture'")
    if not isinstance(inputs.get("script"), list) or not inputs["script"]:
        raise CaseError(f"{where}: inputs.script must be a non-empty list")


def _expect(exp: Mapping[str, Any], where: str) -> Expect:
    """A case's `expect` object as an Expect (each event constraint checked)."""
    return Expect(
        output=as_bytes(exp["output"], f"{where}: expect.output") if "output" in exp else None,
        finish_reason=exp.get("finish_reason"),
        state=exp.get("state"),
        error=exp.get("error"),
        usage=dict(exp.get("usage", {})),
        events=tuple(_constraint(c, f"{where}: expect.events[{i}]") for i, c in enumerate(exp.get("events", []))),
    )


def load_cases(select: Iterable[str] = (), *, folder: str | Path | None = None) -> list[Case]:
    """Every case under `folder` (default properties/cases), sorted by id, filtered by id prefixes."""
    root = Path(folder) if folder is not None else CASES_DIR
    if not root.is_dir():
        raise CaseError(f"case folder {root} does not exist")
    cases: dict[str, Case] = {}
    for path in sorted(root.rglob("*.json")):
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise CaseError(f"{path}: not valid JSON: {exc}") from None
        case = parse_case(obj, path=path)
        if case.id in cases:
            raise CaseError(f"{path}: duplicate id {case.id!r} (also in {cases[case.id].path})")
        cases[case.id] = case
    prefixes = tuple(select)
    return [c for _, c in sorted(cases.items()) if not prefixes or c.id.startswith(prefixes)]


def select_cases(cases: Sequence[Case], prefixes: Iterable[str]) -> list[Case]:
    """The cases whose id starts with one of `prefixes` (all of them with none). A prefix that starts
    no case id is a CaseError naming it: a mistyped selection never runs a smaller suite quietly."""
    prefixes = tuple(prefixes)
    if unmatched := [p for p in prefixes if not any(c.id.startswith(p) for c in cases)]:
        raise CaseError(f"no case id starts with {', '.join(map(repr, unmatched))}")
    return [c for c in cases if not prefixes or c.id.startswith(prefixes)]


# ---- saving counterexamples --------------------------------------------------------------------


def bytes_json(v: bytes) -> Any:
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": v.hex()}


def expect_to_json(e: Expect) -> dict[str, Any]:
    """An Expect in the case file's JSON shape (the inverse of parse_case's `expect`)."""
    b = bytes_json
    exp: dict[str, Any] = {}
    if e.output is not None:
        exp["output"] = b(e.output)
    for key in ("finish_reason", "state", "error"):
        if getattr(e, key) is not None:
            exp[key] = getattr(e, key)
    if e.usage:
        exp["usage"] = dict(e.usage)
    if e.events:
        exp["events"] = [
            {"invariant": c.invariant,
             c.op: [[k, {f: (b(v) if f == "bytes" else v) for f, v in d.items()}] for k, d in c.patterns]
             if c.op == "exact" else [c.patterns[0][0], dict(c.patterns[0][1])],
             **({"n": c.n} if c.op == "count" else {})}
            for c in e.events
        ]
    return exp


def _dump(case: Case) -> dict[str, Any]:
    exp = expect_to_json(case.expect)
    out: dict[str, Any] = {"id": case.id, "anchor": case.anchor, "grade": case.grade.value,
                           "invariant": case.invariant, "diagram": case.diagram, "description": case.description,
                           "kind": case.kind.value, "inputs": dict(case.inputs), "expect": exp}
    if case.recipe:
        out["recipe"] = case.recipe
    if case.decisions:
        out["decisions"] = list(case.decisions)
    return out


def next_id(group: str, *, folder: str | Path | None = None) -> str:
    """The first free id `group/NNN` (group like 'stop/cross-token')."""
    taken = {c.id for c in load_cases((group + "/",), folder=folder)} if Path(folder or CASES_DIR).is_dir() else set()
    n = 1
    while f"{group}/{n:03d}" in taken:
        n += 1
    return f"{group}/{n:03d}"


def case_path(case_id: str, folder: str | Path | None = None) -> Path:
    """Where a case lives: `<folder>/<group>/<rest-with-dashes>.json` (two levels, as packaged)."""
    group, _, rest = case_id.partition("/")
    return Path(folder or CASES_DIR) / group / (rest.replace("/", "--") + ".json")


def save_case(
    group: str,
    *,
    anchor: str,
    invariant: str,
    description: str,
    inputs: Mapping[str, Any],
    expect: Mapping[str, Any],
    grade: str = "MUST",
    diagram: str = "lifecycle",
    folder: str | Path | None = None,
) -> Case:
    """Write a counterexample (a Hypothesis failing example or a model-checker trace) as a new case.

    `inputs`/`expect` use the JSON shape of the module docstring; the new case is validated
    before it is written, and gets the next free id in `group`.
    """
    obj = {"id": next_id(group, folder=folder), "anchor": anchor, "grade": grade, "invariant": invariant,
           "diagram": diagram, "description": description, "kind": "script", "inputs": dict(inputs),
           "expect": dict(expect)}
    case = parse_case(obj)
    path = case_path(case.id, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return attrs.evolve(case, path=path)


def case_from_trace(events: Sequence[Any], *, tokenizer_spec: Mapping[str, Any], prompt: Any) -> dict[str, Any]:
    """The `inputs` of a script case that replays a reference trace (its request and tokens).

    Reads `request.created` (stop strings, limits) and every `token.selected`; faults injected in
    the trace (`fault.injected`) are replayed at the same point and step. A trace does not hold
    the prompt's ids, so the caller passes them (`prompt`, as case items).
    """
    created = next((e for e in events if e.kind == "request.created"), None)
    if created is None:
        raise CaseError("the trace has no request.created event to take the request from")
    script = [e.data["token"] for e in events if e.kind == "token.selected"]
    if not script:
        raise CaseError("the trace selected no token; there is nothing to replay")
    d = created.data
    faults = [{"point": e.data["point"], "step": e.data["step"], "action": e.data["action"]}
              for e in events if e.kind == "fault.injected"]
    inputs: dict[str, Any] = {"tokenizer": dict(tokenizer_spec), "prompt": prompt,
                              "script": script, "max_tokens": d.get("max_output_tokens", len(script))}
    for key in ("stop", "stop_token_ids"):
        if d.get(key):
            inputs[key] = list(d[key])
    if faults:
        inputs["faults"] = faults
    return inputs
