"""Judge a script case again from the exchanges a report recorded, offline (§4.3-§4.10).

A failing case of a report.json keeps every request it sent with the raw answer
(`reproducer.exchanges`): the non-streamed answer and the stream at the served max_tokens first
(and, for a case that holds text back for a stop, the stream asking for per-token reports, D59),
then both at each other max_tokens that failed (http_script.sweep). `rejudge(case, exchanges)`
judges those answers again with today's judge, as run_script does live (http_script.judge_exchange
at the served limit, judge_at at the others, a run past its limit first), against the reference on
the case's own tokenizer: a forced checkpoint's ids are the case's (checkpoints.py), so no
checkpoint is needed. An answer that left the forced script, at the served limit or another, is
an ERROR naming where (D27, D66: script_check.left_script, http_script.left_at), and a connection the recording shows sent again is a finding, as live.
The prefix probe was checked when the report was made; the limits the recording left out passed
then and are listed as not checked.

    python -m decodespec.properties.conformance.replay reports/vllm/report.json [--case ID ...]

prints each failing completions script case's verdict and lead then and now.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .adapters.base import Outcome, case_prompt, case_script, case_tokenizer, reference_on
from .adapters.openai import retried_connections
from .alignment import aligned, asks_reports
from .cases import Case, CaseError, CaseKind, load_cases
from .chat_cases import chat_of
from .engine_wide import sent
from .forced import Program
from .http_script import PATH, at_limit, expected_at, judge_at, judge_exchange, left_at, returned
from .reports import read_report
from .runner import CaseResult, Verdict, grade_run, judge
from .script_check import left_script
from .symptoms import run_on_first
from .wire import Streamed, choices_of, parse_sse

Answers = tuple[int, Any, str, Streamed]  # (status, JSON answer or None, raw answer, stream)


@attrs.frozen
class _Script:
    """What the departure check reads of a forced checkpoint (script_check.left_script): the case's
    program, the tokenizer and the EOS id; here the case's own, whose ids the checkpoint's are."""

    programs: Mapping[str, Program]
    tokenizer: Any
    eos_id: int | None


def _answered(exchanges: Sequence[Mapping[str, Any]]) -> Iterator[tuple[dict[str, Any], Mapping[str, Any]]]:
    """Each recorded request to the completions path that has an answer (a try the connection lost
    has none), with its body, in the order sent."""
    for ex in exchanges:
        body = (ex.get("request") or {}).get("body")
        if (ex.get("request") or {}).get("path") == PATH and isinstance(body, dict) and "status" in ex:
            yield body, ex


def answers(exchanges: Sequence[Mapping[str, Any]]) -> dict[int, Answers]:
    """The recorded answers by max_tokens, in the order sent: the first non-streamed answer and the
    first stream at each limit."""
    whole: dict[int, tuple[int, str]] = {}
    streams: dict[int, tuple[int, str]] = {}
    for body, ex in _answered(exchanges):
        k = body.get("max_tokens")
        if body.get("stream") and "sse" in ex:
            streams.setdefault(k, (ex["status"], ex["sse"]))
        elif not body.get("stream") and "response" in ex:
            whole.setdefault(k, (ex["status"], ex["response"]))
    out: dict[int, Answers] = {}
    for k, (status, raw) in whole.items():
        if k in streams:
            try:
                data = json.loads(raw)
            except ValueError:
                data = None
            out[k] = (status, data, raw, parse_sse(streams[k][1], status=streams[k][0]))
    return out


def reported_stream(exchanges: Sequence[Mapping[str, Any]], k: int) -> Streamed | None:
    """The stream at max_tokens `k` sent after the first asking for per-token reports (D59), the
    last of them as live (a server that refused token ids was asked for logprobs alone), or None."""
    streams = [(body, ex) for body, ex in _answered(exchanges)
               if body.get("stream") and "sse" in ex and body.get("max_tokens") == k]
    asked = [ex for body, ex in streams[1:] if asks_reports(body)]
    return parse_sse(asked[-1]["sse"], status=asked[-1]["status"]) if asked else None


def usage_asked(exchanges: Sequence[Mapping[str, Any]], k: int) -> bool:
    """Whether the first stream at max_tokens `k` asked for its usage chunk (include_usage), as the
    live run asks at the served limit."""
    first = next((body for body, ex in _answered(exchanges)
                  if body.get("stream") and "sse" in ex and body.get("max_tokens") == k), {})
    return sent(first, "stream_options.include_usage")


def replayable(case: Case) -> str | None:
    """Why `case`'s recorded exchanges cannot be judged again here, or None."""
    if case.kind is not CaseKind.SCRIPT:
        return "a black-box recipe: its verdict rests on timing and probes a recording does not keep"
    if chat_of(case) is not None:
        return "a chat variant: judged on the chat template's prompt, which needs its checkpoint"
    if aligned(case):
        return "its per-token reports are judged on the served checkpoint's tokenizer"
    return None


