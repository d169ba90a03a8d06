"""Which of an engine's committed deviations a fuzz run found again, and what it found that no
committed case shows (`decodespec fuzz --against`, `decodespec refound`).

Both sides are read from reports in `decodespec conform`'s report.json format (reports.py): an
engine's committed reports (reports/ENGINE, reports/ENGINE-align, ...) and a fuzz run's report
(its minimal cases, `fuzz-minimal/...`, then the smallest generated example of each kind,
`fuzz/...`). A deviation is a failing case's lead finding (FAIL or DIFFERS) keyed as the fuzz run
keys its failures (shrink.failure_key): the symptom and its basis, the chapter's invariant or a
decision (§4.3-§4.10, symptoms.py). A committed deviation of the chosen severities (by default
text and ending, the severities that change what a reader gets and how the run ended) is re-found
when a fuzz case leads with the same key. Two `field_ignored` keys match when their request fields
share one: a finding resting on several fields shows that one of them had no effect.

The generator draws script cases only (strategies.py). A committed deviation whose every lead
case runs a recipe instead (a batch under load, max_tokens 0, bad input, a stream against the
non-streamed answer: the case's `reproducer.recipe`) is out of its reach, and listed as such.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..symptoms import FIELD_BASIS, SEVERITIES, Severity
from .shrink import Key

FAILING = ("FAIL", "DIFFERS")
MUST_SHOW: tuple[Severity, ...] = (Severity.TEXT, Severity.ENDING)


class RefoundError(ValueError):
    """A report that cannot be read as `decodespec conform`'s report.json."""


@attrs.frozen
class Deviation:
    """One kind of deviation in a report: its key, severity and the cases leading with it (ids in
    report order), and the cases that show it only as a later finding."""

    key: Key
    severity: Severity
    cases: tuple[str, ...]
    later: tuple[str, ...] = ()
    recipes: tuple[str | None, ...] = ()  # each lead case's recipe (None: a script case)

    @property
    def drawable(self) -> bool:
        """Whether a lead case is a script case, the kind of case the generator draws."""
        return not self.recipes or None in self.recipes


@attrs.frozen
class Refound:
    """A committed deviation and the fuzz cases that lead with it (minimal cases first); `by` empty:
    the fuzz run did not find it again."""

    committed: Deviation
    by: tuple[str, ...]
    where: tuple[str, ...]  # the committed reports that show it


@attrs.frozen
class Comparison:
    """A fuzz run against an engine's committed reports: each committed deviation of `severities`
    re-found or not, and the fuzz run's kinds that no committed case leads with (`new`, each with
    the committed cases that show it as a later finding in `later`)."""

    fuzz: str
    reports: tuple[str, ...]
    severities: tuple[Severity, ...]
    refound: tuple[Refound, ...]
    new: tuple[Deviation, ...]


def key_of(finding: Mapping[str, Any]) -> Key:
    """A report finding's key: (symptom, basis kind, basis ref), as shrink.failure_key makes it."""
    try:
        basis = finding["basis"]
        return (finding.get("symptom") or finding["invariant"], basis["kind"], basis["ref"])
    except (KeyError, TypeError) as exc:
        raise RefoundError(f"a finding without its symptom, invariant or basis ({exc}): {finding!r}"[:300]) from None


def same(a: Key, b: Key) -> bool:
    """Whether two keys name the same deviation: equal, or `field_ignored` with a field in common."""
    if a == b:
        return True
    if a[:2] != b[:2] or a[1] != FIELD_BASIS:
        return False
    return bool(_fields(a[2]) & _fields(b[2]))


def _fields(ref: str) -> frozenset[str]:
    return frozenset(f.strip() for f in ref.split(","))


