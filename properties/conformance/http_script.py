"""Script cases over HTTP on a forced checkpoint: the request, the reference answer, the verdict.

The request is what any OpenAI-compatible server accepts on /v1/completions: the program's prompt
ids (marker first), `max_tokens`, greedy `temperature: 0`, the case's `stop` strings, where the
case has single-id stop sequences vLLM's `stop_token_ids`, and the case's `inputs.request` fields
as they are (OpenAI names). It is sent twice, non-streamed and streamed. A case whose stream must
hold text back for a stop (§4.6) or whose reports are aligned (D59) streams it once more asking for
per-token reports (alignment.stream_for_reports: `logprobs: 1`, vLLM's `return_token_ids`), where
the plain stream showed none: hold-back is judged from when that stream's chunks went out. The
expectation is the reference loop's answer on the same checkpoint and script
(judgement.expected_of), and the answer is judged dimension by dimension
(judgement.judge_observed), the stream's framing by the wire conventions (wire.py). Then the case
is run again at every other max_tokens up to its script's length (`sweep`), each limit judged
against the reference at that limit. What the wire cannot show (the trace, the state name) is
listed as not checked, so such a pass is partial; conventions that legitimately differ (whether
completion_tokens counts the EOS that ended the run) are accepted both ways.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

from .adapters.base import Finding, Outcome, reference_on
from .alignment import aligned, run_alignment, stream_for_reports
from .cases import Case, CaseError
from .chat import run_chat
from .chat_cases import chat_of
from .checkpoints import on_checkpoint
from .judgement import expected_of, judge_choices, judge_observed, no_usage_chunk, observe, usage_chunk_missing
from .script_check import Prefix, Returned, detect_prefix, left_script, prompt_placed
from .script_server import ProbedServer, ScriptServer, Swept, case_fields, not_observable, program_body, sweep_limits
from .symptoms import WIRE, Expected, finding, merge, run_on_first
from .wire import (
    Streamed,
    body_findings,
    choices_of,
    first_choice,
    logprob_pieces,
    token_count,
    token_ids,
    wire_findings,
)

PATH = "/v1/completions"


def request_body(a: ScriptServer, case: Case, **over: Any) -> dict[str, Any]:
    prog = a.checkpoint.programs[case.id]
    return {**program_body(a, prog, on_checkpoint(case, a.checkpoint).max_tokens), **case_fields(case), **over}


def expected(a: ScriptServer, case: Case) -> Expected:
    """The reference's answer to `case` on the served checkpoint."""
    prog = a.checkpoint.programs[case.id]
    return expected_of(on_checkpoint(case, a.checkpoint), a.checkpoint.tokenizer, prog.prompt, prog.script,
                       a.reference(case))


def judge_exchange(case: Case, exp: Expected, status: int, data: Any, raw: str, st: Streamed,
                   reported: Streamed | None = None, *, usage_asked: bool = False) -> tuple[list[Finding], list[str]]:
    """Findings (semantics, then wire) and what was not checked, for one case's two answers (and
    `reported`, the stream sent again asking for per-token reports, where it was; `usage_asked`:
    the stream's request set stream_options.include_usage).

    With n > 1 (D34) each choice is judged on its own (judgement.judge_choices)."""
    n = int(case.inputs.get("request", {}).get("n", 1))
    if n == 1:
        found, not_checked = judge_observed(exp, observe(status, data, raw, st, reported=reported,
                                                         usage_asked=usage_asked))
    else:
        found, not_checked = judge_choices(exp, status, data, raw, st, n, reported)
        if usage_asked and usage_chunk_missing(st):
            found.append(no_usage_chunk())
    return merge(found) + wire_findings(st) + body_findings(status, data, raw), not_checked + not_observable(case)


def at_limit(case: Case, k: int) -> Case:
    """`case` with max_tokens k (one limit of the sweep)."""
    return attrs.evolve(case, inputs={**case.inputs, "max_tokens": k})


