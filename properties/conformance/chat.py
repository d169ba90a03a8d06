"""Script cases on /v1/chat/completions, judged with the same exactness as completions.

A chat case is a script case with `inputs.chat` (`{"template": "chatml" | "bos", "reasoning": bool,
"tools": bool}`): the case files under properties/cases/chat/ (reasoning sections, tool calls), and
every other HTTP-runnable script case as `chat/<id>` (ChatML) and, for the byte-table cases,
`chat-bos/<id>` (a template with a BOS and a generation prompt), made by `chat_variants`. Its
checkpoint carries the template in tokenizer_config.json; the message is the marker, the anchor and
the prompt's text, and the program's prompt is what transformers `apply_chat_template` makes of it,
from the marker on (the position counter does not care what stands before the marker, D26), so
`usage.prompt_tokens` must be the whole templated count the manifest records.

The expectation is the reference loop's answer on the same ids (D15), split by spec/channels.toml
(runtime/channels.py, D45-D47) as `decodespec serve --reasoning-parser think --tool-call-parser
hermes` splits it: content, reasoning_content, complete tool calls and the wire finish reason, in
the non-streamed answer and as the concatenation of the stream's deltas, and no chunk may carry a
tag (a tag split across chunks never leaks).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ...runtime.channels import Splitter, merged, tool_close_token, wire_finish
from ...runtime.openai_schema import OPENAI_FINISH
from ...runtime.result import Result
from .adapters.base import Finding, Outcome, reference_on
from .alignment import aligned, run_alignment, stream_for_reports
from .cases import Case
from .chat_cases import TAGS, TOOLS, chat_of, template_of
from .checkpoints import on_checkpoint
from .judgement import expected_of, judge_observed, no_usage_chunk, observe, usage_chunk_missing
from .script_check import Returned, left_script
from .script_server import ScriptServer, case_fields, not_observable, sweep_limits
from .symptoms import Expected, finding, merge
from .wire import Streamed, body_findings, first_choice, token_count, wire_findings

PATH = "/v1/chat/completions"
@attrs.frozen
class ChatExpected:
    """The reference's chat answer: each channel's text, the calls (name, arguments as JSON), the
    wire finish reason, and what the completions judgement needs (`res`)."""

    content: str
    reasoning: str
    calls: tuple[tuple[str, Any], ...]
    finish_reason: str | None
    selected: int
    by_tool_token: bool

    def to_json(self) -> dict[str, Any]:
        return {"content": self.content, "reasoning_content": self.reasoning,
                "tool_calls": [{"name": n, "arguments": a} for n, a in self.calls], "finish_reason": self.finish_reason,
                "selected_tokens": self.selected}


def chat_reference(case: Case, tok: Any, prompt: Sequence[int], script: Sequence[int],
                   max_tokens: int | None = None) -> Result:
    """The reference on (tok, prompt, script) for a chat case: with tools, a call's close token is a
    finish check (D47)."""
    close = tool_close_token(tok, tok.vocab_size) if (chat_of(case) or {}).get("tools") else None
    at = case if max_tokens is None else attrs.evolve(case, inputs={**case.inputs, "max_tokens": max_tokens})
    return reference_on(at, tok, prompt, script, finish_tokens={"tool_call": [close]} if close is not None else None)


def expected_chat(case: Case, tok: Any, prompt: Sequence[int], script: Sequence[int],
                  max_tokens: int | None = None) -> ChatExpected:
    """The reference on (tok, prompt, script), its deltas split as decodespec serve splits them."""
    return split_reference(case, chat_reference(case, tok, prompt, script, max_tokens))


def split_reference(case: Case, res: Result) -> ChatExpected:
    """The reference's run `res` of a chat case, its deltas split as decodespec serve splits them; a
    run that fails (§4.10) ends without the end's flush: what the splitter still holds (a call not
    closed, a piece of a tag, an unfinished character) was never sent, as a failed completions run's
    held bytes are not."""
    chat = chat_of(case) or {}
    split = Splitter(reasoning=bool(chat.get("reasoning")), tools=bool(chat.get("tools")))
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    parts = [p for e in res.events if e.kind == "response.delta" for p in split.push(utf8.decode(bytes(e.data["bytes"])))]
    finished = res.state.name == "FINISHED"
    by_token = finished and res.finish_reason.value == "tool_calls"
    if finished:
        parts += split.push(utf8.decode(b"", final=True)) + split.finish(by_token)
    got = merged(parts)
    wire = wire_finish(OPENAI_FINISH[res.finish_reason], split) if finished else None
    return ChatExpected(got["content"], got["reasoning"], tuple((c.name, json.loads(c.arguments)) for c in got["calls"]),
                        wire, res.usage.selected_tokens, by_token)


def splits(case: Case) -> bool:
    """Whether the case's answer has channels of its own (reasoning, tool calls) beside its content."""
    chat = chat_of(case) or {}
    return bool(chat.get("reasoning") or chat.get("tools"))


