"""Run cases on an adapter and judge each Outcome against the case.

Verdicts: PASS (no finding that weighs: none, or only stream-shape and wire ones, listed with it),
FAIL (a rule of chapter 4 broken: text, ending or accounting findings resting on the chapter),
DIFFERS (such findings, all resting on a project decision or on request fields that had no
effect), SKIP (the engine cannot run the case: the reason is kept), ERROR (the adapter or the judge
raised: counted as a failure, with the exchanges made before, adapters.base.RunRaised). The findings
are ordered most severe first (symptoms.SEVERITIES); `grade` derives the verdict from them, under a
profile (PROFILES) and the decisions an engine declares as its own. A check the engine cannot
observe is listed under `not_checked`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from ...runtime.openai_schema import OPENAI_FINISH
from ...spec import FinishReason
from .adapters.base import (
    Adapter,
    Finding,
    Outcome,
    RunRaised,
    case_prompt,
    case_script,
    case_tokenizer,
    raised,
    reference_on,
)
from .cases import Case, CaseError, CaseKind, Grade, expect_to_json
from .decisions import DECISIONS, decision_line
from .engine_wide import ignored_engine_wide
from .grading import (
    CHAPTER_W,
    DECISION_W,
    DECLARED_W,
    DEFAULT_PROFILE,
    ENGINE_WIDE_W,
    PROFILES,
    SHAPE_W,
    WIRE_W,
    Verdict,
)
from .judgement import expected_of
from .symptoms import (
    FIELD_BASIS,
    WIRE,
    Basis,
    Expected,
    Severity,
    basis_of,
    by_severity,
    compare_reason,
    compare_split,
    compare_stream,
    compare_text,
    finding,
    merge,
    severity_of,
)
from .wire import unterminated

_REASON_VALUES = frozenset(r.value for r in FinishReason)


# What a finding weighs: by its severity, then (for text, ending and accounting) by its basis (grading.py).
_WEIGHT_BY_SEVERITY: Mapping[Severity, str | None] = {
    Severity.TEXT: None, Severity.ENDING: None, Severity.ACCOUNTING: None,
    Severity.STREAM_SHAPE: SHAPE_W, Severity.WIRE: WIRE_W,
}
_WEIGHT_BY_BASIS: Mapping[str, str] = {"chapter": CHAPTER_W, "decision": DECISION_W, "field_ignored": DECISION_W,
                                       "wire": WIRE_W}
_VERDICT_ORDER = (Verdict.FAIL, Verdict.DIFFERS, Verdict.PASS)


def weight(f: Finding, case: Case, declared: frozenset[str] = frozenset(), wide: frozenset[str] = frozenset()) -> str:
    """What finding `f` weighs in `case`: 'chapter', 'decision' (a decision or request fields with no
    effect), 'shape', 'wire', 'declared' (it rests on a decision the engine declares its own), or
    'engine_wide' (it rests only on fields of `wide`, ignored by the engine in the whole run, D71)."""
    by_severity_only = _WEIGHT_BY_SEVERITY[severity_of(f)]
    if by_severity_only is not None:
        return by_severity_only
    basis = basis_of(f, case)
    if basis.kind == "decision" and basis.ref in declared:
        return DECLARED_W
    if basis.kind == FIELD_BASIS and set(basis.ref.split(", ")) <= wide:
        return ENGINE_WIDE_W
    return _WEIGHT_BY_BASIS[basis.kind]


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
        """The invariant the lead finding breaks (a wire convention's name when only those failed)."""
        return self.failures[0].invariant if self.failures else None

    @property
    def lead(self) -> Finding | None:
        return self.failures[0] if self.failures else None

    @property
    def wire(self) -> tuple[Finding, ...]:
        """The OpenAI wire-convention findings (never a §4.x failure; `--strict` counts them)."""
        return tuple(f for f in self.failures if f.family == WIRE)

    @property
    def shape(self) -> tuple[Finding, ...]:
        """The stream-shape findings (empty chunks, hold-back timing, resumption): never a failure
        on their own; `--strict` counts them."""
        return tuple(f for f in self.failures if severity_of(f) is Severity.STREAM_SHAPE)

    def basis(self, f: Finding) -> Basis:
        """What finding `f` of this result rests on (symptoms.basis_of)."""
        return basis_of(f, self.case)

    @property
    def failed(self) -> bool:
        return self.verdict in (Verdict.FAIL, Verdict.ERROR)

    @property
    def judged_apart(self) -> bool:
        """A result whose findings were not all the chapter's: DIFFERS, or a PASS with findings."""
        return self.verdict is Verdict.DIFFERS or (self.verdict is Verdict.PASS and bool(self.failures))


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
    """Compare an Outcome with what the case expects; every finding names the invariant whose
    statement the observation breaks (symptoms.py), never the case's own by default.

    An adapter that judged its answer itself (over HTTP: judgement.py) gives the findings; for the
    others each dimension is compared here. A case none of whose checks could be observed is n/a,
    never a pass; a pass that missed some is partial (`not_checked`). Every stream the case recorded
    is held to §4.7's one terminal (wire.unterminated)."""
    if outcome.judged:
        fails, skipped, ran = list(outcome.findings), list(outcome.not_checked), True
    else:
        fails, skipped, ran = _judge_here(case, outcome, caps)
    seen = {f.symptom for f in fails}  # every recorded stream ends with its terminal (§4.7), whatever the case checks
    fails += [f for f in unterminated(outcome.exchanges) if f.symptom not in seen]
    observed = {
        "output": _text(outcome.output), "finish_reason": outcome.finish_reason, "state": outcome.state,
        "error": outcome.error, "usage": dict(outcome.usage) if outcome.usage is not None else None,
        "chunks": [_text(c) for c in outcome.chunks] if outcome.chunks is not None else None,
        "notes": list(outcome.notes),
        "exchanges": list(outcome.exchanges), "reference": dict(outcome.reference) if outcome.reference else None,
        "server": dict(outcome.server) if outcome.server else None,
    }
    fails = by_severity(merge(fails))
    expected = None if outcome.expect is None else expect_to_json(outcome.expect)
    if not ran and not fails:
        return CaseResult(case, engine, Verdict.SKIP, reason="the engine showed none of what the case checks: "
                          + ", ".join(skipped), observed=observed, expected=expected)
    return grade(CaseResult(case, engine, Verdict.PASS, tuple(fails), tuple(skipped), observed=observed,
                            expected=expected))


def grade(r: CaseResult, profile: str = DEFAULT_PROFILE, declared: frozenset[str] = frozenset(),
          wide: frozenset[str] = frozenset()) -> CaseResult:
    """The verdict of a judged result from its findings (PASS, FAIL or DIFFERS; SKIP and ERROR stay):
    the most severe one its findings' weights give under `profile` (PROFILES). `declared`: the
    decisions the engine declares its own; a case resting on one is n/a with the decision's line,
    a finding resting on one elsewhere weighs nothing. `wide`: the fields the engine ignored in the
    whole run (engine_wide, D71); a finding resting only on them weighs nothing either."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: one of {', '.join(PROFILES)}")
    if unknown := sorted(declared - set(DECISIONS)):
        raise ValueError(f"no such decision {', '.join(unknown)}: one of {', '.join(DECISIONS)}")
    if r.verdict in (Verdict.SKIP, Verdict.ERROR):
        return r
    if own := declared_on(r.case, declared):
        return attrs.evolve(r, verdict=Verdict.SKIP, reason=declared_reason(own))
    given = {PROFILES[profile].get(weight(f, r.case, declared, wide), Verdict.PASS) for f in r.failures}
    return attrs.evolve(r, verdict=next(v for v in _VERDICT_ORDER if v in given or v is Verdict.PASS))


def grade_run(results: Sequence[CaseResult], profile: str = DEFAULT_PROFILE,
              declared: frozenset[str] = frozenset()) -> list[CaseResult]:
    """Every result of one run graded (`grade`), with the fields the engine ignored engine-wide in
    that run (engine_wide.ignored_engine_wide, D71) stated once by the reports instead of weighing
    in each case."""
    wide = frozenset(w.field for w in ignored_engine_wide(results))
    return [grade(r, profile, declared, wide) for r in results]


def declared_on(case: Case, declared: frozenset[str]) -> str | None:
    """The first decision `case` rests on that the engine declares its own (None: none; D69)."""
    return next((d for d in case.decisions if d in declared), None)


def declared_reason(number: str) -> str:
    """The n/a reason of a case resting on a decision the engine declares its own (--declare)."""
    return f"the engine declares its own choice on {decision_line(number)} (--declare {number})"


def _judge_here(case: Case, outcome: Outcome, caps: frozenset[str]) -> tuple[list[Finding], list[str], bool]:
    """(findings, not checked, whether any check ran) for an in-process adapter's Outcome: each of
    _DIMENSIONS in turn, after the adapter's own findings."""
    exp = outcome.expect or case.expect
    here = _Here(case, outcome, exp, _expected(case, exp) if case.kind is CaseKind.SCRIPT else None, caps)
    tally = _Tally(list(outcome.findings), list(outcome.not_checked), bool(outcome.findings))
    for judge in _DIMENSIONS:
        judge(here, tally)
    return tally.fails, tally.skipped, tally.ran


@attrs.frozen
class _Here:
    """One in-process Outcome with what it is judged against: the case's expectation (the
    adapter's own, where it gives one), the reference's answer (script cases) and the adapter's
    capabilities."""

    case: Case
    outcome: Outcome
    exp: Any
    ref: Expected | None
    caps: frozenset[str]

    @property
    def streamed(self) -> bytes | None:
        return b"".join(self.outcome.chunks) if self.outcome.chunks is not None else None


@attrs.define
class _Tally:
    """The findings so far, the dimensions not checked, and whether any check ran."""

    fails: list[Finding]
    skipped: list[str]
    ran: bool

    def checked(self, found: Iterable[Finding]) -> None:
        self.ran = True
        self.fails += found

    def compare(self, field: str, want: Any, got: Any, judge: Callable[[Any, Any], list[Finding]]) -> None:
        """Where the case expects `want` of `field`: not checked when the engine shows nothing, else judged."""
        if want is None:
            return
        if got is None:
            self.skipped.append(field)
        else:
            self.checked(judge(want, got))


def _judge_text(h: _Here, t: _Tally) -> None:
    """The output and the stream's text against the reference's (§4.5), and against each other."""
    if h.exp.output is None or h.ref is None:
        return
    streamed = h.streamed
    for where, got in (("output", h.outcome.output), ("stream", streamed)):
        if got is None:
            t.skipped.append(where)
        else:
            t.checked(compare_text(h.ref, got, where))
    t.fails += compare_stream(h.outcome.output, streamed)


def _judge_split(h: _Here, t: _Tally) -> None:
    """Where the case expects deltas: the chunks' boundaries against the reference's (§4.6)."""
    if h.outcome.chunks is not None and h.ref is not None and any(c.kinds == {"response.delta"} for c in h.exp.events):
        split, missed = compare_split(h.ref, h.outcome.chunks, _selected_by_chunk(h.outcome))
        t.fails += split
        t.skipped += missed


def _judge_reason(h: _Here, t: _Tally) -> None:
    """The finish reason against the expected one (§4.10)."""
    t.compare("finish_reason", h.exp.finish_reason, h.outcome.finish_reason,
              lambda want, got: _reason_findings(h.ref, want, got))


def _judge_state(h: _Here, t: _Tally) -> None:
    """The lifecycle state the run ended in against the expected one (§4.3)."""
    t.compare("state", h.exp.state, h.outcome.state, lambda want, got: [] if got == want else [
        finding("wrong_state", f"the run ended {got}; the reference ends it {want}")])


def _judge_error(h: _Here, t: _Tally) -> None:
    """The error a failing case expects, for an adapter that reports errors: a decoding error's
    tail, where the bytes were right, may have gone unsaid (tail_dropped)."""
    exp, error = h.exp.error, h.outcome.error
    if exp is None:
        return
    if "errors" not in h.caps:
        t.skipped.append("error")
        return
    t.ran = True
    if error is None and exp.startswith("decoding_error"):
        if not any(f.family != WIRE for f in t.fails):  # the bytes were right: the bad tail went unsaid
            t.fails.append(finding("tail_dropped", f"the run ended without the {exp!r} the reference "
                                                   "raises: the bytes no continuation completes were dropped"))
    elif not (error or "").startswith(exp):
        t.fails.append(finding("wrong_error", f"expected an error starting {exp!r}, got {error!r}"))


def _judge_no_error(h: _Here, t: _Tally) -> None:
    """An error where the case expects the run to finish (or expects nothing of it) is never a pass."""
    if h.exp.error is not None or not h.outcome.error or h.exp.state not in (None, "FINISHED"):
        return
    if h.ref is None or h.ref.reason is not None:
        t.checked([finding("unexpected_error", f"the engine raised {h.outcome.error!r}; the reference "
                                               "finishes the run")])


def _judge_usage(h: _Here, t: _Tally) -> None:
    """Each usage count the case expects (§4.10)."""
    t.compare("usage", h.exp.usage or None, h.outcome.usage, lambda want, got: [
        finding("usage_mismatch", f"usage.{k} = {got.get(k)!r}, expected {v}") for k, v in want.items() if got.get(k) != v])


def _judge_events(h: _Here, t: _Tally) -> None:
    """The trace events the case expects; a case that expects only deltas is judged by their split
    where the engine shows chunks and no trace."""
    if not h.exp.events:
        return
    if h.outcome.events is not None:
        t.checked(_check_events(h.case, h.outcome.events))
    elif not (all(c.kinds == {"response.delta"} for c in h.exp.events) and h.outcome.chunks is not None):
        t.skipped.append("events")


def _judge_trace(h: _Here, t: _Tally) -> None:
    """A script case's full trace: every named invariant (properties/monitors.py)."""
    if h.outcome.full_trace and h.outcome.events is not None and h.case.kind is CaseKind.SCRIPT:
        t.fails += _trace_findings(h.case, h.outcome.events)


# What _judge_here judges of an in-process Outcome, in this order (a dropped tail is said only
# where the text was right, so the error follows the text).
_DIMENSIONS: tuple[Callable[[_Here, _Tally], None], ...] = (
    _judge_text, _judge_split, _judge_reason, _judge_state, _judge_error, _judge_no_error, _judge_usage,
    _judge_events, _judge_trace,
)


def _selected_by_chunk(outcome: Outcome) -> tuple[int, ...] | None:
    """For each streamed chunk, the tokens selected before it went out, from a full trace (the
    order of token.selected and response.delta); None for an engine that shows no such trace."""
    if not outcome.full_trace or outcome.events is None:
        return None
    out, n = [], 0
    for e in outcome.events:
        if e.kind == "token.selected":
            n += 1
        elif e.kind == "response.delta":
            out.append(n)
    return tuple(out)


def _expected(case: Case, exp: Any) -> Expected:
    """The symptoms' view of what the case expects: the reference on the case's own tokenizer,
    with the adapter's (or the case's) expected output and reason."""
    tok = case_tokenizer(case)
    prompt, script = case_prompt(case, tok), case_script(case, tok)
    ref = expected_of(case, tok, prompt, script, reference_on(case, tok, prompt, script))
    reason = exp.finish_reason if exp.finish_reason is not None else ref.reason
    wire = OPENAI_FINISH.get(FinishReason(reason)) if reason in _REASON_VALUES else None
    return attrs.evolve(ref, output=exp.output if exp.output is not None else ref.output, reason=reason,
                        wire_reason=wire)


def _reason_findings(ref: Expected | None, want: str, got: str) -> list[Finding]:
    """An in-process engine's finish reason (the reference's own names) against the expected one."""
    if got == want:
        return []
    if ref is not None and got in _REASON_VALUES and ref.wire_reason is not None:
        wire_got = OPENAI_FINISH.get(FinishReason(got))
        found = compare_reason(ref, wire_got, "finish reason", count=None)
        if found:
            return found
        return [finding("precedence", f"finish reason {got!r} where the reference reports {want!r} on the same "
                                      "token (D4: EOS > content policy > stop > length)")]
    return [finding("wrong_state", f"finish reason {got!r} != expected {want!r}")]


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
    except RunRaised as exc:  # the engine, the adapter or the judge broke: never a pass; what it exchanged is kept
        return CaseResult(case, adapter.name, Verdict.ERROR, reason=str(exc), seconds=time.perf_counter() - t0,
                          observed={"exchanges": list(exc.exchanges), "server": exc.server})
    except Exception as exc:
        return CaseResult(case, adapter.name, Verdict.ERROR, reason=raised(exc), seconds=time.perf_counter() - t0)
    if outcome.skip:
        return CaseResult(case, adapter.name, Verdict.SKIP, reason=outcome.skip, seconds=time.perf_counter() - t0)
    if outcome.abort:  # never a FAIL of the case: nothing of it could be judged (D27)
        return CaseResult(case, adapter.name, Verdict.ERROR, reason=outcome.abort, seconds=time.perf_counter() - t0,
                          observed={"exchanges": list(outcome.exchanges), "server": outcome.server,
                                    "reference": dict(outcome.reference) if outcome.reference else None})
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

    Every ERROR (the run could not judge) and every MUST case that FAILs or DIFFERS (its profile
    decides which findings weigh: `grade`), unless its id is listed as a known failure; with
    `strict` also SHOULD ones and any stream-shape or wire finding. A listed case that now passes
    is reported by `fixed`.
    """
    return [r for r in results if r.case.id not in expected_failures
            and (r.verdict is Verdict.ERROR
                 or r.verdict in (Verdict.FAIL, Verdict.DIFFERS) and (strict or r.case.grade is Grade.MUST)
                 or strict and bool(r.wire or r.shape))]


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