def expected_at(case: Case, k: int, tok: Any, prompt: list[int], script: list[int]) -> Expected | None:
    """The reference's answer to `case` at max_tokens k on (tok, prompt, script); None where the
    request is not valid at that limit (min_tokens above it): nothing to compare."""
    try:
        return expected_of(at_limit(case, k), tok, prompt, script, reference_on(at_limit(case, k), tok, prompt, script))
    except CaseError:
        return None


def judge_at(case: Case, k: int, exp: Expected, status: int, data: Any, raw: str, st: Streamed) -> list[Finding]:
    """The chapter-4 findings of the answers at max_tokens k, each saying the limit (wire ones are the
    served limit's to report)."""
    return [attrs.evolve(f, message=f"at max_tokens={k}: {f.message}")
            for f in judge_exchange(at_limit(case, k), exp, status, data, raw, st)[0] if f.family != WIRE]


# Where an answer says how many of its prompt's tokens came from the engine's prompt cache: llama.cpp's
# `timings`, the OpenAI API's usage details (vLLM's with prefix caching).
PROMPT_CACHE_FIELDS: tuple[tuple[str, ...], ...] = (
    ("timings", "cache_n"),
    ("usage", "prompt_tokens_details", "cached_tokens"),
)


def prompt_cached(data: Any) -> int:
    """How many prompt tokens the answer `data` says it took from the engine's prompt cache (0: none
    said): an answer off its script after a cache hit points at the cache, not the model (D27)."""
    for path in PROMPT_CACHE_FIELDS:
        value = data
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def departed(gone: str, data: Any) -> str:
    """D27's message `gone`, with the prompt cache's part where the answer reports one."""
    n = prompt_cached(data)
    return gone if not n else f"{gone}; the engine reports {n} of the prompt's tokens served from its prompt cache"


def left_at(checkpoint: Any, case: Case, k: int, exp: Expected, status: int, data: Any) -> str | None:
    """D27 at max_tokens k: where the non-streamed answer left its forced script
    (script_check.left_script against the reference at that limit), else None."""
    if status != 200 or not isinstance(data, dict):
        return None
    prog = checkpoint.programs[case.id]
    at_k = at_limit(case, k)
    ref = reference_on(at_k, checkpoint.tokenizer, list(prog.prompt), list(prog.script))
    gone = left_script(checkpoint, at_k, exp, ref.tokens, [returned(c) for c in choices_of(data)])
    return departed(gone, data) if gone else None


def sweep(a: ScriptServer, case: Case) -> Swept:
    """§4.3: the case at every other max_tokens (script_server.sweep_limits), each limit judged
    against the reference at that limit (`judge_at`), an answer off its script named (`left_at`)."""
    prog = a.checkpoint.programs[case.id]
    tok = a.checkpoint.tokenizer
    served = on_checkpoint(case, a.checkpoint)

    def at(k: int) -> tuple[Expected, dict[str, Any]] | None:
        exp = expected_at(served, k, tok, list(prog.prompt), list(prog.script))
        return None if exp is None else (exp, request_body(a, case, max_tokens=k))

    return sweep_limits(a, case, served.max_tokens, PATH, at, functools.partial(judge_at, served),
                        functools.partial(left_at, a.checkpoint, served))


