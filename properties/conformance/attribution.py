"""Which layer a finding seen behind a gateway belongs to: the worker's, or the gateway's own.

A gateway (a router, a proxy) re-streams every chunk its worker sends and rewrites the requests it
passes on, so a report judged through it mixes two layers' findings. The same worker judged directly
(its own reports, same checkpoints and cases) separates them, case by case and finding by finding:

- `worker`: the direct run of the case shows the same finding (same invariant and symptom);
- `gateway`: the direct run ran the case and does not show it: only the gateway adds it;
- `unjudged`: no direct run ran the case (absent, n/a or an error there), so nothing tells them apart.

A case that errs behind the gateway and not directly is the gateway's error (the finding `error`).
The worker's findings that the direct run shows and the gateway run does not are listed apart
(`hidden`): a gateway that rewrites what it carries can hide a finding as well as add one. So are
the cases judged directly that are n/a behind the gateway (`lost`, with the reason given there): a
gateway that drops a field the case reads (logprobs) takes the case away rather than failing it.

The worker's reports are named by their folder beside the gateway's (reports/vllm for
reports/vllm-router); several may be given (the chapter's, the chat and alignment runs), the first
that ran a case judges it.

A report's first screen groups each layer's findings by cause, as an engine's report groups its own
(reports.causes, D71's one cause stated once): one `Group` per severity, invariant and symptom, with
the bases it rests on, its cases and the one to open first (`grouped`); the hidden findings and the
lost cases likewise (`hidden_groups`, `lost_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from .symptoms import label

OWNERS = ("gateway", "worker", "unjudged")
ERROR = "error"  # the symptom of a case that could not be judged (ERROR, no finding)
NOT_JUDGED = frozenset({"SKIP", "ERROR"})


@attrs.frozen
class Attributed:
    """One finding of a gateway run and the layer it belongs to (OWNERS)."""

    case: str
    invariant: str
    symptom: str
    severity: str
    verdict: str  # the case's verdict behind the gateway
    owner: str

    def to_json(self) -> dict[str, str]:
        return attrs.asdict(self)


def _findings(entry: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """A case's findings as (invariant, symptom, severity); an ERROR without findings is one, `error`."""
    found = [(f["invariant"], f.get("symptom") or "", f.get("severity") or "") for f in entry.get("failures") or []]
    return found or ([("", ERROR, "")] if entry["verdict"] == "ERROR" else [])


def _direct(case: str, workers: Sequence[Mapping[str, Mapping[str, Any]]]) -> Mapping[str, Any] | None:
    """The first direct run that judged `case` (a verdict other than n/a or error), else None."""
    return next((w[case] for w in workers if case in w and w[case]["verdict"] not in NOT_JUDGED), None)


def _worker_errs(case: str, workers: Sequence[Mapping[str, Mapping[str, Any]]]) -> bool:
    return any(case in w and w[case]["verdict"] == "ERROR" for w in workers)


def _by_id(report: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c["id"]: c for c in report["cases"]}


