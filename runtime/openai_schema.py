"""The OpenAI-compatible wire format of the reference server: strict request parsing, response
and SSE chunk bodies, the finish-reason mapping and the hand-written OpenAPI 3 document.

Bad input never becomes a request (DECISIONS D9): `parse_completion` raises `ApiError` naming the
field (`param`). Limits chosen here, documented in the OpenAPI document too:
- `stop`: a string or a list of 1..MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS
  characters (OpenAI's own limit is 4 strings); `null` means none.
- `max_tokens` (chat also `max_completion_tokens`): an int in [1, context length]; and the prompt
  plus one output token must fit the context (§4.3 context_limit).
- `stop_token_ids` (vLLM's extension): up to MAX_STOP_TOKEN_IDS ids in the vocabulary, each a
  one-token stop sequence; as with every stop, its bytes are never sent.
- `n` must be 1; `logprobs`/`top_logprobs` are accepted and answered with `logprobs: null` (the
  reference engine does not report log-probabilities); `user` is ignored; any other field -> 400.
- chat messages are rendered with the checkpoint's own `chat_template` (tokenizer_config.json,
  Jinja in a sandbox) when it has one, else with CHAT_TEMPLATE (the embedded model is not a chat
  model: that template only makes the request well-defined).

Finish reasons (§4.10 -> OpenAI): eos, stop_sequence, grammar_complete -> "stop";
max_output_tokens, context_limit, deadline_exceeded -> "length" (a budget ran out);
content_interrupted -> "content_filter". The precise reason always travels alongside as
`"decodespec": {"finish_reason": ..., "stop": ...}`. cancelled, model_error and transport_error are
not completions: they end a stream with an `event: error` and a non-stream call with an error body.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ..spec import FinishReason
from ..spec.vocabulary import OPENAI_FINISH
from .errors import RequestError
from .request import Request

MAX_STOP_STRINGS = 4
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
CHAT_ROLES = ("system", "user", "assistant")

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
    """What a completion call asked for, validated."""

    request: Request
    chat: bool
    stream: bool
    include_usage: bool


_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                     "stop_token_ids", "seed", "logprobs", "user", "utf8_guard"})
_FIELDS = {False: _COMMON | {"prompt"}, True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}}


ChatTemplate = Callable[[list[dict[str, str]]], str]


def default_chat_template(messages: list[dict[str, str]]) -> str:
    return "".join(CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + "<|assistant|>\n"


def compile_chat_template(source: str | None) -> ChatTemplate:
    """A checkpoint's Jinja chat template as a renderer (sandboxed; add_generation_prompt set), or
    the default one when there is none. A template that does not compile is refused here, at start."""
    if not source:
        return default_chat_template
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the checkpoint's chat_template does not compile: {exc}") from None

    def render(messages: list[dict[str, str]]) -> str:
        try:
            return template.render(messages=messages, add_generation_prompt=True)
        except TemplateError as exc:
            raise ApiError(400, f"messages: the model's chat template refused them: {exc}", param="messages",
                           code="chat_template_error") from None

    return render


def parse_completion(raw: bytes, *, chat: bool, model_name: str, context_limit: int, vocab_size: int,
                     tokenizer: Any, policy: str = "pause", max_buffer_events: int = 256,
                     chat_template: ChatTemplate = default_chat_template, utf8_guard: str = "sampled",
                     request_id: str | None = None) -> ParsedRequest:
    """Validate a /v1/completions (chat False) or /v1/chat/completions body into a Request.

    `utf8_guard` is the server's default for a body without the field (UTF8_GUARD_DEFAULTS, D16);
    `request_id` the client's own id (the X-Request-Id header), checked against CLIENT_ID."""
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
    unknown = sorted(set(body) - _FIELDS[chat])
    if unknown:
        raise _bad(unknown[0], "unknown field (this server is strict)", "unknown_field")
    model = _get(body, "model", str, required=True)
    if model != model_name:
        raise ApiError(404, f"model: the model {_short(model)!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    prompt, prompt_param = (chat_template(_messages(body)), "messages") if chat else (_prompt(body), "prompt")
    if isinstance(prompt, str):
        try:
            prompt_ids = tokenizer.encode(prompt)
        except ValueError as exc:
            raise _bad(prompt_param, f"cannot be tokenized: {exc}") from None
    else:
        prompt_ids = list(prompt)
        bad = next((x for x in prompt_ids if x >= vocab_size), None)
        if bad is not None:
            raise _bad("prompt", f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    if not prompt_ids:
        raise _bad(prompt_param, "encodes to no tokens")
    if len(prompt_ids) + 1 > context_limit:
        raise _bad(prompt_param, f"the prompt has {len(prompt_ids)} tokens; with one output token it does not fit "
                   f"the context length {context_limit}", "context_length_exceeded")
    max_param = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _get(body, max_param, int, default=16)
    if max_tokens < 1 or max_tokens > context_limit:
        raise _bad(max_param, f"must be between 1 and the context length {context_limit}, got {max_tokens}")
    if _get(body, "n", int, default=1) != 1:
        raise _bad("n", "only n = 1 is supported")
    stream = _get(body, "stream", bool, default=False)
    options = _get(body, "stream_options", dict, default=None)
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "is only allowed with stream: true")
        extra = sorted(set(options) - {"include_usage"})
        if extra:
            raise _bad(f"stream_options.{extra[0]}", "unknown field", "unknown_field")
        include_usage = _get(options, "include_usage", bool, default=False, name="stream_options.include_usage")
    temperature = _get(body, "temperature", float, default=1.0)
    if not 0 <= temperature <= 2:
        raise _bad("temperature", f"must be between 0 and 2, got {temperature}")
    top_p = _get(body, "top_p", float, default=None)
    seed = _get(body, "seed", int, default=None)
    if seed is not None and not 0 <= seed < 2**63:
        raise _bad("seed", f"must be between 0 and 2**63 - 1, got {seed}")
    if chat:
        _get(body, "logprobs", bool, default=None)
        top = _get(body, "top_logprobs", int, default=None)
        if top is not None and not 0 <= top <= 20:
            raise _bad("top_logprobs", f"must be between 0 and 20, got {top}")
    else:
        lp = _get(body, "logprobs", int, default=None)
        if lp is not None and not 0 <= lp <= 5:
            raise _bad("logprobs", f"must be between 0 and 5, got {lp}")
    _get(body, "user", str, default=None)
    guard = _get(body, "utf8_guard", bool, default=None)
    try:
        request = Request(
            prompt_ids if not isinstance(prompt, str) else prompt, stop=_stop(body),
            stop_token_ids=_stop_token_ids(body, vocab_size), max_output_tokens=max_tokens,
            temperature=float(temperature), top_p=top_p, seed=seed, policy=policy,
            max_buffer_events=max_buffer_events, request_id=request_id,
            utf8_guard=UTF8_GUARD_DEFAULTS[utf8_guard](temperature) if guard is None else guard,
        )
    except RequestError as exc:
        raise _bad(_PARAM.get(exc.field, exc.field), str(exc).split(": ", 1)[-1]) from None
    return ParsedRequest(request=request, chat=chat, stream=stream, include_usage=include_usage)


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
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise _bad(f"messages[{i}].{extra[0]}", "unknown field", "unknown_field")
        role = _get(m, "role", str, required=True, name=f"messages[{i}].role")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = _get(m, "content", str, required=True, name=f"messages[{i}].content")
        _get(m, "name", str, name=f"messages[{i}].name")
        parts.append({"role": role, "content": content})
    return parts


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


def finish_fields(reason: FinishReason, stop: str | None) -> tuple[str, dict[str, Any]]:
    """The OpenAI finish_reason and the precise §4.10 one alongside."""
    return OPENAI_FINISH[reason], {"finish_reason": reason.value, "stop": stop}


def openai_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's three counts plus the §4.10 detail (DECISIONS D7)."""
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "decodespec": dict(usage),
    }


