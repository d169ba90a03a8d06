"""The OpenAI-compatible wire format of the reference server: strict request parsing, response
and SSE chunk bodies, the finish-reason mapping and the hand-written OpenAPI 3 document.

Bad input never becomes a request (DECISIONS D9): `parse_completion` raises `ApiError` naming the
field (`param`). Limits chosen here, documented in the OpenAPI document too:
- `stop`: a string or a list of 1..MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS
  characters (OpenAI's own limit is 4 strings); `null` means none.
- `max_tokens` (chat also `max_completion_tokens`): an int in [1, MAX_OUTPUT_TOKENS]; the prompt plus one output token
  must fit the context, and a budget past what is left of it ends the run with context_limit
  (§4.3, D10) instead of being refused.
- `stop_token_ids` (vLLM's extension): up to MAX_STOP_TOKEN_IDS ids in the vocabulary, each a
  one-token stop sequence; as with every stop, its bytes are never sent.
- Every field of OpenAI's completions and chat completions requests is in FIELDS (DECISIONS D30):
  implemented, accepted only at its neutral values (any other value is a 400 `unsupported_value`
  naming the field and the value), informational (no effect on a completion: `user`, ...), or
  not reported (answered with null and named in the answer's X-Decodespec-Ignored header; FIELDS
  holds none of these). `logprobs` (completions: 0..5 alternatives; chat: `logprobs: true` with
  `top_logprobs` 0..20) and vLLM's `return_token_ids` are reported with the text they spell, chunk
  by chunk (DECISIONS D59, runtime/alignment.py, `report_fields`). The engine extensions of EXTENSIONS (vLLM's and SGLang's names:
  top_k, min_p, min_tokens, ignore_eos, repetition_penalty, ...) are accepted the same way. Any
  other field is a 400 `unknown_field`; `strict` (`decodespec serve --strict`) accepts only the
  fields of STRICT_FIELDS, with n = 1 (D30).
- `n` choices (and `best_of` candidates, the best n by the sum of their log-probabilities, not
  streamed) are separate requests of the engine, each with its own lifecycle, stream and finish
  reason (D34); the seed of choice i is seed + i.
- chat messages are rendered with the checkpoint's own `chat_template` (tokenizer_config.json,
  Jinja in a sandbox) when it has one, else with CHAT_TEMPLATE (the embedded model is not a chat
  model: that template only makes the request well-defined).

Finish reasons (§4.10 -> OpenAI): eos, stop_sequence, grammar_complete -> "stop";
max_output_tokens, context_limit, deadline_exceeded -> "length" (a budget ran out);
content_interrupted -> "content_filter". The precise reason always travels alongside as
`"decodespec": {"finish_reason": ..., "stop": ...}`. cancelled, model_error and transport_error are
not completions: they end a stream with an `event: error` and a non-stream call with an error body.
A stream that asks for per-token reports (logprobs, token ids) also says, with each text chunk, how
many tokens the run had selected when it released it (`"decodespec": {"selected": n}`, D59).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..spec import FinishReason
from ..spec.vocabulary import OPENAI_FINISH
from .errors import RequestError
from .request import Request
from .stop import StopValue
from .tokenizers import TokenizerError, own_bytes

MAX_STOP_STRINGS = 4
MAX_OUTPUT_TOKENS = 1 << 20  # a budget, not a promise: the context limit ends a run first (D10)
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# A client's own request id (X-Request-Id): long enough to be unguessable if the client makes it so.
CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{16,128}")
# The server's `--utf8-guard` choices: whether a body that does not say gets the guard (D16).
UTF8_GUARD_DEFAULTS: Mapping[str, Callable[[float], bool]] = {
    "sampled": lambda temperature: temperature > 0,
    "always": lambda temperature: True,
    "never": lambda temperature: False,
}
CHAT_TEMPLATE = "<|{role}|>\n{content}\n"  # each message; then "<|assistant|>\n" opens the reply
CHAT_ROLES = ("system", "developer", "user", "assistant")
# Message fields a client may send at their neutral value (OpenAI's assistant message shape).
_MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {"tool_calls": ((), []), "function_call": ((),), "refusal": ((),), "audio": ((),)}

# Request fields named in errors by their OpenAI name.
_PARAM = {"max_output_tokens": "max_tokens"}


class ApiError(Exception):
    """A 4xx/5xx answer: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_ECHO = 80  # characters of a client's name or value an error message repeats


def _short(text: str) -> str:
    """A client-supplied string as an error may repeat it: bounded, and printable even if it holds
    lone surrogates (the error body must always encode)."""
    safe = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return safe if len(safe) <= MAX_ECHO else safe[:MAX_ECHO] + f"... ({len(text)} characters)"


def _bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    param = _short(param) if param is not None else None
    return ApiError(400, f"{param}: {message}" if param else message, param=param, code=code)


