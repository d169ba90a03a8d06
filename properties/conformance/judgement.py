"""One judgement for every engine that answers a script case: HTTP servers and Python APIs alike.

An engine's answer to one script case is an `Observed`: the non-streamed text, finish reason and
token count, and the streamed chunks (every one, empty ones included) with their finish reasons.
`judge_observed(expected, observed)` compares each dimension on its own with the reference's
answer on the same checkpoint (`expected_of`) and returns findings by symptom (symptoms.py); what
the engine did not show is returned as not checked. The HTTP runner (http_script.py) builds its
Observed from the raw exchanges; an in-house engine with a Python API builds one from its own
output and gets the same verdict:

    exp = expected_for(case, checkpoint)           # the reference on the checkpoint's tokenizer
    obs = Observed(text=b"...", finish_reason="stop", completion_tokens=3, chunks=(b"a", b"b"),
                   stream_finish_reasons=("stop",))
    findings, not_checked = judge_observed(exp, obs)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ...runtime.openai_schema import OPENAI_FINISH
from ...runtime.result import Result
from .adapters.base import Finding, reference_on
from .cases import Case, CaseError
from .symptoms import (
    GUARD_FIELDS,
    Expected,
    Timeline,
    compare_choices,
    compare_count,
    compare_empty,
    compare_held,
    compare_reason,
    compare_stream,
    compare_text,
    finding,
    merge,
    whole_length,
)
from .wire import Streamed, choices_of, token_count


@attrs.frozen
class Observed:
    """What an engine answered for one script case; None where it does not show that field."""

    text: bytes | None = None  # the non-streamed output
    finish_reason: str | None = None  # the non-streamed finish reason, in the API's words (stop, length)
    completion_tokens: int | None = None
    stream_completion_tokens: int | None = None  # the stream's usage chunk's count (include_usage), when it sends one
    chunks: tuple[bytes, ...] | None = None  # every streamed text before the finish chunk, empty ones too
    # the stream hold-back is judged on (§4.6, D59): this one's chunks with the tokens behind them, or
    # those of the same request streamed again asking for per-token reports (None: `chunks`, nothing shown)
    timeline: Timeline | None = None
    stream_finish_reasons: tuple[str, ...] | None = None
    content_after_finish: tuple[bytes, ...] = ()
    error: str | None = None  # the non-streamed answer was an error (its status and body)
    stream_error: str | None = None  # the stream carried an error (a non-200 answer or an error event)
    reason_shown: bool = True  # False: the engine reports no finish reason at all (transformers generate)
    usage_chunk: bool | None = None  # the stream was asked for its usage (include_usage): whether it sent one


def usage_chunk_missing(st: Streamed) -> bool:
    """Whether a stream asked for its usage (stream_options.include_usage) ended with its terminal
    and sent none. A stream that failed or was cut is not judged here (its terminal's findings)."""
    return st.status == 200 and st.usage is None and bool(st.finish_reasons) and not (st.error or st.error_events)


def no_usage_chunk() -> Finding:
    """§4.10: the usage the request asked the stream for never came: the field had no effect."""
    return finding("usage_chunk", "the request asked for the stream's usage (stream_options.include_usage: true) and "
                                  "the stream ended without it: the field had no effect, and the stream's token count "
                                  "cannot be judged", fields=("stream_options.include_usage",))


def observe(status: int, data: Any, raw: str, st: Streamed, index: int = 0, n: int = 1,
            reported: Streamed | None = None, *, usage_asked: bool = False) -> Observed:
    """An HTTP exchange (the non-streamed answer and the stream; `reported`: the stream sent again
    asking for per-token reports, where it was) as an Observed, for choice `index` of `n` (with
    n > 1 the token count is the choices' total and is judged apart). A chat answer's text is its
    message's content (a chat answer that splits nothing off it, D45). `usage_asked`: the stream's
    request set stream_options.include_usage."""
    choice = next((c for c in choices_of(data) if c.get("index", 0) == index), {})
    text = _choice_text(choice)
    body = text.encode() if status == 200 and isinstance(text, str) else None
    usage = data.get("usage") if isinstance(data, dict) else None
    count = token_count(usage, "completion_tokens")
    return Observed(
        text=body, finish_reason=choice.get("finish_reason") if body is not None else None,
        completion_tokens=count if status == 200 and n == 1 else None,
        error=None if status == 200 else f"{status}: {raw[:300]!r}",
        usage_chunk=not usage_chunk_missing(st) if usage_asked else None,
        **_observed_stream(st.choice(index) if n > 1 else st, _reported(reported, index, n), n),
    )


def _choice_text(choice: dict[str, Any]) -> Any:
    """A completion choice's `text`, or a chat choice's message content (null content: no text)."""
    message = choice.get("message")
    if not isinstance(message, dict):
        return choice.get("text")
    text = message.get("content")
    return "" if text is None else text


def _reported(reported: Streamed | None, index: int, n: int) -> Streamed | None:
    """Choice `index` of the stream sent again for per-token reports, where it was answered."""
    if reported is None or reported.status != 200:
        return None
    return reported.choice(index) if n > 1 else reported


def _observed_stream(st: Streamed, rep: Streamed | None, n: int) -> dict[str, Any]:
    """The Observed fields of one choice's stream: shown when it was answered (status 200), its
    timeline from the stream asking for per-token reports where there is one (D59)."""
    ok = st.status == 200
    timeline = (rep.timeline("the stream asking for per-token reports") if rep is not None else
                st.timeline() if ok else None)
    return {
        "stream_completion_tokens": token_count(st.usage, "completion_tokens") if ok and n == 1 else None,
        "chunks": tuple(t.encode() for t in st.texts) if ok else None,
        "timeline": timeline,
        "stream_finish_reasons": tuple(st.finish_reasons) if ok else None,
        "content_after_finish": tuple(t.encode() for t in st.content_after_finish),
        "stream_error": st.error if st.error else ("event: error" if st.error_events else None),
    }


def returned_choices(status: int, data: Any, st: Streamed) -> frozenset[int] | None:
    """The choice indexes the engine answered, in the non-streamed answer or the stream, whichever
    came back (status 200); None when neither did. An answer of no choice at all is judged as
    choices whose bytes were lost (judge_choices)."""
    shown = [choices_of(data)] if status == 200 else []
    shown += [list(st.choices())] if st.status == 200 else []
    if not shown:
        return None
    # a choice whose index is no integer answers none (its shape is wire.py's finding)
    return frozenset(i for cs in shown for c in cs for i in [c.get("index", 0)] if isinstance(i, int))


def judge_choices(exp: Expected, status: int, data: Any, raw: str, st: Streamed, n: int,
                  reported: Streamed | None = None) -> tuple[list[Finding], list[str]]:
    """The findings and what was not checked for an answer of n > 1 choices (D34): each choice the
    engine answered is judged on its own against the reference (greedy choices of one prompt are
    equal); a choice it answered nowhere is `n` ignored (compare_choices, after the answered
    choices' findings, so a text finding on the chapter leads it), not its bytes lost; the token
    count is the answered choices' total."""
    returned = returned_choices(status, data, st)
    answered = sorted(returned) if returned else list(range(n))
    k = len(answered)
    found: list[Finding] = []
    not_checked: list[str] = []
    for i in answered:
        f, missed = judge_observed(exp, observe(status, data, raw, st, i, n, reported))
        found += [attrs.evolve(x, message=f"choice {i}: {x.message}") for x in f]
        not_checked += [m for m in missed if m not in not_checked and not m.startswith("usage")]
    found += compare_choices(n, returned) if returned else []  # after the answered choices' own: they lead a tie
    usage = data.get("usage") if isinstance(data, dict) else None
    total = token_count(usage, "completion_tokens") if status == 200 else None
    one = {exp.selected, exp.selected - 1} if exp.reason == "eos" else {exp.selected}  # D15: the EOS or not
    if total is None:
        not_checked.append("usage.completion_tokens (not reported)")
    elif exp.reason is not None and total in one and total not in {k * c for c in one}:
        found.append(finding("count_low", f"usage.completion_tokens is {total}, one choice's count, for {k} "
                                          f"choices of {exp.selected} tokens each ({k * exp.selected} in all, D34)"))
    elif total % k:
        found.append(finding("usage_mismatch", f"usage.completion_tokens is {total} for {k} equal choices"))
    else:
        found += [attrs.evolve(x, message=f"per choice: {x.message}") for x in compare_count(exp, total // k)]
    return merge(found), not_checked


def expected_of(case: Case, tok: Any, prompt: Sequence[int], script: Sequence[int], res: Result) -> Expected:
    """The reference's Result on (tok, prompt, script) as an Expected (§4.3, §4.6, §4.10)."""
    eos_ids = set(getattr(tok, "eos_ids", ()) or ()) | ({tok.eos_id} if tok.eos_id is not None else set())
    eos_at = next((i + 1 for i, t in enumerate(script) if t in eos_ids), None)
    body = list(script[: eos_at - 1] if eos_at else script)
    head = tok.decode_bytes(list(prompt))
    finished = res.state.name == "FINISHED"
    stops = tuple(s.encode() for s in case.inputs.get("stop", ()))
    request = case.inputs.get("request", {})
    echo_len = len(head) if request.get("echo") else 0
    keep = any(request.get(k) for k in ("include_stop_str_in_output", "no_stop_trim"))
    return Expected(
        output=res.output, reason=res.finish_reason.value if finished else None,
        wire_reason=OPENAI_FINISH.get(res.finish_reason) if finished else None,
        selected=res.usage.selected_tokens, max_tokens=case.max_tokens,
        script_text=_script_text(tok, prompt, body, head), stops=stops,
        stop=res.stop.encode() if isinstance(res.stop, str) and res.stop.encode() in stops else None,
        eos_at=eos_at, eos_text=tok.token_bytes(script[eos_at - 1]) if eos_at else b"", error=res.error,
        state=res.state.name, released=_released(res),
        spelled=_spelled(tok, prompt, list(res.tokens), head, echo_len) if stops else (),
        kept=bool(res.stop) and keep, keep_asked=keep,
        stop_id_text=_stop_id_text(tok, prompt, res, head) if finished and res.stop and not isinstance(res.stop, str) else b"",
        special_texts=tuple(dict.fromkeys(tok.token_bytes(t) for t in res.tokens
                                          if t in getattr(tok, "special_ids", ()) and t not in eos_ids)),
        echo_len=echo_len, guarded=any(request.get(k) for k in GUARD_FIELDS),
        without=_without_each(case, tok, prompt, script) if finished else ())


def _stop_id_text(tok: Any, prompt: Sequence[int], res: Result, head: bytes) -> bytes:
    """What the stop token ids that ended `res` spell: the selected tokens' text past the output (§4.6, D24, D33)."""
    spelled = _script_text(tok, prompt, list(res.tokens), head)
    return spelled[len(res.output):] if spelled.startswith(res.output) else b""


def _script_text(tok: Any, prompt: Sequence[int], body: list[int], head: bytes) -> bytes:
    """The script's text tokens decoded after the prompt (alone where the prompt's bytes change)."""
    full = tok.decode_bytes(list(prompt) + body)
    return full[len(head):] if full.startswith(head) else tok.decode_bytes(body)


def _released(res: Result) -> tuple[int, ...]:
    """After each selected text token (EOS is not text), the bytes the reference had sent (§4.6)."""
    released: list[int] = []
    sent = 0
    for e in res.events:
        if e.kind == "token.selected" and not e.data.get("eos"):
            released.append(sent)
        elif e.kind == "response.delta":
            sent += len(bytes(e.data.get("bytes", b"")))
            if released:
                released[-1] = sent
    return tuple(released)


def _spelled(tok: Any, prompt: Sequence[int], selected: list[int], head: bytes, echo_len: int) -> tuple[int, ...]:
    """After each of the reference's first k selected tokens, the whole characters they spell (with
    the echoed prompt), where a stop string can be matched (§4.4). The tokens it selected, not the
    script's: a guard that passes over the script's EOS (min_tokens, ignore_eos, D31) selects on
    past it, and a stream reports those selections too (D59)."""
    return tuple(echo_len + whole_length(tok.decode_bytes(list(prompt) + selected[:k])[len(head):])
                 for k in range(1, len(selected) + 1))


def _without_each(case: Case, tok: Any, prompt: Sequence[int], script: Sequence[int]) -> tuple[tuple[str, bytes], ...]:
    """(field, output) for each field of the case's request: what the reference sends without that
    one field (D66: an engine whose answer is that one ignored the field). A request that is not
    valid without it (min_tokens' partner), or a run that fails there, gives no entry."""
    fields = dict(case.inputs.get("request") or {})
    out = []
    for name in fields:
        less = attrs.evolve(case, inputs={**case.inputs, "request": {k: v for k, v in fields.items() if k != name}})
        try:
            res = reference_on(less, tok, prompt, script)
        except CaseError:
            continue
        if res.state.name == "FINISHED":
            out.append((name, res.output))
    return tuple(out)


def stream_text(exp: Expected, chunks: Sequence[bytes], late: Sequence[bytes] = (),
                where: str = "stream") -> tuple[list[Finding], bytes]:
    """Where a stream's bytes went, when not into its text in order (D65): text sent after its
    finish chunk (`late`, §4.7), a delta sent twice in a row (§4.5). Returns those findings and
    the text to judge against the reference's: with the late bytes, or without the repeat, where
    that alone is what is wrong with it."""
    found, text = [], b"".join(chunks)
    if late:
        found.append(finding("content_after_finish", f"the {where} sent {b''.join(late)!r} after its finish chunk "
                                                     f"({list(late)}), where no delta may follow the terminal event"))
        if not compare_text(exp, text + b"".join(late), where):
            text += b"".join(late)
    again = next((i for i in range(len(chunks) - 1) if chunks[i] and chunks[i] == chunks[i + 1]
                  and not _script_goes_on(exp, b"".join(chunks[:i + 2]))
                  and not compare_text(exp, b"".join(chunks[:i + 1]) + b"".join(chunks[i + 2:]), where)), None)
    if again is not None:
        found.append(finding("bytes_repeated", f"the {where} sends delta {again + 1} {chunks[again]!r} again as delta "
                                               f"{again + 2}, the same bytes twice; without the repeat it is the "
                                               f"reference's text {exp.output!r}"))
        text = b"".join(chunks[:again + 1]) + b"".join(chunks[again + 2:])
    return found, text


def _script_goes_on(exp: Expected, text: bytes) -> bool:
    """Whether `text` (past the echoed prompt) begins the script's own text: a delta equal to the one
    before it is then the script's next piece (a character the script spells twice), not a repeat."""
    echo = exp.output[:exp.echo_len]
    return text.startswith(echo) and exp.script_text.startswith(text[len(echo):])


def expected_for(case: Case, checkpoint: Any) -> Expected:
    """The Expected of `case` on a forced checkpoint (checkpoints.Checkpoint)."""
    prog = checkpoint.programs[case.id]
    tok = checkpoint.tokenizer
    return expected_of(case, tok, prog.prompt, prog.script, reference_on(case, tok, prog.prompt, prog.script))


def judge_observed(exp: Expected, obs: Observed, *, delta_split: bool = True) -> tuple[list[Finding], list[str]]:
    """Findings by symptom (merged), and what `obs` did not let us check.

    Each dimension is judged alone: the non-streamed text, the stream's text, the two against each
    other, the finish reasons, the token count, the stream's delta boundaries (`delta_split`)."""
    failing = exp.reason is None
    f = [] if failing else _refusals(exp, obs)
    n = obs.completion_tokens
    if n is not None and n > exp.max_tokens:  # tokens past the limit explain any extra text: they lead
        f += compare_count(exp, n)
    told = _early_end(exp, obs)
    f += told
    early = bool(told)  # an early end the reason does not explain: the bytes say what went wrong
    placed, streamed = stream_text(exp, obs.chunks, obs.content_after_finish) if obs.chunks is not None else ([], None)
    f[:0] = placed  # where the stream's bytes went leads (D65)
    texts, not_checked = _judge_texts(exp, obs, streamed, early)
    f += texts
    if not early:  # a non-streamed answer that ended early is no yardstick: a stream unlike it was judged alone
        f += compare_stream(obs.text, streamed)
    if failing:
        f += [] if early else _tail_dropped(exp, obs, f)
    else:
        for judged, missed in (_judge_reasons(exp, obs, streamed, early), _judge_counts(exp, obs, early)):
            f += judged
            not_checked += missed
    if obs.usage_chunk is False:  # a stream that ended with its terminal, wherever the reference ends (D71)
        f.append(no_usage_chunk())
    if obs.chunks is not None and delta_split:
        f += compare_empty(obs.chunks)
        held, missed = compare_held(exp, obs.timeline or Timeline(obs.chunks))
        f += held
        not_checked += missed
    return merge(f), not_checked


def _refusals(exp: Expected, obs: Observed) -> list[Finding]:
    """An error answer, or an error in the stream, where the reference finishes the run."""
    f = []
    if obs.error is not None:
        f.append(finding("refused", f"the non-streamed request was answered {obs.error}; the reference finishes it "
                                    f"({exp.reason}) with {exp.output!r}"))
    if obs.stream_error is not None:
        f.append(finding("error_in_stream", f"the stream carried an error ({obs.stream_error}); the reference "
                                            f"finishes ({exp.reason})"))
    return f


def _early_end(exp: Expected, obs: Observed) -> list[Finding]:
    """The reason a non-streamed answer that ended early gave (fewer tokens, its text a prefix of the
    reference's), where that reason's rule is what it broke rather than the detokenizer: its text is
    the decode of what it selected. An EOS that min_tokens or ignore_eos turns off is guard_ignored
    (D31). None: the bytes say what went wrong."""
    n = obs.completion_tokens
    if obs.text is None or obs.error is not None or not obs.reason_shown:
        return []
    if n is None:  # no count: a text that is the script's whole characters before its EOS shows it ended there
        return _guard_ignored(exp, obs.finish_reason, None,
                              obs.text == exp.script_text[:whole_length(exp.script_text)] != exp.output)
    prefix = n < exp.selected and obs.text != exp.output and exp.output.startswith(obs.text)
    if ignored := _guard_ignored(exp, obs.finish_reason, n, prefix):
        return ignored
    return compare_reason(exp, obs.finish_reason, "non-streamed answer", count=n) if prefix else []


def _guard_ignored(exp: Expected, reason: str | None, n: int | None, prefix: bool) -> list[Finding]:
    """D31: an answer that ends with 'stop' where the reference went on past the script's EOS (or
    failed there, D12), which min_tokens or ignore_eos turns off: it counts the tokens up to that
    EOS (with it or without, D15), or its text is a prefix of the reference's, so whatever its text
    and count lack follows from the EOS. `prefix`: fewer tokens, the text a strict prefix (no count
    `n`: the text is the script's before its EOS)."""
    at = exp.eos_at
    if at is None or not exp.guard_passed or reason != "stop" or (n == exp.selected and exp.wire_reason == "stop"):
        return []
    if n not in (at - 1, at) and not (prefix and (n is None or exp.wire_reason == "stop")):
        return []
    count = f"after {n} token(s)" if n is not None else "with the script's text before its EOS"
    return [finding("guard_ignored", f"the non-streamed answer ends {count} with 'stop': the script's EOS "
                                     f"(token {at}) ended it, which min_tokens or ignore_eos turns off; the reference "
                                     + (f"ends at token {exp.selected} ({exp.reason})" if exp.reason is not None
                                        else f"does not end there and fails the run ({exp.error})"))]


def _judge_texts(exp: Expected, obs: Observed, streamed: bytes | None,
                 early: bool) -> tuple[list[Finding], list[str]]:
    """The non-streamed text and the stream's against the reference's, each alone; a stream past
    the end its whole answer cuts right sent it early."""
    f: list[Finding] = []
    not_checked: list[str] = []
    for where, got in (("non-streamed text", obs.text), ("stream", streamed)):
        if got is None:
            not_checked.append(f"{where} (not shown)")
        elif where == "stream" and _cut_by_error(exp, obs, got):
            not_checked.append("the stream's text past its error event (error_in_stream says why it ends)")
        elif not (early and got == obs.text):
            f += compare_text(exp, got, where, cut_right=where == "stream" and obs.text == exp.output)
    return f, not_checked


def _cut_by_error(exp: Expected, obs: Observed, streamed: bytes) -> bool:
    """A stream that carried an error event where the reference finishes, its text a prefix of the
    reference's: what it lacks follows from the error, which leads (D65's cause first)."""
    return obs.stream_error is not None and exp.reason is not None and exp.output.startswith(streamed)


def _judge_reasons(exp: Expected, obs: Observed, streamed: bytes | None,
                   early: bool) -> tuple[list[Finding], list[str]]:
    """The non-streamed and the streamed finish reasons against the reference's (§4.10): one
    terminal chunk, its reason the reference's."""
    f: list[Finding] = []
    not_checked: list[str] = []
    if not obs.reason_shown:
        not_checked.append("finish_reason (the engine reports none)")
    elif obs.error is None and not early:
        f += compare_reason(exp, obs.finish_reason, "non-streamed answer", count=obs.completion_tokens,
                            text_agrees=obs.text == exp.output)
    reasons = obs.stream_finish_reasons
    if reasons is None:
        not_checked.append("stream finish_reason (not shown)")
    elif obs.stream_error is None:
        if len(reasons) > 1:
            f.append(finding("two_terminals", f"{len(reasons)} chunks carry a finish_reason: {list(reasons)}"))
        if not (early and streamed == obs.text):
            f += compare_reason(exp, reasons[-1] if reasons else None, "stream", count=obs.stream_completion_tokens,
                                text_agrees=streamed == exp.output)
    return f, not_checked


def _judge_counts(exp: Expected, obs: Observed, early: bool) -> tuple[list[Finding], list[str]]:
    """The non-streamed answer's token count and the stream's usage chunk's against the reference's
    (a count past max_tokens was judged first)."""
    f: list[Finding] = []
    not_checked: list[str] = []
    n = obs.completion_tokens
    if n is None:
        not_checked.append("usage.completion_tokens (not reported)")
    elif n <= exp.max_tokens and not early:
        f += compare_count(exp, n)
    if obs.stream_completion_tokens is not None and not early:  # the usage chunk counts the same tokens
        f += [attrs.evolve(x, message=f"stream: {x.message}") for x in compare_count(exp, obs.stream_completion_tokens)]
    return f, not_checked


def _tail_dropped(exp: Expected, obs: Observed, found: list[Finding]) -> list[Finding]:
    """Where the reference fails the run: a server that finished normally with the text before the
    bytes no continuation completes (unless the invalid bytes were already judged)."""
    if obs.text is None or obs.finish_reason not in ("stop", "length") or \
            any(x.symptom in ("invalid_sent", "invalid_dropped") for x in found):
        return []
    return [finding("tail_dropped", f"the server finished with {obs.finish_reason!r} and text {obs.text!r}, "
                                    f"dropping the bytes no continuation completes; the reference sends the same "
                                    f"text and ends the run FAILED there ({exp.error})")]