def chunk(parsed: ParsedRequest, cid: str, created: int, model: str, *, text: str | None = None,
          role: bool = False, finish: tuple[str, dict] | None = None, usage: dict | None = None) -> dict[str, Any]:
    """One SSE `data:` object: a text delta, the opening role (chat), the finish, or usage only."""
    if usage is not None:
        choices: list[dict[str, Any]] = []
    elif parsed.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": None}]
    if finish is not None:
        choices[0]["finish_reason"], choices[0]["decodespec"] = finish
    out = {"id": cid, "object": "chat.completion.chunk" if parsed.chat else "text_completion", "created": created,
           "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def completion_body(parsed: ParsedRequest, cid: str, created: int, model: str, text: str,
                    finish: tuple[str, dict], usage: dict) -> dict[str, Any]:
    """The non-stream answer (usage always included)."""
    reason, detail = finish
    if parsed.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason, "decodespec": detail}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "decodespec": detail}
    return {"id": cid, "object": "chat.completion" if parsed.chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage}


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
    "n": {"type": ["integer", "null"], "enum": [1, None]},
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
        "properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)}, "content": {"type": "string"},
                       "name": {"type": "string"}}}},
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
            "/v1/completions": _post("Text completion (§4.3)", _COMPLETION_REQ),
            "/v1/chat/completions": _post("Chat completion (messages rendered with a plain template)", _CHAT_REQ),
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