def rejudge(case: Case, exchanges: Sequence[Mapping[str, Any]], engine: str = "replay") -> CaseResult:
    """The verdict on `case` from its recorded exchanges (see module); a CaseError where the case
    cannot be replayed or the recording holds no answer both ways."""
    if why := replayable(case):
        raise CaseError(f"{case.id} cannot be judged again from a recording: {why}")
    got = answers(exchanges)
    if not got:
        raise CaseError(f"{case.id}: the recording holds no non-streamed answer and stream at one max_tokens")
    tok = case_tokenizer(case)
    prompt, script = case_prompt(case, tok), case_script(case, tok)
    (served, first), *rest = got.items()
    exp = expected_at(case, served, tok, prompt, script)
    if exp is None:
        raise CaseError(f"{case.id}: max_tokens {served} is not a valid request for the case")
    status, data, _, _ = first
    script_of = _Script({case.id: Program(case.id, -1, prompt, script)}, tok, tok.eos_id)
    if status == 200 and (gone := left_script(script_of, at_limit(case, served), exp, reference_on(
            at_limit(case, served), tok, prompt, script).tokens, [returned(c) for c in choices_of(data)])):
        return CaseResult(case, engine, Verdict.ERROR, reason=gone, observed={"exchanges": list(exchanges)})
    findings, not_checked = judge_exchange(at_limit(case, served), exp, *first, reported_stream(exchanges, served),
                                           usage_asked=usage_asked(exchanges, served))
    for k, answer in rest:
        if (exp_k := expected_at(case, k, tok, prompt, script)) is None:
            continue
        if gone := left_at(script_of, case, k, exp_k, answer[0], answer[1]):
            return CaseResult(case, engine, Verdict.ERROR, reason=f"at max_tokens={k}: {gone}",
                              observed={"exchanges": list(exchanges)})
        findings += judge_at(case, k, exp_k, *answer)
    left = sorted(set(range(1, len(script) + 1)) - set(got))
    if left:
        not_checked.append(f"max_tokens {left} (the recording keeps only the limits that failed when it was made)")
    findings = run_on_first(findings) + retried_connections(exchanges)
    outcome = Outcome(findings=tuple(findings), not_checked=tuple(not_checked), judged=True,
                      exchanges=tuple(exchanges), reference=exp.to_json())
    return judge(case, outcome, engine, frozenset())


def _lead(symptom: str | None, message: str | None) -> str:
    return f"{symptom or '-'}: {(message or '')[:140]}" if symptom or message else "-"


def main(argv: Sequence[str] | None = None) -> int:
    """Print, for each failing case of a report that can be replayed, its verdict and lead then and now."""
    parser = argparse.ArgumentParser(prog="python -m decodespec.properties.conformance.replay",
                                     description="Judge a report's failing script cases again from their recorded "
                                                 "exchanges, offline.")
    parser.add_argument("report", type=Path, help="a report.json written by decodespec conform")
    parser.add_argument("--case", action="append", default=[], metavar="ID", help="only this case (repeatable)")
    args = parser.parse_args(argv)
    try:
        report = read_report(args.report)
    except CaseError as exc:
        parser.error(str(exc))
    known = {c.id: c for c in load_cases()}
    if bad := sorted(set(args.case) - {c["id"] for c in report["cases"]}):
        parser.error(f"the report has no case {', '.join(bad)}")
    judged: list[tuple[str, CaseResult]] = []
    for entry in report["cases"]:
        exchanges = (entry.get("reproducer") or {}).get("exchanges")
        if (args.case and entry["id"] not in args.case) or not exchanges or entry["id"] not in known:
            continue
        first = (entry.get("failures") or [{}])[0]
        was = f"{entry['id']}: {entry['verdict']} ({_lead(first.get('symptom'), first.get('message') or entry.get('reason'))})"
        try:
            judged.append((was, rejudge(known[entry["id"]], exchanges)))
        except CaseError as exc:
            print(f"{was}; not judged again: {exc}")
    # the replayed cases graded as one run: a field ignored in all of them is one cause (D71)
    for (was, _), now in zip(judged, grade_run([r for _, r in judged]), strict=True):
        lead = now.lead
        print(f"{was}\n  now {now.verdict.value} ({_lead(lead.symptom, lead.message) if lead else _lead(None, now.reason)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