def run_script(a: ScriptServer, case: Case) -> Outcome:
    """Send the case both ways and judge the answers against the reference (see module); a chat
    case goes to /v1/chat/completions (chat.run_chat)."""
    if chat_of(case) is not None:
        return run_chat(a, case)
    prog = a.checkpoint.programs[case.id]
    exp = expected(a, case)
    body = request_body(a, case)
    # logprobs on the non-streamed answer only: they show its tokens (D27) and leave the stream as clients see it
    status, data, raw = a.post(PATH, {**body, "stream": False, "logprobs": 1})
    if status == 400 and "stop_token_ids" in body and "stop_token_ids" in raw:
        return Outcome(skip=f"the server refuses the stop_token_ids field: {raw[:200]!r}")
    # n/a where the engine offers no such field; a run the reference fails (invalid UTF-8, D12) is
    # refused for that, not for its fields, and is judged
    if 400 <= status < 500 and case.inputs.get("request") and exp.reason is not None:
        return Outcome(skip=f"the server refuses the request field(s) {sorted(case.inputs['request'])}: {raw[:240]!r}")
    # the usage chunk too: its count is judged as the non-streamed answer's is
    st = a.stream_body(PATH, {**body, "stream": True, "stream_options": {"include_usage": True}})
    usage = data.get("usage") if isinstance(data, dict) else None
    prefix = a.prefix()  # D26: what the engine puts before the prompt, from the probe (None: unknown)
    placed = prompt_placed(token_count(usage, "prompt_tokens"), len(prog.prompt), prefix,
                           as_text=isinstance(body["prompt"], str))
    if placed.changed:
        return Outcome(skip=f"{placed.changed} (the prompt {body['prompt']!r})")
    if status == 200 and isinstance(data, dict) and (gone := left_script(
            a.checkpoint, case, exp, a.reference(case).tokens, [returned(c) for c in choices_of(data)])):
        gone = departed(gone, data)
        if placed.miscounted:  # the count and the tokens both say the engine ran another prompt
            return Outcome(skip=f"{placed.miscounted}; and {gone}", reference=exp.to_json())
        return Outcome(abort=gone, reference=exp.to_json())
    reported = stream_for_reports(a, case, exp, st, body, PATH, chat=False)
    findings, not_checked = judge_exchange(case, exp, status, data, raw, st, reported[0] if reported else None,
                                           usage_asked=True)
    if placed.miscounted:
        findings.append(finding("prompt_count", placed.miscounted))
    if aligned(case):  # D59: the per-token reports of a stream against its chunks' text
        more, na = run_alignment(a, case, body, PATH, chat=False, reported=reported)
        if na:
            return Outcome(skip=na, reference=exp.to_json())
        findings += more
    if a.sweep:
        swept = sweep(a, case)
        if swept.left is not None:  # off its script at another limit: nothing of the case can be judged (D27)
            return Outcome(abort=swept.left, reference=exp.to_json())
        findings = run_on_first(findings + list(swept.findings))
    obs = observe(status, data, raw, st)
    return Outcome(
        output=obs.text, finish_reason=obs.finish_reason, chunks=obs.chunks, findings=tuple(findings),
        not_checked=tuple(not_checked), judged=True, reference=exp.to_json(),
        notes=(f"checkpoint {a.checkpoint.group}; prompt ids {list(prog.prompt)}; script ids {list(prog.script)}",
               *([a.prompt_note] if a.prompt_note else []), prefix.note),
    )


def returned(choice: dict[str, Any]) -> Returned:
    """What one answer's choice reveals of its tokens: its token ids (vLLM's `token_ids`), logprob
    pieces (bytes where given), and its text."""
    text = choice.get("text") if isinstance(choice.get("text"), str) else None
    return Returned(token_ids=token_ids(choice), tokens=logprob_pieces(choice.get("logprobs")) or None, text=text)


def probe_prefix(a: ProbedServer) -> Prefix:
    """What the engine puts before a prompt (D26), from its answer to the checkpoint's prefix probe:
    greedy, one token, read from its token ids, logprobs or text."""
    ck = a.checkpoint
    body = {"model": a.model, "prompt": a.prompt_for(list(ck.probe.prompt)), "max_tokens": 1, "temperature": 0,
            "logprobs": 1}
    status, data, _ = a.post(PATH, body, log=[])
    choice = first_choice(data) if status == 200 else {}
    return detect_prefix(ck.probe, ck.tokenizer, returned(choice) if choice else Returned(text=""))