def attribute(gateway: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> tuple[list[Attributed], list[Attributed]]:
    """(the gateway run's findings, each with its owner; the direct runs' findings the gateway run
    does not show, `hidden`, owner `worker`), both in the gateway report's case order. Reports as
    report.json holds them."""
    direct = [_by_id(w) for w in workers]
    out: list[Attributed] = []
    hidden: list[Attributed] = []
    for entry in gateway["cases"]:
        cid, verdict = entry["id"], entry["verdict"]
        seen = _findings(entry)
        there = _direct(cid, direct)
        if there is None:
            owner_of = {k: "worker" if k[1] == ERROR and _worker_errs(cid, direct) else "unjudged" for k in seen}
        else:
            theirs = {(i, s) for i, s, _ in _findings(there)}
            owner_of = {k: "worker" if k[:2] in theirs else "gateway" for k in seen}
            if verdict not in NOT_JUDGED:
                ours = {k[:2] for k in seen}
                hidden += [Attributed(cid, i, s, sev, verdict, "worker") for i, s, sev in _findings(there)
                           if (i, s) not in ours]
        out += [Attributed(cid, i, s, sev, verdict, owner_of[(i, s, sev)]) for i, s, sev in seen]
    return out, hidden


def lost(gateway: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The cases a direct run judged that are n/a behind the gateway: [{'case', 'reason'}] (its reason there)."""
    direct = [_by_id(w) for w in workers]
    return [{"case": c["id"], "reason": c.get("reason") or ""} for c in gateway["cases"]
            if c["verdict"] == "SKIP" and _direct(c["id"], direct) is not None]


def attribution_json(gateway: Mapping[str, Any], workers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """report.json's `attribution`: the worker reports' names (folders beside the gateway's), the
    findings counted by owner, and each finding with its owner; the hidden ones and the lost cases apart."""
    found, hidden = attribute(gateway, list(workers.values()))
    return {"workers": list(workers), "counts": counts(found),
            "findings": [f.to_json() for f in found], "hidden": [f.to_json() for f in hidden],
            "lost": lost(gateway, list(workers.values()))}


def counts(found: Iterable[Attributed]) -> dict[str, dict[str, int]]:
    """Per owner: its findings and the cases they are in."""
    found = list(found)
    return {o: {"findings": sum(1 for f in found if f.owner == o), "cases": len({f.case for f in found if f.owner == o})}
            for o in OWNERS}


def owned(attribution: Mapping[str, Any], owner: str) -> list[Mapping[str, str]]:
    """The attributed findings (report.json's form) of one owner."""
    if owner not in OWNERS:
        raise ValueError(f"owner {owner!r} is not one of {', '.join(OWNERS)}")
    return [f for f in attribution["findings"] if f["owner"] == owner]


def split_line(attribution: Mapping[str, Any]) -> str:
    """The split in one line: '3 gateway findings (2 cases), 40 the worker's (30 cases), 1 unjudged'."""
    c = attribution["counts"]
    return (f"{c['gateway']['findings']} the gateway's own ({c['gateway']['cases']} cases), "
            f"{c['worker']['findings']} the worker's ({c['worker']['cases']} cases), "
            f"{c['unjudged']['findings']} unjudged (no direct run of their case); "
            f"against {', '.join(attribution['workers'])}")


_OPEN_FIRST = ("FAIL", "ERROR", "DIFFERS")  # verdicts whose case the report details (and links to)


@attrs.frozen
class Part:
    """The cases of a Group that rest on one basis (reports.causes' basis kind and ref; `engine_wide`:
    a field the run ignored in every case that could show it, D71)."""

    kind: str
    ref: str
    engine_wide: bool
    cases: tuple[str, ...]


@attrs.frozen
class Group:
    """What one layer got wrong, once: the run's causes of one severity, invariant and symptom cut to
    the cases where that layer's finding is it (a symptom resting on the chapter in some cases and on
    a decision in others is one group, its `parts` per basis). `first`: the case to open first, one
    it leads that the report details (FAIL, ERROR, DIFFERS), else one the report details, else the
    first. An error (a case that could not be judged) is a group with severity '' and symptom `error`."""

    owner: str
    severity: str
    invariant: str
    symptom: str
    label: str
    parts: tuple[Part, ...]
    cases: tuple[str, ...]
    lead_in: tuple[str, ...]
    first: str

    def basis_of(self, case: str) -> Part | None:
        """The part holding `case` (None: not one of this group's cases, or an error)."""
        return next((p for p in self.parts if case in p.cases), None)


def _group(owner: str, key: tuple[str, str, str], rows: Sequence[tuple[Mapping[str, Any], str]],
           verdict: Mapping[str, str], name: str = "") -> Group:
    """A Group of (cause, case) rows, in the causes' order."""
    severity, invariant, symptom = key
    parts: dict[tuple[str, str, bool], list[str]] = {}
    for cause, cid in rows:
        b = cause["basis"]
        parts.setdefault((b["kind"], b["ref"], bool(cause.get("engine_wide"))), []).append(cid)
    cases = tuple(dict.fromkeys(cid for _, cid in rows))
    lead_in = tuple(dict.fromkeys(cid for cause, cid in rows if cid in cause.get("lead_in", ())))
    shown = [c for c in cases if verdict[c] in _OPEN_FIRST]
    first = next((c for c in lead_in if c in shown), shown[0] if shown else cases[0])
    return Group(owner, severity, invariant, symptom, name or label(symptom) or symptom,
                 tuple(Part(k, r, w, tuple(cs)) for (k, r, w), cs in parts.items()), cases, lead_in, first)


def grouped(attribution: Mapping[str, Any], causes: Sequence[Mapping[str, Any]]) -> dict[str, list[Group]]:
    """Per owner (OWNERS), its findings as Groups: its errors first, then in the order of the run's
    causes (reports.causes: most severe first, the chapter's before decisions). `attribution` and
    `causes` as report.json holds them; a finding one has and the other lacks is a ValueError."""
    found = {(f["case"], f["invariant"], f["symptom"], f["severity"]): f for f in attribution["findings"]}
    verdict = {f["case"]: f["verdict"] for f in attribution["findings"]}
    rows: dict[tuple[str, str, str, str], list[tuple[Mapping[str, Any], str]]] = {}
    placed: set[tuple[str, str, str, str]] = set()
    for cause in causes:
        for cid in cause["cases"]:
            at = (cid, cause["invariant"], cause["symptom"], cause["severity"])
            if at not in found:
                raise ValueError(f"the cause {cause['symptom']!r} ({cause['invariant']}) names case {cid!r}, "
                                 "which the attribution does not list with that finding")
            placed.add(at)
            rows.setdefault((found[at]["owner"], cause["severity"], cause["invariant"], cause["symptom"]),
                            []).append((cause, cid))
    errors = [k for k, f in found.items() if f["symptom"] == ERROR and not f["invariant"]]
    if missing := [k for k in found if k not in placed and k not in errors]:
        raise ValueError(f"no cause of the run holds the attributed finding {missing[0][2]!r} of case {missing[0][0]!r}")
    out: dict[str, list[Group]] = {o: [] for o in OWNERS}
    for o in OWNERS:
        mine = [(_ERROR_CAUSE, k[0]) for k in errors if found[k]["owner"] == o]
        if mine:
            out[o].append(_group(o, ("", "", ERROR), mine, verdict, "the case could not be judged"))
    for (o, *key), got in rows.items():
        out[o].append(_group(o, (key[0], key[1], key[2]), got, verdict))
    return out


_ERROR_CAUSE: Mapping[str, Any] = {"basis": {"kind": "", "ref": ""}}


def hidden_groups(attribution: Mapping[str, Any]) -> list[Group]:
    """The worker's findings the gateway run does not show (`hidden`), one Group per severity,
    invariant and symptom (no basis: the worker's report has it), most cases first."""
    rows: dict[tuple[str, str, str], list[tuple[Mapping[str, Any], str]]] = {}
    for f in attribution["hidden"]:
        rows.setdefault((f["severity"], f["invariant"], f["symptom"]), []).append((_ERROR_CAUSE, f["case"]))
    verdict = {f["case"]: f["verdict"] for f in attribution["hidden"]}
    return sorted((_group("worker", k, got, verdict) for k, got in rows.items()), key=lambda g: -len(g.cases))


def lost_groups(attribution: Mapping[str, Any], gist: Callable[[str], str]) -> list[tuple[str, list[str]]]:
    """The cases judged directly and n/a through the gateway (`lost`), by `gist(reason)`, most cases first."""
    by: dict[str, list[str]] = {}
    for c in attribution["lost"]:
        by.setdefault(gist(c["reason"]), []).append(c["case"])
    return sorted(by.items(), key=lambda kv: -len(kv[1]))