def request_body(a: ScriptServer, case: Case, message: str, max_tokens: int) -> dict[str, Any]:
    chat = chat_of(case) or {}
    body: dict[str, Any] = {"model": a.model, "messages": [{"role": "user", "content": message}],
                            "max_tokens": max_tokens, "temperature": 0}
    if chat.get("tools"):
        body["tools"] = TOOLS
    if not chat.get("reasoning"):  # a server whose parser assumes the model thinks is told it does not
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return {**body, **case_fields(case)}


@attrs.frozen
class ChatObserved:
    """One chat answer's channels: None where the answer does not show them."""

    content: str | None
    reasoning: str | None
    calls: tuple[tuple[str | None, Any], ...] | None  # a call may come without a name
    finish_reason: str | None
    completion_tokens: int | None
    prompt_tokens: int | None
    leaks: tuple[tuple[str, str], ...] = ()  # (field, text) of texts holding a tag or a piece of one: whole, or a chunk
    half_calls: tuple[str, ...] = ()
    odd_arguments: tuple[str, ...] = ()  # calls whose function.arguments came as something else than text


def _calls(raw: Any) -> tuple[tuple[tuple[str | None, Any], ...], tuple[str, ...], tuple[str, ...]]:
    """A message's tool calls as (name, arguments) pairs, the calls whose arguments are not the
    JSON text the API gives (an object is compared as the value it is, and named), and the calls
    whose argument text is not whole JSON (half a call)."""
    out, odd, half = [], [], []
    for i, c in enumerate(raw or []):
        fn = c.get("function") if isinstance(c, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args or "null")
            except ValueError:  # not JSON: kept as the text, compared as such
                half.append(_half(i, fn.get("name"), args))
        elif args is not None:
            odd.append(_not_text(i, fn.get("name"), args))
        out.append((fn.get("name"), args))
    return tuple(out), tuple(odd), tuple(half)


def _not_text(index: int, name: Any, arguments: Any) -> str:
    return f"call {index} ({name}): arguments given as a JSON {type(arguments).__name__}"


def _half(index: int, name: Any, arguments: str) -> str:
    return f"call {index} ({name}): arguments {arguments!r} are not whole JSON"


def _leaks(field: str, text: str) -> list[tuple[str, str]]:
    """(field, text) where `text` holds a tag or a piece of one (think_tags_never_text)."""
    return [(field, text)] if text and any(_has_fragment(text, t) for t in TAGS) else []


def observe_message(status: int, data: Any) -> ChatObserved | None:
    """A non-streamed chat answer's channels, each read where it has the API's type (a field that
    has not is a wire finding, wire.body_findings); None where there is no message to read."""
    choice = first_choice(data) if status == 200 else {}
    msg = choice.get("message")
    if not isinstance(msg, dict):
        return None
    usage = data.get("usage")
    calls, odd, half = _calls(msg.get("tool_calls") if isinstance(msg.get("tool_calls"), list) else None)
    content, reasoning = _text(msg, "content"), _text(msg, "reasoning_content") or _text(msg, "reasoning")
    return ChatObserved(content, reasoning, calls, choice.get("finish_reason"), token_count(usage, "completion_tokens"),
                        token_count(usage, "prompt_tokens"),
                        leaks=tuple(_leaks("content", content) + _leaks("reasoning_content", reasoning)),
                        half_calls=half, odd_arguments=odd)


