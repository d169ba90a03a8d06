"""Run cases on an adapter and judge each Outcome against the case (issue 7 items 2-3).

Verdicts: PASS (every check that ran held), FAIL (one did not; the first violated invariant is
named), SKIP (the engine cannot run the case: the reason is kept), ERROR (the adapter itself
raised: counted as a failure). A check the engine cannot observe is listed under `not_checked`.
"""

from __future__ import annotations

import enum
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from .adapters.base import Adapter, Finding, Outcome, case_tokenizer
from .cases import Case, CaseError, CaseKind, Grade, expect_to_json


class Verdict(enum.StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"
    ERROR = "ERROR"


@attrs.frozen
class CaseResult:
    """The verdict on one case for one engine, with what a reader needs to reproduce it."""

    case: Case
    engine: str
    verdict: Verdict
    failures: tuple[Finding, ...] = ()
    not_checked: tuple[str, ...] = ()
    reason: str = ""  # why SKIP or ERROR
    observed: Mapping[str, Any] = attrs.field(factory=dict)
    seconds: float = 0.0
    expected: Mapping[str, Any] | None = None  # the expectation judged, when not the case file's own

    @property
    def first_invariant(self) -> str | None:
        return self.failures[0].invariant if self.failures else None

    @property
    def failed(self) -> bool:
        return self.verdict in (Verdict.FAIL, Verdict.ERROR)


def _text(b: bytes | None) -> str | None:
    return None if b is None else b.decode("utf-8", "backslashreplace")


def _matches(event: Any, pattern: tuple[str, Mapping[str, Any]]) -> bool:
    kind, fields = pattern
    if str(event.kind) != kind:
        return False
    for key, want in fields.items():
        got = event.data.get(key)
        if isinstance(got, (bytes, bytearray)):
            got = bytes(got)
        elif hasattr(got, "value"):
            got = got.value
        if got != want:
            return False
    return True


def _check_events(case: Case, events: Sequence[Any]) -> list[Finding]:
    out = []
    for c in case.expect.events:
        if c.op == "exact":
            seen = [e for e in events if str(e.kind) in c.kinds]
            if len(seen) != len(c.patterns) or not all(_matches(e, p) for e, p in zip(seen, c.patterns)):
                got = [f"{e.kind}({', '.join(f'{k}={v!r}' for k, v in e.data.items() if k in ('step', 'token', 'bytes', 'stop', 'finish_reason', 'seq'))})" for e in seen]
                out.append(Finding(c.invariant, f"events of kinds {sorted(c.kinds)} were {got}, expected {len(c.patterns)} matching {[p[0] for p in c.patterns]}"))
        else:
            n = sum(_matches(e, c.patterns[0]) for e in events)
            want = 0 if c.op == "absent" else c.n
            if n != want:
                out.append(Finding(c.invariant, f"{n} event(s) match {c.patterns[0][0]} {dict(c.patterns[0][1])}, expected {want}"))
    return out


def judge(case: Case, outcome: Outcome, engine: str, caps: frozenset[str]) -> CaseResult:
    """Compare an Outcome with its expectation (the adapter's, else the case's); findings name invariants."""
    exp = outcome.expect or case.expect
    fails: list[Finding] = list(outcome.findings)
    skipped: list[str] = []
    stops = [s.encode() for s in case.inputs.get("stop", ())]
    streamed = b"".join(outcome.chunks) if outcome.chunks is not None else None
    for label, data in (("output", outcome.output), ("stream", streamed)):
        for s in stops:
            if data is not None and s in data:
                fails.append(Finding("stop_bytes_never_emitted", f"the {label} contains the stop string {s!r}: {_text(data)!r}"))
    if exp.output is not None:
        if outcome.output is None:
            skipped.append("output")
        elif outcome.output != exp.output:
            fails.append(Finding(case.invariant, f"output {_text(outcome.output)!r} != expected {_text(exp.output)!r}"))
    if streamed is not None and outcome.output is not None and streamed != outcome.output:
        fails.append(Finding("detok_concat_equals_batch", f"streamed bytes {_text(streamed)!r} differ from the returned output {_text(outcome.output)!r}"))
    for key, inv in (("finish_reason", case.invariant), ("state", "finish_reason_matches_state")):
        want = getattr(exp, key)
        if want is None:
            continue
        got = getattr(outcome, key)
        if got is None:
            skipped.append(key)
        elif got != want:
            fails.append(Finding(inv, f"{key} {got!r} != expected {want!r}"))
    if exp.error is not None:
        if "errors" not in caps:
            skipped.append("error")
        elif not (outcome.error or "").startswith(exp.error):
            fails.append(Finding(case.invariant, f"expected an error starting {exp.error!r}, got {outcome.error!r}"))
    if exp.usage:
        if outcome.usage is None:
            skipped.append("usage")
        else:
            for k, v in exp.usage.items():
                if outcome.usage.get(k) != v:
                    fails.append(Finding("usage_consistent", f"usage.{k} = {outcome.usage.get(k)!r}, expected {v}"))
    if exp.events:
        if outcome.events is None:
            skipped.append("events")
        else:
            fails += _check_events(case, outcome.events)
    if outcome.full_trace and outcome.events is not None and case.kind is CaseKind.SCRIPT:
        fails += _trace_findings(case, outcome.events)
    observed = {
        "output": _text(outcome.output), "finish_reason": outcome.finish_reason, "state": outcome.state,
        "error": outcome.error, "usage": dict(outcome.usage) if outcome.usage is not None else None,
        "chunks": [_text(c) for c in outcome.chunks] if outcome.chunks is not None else None,
        "notes": list(outcome.notes),
        "exchanges": list(outcome.exchanges), "reference": dict(outcome.reference) if outcome.reference else None,
    }
    fails.sort(key=lambda f: f.invariant != case.invariant)  # the case's own invariant leads the report
    verdict = Verdict.FAIL if fails else Verdict.PASS
    expected = None if outcome.expect is None else expect_to_json(outcome.expect)
    return CaseResult(case, engine, verdict, tuple(_dedup(fails)), tuple(skipped), observed=observed, expected=expected)


def _dedup(findings: Iterable[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        if (f.invariant, f.message) not in seen:
            seen.add((f.invariant, f.message))
            out.append(f)
    return out


def _trace_findings(case: Case, events: Sequence[Any]) -> list[Finding]:
    """Every named invariant of spec/invariants.toml on the trace (properties/monitors.py)."""
    from ..monitors import check_trace

    return [Finding(v.invariant, f"{v.message} (event {v.index})") for v in check_trace(events, tokenizer=case_tokenizer(case))]


def run_case(adapter: Adapter, case: Case) -> CaseResult:
    """One case on one adapter: SKIP with the reason, or the judged Outcome, or ERROR."""
    t0 = time.perf_counter()
    reason = adapter.unsupported(case)
    if reason:
        return CaseResult(case, adapter.name, Verdict.SKIP, reason=reason)
    try:
        outcome = adapter.run(case)
    except Exception as exc:  # the engine or the adapter broke: never a pass
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return CaseResult(case, adapter.name, Verdict.ERROR, reason=tb, seconds=time.perf_counter() - t0)
    if outcome.skip:
        return CaseResult(case, adapter.name, Verdict.SKIP, reason=outcome.skip, seconds=time.perf_counter() - t0)
    res = judge(case, outcome, adapter.name, adapter.capabilities)
    return attrs.evolve(res, seconds=time.perf_counter() - t0)


def run_cases(
    adapter: Adapter,
    cases: Sequence[Case],
    *,
    jobs: int = 1,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Run every case (on `jobs` threads), in case order; `on_result` sees each as it finishes."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")

    def one(case: Case) -> CaseResult:
        res = run_case(adapter, case)
        if on_result is not None:
            on_result(res)
        return res

    if jobs == 1:
        return [one(c) for c in cases]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, cases))


def unexpected(results: Sequence[CaseResult], expected_failures: frozenset[str] = frozenset(), *,
               strict: bool = False) -> list[CaseResult]:
    """The results that fail a run: the one rule shared by the CLI and the pytest plugin.

    Every ERROR (the run could not judge) and every MUST failure, unless its id is listed as a known
    failure; SHOULD failures too with `strict`. A listed case that now passes is reported by `fixed`.
    """
    return [r for r in results if r.failed and r.case.id not in expected_failures
            and (r.verdict is Verdict.ERROR or strict or r.case.grade is Grade.MUST)]


def counts(r: CaseResult, *, strict: bool = False) -> bool:
    """Whether this one result fails a run (see `unexpected`), for runners that see one at a time."""
    return bool(unexpected([r], strict=strict))


def fixed(results: Sequence[CaseResult], expected_failures: frozenset[str]) -> list[CaseResult]:
    """Cases listed as known failures that passed this time (the list should be updated)."""
    return [r for r in results if r.verdict is Verdict.PASS and r.case.id in expected_failures]


def read_expectations(text: str, known: Iterable[str] | None = None) -> frozenset[str]:
    """An expectations file: one case id per line; `#` starts a comment. With `known` (every case
    id), an id that names no case is a CaseError listing them (a typo would hide a failure)."""
    ids = frozenset(i for i in (line.split("#", 1)[0].strip() for line in text.splitlines()) if i)
    if known is not None and (bad := sorted(ids - set(known))):
        raise CaseError(f"the expectations name no such case: {', '.join(bad)}")
    return ids
