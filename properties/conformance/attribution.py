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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

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