def observe_stream(st: Streamed) -> ChatObserved | None:
    """The stream's channels: each the concatenation of its deltas, tool-call argument fragments
    joined per call index (OpenAI streams a call's arguments in pieces). A delta's reasoning is its
    `reasoning_content`, else its `reasoning` (as for the message): servers that keep the old name
    beside the new one send the same text under both, once."""
    if st.status != 200:
        return None
    content: list[str] = []
    reasoning: list[str] = []
    leaks: list[tuple[str, str]] = []
    calls: dict[int, list[Any]] = {}
    for choice in st.choices():
        d = choice.get("delta") or {}
        said = _text(d, "reasoning_content")
        for field, text, into in (("content", _text(d, "content"), content),
                                  ("reasoning_content" if said else "reasoning", said or _text(d, "reasoning"), reasoning)):
            if text:
                into.append(text)
                leaks += _leaks(field, text)
        for t in d.get("tool_calls") or []:
            slot = calls.setdefault(int(t.get("index", 0)), [None, "", None])  # name, text pieces, a value
            fn = t.get("function") or {}
            slot[0] = slot[0] or fn.get("name")
            piece = fn.get("arguments")
            if isinstance(piece, str):
                slot[1] += piece
            elif piece is not None:
                slot[2] = piece
    reasons = st.finish_reasons
    parsed, half, odd = [], [], []
    for i in sorted(calls):
        name, args, value = calls[i]
        if value is not None:
            odd.append(_not_text(i, name, value))
            parsed.append((name, value))
            continue
        try:
            parsed.append((name, json.loads(args)))
        except ValueError:
            half.append(_half(i, name, args))
            parsed.append((name, args))
    return ChatObserved("".join(content), "".join(reasoning), tuple(parsed), reasons[-1] if reasons else None,
                        token_count(st.usage, "completion_tokens"), token_count(st.usage, "prompt_tokens"),
                        tuple(leaks), tuple(half), tuple(odd))


def _text(delta: dict[str, Any], field: str) -> str:
    """A delta's text under `field`; "" where it is absent, null or not a string."""
    text = delta.get(field)
    return text if isinstance(text, str) else ""


def _has_fragment(text: str, tag: str) -> bool:
    """Whether `text` holds `tag`, or begins or ends with a piece of it at least 3 characters long
    (a tag split across chunks: `<th`, `ink>`)."""
    if tag in text:
        return True
    return any(text.endswith(tag[:k]) or text.startswith(tag[-k:]) for k in range(3, len(tag)))


# Findings that say where a piece of the output went instead of its channel (into half a call, into a
# call reported before its </tool_call>, out as tag text): a specific rule broken at a known place,
# where a channel's text differing is the catch-all every misplaced piece also trips. They lead the
# case, across every limit of the sweep (D65).
EXPLAINING = ("chat_half_call", "chat_call_unclosed", "chat_tag_leaked")


def leading(findings: list[Finding]) -> list[Finding]:
    """`findings` with the EXPLAINING ones first, in EXPLAINING's order; the rest in theirs."""
    return sorted(findings, key=lambda f: EXPLAINING.index(f.symptom) if f.symptom in EXPLAINING else len(EXPLAINING))


def judge_chat(exp: ChatExpected, obs: ChatObserved | None, where: str, *, content: bool = True) -> list[Finding]:
    """Each channel, the calls and the finish reason of one answer against the reference; with
    `content` False the reasoning, the calls and the tags alone (the content, the finish reason and
    the count judged as a completions answer's: run_chat)."""
    if obs is None:
        return [finding("refused", f"the {where} was not a chat answer; the reference finishes ({exp.finish_reason})")] \
            if exp.finish_reason and content else []
    f = _channel_findings(exp, obs, where, content) + _call_findings(exp, obs, where) + _leak_findings(exp, obs, where)
    return f + _end_findings(exp, obs, where) if content else f


def _channel_findings(exp: ChatExpected, obs: ChatObserved, where: str, content: bool) -> list[Finding]:
    """The content (where judged here) and the reasoning_content against the reference's (D45)."""
    f = []
    if content and obs.content != exp.content:
        f.append(finding("chat_content", f"{where}: content {obs.content!r}, the reference's {exp.content!r}"))
    if obs.reasoning != exp.reasoning:
        f.append(finding("chat_reasoning", f"{where}: reasoning_content {obs.reasoning!r}, the reference's {exp.reasoning!r}"))
    return f


