"""Script cases over HTTP on a forced checkpoint: the request, the reference answer, the verdict.

The request is what any OpenAI-compatible server accepts on /v1/completions: the program's prompt
ids (marker first), `max_tokens`, greedy `temperature: 0`, the case's `stop` strings and, where
the case has single-id stop sequences, vLLM's `stop_token_ids`. It is sent twice, non-streamed
and streamed. The expectation is the reference loop's Result on the same checkpoint and script,
put in the wire's terms (§4.10 reasons mapped as `decodespec serve` maps them). What the wire
cannot show (the trace, the state name) is not judged here; conventions that legitimately differ
(whether completion_tokens counts the EOS that ended the run) are accepted both ways.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...runtime.openai_schema import OPENAI_FINISH
from ...runtime.result import Result
from ...spec import FinishReason
from .adapters.base import Finding, Outcome
from .cases import Case, Expect

if TYPE_CHECKING:
    from .adapters.openai import OpenAIAdapter

PATH = "/v1/completions"


def request_body(a: OpenAIAdapter, case: Case) -> dict[str, Any]:
    prog = a.checkpoint.programs[case.id]
    body: dict[str, Any] = {"model": a.model, "prompt": a.prompt_for(list(prog.prompt)), "max_tokens": case.max_tokens,
                            "temperature": 0}
    if case.inputs.get("stop"):
        body["stop"] = list(case.inputs["stop"])
    if case.inputs.get("stop_token_ids"):
        body["stop_token_ids"] = [s[0] for s in case.inputs["stop_token_ids"]]
    return body


def reference_view(res: Result) -> dict[str, Any]:
    """The reference's answer, as a report shows it beside the engine's."""
    finished = res.state.name == "FINISHED"
    return {
        "state": res.state.name, "finish_reason": res.finish_reason.value if res.finish_reason else None,
        "wire_finish_reason": OPENAI_FINISH.get(res.finish_reason) if finished else None,
        "output": res.output.decode("utf-8", "backslashreplace"), "error": res.error,
        "usage": res.usage.as_dict(),
    }


def _completion_counts(res: Result) -> set[int]:
    n = res.usage.selected_tokens
    return {n, n - 1} if res.finish_reason is FinishReason.EOS else {n}


def run_script(a: OpenAIAdapter, case: Case) -> Outcome:
    """Send the case both ways and judge the answers against the reference (see module)."""
    from .adapters.openai import ServerError

    prog = a.checkpoint.programs[case.id]
    ref = a.reference(case)
    body = request_body(a, case)
    log: list[dict[str, Any]] = []
    status, data, raw = a.post(PATH, {**body, "stream": False}, log)
    if status == 400 and "stop_token_ids" in body and "stop_token_ids" in raw:
        return Outcome(skip=f"the server refuses the stop_token_ids field: {raw[:200]!r}", exchanges=tuple(log))
    st = a.stream_body(PATH, {**body, "stream": True}, log=log)
    choice = (data.get("choices") or [{}])[0] if isinstance(data, dict) else {}
    usage = data.get("usage") if isinstance(data, dict) else None
    sent = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    as_text = isinstance(body["prompt"], str)
    if sent is not None and sent != len(prog.prompt) or as_text and sent is None and status == 200:
        why = (f"the server made {sent} prompt tokens of the {len(prog.prompt)} ids" if sent is not None else
               "the server reports no usage, so the re-tokenized text prompt cannot be checked")
        return Outcome(skip=f"{why} ({'sent as text: ' + repr(body['prompt']) if as_text else 'sent as ids'}); "
                            "the forced checkpoint steers only the exact prompt", exchanges=tuple(log))
    finished = ref.state.name == "FINISHED"
    got_n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    f: list[Finding] = []
    text = choice.get("text") if status == 200 and isinstance(choice.get("text"), str) else None
    reason = choice.get("finish_reason") if status == 200 else None
    if finished:
        want = OPENAI_FINISH[ref.finish_reason]
        if status != 200:
            raise ServerError(f"the server refused a valid request with {status}: {raw[:300]!r} (the reference "
                              f"finishes it, {ref.finish_reason.value}, with {ref.output!r})")
        if st.error or st.error_events:
            f.append(Finding(case.invariant, f"the stream carried an error ({st.error or 'event: error'}); the reference "
                             f"finishes ({ref.finish_reason.value})"))
        if st.finish_reasons and st.finish_reasons[-1] != want:
            f.append(Finding(case.invariant, f"the stream's finish_reason is {st.finish_reasons[-1]!r}, expected {want!r} "
                             f"({ref.finish_reason.value})"))
        expect = Expect(output=ref.output, finish_reason=want)
        counts = _completion_counts(ref)
        if got_n is not None and got_n not in counts:
            n = ref.usage.selected_tokens
            how = (f"it went on {got_n - n} token(s) past the one that ends the run ({ref.finish_reason.value} at token {n})"
                   if got_n > n else f"the run ends only at token {n} ({ref.finish_reason.value})")
            f.append(Finding("usage_consistent", f"usage.completion_tokens is {got_n}: {how}; accepted counts "
                             f"{sorted(counts)} (with or without the EOS)"))
    else:
        # §4.5 / D12: the run fails with a decoding error; the bytes before it are all it may show.
        if text is not None and reason in ("stop", "length"):
            f.append(Finding(case.invariant, f"the reference fails this run ({ref.error}); the server completed it "
                             f"with finish_reason {reason!r} and text {text!r}"))
        if st.finish_reasons and not (st.error or st.error_events):
            f.append(Finding(case.invariant, f"the reference fails this run ({ref.error}); the stream ended with "
                             f"finish_reason {st.finish_reasons[-1]!r} and no error"))
        streamed = "".join(st.deltas).encode("utf-8")
        if streamed != ref.output:
            f.append(Finding("detok_concat_equals_batch", f"the stream sent {streamed!r}; before the decoding error "
                             f"only {ref.output!r} may be sent"))
        expect = Expect()
        text = None  # an error answer has no output to compare
    if isinstance(got_n, int) and got_n > case.max_tokens:
        f.append(Finding("length_respected", f"usage.completion_tokens is {got_n} with max_tokens {case.max_tokens}: "
                         "the server generated past its limit"))
    if len(st.finish_reasons) > 1:
        f.append(Finding("single_terminal_event", f"{len(st.finish_reasons)} chunks carry a finish_reason: {st.finish_reasons}"))
    if st.content_after_finish:
        f.append(Finding("no_delta_after_terminal", f"content after the finish chunk: {st.content_after_finish}"))
    if st.status == 200 and not st.done and not (st.error or st.error_events):
        f.append(Finding("single_terminal_event", "the stream did not end with data: [DONE]"))
    return Outcome(
        output=text.encode("utf-8") if text is not None else None, finish_reason=reason if finished else None,
        chunks=tuple(d.encode("utf-8") for d in st.deltas), findings=tuple(f), expect=expect,
        exchanges=tuple(log), reference=reference_view(ref),
        notes=(f"checkpoint {a.checkpoint.group}; prompt ids {list(prog.prompt)}; script ids {list(prog.script)}",
               *([a.prompt_note] if a.prompt_note else [])),
    )
