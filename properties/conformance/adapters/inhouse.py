"""An in-house engine (contract.Engine) judged exactly as an OpenAI-compatible server is (§4.3-§4.10, D68).

`InHouseAdapter` is a ScriptServer (script_server.py) whose requests are calls: each request body
the HTTP runner would send becomes a contract.Request, the engine's Answer or Chunks are rendered
as the API renders an answer and its stream (`answer_json`, `chunk_json`; the stream read back by
wire.py's own parser), and http_script.run_script and chat.run_chat judge them with the functions
that judge HTTP engines: the departure check (D27), the sweep (§4.3), channels, n > 1, per-chunk
token alignment and hold-back (D59: `Chunk.selected` shown as decodespec serve's
`decodespec.selected`), and the context-limit cases where the engine says it runs with the context
it was loaded with (`Engine.context_length` read as a server's /props is, D10). What the engine
leaves unshown (None fields, no `stream`) reads as absent from an answer, so the judge lists it as
not checked. Findings of the "wire" family are dropped: the rendering is ours, the engine has no
wire. Every call is recorded (`call`, `request`, what came back).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from .. import contract
from ..cases import Case
from ..chat_cases import chat_of
from ..checkpoints import Checkpoint, digest, group_of, http_blocker, reference_result, served_context
from ..http_script import probe_prefix, run_script
from ..symptoms import WIRE
from ..wire import Streamed, body_ended, feed
from .base import Finding, Outcome, context_unmet

CHAT_PATH = "/v1/chat/completions"
# Body fields that are the transport's, not the request's: the Request says them its own way.
_TRANSPORT = ("model", "stream", "stream_options", "return_token_ids", "top_logprobs")


def _transport(f: Finding) -> bool:
    """Whether `f` rests only on transport fields (a usage chunk asked with stream_options): the
    engine never got them, the rendering is ours."""
    return bool(f.fields) and all(name.split(".")[0] in _TRANSPORT for name in f.fields)


def public_checkpoint(ck: Checkpoint, context: int | None = None) -> contract.Checkpoint:
    """What a factory is given of a forced checkpoint (contract.Checkpoint), to load with the
    context length `context` (None: the engine's own)."""
    return contract.Checkpoint(folder=ck.folder, group=ck.group, eos_token_id=ck.eos_id, context_length=context)


def request_of(body: Mapping[str, Any]) -> contract.Request:
    """The contract.Request of an HTTP request body (see contract.Request for what goes where)."""
    rest = {k: v for k, v in body.items() if k not in _TRANSPORT}
    stop = rest.pop("stop", ())
    return contract.Request(
        max_tokens=rest.pop("max_tokens"), prompt=rest.pop("prompt", ()), messages=rest.pop("messages", ()),
        stop=(stop,) if isinstance(stop, str) else stop, stop_token_ids=rest.pop("stop_token_ids", ()),
        n=rest.pop("n", 1), logprobs=bool(rest.pop("logprobs", False)), fields=rest)


def _tokens_json(tokens: tuple[contract.TokenReport, ...] | None) -> dict[str, Any]:
    """A choice's token reports as the API shows them: `token_ids` where every one has its id,
    `logprobs.content` (bytes, logprob) where every one has its bytes."""
    if tokens is None:
        return {}
    out: dict[str, Any] = {}
    if all(t.id is not None for t in tokens):
        out["token_ids"] = [t.id for t in tokens]
    if all(t.bytes is not None for t in tokens):
        out["logprobs"] = {"content": [{"token": t.bytes.decode("utf-8", "replace"), "bytes": list(t.bytes),
                                        "logprob": t.logprob} for t in tokens if t.bytes is not None]}
    return out


def _calls_json(calls: tuple[contract.ToolCall, ...], *, delta: bool) -> list[dict[str, Any]]:
    out = []
    for c in calls:
        fn = {**({"name": c.name} if c.name is not None else {}), "arguments": c.arguments}
        out.append({"index": c.index, "function": fn} if delta else
                   {"id": f"call_{c.index}", "type": "function", "function": fn})
    return out


def _usage_json(usage: contract.Usage | None) -> dict[str, Any]:
    if usage is None:
        return {}
    counts = {k: v for k, v in (("prompt_tokens", usage.prompt_tokens), ("completion_tokens", usage.completion_tokens))
              if v is not None}
    return {"usage": counts}


def answer_json(answer: contract.Answer, chat: bool) -> dict[str, Any]:
    """A whole Answer as the API's non-streamed answer; a text or channel left None is absent."""
    choices = []
    for c in answer.choices:
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.reasoning is not None:
                message["reasoning_content"] = c.reasoning
            if c.tool_calls:
                message["tool_calls"] = _calls_json(c.tool_calls, delta=False)
            shown: dict[str, Any] = {"message": message}
        else:
            shown = {} if c.text is None else {"text": c.text}
        choices.append({"index": c.index, **shown, "finish_reason": c.finish_reason, **_tokens_json(c.tokens)})
    return {"object": "chat.completion" if chat else "text_completion", "choices": choices, **_usage_json(answer.usage)}


def chunk_json(chunk: contract.Chunk, chat: bool, selected: int | None = None) -> dict[str, Any]:
    """One Chunk as the API's stream chunk: a usage chunk (no choices) when it carries counts alone.
    `selected`: the tokens its choice had selected when it went out (`Chunk.selected` summed), shown
    as decodespec serve shows it (`decodespec.selected`, D59)."""
    if chunk.error is not None:
        return {"error": {"message": chunk.error}}
    alone = not (chunk.text or chunk.reasoning or chunk.tool_calls or chunk.finish_reason or chunk.tokens)
    if chunk.usage is not None and alone:
        return {"choices": [], **_usage_json(chunk.usage)}
    if chat:  # a delta carries content where it has some, or where it carries no other channel
        delta: dict[str, Any] = {}
        if chunk.text or not (chunk.reasoning or chunk.tool_calls):
            delta["content"] = chunk.text
        if chunk.reasoning:
            delta["reasoning_content"] = chunk.reasoning
        if chunk.tool_calls:
            delta["tool_calls"] = _calls_json(chunk.tool_calls, delta=True)
        shown: dict[str, Any] = {"delta": delta}
    else:
        shown = {"text": chunk.text}
    clock = {} if selected is None else {"decodespec": {"selected": selected}}
    return {"object": "chat.completion.chunk" if chat else "text_completion",
            "choices": [{"index": chunk.index, **shown, "finish_reason": chunk.finish_reason,
                         **_tokens_json(chunk.tokens), **clock}], **_usage_json(chunk.usage)}


def _shape(value: Any, kind: type, engine: str, method: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"{engine}.{method} gave a {type(value).__name__}, not a contract.{kind.__name__}")
    return value


def _stream_json(chunks: Iterable[contract.Chunk], chat: bool, engine: str) -> list[dict[str, Any]]:
    """An engine's chunks as the API's stream chunks, each choice's `selected` ids counted as they
    accumulate (chunk_json)."""
    counts: dict[int, int] = {}
    out = []
    for c in chunks:
        _shape(c, contract.Chunk, engine, "stream")
        if c.selected is not None:
            counts[c.index] = counts.get(c.index, 0) + len(c.selected)
        out.append(chunk_json(c, chat, None if c.selected is None else counts[c.index]))
    return out


class ContextLengthError(ValueError):
    """A loaded engine says a context length the contract cannot take: that load failed, an ERROR of
    the cases it was to run (D68), not a wrong --engine value."""


def _context_length(engine: Any, name: str) -> int | None:
    """The context an engine says it runs with (`Engine.context_length`), None where it says none;
    a ContextLengthError naming the engine and the value for anything but a positive int."""
    said = getattr(engine, "context_length", None)
    if said is not None and (isinstance(said, bool) or not isinstance(said, int) or said < 1):
        raise ContextLengthError(f"{name}.context_length is {said!r}; the contract wants a positive int "
                                 "(None: not said)")
    return said


class InHouseAdapter:
    """The script cases compiled into one forced checkpoint, run on an in-house engine (see module)."""

    capabilities: frozenset[str] = frozenset()  # what it runs is said by `unsupported`: the checkpoint's cases

    def __init__(self, engine: Any, checkpoint: Checkpoint, context: int | None = None) -> None:
        self.engine = engine
        self.name = str(getattr(engine, "name", type(engine).__name__))
        cannot = frozenset(getattr(engine, "cannot", frozenset()))
        if unknown := sorted(cannot - set(contract.CANNOT)):
            raise ValueError(f"{self.name}.cannot holds {', '.join(map(repr, unknown))}; the contract knows "
                             f"{', '.join(contract.CANNOT)}")
        self.cannot = cannot if callable(getattr(engine, "stream", None)) else cannot | {"stream"}
        self.checkpoint = checkpoint
        self.context = context  # the context length the factory was asked to load with (Checkpoint.context_length)
        self.context_length = _context_length(engine, self.name)
        self.model = self.name
        self.sweep = "sweep" not in self.cannot
        self.prompt_note = ""
        self._reference: dict[str, Any] = {}
        self._prefix: Any = None
        self._case = threading.local()  # the calls of the case this thread runs (for its reproducer)
        self._about: dict[str, Any] | None = None

    def unsupported(self, case: Case) -> str | None:
        if blocker := http_blocker(case):
            return f"not compiled into a forced checkpoint: {blocker}"
        if case.id not in self.checkpoint.programs:
            return f"compiled into the {group_of(case)} checkpoint; this engine loaded {self.checkpoint.group}"
        if (need := served_context(case, self.checkpoint)) is not None and (why := context_unmet(
                case, need, self.context, self.running_context, who=self.name,
                how="a run over a checkpoint set loads it so: decodespec conform --engine MODULE:FACTORY --checkpoint "
                    "DIR")):
            return why
        if chat_of(case) is not None and "chat" in self.cannot:
            return f"{self.name} declares it cannot take chat requests"
        return None

    def running_context(self) -> tuple[int | None, str]:
        """The context length the engine says it runs with, and where it says it (D10)."""
        return self.context_length, f"{self.name}.context_length"

    def about(self) -> dict[str, Any]:
        """The engine as a reproducer names it: its name, the contract and the checkpoint's hash."""
        if self._about is None:
            self._about = {"engine": self.name, "contract": contract.CONTRACT_VERSION,
                           "checkpoint": {"group": self.checkpoint.group, "sha256": digest(self.checkpoint.folder)}}
        return self._about

    def run(self, case: Case) -> Outcome:
        log: list[dict[str, Any]] = []
        self._case.log = log
        try:
            out = run_script(self, case)
        except contract.Unsupported as exc:
            out = Outcome(skip=f"{self.name} cannot take the request: {exc}")
        finally:
            self._case.log = None
        return attrs.evolve(out, findings=tuple(f for f in out.findings if f.family != WIRE and not _transport(f)),
                            exchanges=tuple(log), server=self.about())

    # ---- the ScriptServer side: requests become calls ----------------------------------------------

    def post(self, path: str, body: dict[str, Any], log: list[dict[str, Any]] | None = None) -> tuple[int, Any, str]:
        """`complete` on the body's Request: (200, the answer as JSON, its text), or 500 with the
        engine's error."""
        request = request_of(body)
        t0 = time.perf_counter()
        answer = _shape(self.engine.complete(request), contract.Answer, self.name, "complete")
        data = ({"error": {"message": answer.error}} if answer.error is not None
                else answer_json(answer, chat=path == CHAT_PATH))
        self._record(log, {"call": "complete", "request": attrs.asdict(request), "answer": data,
                           "timings": dict(answer.timings), "seconds": round(time.perf_counter() - t0, 6)})
        return (200 if answer.error is None else 500), data, json.dumps(data, ensure_ascii=False)

    def stream_body(self, path: str, body: dict[str, Any], *, log: list[dict[str, Any]] | None = None) -> Streamed:
        """`stream` on the body's Request, its chunks read back as the API's event stream; a
        Streamed that was never answered (status 0: not shown) where the engine cannot stream."""
        out = Streamed()
        if "stream" in self.cannot:
            return out
        request = request_of(body)
        t0 = time.perf_counter()
        sent = _stream_json(self.engine.stream(request), path == CHAT_PATH, self.name)
        out.status = 200
        for data in [*(json.dumps(c, ensure_ascii=False) for c in sent), "[DONE]"]:
            feed(out, f"data: {data}")
            feed(out, "")
        body_ended(out)
        self._record(log, {"call": "stream", "request": attrs.asdict(request), "chunks": sent,
                           "seconds": round(time.perf_counter() - t0, 6)})
        return out

    def _record(self, log: list[dict[str, Any]] | None, entry: dict[str, Any]) -> None:
        log = log if log is not None else getattr(self._case, "log", None)
        if log is not None:
            log.append(entry)

    def log_exchanges(self, entries: list[dict[str, Any]]) -> None:
        log = getattr(self._case, "log", None)
        if log is not None:
            log.extend(entries)

    def reference(self, case: Case) -> Any:
        if case.id not in self._reference:
            self._reference[case.id] = reference_result(case, self.checkpoint)
        return self._reference[case.id]

    def prefix(self) -> Any:
        if self._prefix is None:
            self._prefix = probe_prefix(self)
        return self._prefix

    def prompt_for(self, ids: list[int]) -> list[int]:
        return ids