def _call_findings(exp: ChatExpected, obs: ChatObserved, where: str) -> list[Finding]:
    """The tool calls against the reference's, a call cut in half, arguments that are no JSON object (D47)."""
    f = []
    if obs.calls is not None and obs.calls != exp.calls:
        # more calls than the reference, which still holds a call open as content: one reported unclosed (D47)
        unclosed = len(obs.calls) > len(exp.calls) and "<tool_call>" in (exp.content or "")
        f.append(finding("chat_call_unclosed" if unclosed else "chat_tool_calls",
                         f"{where}: tool_calls {list(obs.calls)}, the reference's {list(exp.calls)}"))
    if obs.half_calls:
        f.append(finding("chat_half_call", f"{where}: {'; '.join(obs.half_calls)}"))
    if obs.odd_arguments:
        f.append(finding("call_arguments", f"{where}: {'; '.join(obs.odd_arguments)}"))
    return f


def _leak_findings(exp: ChatExpected, obs: ChatObserved, where: str) -> list[Finding]:
    """Tag text the reference's channel does not hold there (D45: a cut call is content, tags included)."""
    leaked = [f"{field} {text!r}" for field, text in obs.leaks
              if text not in (exp.content if field == "content" else exp.reasoning)]
    return [finding("chat_tag_leaked", f"{where}: {'; '.join(leaked[:4])}")] if leaked else []


def _end_findings(exp: ChatExpected, obs: ChatObserved, where: str) -> list[Finding]:
    """The finish reason and the completion token count against the reference's (§4.10)."""
    f = []
    if exp.finish_reason and obs.finish_reason != exp.finish_reason:
        f.append(finding("chat_finish", f"{where}: finish_reason {obs.finish_reason!r}, the reference's "
                                        f"{exp.finish_reason!r}"))
    n = obs.completion_tokens
    # D15: the EOS (or the tool-call token's following EOS) may be counted or not.
    ok = {exp.selected, exp.selected - 1} if exp.finish_reason == "stop" else {exp.selected}
    if exp.by_tool_token:
        ok = {exp.selected, exp.selected + 1}  # an engine that runs on to the EOS after </tool_call>
    if n is not None and exp.finish_reason and n not in ok:
        f.append(finding("usage_mismatch", f"{where}: completion_tokens {n}, the reference selects {exp.selected}"))
    return f


def judge_answers(exp: ChatExpected, text: Expected | None, answers: tuple[int, Any, str, Streamed],
                  whole: ChatObserved | None, streamed: ChatObserved | None,
                  reported: Streamed | None = None, *, usage_asked: bool = False) -> tuple[list[Finding], list[str]]:
    """Both answers of a chat case (`answers`: the non-streamed status, JSON and text, and the
    stream; `whole`, `streamed`: their channels; `reported`: the stream sent again asking for
    per-token reports, where it was) against the reference: findings, and what they did not let us
    check. A case that splits nothing off its content is a completions answer in a chat envelope:
    judged by the completions rules against `text` (the reference's run as an Expected), its
    channels added. One that splits reasoning or calls off it (`text` None) is judged channel by
    channel. `usage_asked`: the stream's request set stream_options.include_usage."""
    if text is not None:
        findings, missed = judge_observed(text, observe(*answers, reported=reported, usage_asked=usage_asked))
        return (findings + judge_chat(exp, whole, "non-streamed answer", content=False)
                + judge_chat(exp, streamed, "stream", content=False)), missed
    findings = judge_chat(exp, whole, "non-streamed answer") + judge_chat(exp, streamed, "stream")
    if usage_asked and usage_chunk_missing(answers[3]):
        findings.append(no_usage_chunk())
    if whole is not None and streamed is not None and (whole.content, whole.reasoning) != (streamed.content,
                                                                                         streamed.reasoning):
        findings.append(finding("stream_vs_batch", f"stream {streamed.content!r}/{streamed.reasoning!r} against "
                                                   f"non-stream {whole.content!r}/{whole.reasoning!r}"))
    unreported = whole is not None and whole.completion_tokens is None
    return findings, ["usage.completion_tokens (not reported)"] if unreported else []