def _surrogate_path(value: Any, path: str) -> str | None:
    """The JSON path of the first string (key or value) holding a lone surrogate, iteratively."""
    todo = [(value, path)]
    while todo:
        v, where = todo.pop()
        if isinstance(v, str):
            if any("\ud800" <= c <= "\udfff" for c in v):
                return where
        elif isinstance(v, dict):
            for k, item in v.items():
                if any("\ud800" <= c <= "\udfff" for c in k):
                    return f"{where}.<key>" if where else "<key>"
                todo.append((item, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            todo.extend((item, f"{where}[{i}]") for i, item in enumerate(v))
    return None


@attrs.frozen
class ParsedRequest:
    """What a completion call asked for, validated. `n` choices of `best_of` candidates (D34);
    `index` is the choice one reconnect renders; `ignored` the fields accepted and not acted on
    (the X-Decodespec-Ignored header)."""

    request: Request
    chat: bool
    stream: bool
    include_usage: bool
    n: int = 1
    best_of: int = 1
    index: int = 0
    ignored: tuple[str, ...] = ()
    # The chat answer's split (spec/channels.toml, D45-D47): think tags (the server's reasoning
    # parser) and call tags (its tool parser, when the request has tools).
    reasoning: bool = False
    tools: bool = False
    # Per-token reports (D59): logprobs asked (completions' `logprobs`, chat's `logprobs: true`),
    # with this many alternatives; vLLM's `return_token_ids`.
    logprobs: int | None = None
    token_ids: bool = False

    @property
    def reports_tokens(self) -> bool:
        """Whether the answer carries per-token entries (logprobs or token ids)."""
        return self.logprobs is not None or self.token_ids

    def choice(self, i: int) -> Request:
        """Choice (or candidate) i of an n > 1 request: its own id and, with a seed, seed + i (D34)."""
        req = self.request
        # Request's own __init__ takes every field but the prompt as **kw, so the attrs plugin
        # types evolve() without them; evolve passes them on as Request accepts them.
        return attrs.evolve(req, request_id=f"{req.request_id}.{i}",  # type: ignore[call-arg]
                            seed=None if req.seed is None else req.seed + i, score=self.best_of > self.n)


MAX_N = 16  # choices (n) or candidates (best_of) of one request

# The fields of OpenAI's requests and the engine extensions, and what this server does with each (D30).
IMPLEMENTED, NEUTRAL, INFORMATIONAL, NOT_REPORTED = "implemented", "neutral", "informational", "not reported"


@attrs.frozen
class Field:
    """One request field. `neutral`: the values that ask for nothing (null always does); a NEUTRAL
    field takes only those, a NOT_REPORTED one is named in X-Decodespec-Ignored for any other."""

    name: str
    status: str
    neutral: tuple[Any, ...] = ()
    note: str = ""
    origin: str = "OpenAI"


def _fields(*specs: tuple) -> dict[str, Field]:
    return {name: Field(name, *rest) for name, *rest in specs}


_BOTH: tuple[tuple[Any, ...], ...] = (
    ("model", IMPLEMENTED), ("max_tokens", IMPLEMENTED), ("temperature", IMPLEMENTED), ("top_p", IMPLEMENTED),
    ("n", IMPLEMENTED, (1,), "each choice its own request (D34)"), ("stream", IMPLEMENTED),
    ("stream_options", IMPLEMENTED), ("stop", IMPLEMENTED), ("seed", IMPLEMENTED, (), "choice i uses seed + i"),
    ("presence_penalty", IMPLEMENTED, (0, 0.0)), ("frequency_penalty", IMPLEMENTED, (0, 0.0)),
    ("logit_bias", IMPLEMENTED, ({},), "token id (a string) -> bias in [-100, 100], added to its logit"),
    ("user", INFORMATIONAL),
)
COMPLETION_FIELDS = _fields(
    *_BOTH, ("prompt", IMPLEMENTED),
    ("best_of", IMPLEMENTED, (1,), "the n best of best_of candidates by log-probability; not streamed (D34)"),
    ("echo", IMPLEMENTED, (False,), "the prompt's bytes first, by the detokenizer's rules (D33)"),
    ("logprobs", IMPLEMENTED, (), "0..5 alternatives per token, each chunk's tokens with its text (D59)"),
    ("suffix", NEUTRAL, ("",), "insertion is not supported"),
)
CHAT_FIELDS = _fields(
    *_BOTH, ("messages", IMPLEMENTED), ("max_completion_tokens", IMPLEMENTED),
    ("logprobs", IMPLEMENTED, (False,), "logprobs.content, each chunk's tokens with its text (D59)"),
    ("top_logprobs", IMPLEMENTED, (0,), "0..20 alternatives per token; needs logprobs: true"),
    ("audio", NEUTRAL, (), "audio output is not supported"),
    ("modalities", NEUTRAL, (["text"],), "only text"),
    ("tools", NEUTRAL, ([],), "tool calling is not supported"),
    ("tool_choice", NEUTRAL, ("none", "auto"), "without tools, auto is none"),
    ("parallel_tool_calls", NEUTRAL, (True, False), "without tools either value asks for nothing"),
    ("functions", NEUTRAL, ([],), "deprecated function calling is not supported"),
    ("function_call", NEUTRAL, ("none", "auto"), "without functions, auto is none"),
    ("response_format", NEUTRAL, ({"type": "text"},), "JSON modes are not supported"),
    ("prediction", NEUTRAL, (), "predicted outputs are not supported"),
    ("reasoning_effort", NEUTRAL, ("none",), "the model does not reason"),
    ("verbosity", NEUTRAL, ("medium",), "the model has one verbosity"),
    ("web_search_options", NEUTRAL, (), "web search is not supported"),
    ("store", NEUTRAL, (False,), "completions are not stored"),
    ("service_tier", NEUTRAL, ("auto", "default"), "one tier"),
    ("metadata", INFORMATIONAL, (), "kept nowhere (store is false)"),
    ("prompt_cache_key", INFORMATIONAL), ("prompt_cache_retention", INFORMATIONAL), ("safety_identifier", INFORMATIONAL),
    ("chat_template_kwargs", IMPLEMENTED, ({},), "passed to the chat template, as transformers passes them", "vLLM, SGLang"),
)
# Engine extensions clients and routers send (vLLM, SGLang, llama.cpp names), on both endpoints.
EXTENSIONS = _fields(
    ("top_k", IMPLEMENTED, (-1, 0), "-1 or 0: no top-k (vLLM, llama.cpp)", "vLLM, SGLang, llama.cpp"),
    ("min_p", IMPLEMENTED, (0, 0.0), "", "vLLM, SGLang, llama.cpp"),
    ("repetition_penalty", IMPLEMENTED, (1, 1.0), "", "vLLM, SGLang"),
    ("min_tokens", IMPLEMENTED, (0,), "a finish-check guard (D31)", "vLLM"),
    ("min_new_tokens", IMPLEMENTED, (0,), "SGLang's name of min_tokens", "SGLang"),
    ("ignore_eos", IMPLEMENTED, (False,), "a finish-check guard (D31)", "vLLM, SGLang, llama.cpp"),
    ("skip_special_tokens", IMPLEMENTED, (True,), "", "vLLM, SGLang"),
    ("include_stop_str_in_output", IMPLEMENTED, (False,), "stop strings only (D33)", "vLLM"),
    ("no_stop_trim", IMPLEMENTED, (False,), "SGLang's name of include_stop_str_in_output", "SGLang"),
    ("stop_token_ids", IMPLEMENTED, ([],), "", "vLLM, SGLang"),
    ("utf8_guard", IMPLEMENTED, (), "DECISIONS D16", "decodespec"),
    ("return_token_ids", IMPLEMENTED, (False,), "each chunk's token ids with its text (D59)", "vLLM"),
    ("spaces_between_special_tokens", NEUTRAL, (True,), "special tokens are skipped or kept as bytes", "vLLM, SGLang"),
    ("return_hidden_states", NEUTRAL, (False,), "", "SGLang"),
    ("use_beam_search", NEUTRAL, (False,), "", "vLLM"),
    ("length_penalty", NEUTRAL, (1, 1.0), "beam search only", "vLLM"),
    ("prompt_logprobs", NEUTRAL, (0,), "", "vLLM"),
    ("truncate_prompt_tokens", NEUTRAL, (), "a prompt that does not fit is refused (D9)", "vLLM"),
    ("typical_p", NEUTRAL, (1, 1.0), "", "llama.cpp"),
    ("continue_final_message", NEUTRAL, (False,), "the reply is a new assistant message", "vLLM"),
    ("include_reasoning", NEUTRAL, (True, False), "the model does not reason", "SGLang"),
    ("separate_reasoning", NEUTRAL, (True, False), "the model does not reason", "SGLang"),
    ("stream_reasoning", NEUTRAL, (True, False), "the model does not reason", "SGLang"),
)
# The strict request set: all that `strict` accepts (n = 1 only; D30).
STRICT_FIELDS = {
    False: frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                      "stop_token_ids", "seed", "logprobs", "user", "utf8_guard", "prompt"}),
    True: frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                     "stop_token_ids", "seed", "logprobs", "user", "utf8_guard", "messages", "max_completion_tokens",
                     "top_logprobs"}),
}
FIELDS = {False: {**COMPLETION_FIELDS, **EXTENSIONS}, True: {**CHAT_FIELDS, **EXTENSIONS}}
_ALL_FIELDS = {**FIELDS[False], **FIELDS[True]}


