"""A generation request and its validation (§4.3 normalize_request; DECISIONS D9).

Malformed input never becomes a request: construction raises `RequestError` naming the field.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import attrs

from ..spec import load_spec
from .errors import RequestError
from .grammar import Grammar, as_grammar

MAX_STOPS = 1024


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        raise RequestError("prompt", "must be str or a list of token ids, not bytes")
    if isinstance(value, Sequence):
        ids = tuple(value)
        for i, x in enumerate(ids):
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise RequestError("prompt", f"token id at index {i} must be a non-negative int, got {x!r}")
        if not ids:
            raise RequestError("prompt", "must not be empty")
        return ids
    raise RequestError("prompt", f"must be str or a list of token ids, got {type(value).__name__}")


def _stops(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence):
        raise RequestError("stop", f"must be a string or a list of strings, got {type(value).__name__}")
    out = tuple(value)
    if len(out) > MAX_STOPS:
        raise RequestError("stop", f"at most {MAX_STOPS} stop strings, got {len(out)}")
    for i, s in enumerate(out):
        if not isinstance(s, str):
            raise RequestError("stop", f"entry {i} must be a string, got {type(s).__name__}")
        if not s:
            raise RequestError("stop", f"entry {i} is empty")
    return out


def _stop_ids(value: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise RequestError("stop_token_ids", "must be a list of token-id sequences")
    out = []
    for i, seq in enumerate(value):
        seq = (seq,) if isinstance(seq, int) and not isinstance(seq, bool) else seq
        if not isinstance(seq, Sequence) or not seq:
            raise RequestError("stop_token_ids", f"entry {i} must be a non-empty list of token ids")
        for x in seq:
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise RequestError("stop_token_ids", f"entry {i} holds {x!r}, not a non-negative int")
        out.append(tuple(seq))
    return tuple(out)


def token_checks() -> tuple[str, ...]:
    """The lifecycle table's token finish checks (`tokens = true`): the events finish_tokens may name."""
    return tuple(c.event for c in load_spec("lifecycle").finish_checks if c.tokens)


def _finish_tokens(value: Any) -> tuple[tuple[str, frozenset[int]], ...]:
    """{event: token ids}: selecting one of the ids fires the event (a token finish check, D4).
    Its own result (pairs of event and ids) converts to itself, so attrs.evolve keeps it."""
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = {event: sorted(ids) for event, ids in value}
    if not isinstance(value, Mapping):
        raise RequestError("finish_tokens", f"must map a finish event to token ids, got {type(value).__name__}")
    declared = token_checks()
    out = []
    for event, ids in sorted(value.items(), key=lambda kv: str(kv[0])):
        if event not in declared:
            raise RequestError("finish_tokens", f"{event!r} is not a token finish check of spec/lifecycle.toml "
                               f"(declared: {', '.join(declared) or 'none'})")
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
            raise RequestError("finish_tokens", f"{event!r} must list token ids")
        for x in ids:
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise RequestError("finish_tokens", f"{event!r} holds {x!r}, not a non-negative int")
        out.append((event, frozenset(ids)))
    return tuple(out)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias}: added to that token's logit before every choice (§4.3 choose, D32).
    Its own result (sorted pairs) converts to itself."""
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise RequestError("logit_bias", f"must map token ids to numbers, got {type(value).__name__}")
    out = []
    for tid, bias in value.items():
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise RequestError("logit_bias", f"key {tid!r} is not a token id (a non-negative int)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError("logit_bias", f"token {tid}: the bias must be a number in [-100, 100], got {bias!r}")
        out.append((tid, float(bias)))
    return tuple(sorted(out))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(field: str, v: Any, lo: float, hi: float, *, low_open: bool = False, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not _is_number(v) or not (lo < v if low_open else lo <= v) or not v <= hi:
        raise RequestError(field, f"must be a number in {'(' if low_open else '['}{lo:g}, {hi:g}], got {v!r}")


def _flag(field: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise RequestError(field, f"must be true or false, got {v!r}")


def _positive_int(field: str, v: Any, *, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not _is_int(v) or v < 1:
        raise RequestError(field, f"must be an int >= 1, got {v!r}")


def _top_p(field: str, v: Any) -> None:
    if v is not None and not (_is_number(v) and 0 < v <= 1):
        raise RequestError(field, f"must be in (0, 1], got {v!r}")


def _seed(field: str, v: Any) -> None:
    if v is not None and not _is_int(v):
        raise RequestError(field, f"must be an int, got {v!r}")


def _deadline(field: str, v: Any) -> None:
    if v is not None and (not _is_number(v) or v < 0):
        raise RequestError(field, f"must be a number of seconds >= 0, got {v!r}")


def _logprobs(field: str, v: Any) -> None:
    if v is not None and not (_is_int(v) and 0 <= v <= 20):
        raise RequestError(field, f"must be an int in [0, 20] or None, got {v!r}")


def _policy(field: str, v: Any) -> None:
    if v not in ("pause", "buffer", "fail"):
        raise RequestError(field, f"must be one of pause, buffer, fail; got {v!r}")


_FLAGS = frozenset({"utf8_guard", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "echo",
                    "score"})
# Each checked Request field's own check (§4.3 normalize_request, D9): RequestError names the field.
_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "max_output_tokens": _positive_int,
    "top_k": partial(_positive_int, allow_none=True),
    "temperature": partial(_number, lo=0, hi=100),
    "top_p": _top_p,
    "seed": _seed,
    "deadline_s": _deadline,
    "presence_penalty": partial(_number, lo=-2, hi=2),
    "frequency_penalty": partial(_number, lo=-2, hi=2),
    "repetition_penalty": partial(_number, lo=0, hi=10, low_open=True),
    "min_p": partial(_number, lo=0, hi=1, allow_none=True),
    "logprobs": _logprobs,
    "policy": _policy,
    **dict.fromkeys(_FLAGS, _flag),
}


def _check(inst: Request, attribute: attrs.Attribute, value: Any) -> None:
    """A Request field's check from _CHECKS."""
    _CHECKS[attribute.name](attribute.name, value)


