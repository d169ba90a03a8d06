"""Request fields an engine ignored in every case that could show it: one cause of the run, not a
verdict per case (D71).

A field an engine accepts and never honours (llama-cpp-python's stream_options.include_usage) shows
in every case whose request sends it. Reported per case it would make each of them DIFFER on the
same cause and hide what else the run found, so a run states it once: `ignored_engine_wide` finds
such fields, the reports name each with the cases that showed it (reports.headline, causes), and
runner.grade gives a finding resting only on them no weight, as a declared choice's (D69); the
finding stays listed in its case.

What a case shows of a field F, from its findings and its recorded exchanges:

- ignored: a finding rests on F having had no effect (symptoms.basis_of: field_ignored naming F).
  The findings alone say it, so the headline, the cause and the summary count the same cases; a
  field one exchange shows (SHOWN_ON_WIRE) gets its finding from the judge in every stream that
  shows it ignored, and from `wire_findings` where a stored report is re-graded;
- honoured: a recorded exchange that sent F shows it honoured on the wire; for a field the wire
  cannot show alone (no SHOWN_ON_WIRE row), a case whose request sets F with no finding resting on
  it (the judge compared the field's effect and found it);
- nothing: otherwise (the stream was cut, the case never sent F).

F is ignored engine-wide when at least MIN_CASES base cases that ran show it ignored and none shows
it honoured; a case's chat variants (`chat/<id>`, `chat-bos/<id>`) are one base case, `<id>`, for
they send the same request under two templates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from .adapters.base import Finding
from .cases import Case
from .chat_cases import chat_of
from .grading import Verdict
from .judgement import no_usage_chunk, usage_chunk_missing
from .symptoms import FIELD_BASIS, Basis, basis_of
from .wire import parse_sse


class JudgedCase(Protocol):
    """What this module reads of a judged case (runner.CaseResult): its case, verdict, findings and
    the recorded exchanges in `observed`. A protocol, so the runner, which grades through this
    module, is not imported back."""

    @property
    def case(self) -> Case: ...
    @property
    def verdict(self) -> Verdict: ...
    @property
    def failures(self) -> tuple[Finding, ...]: ...
    @property
    def observed(self) -> Mapping[str, Any]: ...


MIN_CASES = 3  # D71: fewer base cases are per-case findings, not a cause of the whole run


def _usage_shown(exchange: Mapping[str, Any]) -> bool | None:
    """A stream asked for its usage: True when it sent the usage chunk, False when it ended with its
    terminal and without one (judgement.usage_chunk_missing), None when it could not show (cut, failed)."""
    if "sse" not in exchange:
        return None
    st = parse_sse(exchange["sse"], status=int(exchange.get("status") or 0))
    if usage_chunk_missing(st):
        return False
    return True if st.status == 200 and st.usage is not None else None


@attrs.frozen
class OnWire:
    """How one recorded exchange that sent a field shows it: `shown` (True honoured, False ignored,
    None nothing) and `finding`, the judge's finding for a stream that ignored it."""

    shown: Callable[[Mapping[str, Any]], bool | None]
    finding: Callable[[], Finding]


# The fields whose effect one recorded exchange shows alone.
SHOWN_ON_WIRE: Mapping[str, OnWire] = {
    "stream_options.include_usage": OnWire(_usage_shown, no_usage_chunk),
}


def sent(body: Any, field: str) -> bool:
    """Whether a request body sets `field` (a dotted path: 'stream_options.include_usage') to a
    value other than null or false."""
    for key in field.split("."):
        if not isinstance(body, Mapping) or key not in body:
            return False
        body = body[key]
    return body is not None and body is not False


def fields_ignored(r: JudgedCase) -> set[str]:
    """The request fields the findings of `r` rest on having had no effect (basis field_ignored)."""
    return {name for f in r.failures if (b := basis_of(f, r.case)).kind == FIELD_BASIS for name in b.ref.split(", ")}


@attrs.frozen
class IgnoredField:
    """One field ignored engine-wide (D71): the cases that showed it ignored, in the run's order."""

    field: str
    cases: tuple[str, ...]

    @property
    def basis(self) -> Basis:
        return Basis(FIELD_BASIS, self.field)

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "cases": len(self.cases), "basis": {"kind": FIELD_BASIS, "ref": self.field}}


def wire_findings(exchanges: Iterable[Mapping[str, Any]]) -> list[Finding]:
    """The findings recorded exchanges give of the fields they show alone (SHOWN_ON_WIRE): one per
    field that an exchange which sent it shows ignored. The regrade derives them from a stored
    report's exchanges as the judge found them in the live run."""
    sent_by = [(ex, (ex.get("request") or {}).get("body")) for ex in exchanges if isinstance(ex, Mapping)]
    return [row.finding() for field, row in SHOWN_ON_WIRE.items()
            if any(sent(body, field) and row.shown(ex) is False for ex, body in sent_by)]


def base_case(case: Case) -> str:
    """The base case a case counts as (D71's MIN_CASES): a chat case is the id after its template's
    prefix, so `chat/<id>` and `chat-bos/<id>`, one request under two templates, are one case."""
    return case.id.partition("/")[2] if chat_of(case) is not None else case.id


def _shown(r: JudgedCase, field: str, found: set[str]) -> bool | None:
    """What case `r` shows of `field`: False ignored, True honoured, None nothing (see module)."""
    if field in found:
        return False
    on_wire = SHOWN_ON_WIRE.get(field)
    if on_wire is not None:
        return True if any(sent((ex.get("request") or {}).get("body"), field) and on_wire.shown(ex)
                           for ex in (r.observed or {}).get("exchanges") or () if isinstance(ex, Mapping)) else None
    asked = field.split(".")[0] in ((r.case.inputs.get("request") or {}) if r.case is not None else {})
    return True if asked else None


def ignored_engine_wide(results: Iterable[JudgedCase]) -> tuple[IgnoredField, ...]:
    """The fields ignored engine-wide in a run (D71), each with the cases that showed it ignored;
    in the order the run first showed them. SKIP and ERROR results show nothing."""
    ran: Sequence[JudgedCase] = [r for r in results if r.verdict not in (Verdict.SKIP, Verdict.ERROR)]
    found = {id(r): fields_ignored(r) for r in ran}
    candidates: dict[str, None] = {}
    for r in ran:
        candidates.update(dict.fromkeys(sorted(found[id(r)])))
    out = []
    for field in candidates:
        shown = [(r.case, _shown(r, field, found[id(r)])) for r in ran]
        ignored = tuple(case.id for case, s in shown if s is False)
        bases = {base_case(case) for case, s in shown if s is False}
        if len(bases) >= MIN_CASES and not any(s is True for _, s in shown):
            out.append(IgnoredField(field, ignored))
    return tuple(out)