def _same(a: Any, b: Any) -> bool:
    """JSON equality that keeps true apart from 1 and 1 apart from 1.0 only where JSON does."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _neutral(field: Field, value: Any) -> bool:
    return value is None or any(_same(value, n) for n in field.neutral)


def _check_fields(body: Mapping[str, Any], chat: bool, strict: bool,
                  implemented: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Refuse an unknown field, or a NEUTRAL one at another value (D30); the NOT_REPORTED fields
    the body sets. `implemented`: NEUTRAL fields this server acts on (the tool fields with a tool
    parser, D47)."""
    known = FIELDS[chat]
    allowed = STRICT_FIELDS[chat] if strict else known
    for name in sorted(body):
        if name not in allowed:
            why = ("unknown field (this server is strict)" if strict else
                   f"unknown field: not a field of OpenAI's {'chat completions' if chat else 'completions'} request "
                   "nor an extension this server documents (/openapi.json lists them)")
            raise _bad(name, why, "unknown_field")
        field, value = known[name], body[name]
        if field.status == NEUTRAL and name not in implemented and not _neutral(field, value):
            only = " or ".join(json.dumps(n) for n in field.neutral) or "null"
            raise _bad(name, f"{json.dumps(value)[:MAX_ECHO]} is not supported by this server ({field.note}); it "
                             f"accepts only {only}", "unsupported_value")
    return tuple(n for n in sorted(body) if known[n].status == NOT_REPORTED and not _neutral(known[n], body[n]))


ChatTemplate = Callable[[list[dict[str, str]], Mapping[str, Any]], str]


