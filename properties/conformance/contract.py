"""The adapter contract: what an in-house engine with a Python API (no HTTP server) implements to be
judged on the forced checkpoints exactly as an OpenAI-compatible server is (§4.3-§4.10, D27, D59, D68).

This module is the contract's whole public surface; nothing else of decodespec is part of it.
Public names (`__all__`): CANNOT, CONTRACT_VERSION, Answer, Checkpoint, Choice, Chunk, Engine, Request,
TokenReport, ToolCall, Unsupported, Usage.

- `CONTRACT_VERSION`: "MAJOR.MINOR". A MINOR step adds optional names or fields; a MAJOR one
  changes or removes one. Every report.json records the version it was judged under ("contract").
  Versions: 1.0, the contract; 1.1, `Checkpoint.context_length` with `Engine.context_length` (the
  context-limit cases, D10) and `Chunk.selected` (hold-back, D59).
- `Checkpoint`: what the factory is given, one forced checkpoint to load (`folder`: a Llama
  checkpoint with config.json, model.safetensors, tokenizer.json and tokenizer_config.json, whose
  chat template the chat cases use); `os.fspath(checkpoint)` is the folder. `context_length`: the
  context (prompt and output positions) to load the engine with, for a case with a context limit;
  None: the engine's own.
- `Request`: one request of a case: the prompt's token ids (or, on chat, the messages), the limit,
  the stop strings and stop ids, the number of choices, whether logprobs are asked, and every
  other field of the case's request by its OpenAI name (`fields`).
- `Answer` (of `Choice`s, with `Usage`, `timings`, `error`), `Chunk` (one streamed piece),
  `ToolCall`, `TokenReport`: what the engine shows. None (or an absent method) means "not shown":
  what it leaves unshown is listed as not checked, so a pass that needed it is partial.
- `Engine`: the protocol: `complete(request) -> Answer`, `stream(request) -> Iterable[Chunk]`
  (optional), `name`, `cannot` (optional, a subset of `CANNOT`) and `context_length` (optional:
  the context it runs with; a context-limit case is judged only where it says the one it was
  loaded with, as a server says it in /props or max_model_len, D10).
- `CANNOT`: what an engine may declare it cannot do, with what the judge then leaves out.
- `Unsupported`: raised by `complete` or `stream` for a request the engine cannot take (a field,
  a chat request): the case is n/a with the exception's message.

The factory: `make(checkpoint: Checkpoint) -> Engine`, run as
`decodespec conform --engine my_engine:make --checkpoint CKPTS` (CKPTS a checkpoint, or the folder
`decodespec checkpoints build` wrote: the factory is called once per checkpoint, one report for
all). A factory that raises is an ERROR of every case of that checkpoint (the run exits 1).

From what the engine shows the judge derives all that it derives over HTTP: the answer's text,
finish reason and token count against the reference's (streamed and not), whether the engine
followed the forced script (from the reported token ids, else their bytes, else the text: a departure
is the case's ERROR naming the position, never a FAIL), the same case at every other `max_tokens`
(`complete` and `stream` are called again, unless `cannot` holds "sweep"), the reasoning and
tool-call channels on chat, the count rule for several choices (`n`), each streamed chunk's
token reports against its text, and the hold-back of text that may begin a stop from the tokens
selected when each chunk went out (`Chunk.selected`; without it hold-back is not checked, D59).
The OpenAI wire conventions (SSE framing, ids) are not judged: an in-house engine has no wire.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

__all__ = ["CANNOT", "CONTRACT_VERSION", "Answer", "Checkpoint", "Choice", "Chunk", "Engine", "Request",
           "TokenReport", "ToolCall", "Unsupported", "Usage"]

CONTRACT_VERSION = "1.1"

# What an engine may declare it cannot do (`Engine.cannot`), and what the judge then leaves out.
CANNOT: Mapping[str, str] = {
    "stream": "the streamed answer is not judged (listed as not checked)",
    "chat": "the chat cases are n/a",
    "sweep": "a case is judged at its own max_tokens only, not again at every other limit (§4.3)",
}


class Unsupported(Exception):
    """Raised by an engine for a request it cannot take; the case is n/a with this message."""


@attrs.frozen
class Checkpoint:
    """One forced checkpoint for the factory to load: its folder, its group, its EOS token id, and
    the context length to load it with (None: the engine's own; set for the context-limit cases,
    whose run must end where that context is full: §4.3, D10)."""

    folder: Path
    group: str
    eos_token_id: int
    context_length: int | None = None

    def __fspath__(self) -> str:
        return os.fspath(self.folder)


def _strings(items: Iterable[str]) -> tuple[str, ...]:
    """The items as a tuple: a converter mypy can type (it cannot type `converter=tuple`)."""
    return tuple(items)


@attrs.frozen
class Request:
    """One request of a case. `prompt` holds the prompt's token ids (a completions request);
    `messages` the chat messages (a chat request: render them with the checkpoint's chat template,
    `fields` may hold `tools` and `chat_template_kwargs`). Decoding is greedy (`fields` holds
    `temperature: 0`). `fields` holds every other field of the case's request by its OpenAI name
    (`min_tokens`, `ignore_eos`, `logit_bias`, `echo`, `skip_special_tokens`,
    `include_stop_str_in_output`, ...): an engine that does not take one raises Unsupported."""

    max_tokens: int
    prompt: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    messages: tuple[Mapping[str, Any], ...] = attrs.field(default=(), converter=tuple)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    n: int = 1
    logprobs: bool = False  # report each selected token (TokenReport), per chunk when streamed
    fields: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def chat(self) -> bool:
        return bool(self.messages)


@attrs.frozen
class TokenReport:
    """One selected token as the engine reports it: its id, its bytes, its logprob (None: not
    shown). The EOS or stop token that ended the run may be reported or left out (D15)."""

    id: int | None = None
    bytes: bytes | None = None
    logprob: float | None = None


@attrs.frozen
class ToolCall:
    """A tool call: `arguments` is JSON text. In a Chunk, a piece of call `index` (its name on the
    first piece, its arguments in as many pieces as the engine sends)."""

    name: str | None
    arguments: str = ""
    index: int = 0


@attrs.frozen
class Usage:
    """Token counts of an answer (all its choices together); None: not reported."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def _optional_tuple(value: Any) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen
class Choice:
    """One choice of an answer. `text` is the output (on chat: the content channel); `reasoning`
    and `tool_calls` the chat channels; `finish_reason` in the API's words (stop, length,
    tool_calls). `tokens`: the selected tokens, in order (None: not shown)."""

    text: str | None
    finish_reason: str | None
    index: int = 0
    tokens: tuple[TokenReport, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = attrs.field(default=None, converter=_optional_tuple)


@attrs.frozen
class Answer:
    """A whole (non-streamed) answer. `error`: the engine failed the request (judged as an HTTP
    error answer); `timings`: seconds the engine measured (recorded, not judged)."""

    choices: tuple[Choice, ...] = attrs.field(default=(), converter=tuple)
    usage: Usage | None = None
    error: str | None = None
    timings: Mapping[str, float] = attrs.field(factory=dict)


@attrs.frozen
class Chunk:
    """One streamed piece of choice `index`: the text it sends (on chat: content; `reasoning` and
    `tool_calls` pieces beside), the tokens it reports, the finish reason on the last. A chunk with
    `usage` alone ends the stream with the counts; one with `error` is an error in the stream.
    `selected`: the ids of the tokens the engine selected since its previous chunk of this choice
    went out, those whose text it holds included (None: not said). `tokens` are the tokens whose
    text the chunk carries (D59); `selected` says when the chunk went out, from which hold-back
    for a stop is judged (§4.6)."""

    text: str = ""
    index: int = 0
    finish_reason: str | None = None
    tokens: tuple[TokenReport, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = attrs.field(default=(), converter=tuple)
    usage: Usage | None = None
    error: str | None = None
    selected: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_tuple)


class Engine(Protocol):
    """An in-house engine as the judge calls it. Besides `complete`, optional members:
    `stream(request) -> Iterable[Chunk]` (absent: as `cannot` holding "stream"), `name: str` (shown
    in reports; default the class's name), `cannot: frozenset[str]` (a subset of CANNOT),
    `context_length: int` (the context it runs with; absent or None: not said, and the
    context-limit cases are n/a, D10)."""

    def complete(self, request: Request) -> Answer: ...