def _min_tokens(inst: Request, attribute: attrs.Attribute, value: Any) -> None:
    """min_tokens: an int >= 0, at most max_output_tokens (a guard the budget can meet, D31)."""
    if not _is_int(value) or value < 0:
        raise RequestError(attribute.name, f"must be an int >= 0, got {value!r}")
    if isinstance(inst.max_output_tokens, int) and value > inst.max_output_tokens:
        raise RequestError(attribute.name, f"must not exceed max_output_tokens ({inst.max_output_tokens}), got {value}")


@attrs.frozen(kw_only=True, init=False)
class Request:
    """What the client asked for (docs/concepts.md, "Using it as a library"); immutable once built."""

    prompt: str | tuple[int, ...] = attrs.field(converter=_prompt)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stops)
    stop_token_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_stop_ids)
    max_output_tokens: int = attrs.field(default=16, validator=_check)
    temperature: float = attrs.field(default=0.0, validator=_check)
    top_k: int | None = attrs.field(default=None, validator=_check)
    top_p: float | None = attrs.field(default=None, validator=_check)
    seed: int | None = attrs.field(default=None, validator=_check)
    deadline_s: float | None = attrs.field(default=None, validator=_check)
    grammar: Grammar | None = attrs.field(default=None, converter=as_grammar)
    # Mask tokens that would make the output invalid UTF-8 (runtime/utf8_guard.py, DECISIONS D16).
    utf8_guard: bool = attrs.field(default=False, validator=_check)
    # Unguessable (a CSPRNG, 96 bits): over HTTP the id is the capability to cancel or replay a request.
    request_id: str = attrs.field(default=None, converter=lambda v: v if v else f"req-{secrets.token_hex(12)}")
    policy: str = attrs.field(default="pause", validator=_check)
    max_buffer_events: int = 256
    max_buffer_bytes: int = 1 << 20
    content_policy: Any = None  # callable(bytes_so_far, new_chunk) -> bool (True: interrupt), D11
    # Token ids that fire a token finish check of the lifecycle table ({"tool_call": [id, ...]}):
    # such a token is not text, like EOS (D4).
    finish_tokens: tuple[tuple[str, frozenset[int]], ...] = attrs.field(factory=dict, converter=_finish_tokens)
    # How the logits are shaped before each choice (runtime/sampling.py, DECISIONS D32).
    min_p: float | None = attrs.field(default=None, validator=_check)
    presence_penalty: float = attrs.field(default=0.0, validator=_check)
    frequency_penalty: float = attrs.field(default=0.0, validator=_check)
    repetition_penalty: float = attrs.field(default=1.0, validator=_check)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(factory=dict, converter=_logit_bias)
    # The guards of the lifecycle table's finish checks (spec/lifecycle.toml [finish_guards], D31):
    # the first min_tokens tokens, and with ignore_eos every token, cannot end the run by EOS.
    min_tokens: int = attrs.field(default=0, validator=_min_tokens)
    ignore_eos: bool = attrs.field(default=False, validator=_check)
    # What the output holds (D33): a stop string's own bytes at its end; special tokens' bytes;
    # the prompt's bytes in front (echo), through the detokenizer's rules.
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_check)
    skip_special_tokens: bool = attrs.field(default=True, validator=_check)
    echo: bool = attrs.field(default=False, validator=_check)
    # Keep the sum of the chosen tokens' log-probabilities (best_of ranks choices by it, D34).
    score: bool = attrs.field(default=False, validator=_check)
    # Keep each selected token's log-probability and this many most likely alternatives (None:
    # none kept); the server reports them with the text they spell (D59).
    logprobs: int | None = attrs.field(default=None, validator=_check)

    def __init__(self, prompt: str | Sequence[int], **kw: Any) -> None:  # positional prompt, rest keywords
        self.__attrs_init__(prompt=prompt, **kw)