def default_chat_template(messages: list[dict[str, str]], kwargs: Mapping[str, Any] = {}) -> str:
    return "".join(CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + "<|assistant|>\n"


def compile_chat_template(source: str | None, tokens: Mapping[str, str] = {}) -> ChatTemplate:
    """A checkpoint's Jinja chat template as a renderer (sandboxed; add_generation_prompt set, its
    special tokens `tokens` (bos_token, eos_token) and the request's chat_template_kwargs given as
    transformers' apply_chat_template gives them), or the default one when there is none. A
    template that does not compile is refused here, at start."""
    if not source:
        return default_chat_template
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the checkpoint's chat_template does not compile: {exc}") from None

    def render(messages: list[dict[str, str]], kwargs: Mapping[str, Any] = {}) -> str:
        try:
            return template.render(**{**tokens, **kwargs, "messages": messages, "add_generation_prompt": True})
        except TemplateError as exc:
            raise ApiError(400, f"messages: the model's chat template refused them: {exc}", param="messages",
                           code="chat_template_error") from None

    return render


def parse_completion(raw: bytes, *, chat: bool, model_name: str, context_limit: int, vocab_size: int,
                     tokenizer: Any, policy: str = "pause", max_buffer_events: int = 256,
                     chat_template: ChatTemplate = default_chat_template, utf8_guard: str = "sampled",
                     request_id: str | None = None, strict: bool = False, reasoning: bool = False,
                     tool_parser: bool = False, tool_close_id: int | None = None) -> ParsedRequest:
    """Validate a /v1/completions (chat False) or /v1/chat/completions body into a ParsedRequest
    (its Request and how to answer it); bad input is an ApiError naming the field (D9).

    `policy` and `max_buffer_events`: the stream of a request that names none (§4.8). `utf8_guard`:
    the server's default for a body without the field (UTF8_GUARD_DEFAULTS, D16). `request_id`: the
    client's own id (the X-Request-Id header), checked against CLIENT_ID. `strict`: only
    STRICT_FIELDS (D30). `reasoning`: the server splits think tags into reasoning_content (D45).
    `tool_parser`: the server parses Hermes tool calls of a chat request with tools (D47), and
    `tool_close_id` is their `</tool_call>` token, if the vocabulary has one, which then ends the
    turn (the lifecycle's tool_call token check)."""
    body = _read_body(raw, request_id)
    tool_parser = chat and tool_parser
    ignored = _check_fields(body, chat, strict, _TOOL_FIELDS if tool_parser else frozenset())
    tools = tool_parser and _tools(body)
    model = _get(body, "model", str, required=True)
    if model != model_name:
        raise ApiError(404, f"model: the model {_short(model)!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    prompt, prompt_param = _prompt_of(body, chat, tool_parser, chat_template)
    prompt_ids = _prompt_ids(prompt, prompt_param, tokenizer, vocab_size, context_limit)
    max_param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _ranged(body, max_param, _RANGES["max_tokens"])
    n, best_of, stream = _choices(body, strict)
    include_usage = _include_usage(body, stream)
    temperature = _ranged(body, "temperature", _RANGES["temperature"])
    top_p = _get(body, "top_p", float, default=None)
    seed = _ranged(body, "seed", _RANGES["seed"])
    logprobs = _logprobs(body, chat)  # with echo: the output's tokens only, no prompt logprobs (D59)
    token_ids = bool(_get(body, "return_token_ids", bool, default=False))
    for key, kind in _INFORMATIONAL_TYPES.items():
        _get(body, key, kind, default=None)
    guard = _get(body, "utf8_guard", bool, default=None)
    try:
        request = Request(  # the ids, tokenized here once (the engine does not tokenize them again)
            prompt_ids, stop=_stop(body),
            stop_token_ids=_stop_token_ids(body, vocab_size), max_output_tokens=max_tokens,
            temperature=float(temperature), top_p=top_p, seed=seed, policy=policy,
            max_buffer_events=max_buffer_events, request_id=request_id,
            utf8_guard=UTF8_GUARD_DEFAULTS[utf8_guard](temperature) if guard is None else guard,
            finish_tokens={"tool_call": [tool_close_id]} if tools and tool_close_id is not None else {},
            logprobs=logprobs, **request_options(body, vocab_size),
        )
    except RequestError as exc:
        raise _bad(_PARAM.get(exc.field, exc.field), str(exc).split(": ", 1)[-1]) from None
    return ParsedRequest(request=request, chat=chat, stream=stream, include_usage=include_usage, n=n,
                         best_of=best_of, ignored=ignored, reasoning=chat and reasoning, tools=bool(tools),
                         logprobs=logprobs, token_ids=token_ids)


def _read_body(raw: bytes, request_id: str | None) -> dict[str, Any]:
    """The client's id checked against CLIENT_ID, then the body as a JSON object of text: valid
    UTF-8, parseable JSON, no lone surrogate in a key or a string (D9)."""
    if request_id is not None and not CLIENT_ID.fullmatch(request_id):
        raise _bad("X-Request-Id", f"must be 16 to 128 characters from A-Z a-z 0-9 . _ : - (an id the client "
                                   f"made unguessable), got {_short(request_id)!r}", "invalid_request_id")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(None, f"the body is not valid UTF-8 (byte {exc.start})", "invalid_utf8") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(None, f"the body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                   "invalid_json") from None
    except RecursionError:
        raise _bad(None, "the body nests too deeply to parse", "invalid_json") from None
    except ValueError as exc:  # an integer longer than Python converts (4300 digits)
        raise _bad(None, f"the body holds a number too large to read: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(None, f"the body must be a JSON object, got {type(body).__name__}", "invalid_json")
    if (where := _surrogate_path(body, "")) is not None:
        raise _bad(where, "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text", "invalid_text")
    return body


def _prompt_of(body: Mapping[str, Any], chat: bool, tool_parser: bool,
               chat_template: ChatTemplate) -> tuple[str | list[int], str]:
    """The prompt and the field it came from: chat messages rendered by the template (with the
    request's chat_template_kwargs, and the offered tools when the server parses calls, D47), or
    completions' `prompt`."""
    if not chat:
        return _prompt(body), "prompt"
    kwargs = _get(body, "chat_template_kwargs", dict, default=None) or {}
    if tool_parser and body.get("tools"):  # the template lists the offered tools, as transformers and vLLM render them
        kwargs = {**kwargs, "tools": body["tools"]}
    return chat_template(_messages(body), kwargs), "messages"


def _prompt_ids(prompt: str | list[int], param: str, tokenizer: Any, vocab_size: int, context_limit: int) -> list[int]:
    """The prompt's token ids: text tokenized, ids checked against the vocabulary; at least one, and
    room left in the context for one output token (§4.3)."""
    if isinstance(prompt, str):
        try:
            prompt_ids = tokenizer.encode(prompt)
        except ValueError as exc:
            raise _bad(param, f"cannot be tokenized: {exc}") from None
    else:
        prompt_ids = list(prompt)
        bad = next((x for x in prompt_ids if x >= vocab_size), None)
        if bad is not None:
            raise _bad("prompt", f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    if not prompt_ids:
        raise _bad(param, "encodes to no tokens")
    if len(prompt_ids) + 1 > context_limit:
        raise _bad(param, f"the prompt has {len(prompt_ids)} tokens; with one output token it does not fit "
                   f"the context length {context_limit}", "context_length_exceeded")
    return prompt_ids


@attrs.frozen
class _Range:
    """A numeric field's JSON type, its value when absent, and its inclusive bounds as the error writes them."""

    kind: type
    default: Any
    low: int
    high: int
    bounds: str


_RANGES = {
    "max_tokens": _Range(int, 16, 1, MAX_OUTPUT_TOKENS, f"1 and {MAX_OUTPUT_TOKENS} (D18: 0 selects nothing)"),
    "n": _Range(int, 1, 1, MAX_N, f"1 and {MAX_N}"),
    "temperature": _Range(float, 1.0, 0, 2, "0 and 2"),
    "seed": _Range(int, None, 0, 2**63 - 1, "0 and 2**63 - 1"),
}
# Fields with no effect on a completion, checked for their JSON type only (D30).
_INFORMATIONAL_TYPES: dict[str, type] = {"user": str, "prompt_cache_key": str, "prompt_cache_retention": str,
                                         "safety_identifier": str, "metadata": dict}


def _in_range(param: str, value: Any, row: _Range) -> Any:
    if value is not None and not row.low <= value <= row.high:
        raise _bad(param, f"must be between {row.bounds}, got {value}")
    return value


def _ranged(body: Mapping[str, Any], param: str, row: _Range) -> Any:
    """body[param] of the row's type, its default when absent, refused outside the row's bounds."""
    return _in_range(param, _get(body, param, row.kind, default=row.default), row)


def _choices(body: Mapping[str, Any], strict: bool) -> tuple[int, int, bool]:
    """`n` choices of `best_of` candidates (D34; strict: n = 1 only, D30) and `stream`: candidates
    beyond n are chosen at the end, so they are not streamed."""
    n = _get(body, "n", int, default=1)
    if strict and n != 1:
        raise _bad("n", "only n = 1 is supported (this server is strict)")
    _in_range("n", n, _RANGES["n"])
    best_of = _get(body, "best_of", int, default=n)
    if not n <= best_of <= MAX_N:
        raise _bad("best_of", f"must be between n ({n}) and {MAX_N}, got {best_of}")
    stream = _get(body, "stream", bool, default=False)
    if stream and best_of > n:
        raise _bad("best_of", f"{best_of} candidates for {n} choice(s) cannot be streamed: the best are known only "
                              "at the end (send best_of = n, or stream: false)")
    return n, best_of, stream


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    """`stream_options` (a stream's only): include_usage, the others of _STREAM_OPTIONS only false."""
    options = _get(body, "stream_options", dict, default=None)
    if options is None:
        return False
    if not stream:
        raise _bad("stream_options", "is only allowed with stream: true")
    extra = sorted(set(options) - _STREAM_OPTIONS)
    if extra:
        raise _bad(f"stream_options.{extra[0]}", "unknown field", "unknown_field")
    for key in _STREAM_OPTIONS - {"include_usage"}:
        if _get(options, key, bool, default=False, name=f"stream_options.{key}"):
            raise _bad(f"stream_options.{key}", "true is not supported by this server; it accepts only false",
                       "unsupported_value")
    return _get(options, "include_usage", bool, default=False, name="stream_options.include_usage")


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """How many alternatives per token the body asks for, None when it asks for no logprobs:
    completions' `logprobs` (0..5), chat's `logprobs: true` with `top_logprobs` (0..20)."""
    if not chat:
        lp = _get(body, "logprobs", int, default=None)
        if lp is not None and not 0 <= lp <= 5:
            raise _bad("logprobs", f"must be between 0 and 5, got {lp}")
        return lp
    asked = _get(body, "logprobs", bool, default=None)
    top = _get(body, "top_logprobs", int, default=None)
    if top is not None and not 0 <= top <= 20:
        raise _bad("top_logprobs", f"must be between 0 and 20, got {top}")
    if top and not asked:
        raise _bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if asked else None


_TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})


def _tools(body: Mapping[str, Any]) -> bool:
    """Whether a chat body with a tool parser asks for calls (D47): `tools` a list of functions, each
    `{"type": "function", "function": {"name": ...}}`, and `tool_choice` auto (or none: no calls)."""
    tools = _get(body, "tools", list, default=None) or []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _bad("tool_choice", f"{json.dumps(choice)[:MAX_ECHO]} is not supported by this server; it accepts "
                                  '"auto" or "none" (the model decides; a forced call is not implemented)',
                   "unsupported_value")
    _get(body, "parallel_tool_calls", bool, default=None)
    return bool(tools) and choice != "none"


_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation", "continuous_usage_stats"})
# OpenAI or extension name -> the Request field (two extensions are other engines' names of one).
_OPTIONS = {"presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "repetition_penalty": "repetition_penalty", "min_p": "min_p", "min_tokens": "min_tokens",
            "min_new_tokens": "min_tokens", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
            "include_stop_str_in_output": "include_stop_str_in_output",
            "no_stop_trim": "include_stop_str_in_output", "echo": "echo"}
_OPTION_TYPES = {"presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float, "min_p": float,
                 "min_tokens": int, "ignore_eos": bool, "skip_special_tokens": bool,
                 "include_stop_str_in_output": bool, "echo": bool}


def request_options(body: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """The Request keywords of a body's shaping, guard and output fields (D31-D33), by their OpenAI
    or extension names: one mapping for the server and for the conformance reference
    (properties/conformance/adapters/base.py). Types and the vocabulary are checked here, ranges
    by Request (RequestError names the field)."""
    out: dict[str, Any] = {}
    for field in dict.fromkeys(_OPTIONS.values()):
        kind = _OPTION_TYPES[field]
        given = [(k, v) for k, f in _OPTIONS.items() if f == field and (v := _get(body, k, kind, default=None)) is not None]
        asked = [(k, v) for k, v in given if not _neutral(_ALL_FIELDS[k], v)]  # a router sends the other name's neutral
        if len({v for _, v in asked}) > 1:
            (a, va), (b, vb) = asked[:2]
            raise _bad(b, f"{json.dumps(vb)} contradicts {a} ({json.dumps(va)}), another engine's name of the same field")
        if given:
            value = (asked or given)[0][1]
            out[field] = float(value) if kind is float else value
    top_k = _get(body, "top_k", int, default=None)
    if top_k is not None and top_k not in (-1, 0):
        if top_k < 1:
            raise _bad("top_k", f"must be a positive int, or -1 or 0 for none, got {top_k}")
        out["top_k"] = top_k
    bias = _get(body, "logit_bias", dict, default=None)
    if bias:
        out["logit_bias"] = {_bias_id(k, vocab_size): _bias_value(k, v) for k, v in bias.items()}
    return out


def _bias_id(key: str, vocab_size: int) -> int:
    """A logit_bias key: a token id written as a JSON object key (a string of digits)."""
    if not key.isdigit() or not key.isascii():
        raise _bad(f"logit_bias.{key}", "a key must be a token id (digits)")
    tid = int(key)
    if tid >= vocab_size:
        raise _bad(f"logit_bias.{key}", f"token id {tid} is outside the vocabulary (0..{vocab_size - 1})")
    return tid


def _bias_value(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
        raise _bad(f"logit_bias.{key}", f"must be a number in [-100, 100], got {json.dumps(value)[:40]}")
    return float(value)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
               list: "an array"}


def _get(body: Mapping[str, Any], key: str, kind: type, *, default: Any = None, required: bool = False,
         name: str | None = None) -> Any:
    """body[key] checked against a JSON type (null = absent); bool is never a number."""
    value = body.get(key)
    if value is None:
        if required:
            raise _bad(name or key, "is required", "missing_field")
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise _bad(name or key, f"must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:40]}", "invalid_type")
    return value


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise _bad("prompt", "must not be empty")
        return value
    if isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return value
    if value is None:
        raise _bad("prompt", "is required", "missing_field")
    raise _bad("prompt", "must be a non-empty string, a list of one string, or a list of token ids",
               "invalid_type")


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    """The validated messages, as {role, content} (a chat template renders them)."""
    msgs = _get(body, "messages", list, required=True)
    if not msgs:
        raise _bad("messages", "must not be empty")
    parts = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object", "invalid_type")
        extra = sorted(set(m) - {"role", "content", "name"} - set(_MESSAGE_NEUTRAL))
        if extra:
            raise _bad(f"messages[{i}].{extra[0]}", "unknown field", "unknown_field")
        for key, (_, *empty) in _MESSAGE_NEUTRAL.items():
            if m.get(key) is not None and not any(_same(m[key], e) for e in empty):
                raise _bad(f"messages[{i}].{key}", f"{json.dumps(m[key])[:MAX_ECHO]} is not supported by this server "
                                                   "(no tool calls, refusals or audio in messages)", "unsupported_value")
        role = _get(m, "role", str, required=True, name=f"messages[{i}].role")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = _content(m.get("content"), f"messages[{i}].content")
        _get(m, "name", str, name=f"messages[{i}].name")
        parts.append({"role": role, "content": content})
    return parts


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(value, str):
        return value
    if value is None:
        raise _bad(where, "is required", "missing_field")
    if not isinstance(value, list):
        raise _bad(where, "must be a string or a list of text parts", "invalid_type")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"{where}[{j}]", f"a {json.dumps(kind)[:40]} part is not supported by this server; it takes only "
                                        '{"type": "text", "text": ...} parts', "unsupported_value")
        texts.append(part["text"])
    return "".join(texts)


def _stop_token_ids(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's extension: token ids that each end the run when selected (§4.6); none of their bytes is sent."""
    ids = _get(body, "stop_token_ids", list, default=[])
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise _bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise _bad(f"stop_token_ids[{i}]", f"must be a token id in 0..{vocab_size - 1}, got {json.dumps(t)[:40]}")
    return tuple((t,) for t in ids)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "must be a string or a list of strings", "invalid_type")
    if not stops or len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"must hold 1 to {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for i, s in enumerate(stops):
        if not s:
            raise _bad("stop", f"entry {i} is empty")
        if len(s) > MAX_STOP_CHARS:
            raise _bad("stop", f"entry {i} has {len(s)} characters, more than {MAX_STOP_CHARS}")
    return tuple(stops)


# ---- response bodies ---------------------------------------------------------------------------


def finish_fields(reason: FinishReason, stop: StopValue | None) -> tuple[str, dict[str, Any]]:
    """The OpenAI finish_reason and the precise §4.10 one alongside, with the stop that ended the
    request (a token-id stop as its list of ids)."""
    return OPENAI_FINISH[reason], {"finish_reason": reason.value, "stop": stop}


def openai_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's three counts plus the §4.10 detail (DECISIONS D7)."""
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "decodespec": dict(usage),
    }


def choices_usage(usages: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The usage of n choices (D34): the prompt once, every choice's (or candidate's) completion
    tokens, and each choice's §4.10 detail."""
    total = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": usages[0]["prompt_tokens"], "completion_tokens": total,
            "total_tokens": usages[0]["prompt_tokens"] + total, "decodespec": {"choices": [dict(u) for u in usages]}}


def token_text(tokenizer: Any, token_id: int, data: bytes | None) -> str:
    """A token's string in a logprobs entry (D59): the bytes the detokenizer made of it as text;
    bytes that are not whole characters as OpenAI writes them (`bytes:\\xe4\\xb8`); a token that
    made no bytes (EOS, a skipped special token) as its own text."""
    if data is None:
        return tokenizer.decode([token_id], skip_special=False)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _alternative(tokenizer: Any, token_id: int) -> tuple[str, list[int] | None]:
    """An alternative token's string and bytes (its own bytes; a special token's text, no bytes; an
    id the tokenizer cannot decode, never chosen (D20), as vLLM writes an id: `token_id:N`)."""
    try:
        if token_id in getattr(tokenizer, "special_ids", ()):
            return tokenizer.decode([token_id], skip_special=False), None
        data = own_bytes(tokenizer, token_id)
    except TokenizerError:
        return f"token_id:{token_id}", None
    return token_text(tokenizer, token_id, data), list(data)


def _completion_logprobs(entries: Sequence[Any], tokenizer: Any) -> dict[str, Any]:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs (string -> logprob) and
    text_offset (the character where each token's text starts in the choice's text)."""
    return {"tokens": [token_text(tokenizer, e.token_id, e.data) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_alternative(tokenizer, t)[0]: lp for t, lp in e.top} for e in entries],
            "text_offset": [e.offset for e in entries]}


def _chat_logprobs(entries: Sequence[Any], tokenizer: Any) -> dict[str, Any]:
    """OpenAI's chat logprobs: `content`, one {token, logprob, bytes, top_logprobs} per token."""
    def alt(t: int, lp: float) -> dict[str, Any]:
        text, data = _alternative(tokenizer, t)
        return {"token": text, "logprob": lp, "bytes": data}

    return {"content": [{"token": token_text(tokenizer, e.token_id, e.data), "logprob": e.logprob,
                         "bytes": None if e.data is None else list(e.data),
                         "top_logprobs": [alt(t, lp) for t, lp in e.top]} for e in entries]}


# The logprobs shape of each endpoint (chat?), D59.
LOGPROB_SHAPES: Mapping[bool, Callable[[Sequence[Any], Any], dict[str, Any]]] = {
    False: _completion_logprobs, True: _chat_logprobs}


def report_fields(parsed: ParsedRequest, entries: Sequence[Any], tokenizer: Any) -> dict[str, Any]:
    """The per-token fields of one choice chunk (or non-stream choice) that reports `entries`
    (runtime/alignment.TokenEntry, D59): `logprobs` in the endpoint's shape when asked, vLLM's
    `token_ids` when asked; nothing when neither is."""
    out: dict[str, Any] = {}
    if parsed.logprobs is not None:
        out["logprobs"] = LOGPROB_SHAPES[parsed.chat](entries, tokenizer)
    if parsed.token_ids:
        out["token_ids"] = [e.token_id for e in entries]
    return out


def chunk(parsed: ParsedRequest, cid: str, created: int, model: str, *, text: str | None = None,
          role: bool = False, finish: tuple[str, dict] | None = None, usage: dict | None = None,
          delta: Mapping[str, Any] | None = None, report: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One SSE `data:` object of choice `parsed.index`: a text delta, the opening role (chat), the
    finish, or usage only; `delta`: a chat delta split into channels (channel_delta); `report`: the
    chunk's per-token fields (report_fields, D59)."""
    i = parsed.index
    if usage is not None:
        choices: list[dict[str, Any]] = []
    elif parsed.chat:
        shown: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            shown["content"] = text
        shown.update(delta or {})
        choices = [{"index": i, "delta": shown, "logprobs": None, "finish_reason": None}]
    else:
        choices = [{"index": i, "text": text or "", "logprobs": None, "finish_reason": None}]
    if report and choices:
        choices[0].update(report)
    if finish is not None:
        choices[0]["finish_reason"], choices[0]["decodespec"] = finish
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk" if parsed.chat else "text_completion",
                           "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def channel_delta(split: Mapping[str, Any], call_id: Callable[[int], str]) -> dict[str, Any]:
    """A stream delta of split parts (runtime/channels.merged) in OpenAI's shape: `reasoning_content`
    and `content` where they have text, and each complete call whole in `tool_calls` (D47)."""
    out: dict[str, Any] = {}
    if split["reasoning"]:
        out["reasoning_content"] = split["reasoning"]
    if split["content"]:
        out["content"] = split["content"]
    if split["calls"]:
        out["tool_calls"] = [{"index": c.index, **c.to_json(call_id(c.index))} for c in split["calls"]]
    return out


def chat_message(split: Mapping[str, Any], call_id: Callable[[int], str], *, reasoning: bool) -> dict[str, Any]:
    """The non-stream assistant message of a split answer: content (null when the answer is calls
    only), reasoning_content with a reasoning parser, tool_calls when it holds any (D45-D47)."""
    msg: dict[str, Any] = {"role": "assistant",
                           "content": split["content"] if split["content"] or not split["calls"] else None}
    if reasoning:
        msg["reasoning_content"] = split["reasoning"] or None
    if split["calls"]:
        msg["tool_calls"] = [c.to_json(call_id(c.index)) for c in split["calls"]]
    return msg


def choice_body(parsed: ParsedRequest, index: int, text: str, finish: tuple[str, dict],
                message: dict[str, Any] | None = None, report: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a non-stream answer (`message`: a chat answer's split message, chat_message;
    `report`: its per-token fields, report_fields)."""
    reason, detail = finish
    if parsed.chat:
        out = {"index": index, "message": message or {"role": "assistant", "content": text}, "logprobs": None,
               "finish_reason": reason, "decodespec": detail}
    else:
        out = {"index": index, "text": text, "logprobs": None, "finish_reason": reason, "decodespec": detail}
    out.update(report or {})
    return out


def completion_body(parsed: ParsedRequest, cid: str, created: int, model: str, text: str,
                    finish: tuple[str, dict], usage: dict, *, more: tuple[dict[str, Any], ...] = (),
                    message: dict[str, Any] | None = None, report: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The non-stream answer (usage always included); `more`: the choice_body of choices 1..n-1."""
    return {"id": cid, "object": "chat.completion" if parsed.chat else "text_completion", "created": created,
            "model": model, "choices": [choice_body(parsed, parsed.index, text, finish, message, report), *more],
            "usage": usage}


# A failure's error kind (the prefix of its `error`, D12) -> (HTTP status, code, type, what to do).
# An output that is not UTF-8 is the model's answer, not a server fault: a 422 that retrying as it
# is will not fix (greedy repeats it), with the remedy named.
_FAILURES: Mapping[str, tuple[int, str, str, str]] = {
    "decoding_error": (422, "output_not_utf8", "invalid_output_error",
                       "the model's output bytes are not valid UTF-8 (§4.5); send \"utf8_guard\": true to "
                       "sample only tokens that keep it valid"),
}
_FAILED = (500, "", "server_error", "")


def terminal_error(reason: FinishReason, error: str | None, request_id: str) -> ApiError:
    """A cancelled or failed request as an error (never a fake stop, §4.7)."""
    if reason is FinishReason.CANCELLED:
        return ApiError(409, f"request {request_id} was cancelled", code="cancelled", type="request_cancelled")
    status, code, kind, hint = _FAILURES.get((error or "").split(":", 1)[0], _FAILED)
    message = f"request {request_id} failed: {error or reason.value}" + (f"; {hint}" if hint else "")
    return ApiError(status, message, code=code or reason.value, type=kind)


# ---- OpenAPI 3 ---------------------------------------------------------------------------------

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_STOP = {"oneOf": [{"type": "null"}, {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                   {"type": "array", "minItems": 1, "maxItems": MAX_STOP_STRINGS,
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}}]}
_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                       "properties": {"include_usage": {"type": "boolean"}}},
    "stop": _STOP,
    "stop_token_ids": {"type": ["array", "null"], "maxItems": MAX_STOP_TOKEN_IDS, "items": {"type": "integer", "minimum": 0}},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
    "user": {"type": ["string", "null"]},
    "utf8_guard": {"type": ["boolean", "null"], "description": "sample only tokens that keep the output valid "
                   "UTF-8 (DECISIONS D16); unset: the server's --utf8-guard default"},
}
_COMPLETION_REQ = {"type": "object", "additionalProperties": False, "required": ["model", "prompt"], "properties": {
    **_SAMPLING,
    "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                         {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
    "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
}}
_CHAT_REQ = {"type": "object", "additionalProperties": False, "required": ["model", "messages"], "properties": {
    **_SAMPLING,
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "additionalProperties": False, "required": ["role", "content"],
        "properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)},
                       "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                           "type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
                       "name": {"type": "string"}, **{k: {"type": "null"} for k in _MESSAGE_NEUTRAL}}}},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
    "logprobs": {"type": ["boolean", "null"]},
    "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
}}
_ERRORS = {str(s): {"description": d, "content": {"application/json": {"schema": _ERROR}}}
           for s, d in ((400, "invalid request: `param` names the field"), (404, "unknown model or request"),
                        (409, "the request was cancelled, or its X-Request-Id is in use"), (429, "the queue is full"),
                        (422, "the output is not valid UTF-8 (code output_not_utf8; D12, D16)"),
                        (500, "the request failed (model_error, transport_error)"), (503, "shutting down"))}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def _catalogued(schema: dict[str, Any], chat: bool) -> dict[str, Any]:
    """A request schema with every field of FIELDS[chat] (D30): the hand-written ones keep their
    schema; each says what the server does with it (and, for a neutral one, the values it takes)."""
    props = dict(schema["properties"])
    for name, f in FIELDS[chat].items():
        what = f"{f.status} ({f.origin})" + (f": {f.note}" if f.note else "")
        entry = dict(props.get(name, {}))
        if f.status == NEUTRAL:
            entry["enum"] = [None, *f.neutral]
        entry["description"] = (entry["description"] + "; " if "description" in entry else "") + what
        props[name] = entry
    return {**schema, "properties": props}


