"""The chat answer's channels: content, reasoning_content and tool calls, split by spec/channels.toml
(§4.7; DECISIONS D45-D47).

`Splitter.push(text)` takes the text the stream released (after the stop matcher, §4.6: stop
strings see the whole output, reasoning included, D46) and returns the `Part`s that go out now;
`Splitter.finish(closed_by_token)` flushes at the end of the run. The table decides, per state,
which tags exist (the events it allows): the scanner looks only for those, so a `</think>` in
plain content is text. The longest suffix that is a proper prefix of an allowed tag is held back
until the next push settles it, so a tag split across tokens (`<th` + `ink>`) is recognised whole
and never leaks into either channel; at the end the held suffix goes out as text of the current
state. A tool call is held whole from its opening tag to its close and goes out as one part (D47):
no client ever sees half a call reported. The lifecycle's `tool_call` token check (the request's
`</tool_call>` token ends the run, D47) closes the open call from the finish: `finish(True)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from ..machine.actions import Executor, fire_with_effects
from ..machine.compiled import compiled
from ..spec import load_spec

THINK = ("<think>", "</think>")
CALL = ("<tool_call>", "</tool_call>")
# The tag of each tag event (call_close and call_bad share one: the call's JSON decides which).
TAG_EVENTS = {"think_open": THINK[0], "think_close": THINK[1], "call_open": CALL[0], "call_close": CALL[1]}
REASONING_EVENTS = frozenset({"think_open", "think_close"})
CALL_EVENTS = frozenset({"call_open", "call_close"})


@attrs.frozen
class ToolCall:
    """One complete call, in the OpenAI shape's terms: `arguments` is the JSON text of its arguments."""

    index: int
    name: str
    arguments: str

    def to_json(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class Part:
    """One piece of the answer: `channel` is content, reasoning or tool_call (then `call` is set)."""

    channel: str
    text: str = ""
    call: ToolCall | None = None


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a Hermes call body `{"name": ..., "arguments": {...}}`, or None when
    it is not a JSON object with a string name (then the call is content, D47)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class Splitter:
    """One answer's split (see module): `reasoning` turns the think tags on, `tools` the call tags."""

    def __init__(self, *, reasoning: bool, tools: bool) -> None:
        self._st = compiled("channels").new()
        self._on = (REASONING_EVENTS if reasoning else frozenset()) | (CALL_EVENTS if tools else frozenset())
        self._held = ""
        self.call = ""  # the open call's text, its opening tag included
        self.calls: list[ToolCall] = []
        self.out: list[Part] = []

    @property
    def state(self) -> str:
        return self._st.state.value

    def _tags(self) -> dict[str, str]:
        """The tags this state allows (the table's rows), event -> text."""
        return {e: t for e, t in TAG_EVENTS.items() if e in self._on and self._st.allows(e)}

    def _fire(self, event: str, piece: str) -> None:
        fire_with_effects(self._st, _PLANS, event, self, piece)

    def push(self, text: str) -> list[Part]:
        """The parts `text` lets out now (a suffix that may begin a tag stays held)."""
        self.out = []
        held = self._held + text
        while True:
            tags = self._tags()
            hits = [(held.find(t), e, t) for e, t in tags.items() if t in held]
            if not hits:
                keep = max((k for t in tags.values() for k in range(len(t) - 1, 0, -1) if held.endswith(t[:k])),
                           default=0)
                if len(held) > keep:
                    self._fire("text", held[:len(held) - keep])
                self._held = held[len(held) - keep:]
                return self.out
            at, event, tag = min(hits)
            if at:
                self._fire("text", held[:at])
            self._fire(self._classify(event), tag)
            held = held[at + len(tag):]

    def _classify(self, event: str) -> str:
        if event == "call_close" and parse_call(self.call[len(CALL[0]):]) is None:
            return "call_bad"
        return event

    def finish(self, closed_by_token: bool = False) -> list[Part]:
        """The end of the output (§4.3): the held suffix as text, the call closed by the lifecycle's
        tool_call token when `closed_by_token`, then `end`."""
        self.out = []
        if self._held:
            self._fire("text", self._held)
            self._held = ""
        if closed_by_token and self._st.allows("call_close"):
            self._fire(self._classify("call_close"), "")
        self._fire("end", "")
        return self.out

    @property
    def called(self) -> bool:
        """The answer ended holding complete calls (the ENDED_CALLS terminal)."""
        return self.state == "ENDED_CALLS"


def tool_close_token(tokenizer: Any, vocab_size: int) -> int | None:
    """The id whose bytes are `</tool_call>` (the lifecycle's tool_call token, D47), or None."""
    want = CALL[1].encode()
    for i in range(vocab_size):
        try:
            if tokenizer.token_bytes(i) == want:
                return i
        except Exception:  # an id the tokenizer cannot spell (a padded vocabulary) is no tag
            continue
    return None


def wire_finish(reason: str, splitter: Splitter | None) -> str:
    """The chat finish_reason: "tool_calls" when the answer holds complete calls and the model ended
    it (its wire reason is stop or tool_calls); a budget that ran out stays "length" (D47). A
    tool_call token outside any call ended a turn with no call: "stop"."""
    if splitter is not None and splitter.called and reason in ("stop", "tool_calls"):
        return "tool_calls"
    return "stop" if reason == "tool_calls" else reason


def merged(parts: list[Part]) -> Mapping[str, Any]:
    """The parts of one delta as (content, reasoning, calls): text joined per channel."""
    return {"content": "".join(p.text for p in parts if p.channel == "content"),
            "reasoning": "".join(p.text for p in parts if p.channel == "reasoning"),
            "calls": [p.call for p in parts if p.call is not None]}


CHANNELS = Executor("channels", "the runtime (channels.Splitter)")


@CHANNELS.effect("to_content")
def _to_content(s: Splitter, piece: str) -> None:
    if piece:
        s.out.append(Part("content", piece))


@CHANNELS.effect("to_reasoning")
def _to_reasoning(s: Splitter, piece: str) -> None:
    if piece:
        s.out.append(Part("reasoning", piece))


@CHANNELS.effect("swallow_tag")
def _swallow(s: Splitter, piece: str) -> None:
    return None


@CHANNELS.effect("begin_call")
def _begin_call(s: Splitter, piece: str) -> None:
    s.call = piece


@CHANNELS.effect("to_call")
def _to_call(s: Splitter, piece: str) -> None:
    s.call += piece


@CHANNELS.effect("call_out")
def _call_out(s: Splitter, piece: str) -> None:
    parsed = parse_call(s.call[len(CALL[0]):])
    if parsed is None:  # _classify fires call_bad for such a body; a table edit may not
        raise ValueError(f"channels: report_call on a body that is not a call: {s.call!r}")
    call = ToolCall(len(s.calls), *parsed)
    s.calls.append(call)
    s.out.append(Part("tool_call", call=call))
    s.call = ""


@CHANNELS.effect("call_to_content")
def _call_to_content(s: Splitter, piece: str) -> None:
    if s.call + piece:
        s.out.append(Part("content", s.call + piece))
    s.call = ""


@CHANNELS.effect("close_output")
def _close(s: Splitter, piece: str) -> None:
    return None


_PLANS = CHANNELS.plans(load_spec("channels"))