def run_chat(a: ScriptServer, case: Case) -> Outcome:
    """Send a chat case both ways and judge each channel against the reference (see module)."""
    chat = chat_of(case)
    if chat is None:
        raise ValueError(f"run_chat: case {case.id} has no inputs.chat: it is not a chat case")
    prog = a.checkpoint.programs[case.id]
    info = a.checkpoint.chat.get(case.id)
    if info is None:
        return Outcome(skip=f"the checkpoint {a.checkpoint.group} has no chat template for {case.id}")
    tok = a.checkpoint.tokenizer
    served = on_checkpoint(case, a.checkpoint)  # its context widened as the server's is
    res = chat_reference(served, tok, prog.prompt, prog.script)
    exp = split_reference(served, res)
    body = request_body(a, case, info["message"], served.max_tokens)
    status, data, raw = a.post(PATH, {**body, "stream": False})
    # a 4xx where the reference finishes is the server refusing the fields; where the reference fails
    # the run (an invalid byte, D12) the error is its answer, judged as such
    if 400 <= status < 500 and (case.inputs.get("request") or chat.get("tools")) and res.state.name == "FINISHED":
        return Outcome(skip=f"the server refuses the request's fields: {raw[:240]!r}")
    st = a.stream_body(PATH, {**body, "stream": True, "stream_options": {"include_usage": True}})
    whole, streamed = observe_message(status, data), observe_stream(st)
    if whole is not None and (why := _other_prompt(whole, info)):
        return Outcome(skip=why)
    text = None if splits(case) else expected_of(served, tok, prog.prompt, prog.script, res)
    if text is not None and whole is not None and (gone := _left_script(a, case, text, res, whole)):
        return Outcome(abort=gone, reference=exp.to_json())  # it left the script: nothing to judge (D27, D66)
    reported = stream_for_reports(a, case, text, st, body, PATH, chat=True)
    findings, missed = judge_answers(exp, text, (status, data, raw, st), whole, streamed,
                                     reported[0] if reported else None, usage_asked=True)
    if aligned(case):  # D59: the per-token reports of a stream against its chunks' text
        more, na = run_alignment(a, case, body, PATH, chat=True, reported=reported)
        if na:
            return Outcome(skip=na, reference=exp.to_json())
        findings += more
    if chat.get("sweep"):
        findings += sweep_chat(a, case, info)
    return Outcome(output=_content_bytes(whole), finish_reason=whole.finish_reason if whole else None,
                   findings=tuple(leading(merge(findings)) + wire_findings(st)
                                  + body_findings(status, data, raw)),
                   judged=True, reference=exp.to_json(),
                   not_checked=tuple(missed + not_observable(case)),
                   notes=(f"checkpoint {a.checkpoint.group}; chat template {template_of(case)}; prompt "
                          f"{info['prompt_tokens']} tokens, program ids {list(prog.prompt)}; script ids {list(prog.script)}",))


def _other_prompt(whole: ChatObserved, info: Mapping[str, Any]) -> str | None:
    """Why a chat answer cannot be judged when the server made another prompt of the message than
    the one the forced checkpoint was built for (transformers' apply_chat_template); else None."""
    if whole.prompt_tokens == info["prompt_tokens"]:
        return None
    return (f"the server made {whole.prompt_tokens} prompt tokens of the message; transformers' apply_chat_template "
            f"makes {info['prompt_tokens']}: the forced checkpoint steers only the prompt it was built for")


def _left_script(a: ScriptServer, case: Case, text: Expected, res: Result, whole: ChatObserved) -> str | None:
    """Where the non-streamed content left the forced script (D27), when it has content."""
    if whole.content is None:
        return None
    return left_script(a.checkpoint, case, text, res.tokens, [Returned(text=whole.content)])


def _content_bytes(whole: ChatObserved | None) -> bytes | None:
    return whole.content.encode() if whole is not None and whole.content is not None else None


def sweep_chat(a: ScriptServer, case: Case, info: Mapping[str, Any]) -> list[Finding]:
    """§4.3: the case at every other max_tokens (script_server.sweep_limits: a limit inside the
    reasoning, inside a tag, inside a call), each judged against the reference at that limit."""
    prog = a.checkpoint.programs[case.id]
    served = on_checkpoint(case, a.checkpoint)

    def at(k: int) -> tuple[ChatExpected, dict[str, Any]]:
        return (expected_chat(served, a.checkpoint.tokenizer, prog.prompt, prog.script, max_tokens=k),
                request_body(a, case, info["message"], k))

    def judge(k: int, exp: ChatExpected, status: int, data: Any, raw: str, st: Streamed) -> list[Finding]:
        return judge_chat(exp, observe_message(status, data), f"at max_tokens={k}, non-streamed answer") + \
            judge_chat(exp, observe_stream(st), f"at max_tokens={k}, stream")

    return list(sweep_limits(a, case, served.max_tokens, PATH, at, judge).findings)