def load(path: Path) -> Mapping[str, Any]:
    """A report.json (a folder is read as its report.json); a clear error when it is none."""
    file = path / "report.json" if path.is_dir() else path
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RefoundError(f"{file}: not a readable report.json ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("cases"), list):
        raise RefoundError(f"{file}: no `cases` list, so not decodespec conform's report.json")
    return report


def later_findings(report: Mapping[str, Any]) -> dict[Key, list[str]]:
    """The failing cases of the report showing each key as a finding after their lead."""
    out: dict[Key, list[str]] = {}
    for case in _failing(report):
        for f in case["failures"][1:]:
            out.setdefault(key_of(f), []).append(case["id"])
    return out


def deviations(report: Mapping[str, Any]) -> dict[Key, Deviation]:
    """The report's deviations by key (see module), each with the cases leading with it and those
    showing it only later."""
    lead: dict[Key, list[str]] = {}
    recipes: dict[Key, list[str | None]] = {}
    severity: dict[Key, Severity] = {}
    for case in _failing(report):
        first = case["failures"][0]
        k = key_of(first)
        lead.setdefault(k, []).append(case["id"])
        recipes.setdefault(k, []).append((case.get("reproducer") or {}).get("recipe"))
        try:
            severity.setdefault(k, Severity(first["severity"]))
        except (KeyError, ValueError):
            raise RefoundError(f"case {case['id']}: its lead finding has no severity of {list(SEVERITIES)}") from None
    later = later_findings(report)
    return {k: Deviation(k, severity[k], tuple(ids), tuple(later.get(k, ())), tuple(recipes[k]))
            for k, ids in lead.items()}


def _failing(report: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    return (c for c in report["cases"] if c.get("verdict") in FAILING and c.get("failures"))


def _merge(parts: Iterable[tuple[str, Mapping[Key, Deviation]]]) -> dict[Key, tuple[Deviation, tuple[str, ...]]]:
    """Deviations of several reports by key: cases joined, with the reports showing each."""
    out: dict[Key, tuple[Deviation, tuple[str, ...]]] = {}
    for name, devs in parts:
        for k, d in devs.items():
            if k in out:
                old, where = out[k]
                d = attrs.evolve(old, cases=old.cases + d.cases, later=old.later + d.later,
                                 recipes=old.recipes + d.recipes)
                out[k] = (d, (*where, name))
            else:
                out[k] = (d, (name,))
    return out


def compare(fuzz: tuple[str, Mapping[str, Any]], committed: Sequence[tuple[str, Mapping[str, Any]]],
            severities: Sequence[Severity] = MUST_SHOW) -> Comparison:
    """The fuzz report (name, report) against the committed ones (see module)."""
    found = deviations(fuzz[1])
    ours = _merge((name, deviations(r)) for name, r in committed)
    refound = tuple(
        Refound(d, tuple(sorted(c for k, f in found.items() if same(d.key, k) for c in f.cases)), where)
        for d, where in sorted(ours.values(), key=lambda dw: (SEVERITIES.index(dw[0].severity), dw[0].key))
        if d.severity in severities)
    later: dict[Key, list[str]] = {}
    for _, r in committed:
        for k, ids in later_findings(r).items():
            later.setdefault(k, []).extend(ids)
    new = tuple(
        attrs.evolve(f, later=tuple(c for k, ids in later.items() if same(k, f.key) for c in ids))
        for f in sorted(found.values(), key=lambda f: (SEVERITIES.index(f.severity), f.key))
        if not any(same(f.key, k) for k in ours))
    return Comparison(fuzz[0], tuple(name for name, _ in committed), tuple(severities), refound, new)


def compare_paths(fuzz: Path, committed: Sequence[Path], severities: Sequence[Severity] = MUST_SHOW) -> Comparison:
    """`compare` on report files or folders (a folder: its report.json)."""
    if not committed:
        raise RefoundError("no committed report to compare the fuzz run with")
    return compare((str(fuzz), load(fuzz)), [(str(p), load(p)) for p in committed], severities)


def _key(k: Key) -> str:
    return f"`{k[0]}` ({k[1]}: {k[2]})"


def _ids(ids: Sequence[str], most: int = 6) -> str:
    shown = ", ".join(f"`{i}`" for i in ids[:most])
    return shown + (f" and {len(ids) - most} more" if len(ids) > most else "")


def render(c: Comparison) -> str:
    """The comparison as Markdown: the committed deviations re-found or not, then the new kinds."""
    kinds = " and ".join(s.value for s in c.severities)
    hit = sum(1 for r in c.refound if r.by)
    reach = [r for r in c.refound if r.committed.drawable]
    reach_hit = sum(1 for r in reach if r.by)
    lines = ["# Committed deviations the fuzz run found again", "",
             f"Fuzz run: `{c.fuzz}`; committed: {', '.join(f'`{r}`' for r in c.reports)}. A deviation is a failing "
             f"case's lead finding, keyed by symptom and basis as the fuzz run keys its failures "
             f"(properties/conformance/fuzz/refound.py).", "",
             f"## The committed {kinds} deviations: {hit} of {len(c.refound)} re-found, {reach_hit} of the "
             f"{len(reach)} a script case shows (the generator draws no recipe)", ""]
    for r in c.refound:
        d = r.committed
        got = (f"re-found by {_ids(r.by)}" if r.by else "**not re-found**" if d.drawable else
               f"not re-found: out of the generator's reach (recipe {_ids(sorted({str(x) for x in d.recipes}))})")
        lines.append(f"- {_key(d.key)}, {d.severity.value}, in {_ids(d.cases, 3)}: {got}")
    lines += ["", f"## What the fuzz run found that no committed case leads with: {len(c.new)} kind(s)", ""]
    for d in c.new:
        also = f"; a later finding of committed {_ids(d.later, 3)}" if d.later else "; no committed case shows it"
        lines.append(f"- {_key(d.key)}, {d.severity.value}: {_ids(d.cases)}{also}")
    if not c.new:
        lines.append("- none")
    return "\n".join(lines) + "\n"