def _post(summary: str, schema: dict) -> dict[str, Any]:
    return {"post": {"summary": summary, "parameters": [{
        "name": "X-Request-Id", "in": "header", "required": False,
        "description": "the client's own request id, known before any answer (to cancel a non-streamed call)",
        "schema": {"type": "string", "pattern": f"^{CLIENT_ID.pattern}$"}}],
        "requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}}, "responses": {
        "200": {"description": "the completion (JSON), or SSE when stream is true",
                "headers": {"X-Request-Id": {"schema": {"type": "string"}}},
                "content": {"application/json": {"schema": {"type": "object"}}, **_SSE}}, **_ERRORS}}}


def openapi(model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server's endpoints."""
    rid = [{"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "decodespec reference server", "version": "1",
                 "description": f"OpenAI-compatible completions from {model_name!r} with the semantics of "
                                "chapter 4 (§4.7 ordered SSE stream, §4.9 cancel, §4.10 finish reasons)."},
        "paths": {
            "/v1/completions": _post("Text completion (§4.3)", _catalogued(_COMPLETION_REQ, False)),
            "/v1/chat/completions": _post("Chat completion (messages rendered with a plain template)",
                                          _catalogued(_CHAT_REQ, True)),
            "/v1/requests/{request_id}/events": {"get": {
                "summary": "Replay a retained request's stream after Last-Event-ID, then follow it (§4.7 rule 4)",
                "parameters": rid + [{"name": "Last-Event-ID", "in": "header", "required": False,
                                      "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}}],
                "responses": {"200": {"description": "SSE", "content": _SSE}, "400": _ERRORS["400"],
                              "404": _ERRORS["404"]}}},
            "/v1/requests/{request_id}/cancel": {"post": {
                "summary": "Cancel a request; it ends at its next safe point (§4.9)", "parameters": rid,
                "responses": {"200": {"description": "accepted", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"id": {"type": "string"}, "cancelled": {"type": "boolean"},
                                                     "state": {"type": "string"}}}}}},
                              "404": _ERRORS["404"]}}},
            "/v1/models": {"get": {"summary": "The served model", "responses": {"200": {
                "description": "model list", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/metrics": {"get": {"summary": "Prometheus counters", "responses": {"200": {
                "description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/health": {"get": {"summary": "Liveness", "responses": {
                "200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}},
                "503": {"description": "the engine thread failed"}}}},
        },
    }
