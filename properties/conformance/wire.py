"""The OpenAI stream as it came over the wire: every SSE line kept, and its conventions checked.

`parse_sse(text)` reads a whole `text/event-stream` body into a `Streamed`: every event's data in
order (empty chunks included: an empty delta is a finding, not noise), the SSE `id:` fields, [DONE]
and what follows it. The body is read as the event-stream grammar reads it (DECISIONS D64): a line
ends at CRLF, LF or CR and nowhere else (`SseLines`), and an event is its `data:` lines joined by
LF, dispatched at a blank line. `str.splitlines` and httpx's `iter_lines` also end a line at
U+2028, U+2029, U+0085 and five C0 separators; JSON carries the first three unescaped, so a model's
text holding one of them would read as two broken data lines, a false "malformed" finding and a
lost delta. The chunks are folded into what chapter 4 judges (the deltas, the finish reasons, text
after the finish chunk) by `Streamed`'s properties, so a report re-judged from the raw text sees
exactly what the live run saw. Each chunk's fields are checked against the API's types first
(CHUNK, ANSWER), and a live stream is bounded (`Watch`).

`wire_findings` checks the API's own conventions ([DONE], JSON lines, finish_reason values, SSE
and chunk ids, the usage chunk); they are the "wire" family of symptoms.py, graded by the
convention and never as a §4.x MUST (§4.7's rule is one terminal event, which a stream without
[DONE] can still keep).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import httpx

from .adapters.base import Finding
from .symptoms import Timeline, finding

API_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls", "function_call"})


def trim_middle(text: str, cap: int = 24000) -> str:
    """`text` whole up to `cap` characters, else its head and tail with the middle cut (the tail holds
    the finish chunk, the usage chunk and [DONE], where framing faults live)."""
    if len(text) <= cap:
        return text
    half = cap // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"


@attrs.define
class Streamed:
    """One streamed response: status, every parsed chunk, and the SSE framing around them."""

    status: int = 0
    error: str | None = None  # a non-200 body, or an in-band {"error": ...} chunk
    error_events: int = 0  # events of type `error`
    chunks: list[dict[str, Any]] = attrs.field(factory=list)  # every JSON event's object, in order
    sse_ids: list[str] = attrs.field(factory=list)
    done: bool = False
    data_after_done: int = 0
    malformed: list[str] = attrs.field(factory=list)
    events: int = attrs.field(default=0, repr=False, eq=False)  # events dispatched, of any kind
    # the event being read: its `data:` lines and its `event:` type, until a blank line dispatches it
    pending: list[str] = attrs.field(factory=list, repr=False, eq=False)
    pending_type: str = attrs.field(default="", repr=False, eq=False)

    # ---- chapter 4's view of the chunks ---------------------------------------------------------

    def choices(self) -> Iterator[dict[str, Any]]:
        """Every choice of every chunk, in the order they came."""
        for chunk in self.chunks:
            yield from chunk.get("choices") or []

    def _fold(self) -> tuple[list[str], list[str], list[str]]:
        """(texts sent before the first finish chunk, including empty ones; finish reasons; text after)."""
        texts: list[str] = []
        reasons: list[str] = []
        after: list[str] = []
        for choice in self.choices():
            text = _choice_text(choice)
            if choice.get("finish_reason"):
                if text and not reasons:
                    texts.append(text)  # the finish chunk may carry the last delta
                elif text:
                    after.append(text)
                reasons.append(choice["finish_reason"])
            elif text is not None:
                (after if reasons else texts).append(text)
        return texts, reasons, after

    @property
    def texts(self) -> list[str]:
        """Every text sent before the finish chunk, from the first non-empty one on: empty chunks
        before any text are the stream's opening (several servers send one, as response.start)."""
        texts = self._fold()[0]
        return texts[next((i for i, t in enumerate(texts) if t), len(texts)):]

    def timeline(self, where: str = "the stream") -> Timeline:
        """The chunks before the finish chunk, opening ones too, as hold-back reads them
        (symptoms.Timeline, named `where` in findings): their texts, the tokens reported through
        each (token ids or logprobs entries, D59), the tokens the whole stream reported (its finish
        chunk's too), and the tokens the engine had selected when each went out where it says so
        (`decodespec.selected`, the reference's)."""
        texts: list[bytes] = []
        reported: list[int] | None = []
        selected: list[int] | None = []
        n = said = 0
        total = sum(reported_tokens(c) or 0 for c in self.choices())
        for choice in self.choices():
            if choice.get("finish_reason"):
                break
            text = _choice_text(choice)
            got = reported_tokens(choice)
            n += got or 0
            detail = choice.get("decodespec")
            clock = detail.get("selected") if isinstance(detail, dict) else None
            said = clock if isinstance(clock, int) else said
            if text is None:
                continue
            texts.append(text.encode())  # a chunk with no text needs to say nothing
            reported = None if reported is None or (got is None and text) else [*reported, n]
            selected = None if selected is None or (clock is None and text) else [*selected, said]
        return Timeline(tuple(texts), tuple(reported) if reported is not None and n else None,
                        tuple(selected) if selected is not None and said else None, where, total if n else None)

    @property
    def deltas(self) -> list[str]:
        return [t for t in self.texts if t]

    @property
    def empty_deltas(self) -> int:
        return sum(1 for t in self.texts if not t)

    @property
    def finish_reasons(self) -> list[str]:
        return self._fold()[1]

    @property
    def content_after_finish(self) -> list[str]:
        return self._fold()[2]

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def choice(self, index: int) -> Streamed:
        """The stream of choice `index` alone (n > 1 interleaves the choices' chunks)."""
        chunks = [{**c, "choices": [x for x in c.get("choices") or [] if x.get("index", 0) == index]}
                  for c in self.chunks]
        return attrs.evolve(self, chunks=[c for c in chunks if c["choices"] or c.get("usage")])

    @property
    def usage(self) -> dict[str, Any] | None:
        found = [c["usage"] for c in self.chunks if isinstance(c.get("usage"), dict)]
        return found[-1] if found else None


def _choice_text(choice: dict[str, Any]) -> str | None:
    """The text a choice chunk carries; None for one that carries no text field (a chat role chunk)."""
    if "delta" in choice:
        delta = choice.get("delta") or {}
        if "role" in delta and not delta.get("content"):
            return None  # the chat stream's opening chunk: the start, not a delta
        return delta.get("content") if "content" in delta else None
    return choice.get("text")


def logprob_pieces(lp: Any) -> tuple[bytes | str, ...] | None:
    """A choice's per-token pieces from its `logprobs`, one per entry: chat `content` (an entry's
    `bytes` where given, else its `token`), completions `tokens`; None when it has neither."""
    if not isinstance(lp, dict):
        return None
    if isinstance(lp.get("content"), list):
        return tuple(_entry_piece(c) for c in lp["content"])
    if isinstance(lp.get("tokens"), list):
        return tuple(str(t) for t in lp["tokens"])
    return None


def reported_tokens(choice: dict[str, Any]) -> int | None:
    """How many tokens one choice chunk reports: its `token_ids` (vLLM's return_token_ids), else its
    logprobs entries; None when it reports neither."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return len(ids)
    pieces = logprob_pieces(choice.get("logprobs"))
    return None if pieces is None else len(pieces)


def byte_values(raw: Any) -> bytes | None:
    """A logprobs entry's `bytes` field as bytes, where it is a list of byte values (0-255)."""
    if isinstance(raw, list) and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in raw):
        return bytes(raw)
    return None


def _entry_piece(entry: Any) -> bytes | str:
    """A chat logprobs entry's piece: its `bytes` where they are byte values, else its `token`."""
    if not isinstance(entry, dict):
        return ""
    raw = byte_values(entry.get("bytes"))
    return raw if raw is not None else str(entry.get("token", ""))


_EOL = re.compile(r"\r\n|\r|\n")


@attrs.define
class SseLines:
    """An event stream arriving in pieces, cut into its lines: each `push(piece)` returns the lines
    it completed; `end()` the last one when the body did not end with a line break. A CR that ends
    a piece ends its line at once; an LF opening the next piece is then the second half of CRLF."""

    rest: str = ""
    after_cr: bool = False

    def push(self, piece: str) -> list[str]:
        if self.after_cr and piece[:1] == "\n":
            piece = piece[1:]
            self.after_cr = False
        if piece:
            self.after_cr = piece[-1] == "\r"
        lines = _EOL.split(self.rest + piece)
        self.rest = lines.pop()
        return lines

    def end(self) -> list[str]:
        rest, self.rest = self.rest, ""
        return [rest] if rest else []


def sse_lines(pieces: Iterable[str]) -> Iterator[str]:
    """Every line of an event stream given in pieces (a response's `iter_text()`), the last one too."""
    lines = SseLines()
    for piece in pieces:
        yield from lines.push(piece)
    yield from lines.end()


def feed(out: Streamed, line: str) -> None:
    """One SSE line into `out`: a field of the event being read, or the blank line that dispatches it."""
    if not line:
        _dispatch(out)
        return
    if line[0] == ":":  # a comment (a keep-alive)
        return
    name, _, value = line.partition(":")
    if value[:1] == " ":
        value = value[1:]
    if name == "data":
        out.pending.append(value)
    elif name == "event":
        out.pending_type = value
    elif name == "id":
        out.sse_ids.append(value.strip())


def body_ended(out: Streamed) -> None:
    """The body ended: an event still being read counts as if its blank line had come (the grammar
    drops it, but a verdict should not hang on the last blank line of a body)."""
    _dispatch(out)


def _dispatch(out: Streamed) -> None:
    """One whole event: an `error` event, [DONE], or one JSON object (a chunk, or an in-band error)."""
    kind, out.pending_type = out.pending_type, ""
    if not out.pending:
        return
    payload = "\n".join(out.pending).strip()
    out.pending = []
    out.events += 1
    if kind == "error":
        out.error_events += 1
        out.error = out.error or _error_text(payload)
        return
    if out.done:
        out.data_after_done += 1
        return
    if payload == "[DONE]":
        out.done = True
        return
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError:
        out.malformed.append(f"not JSON: {payload[:80]}")
        return
    if not isinstance(chunk, dict):
        out.malformed.append(f"not an object: {payload[:80]}")
        return
    if chunk.get("error"):
        out.error = json.dumps(chunk["error"], ensure_ascii=False)[:500]
        return
    if (why := shape_error(chunk, CHUNK)) is not None:  # judged as sent it would mislead or break the reading
        out.malformed.append(f"{why}: {payload[:80]}")
        return
    out.chunks.append(chunk)


# The API's shape of what the judgement reads from an answer: each field, the JSON type it holds
# when present and not null, and for an object or a list of objects the shape of that object. A
# chunk that departs from it is a `malformed` wire finding and is left out, never read half-way.
Shape = dict[str, tuple[type | tuple[type, ...], "Shape | None"]]
FUNCTION: Shape = {"name": (str, None)}
CALL: Shape = {"index": (int, None), "function": (dict, FUNCTION)}
DELTA: Shape = {"content": (str, None), "reasoning_content": (str, None), "reasoning": (str, None),
                "tool_calls": (list, CALL)}
CHOICE: Shape = {"index": (int, None), "delta": (dict, DELTA), "text": (str, None), "finish_reason": (str, None)}
USAGE: Shape = {"completion_tokens": (int, None), "prompt_tokens": (int, None)}
CHUNK: Shape = {"choices": (list, CHOICE), "usage": (dict, USAGE), "id": ((str, int), None)}
ANSWER_CHOICE: Shape = {**{k: v for k, v in CHOICE.items() if k != "delta"}, "message": (dict, DELTA)}  # a whole message
ANSWER: Shape = {"choices": (list, ANSWER_CHOICE), "usage": (dict, USAGE)}
_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list", dict: "an object"}


def choices_of(data: Any) -> list[dict[str, Any]]:
    """A non-streamed answer's choices that are objects (an answer in another shape: body_findings)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def first_choice(data: Any) -> dict[str, Any]:
    """Choice 0 of a non-streamed answer; {} where it has none."""
    return next(iter(choices_of(data)), {})


def token_ids(choice: Any) -> tuple[int, ...] | None:
    """A choice's `token_ids` (vLLM's extension), None where absent or not a list of ids."""
    value = choice.get("token_ids") if isinstance(choice, dict) else None
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return tuple(value)
    return None


def token_count(usage: Any, field: str) -> int | None:
    """`usage[field]` where it is a whole count (an answer in another shape: body_findings says so)."""
    n = usage.get(field) if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def shape_error(value: Any, shape: Shape, at: str = "") -> str | None:
    """Where `value` (an object) departs from `shape`: 'choices[0].delta is a list, not an object'."""
    for name, (kind, inner) in shape.items():
        v = value.get(name)
        where = f"{at}.{name}" if at else name
        if v is None:
            continue
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
            wanted = " or ".join(_JSON_NAMES[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
            return f"{where} is {_JSON_NAMES.get(type(v), type(v).__name__)}, not {wanted}"
        if inner is None:
            continue
        for i, item in enumerate(v if isinstance(v, list) else [v]):
            here = f"{where}[{i}]" if isinstance(v, list) else where
            if not isinstance(item, dict):
                return f"{here} is {_JSON_NAMES.get(type(item), type(item).__name__)}, not an object"
            if (why := shape_error(item, inner, here)) is not None:
                return why
    return None


def _error_text(payload: str) -> str:
    """What an `error` event says: its JSON's `error` member where it has one, else its data."""
    try:
        error = json.loads(payload)
    except json.JSONDecodeError:
        return payload[:500]
    if isinstance(error, dict) and error.get("error"):
        error = error["error"]
    return json.dumps(error, ensure_ascii=False)[:500]


class EventTimeout(httpx.ReadTimeout):
    """Bytes kept coming but no event did (keep-alive comments only) for the read timeout: to the
    reader it is the silence a read timeout is about, and it is handled as one."""


class StreamOverrun(Exception):
    """A stream sent more events than its request could make and had not ended: the reader stops."""


class AnswerTimeout(httpx.ReadTimeout):
    """A non-streamed answer was not whole within the read timeout of its request, though bytes kept
    coming (whitespace before the JSON, as some proxies send to keep a connection open, or a body
    without end): handled as the read timeout it stands for."""


def whole_answer(client: httpx.Client, method: str, path: str, **kw: Any) -> httpx.Response:
    """`client.request(method, path, **kw)`, whole within the read timeout in force for it (its
    `timeout=` seconds, else the client's), counted from the request, or AnswerTimeout: an answer
    that is not a stream comes once, so bytes that trickle in (each resetting httpx's per-read
    timeout) can hold the judge no longer than silence does (D64)."""
    given = kw.get("timeout")
    within = given if isinstance(given, (int, float)) else client.timeout.read or 60.0
    start = time.monotonic()
    with client.stream(method, path, **kw) as r:
        body = bytearray()
        for piece in r.iter_bytes():
            body += piece
            if time.monotonic() - start > within:
                raise AnswerTimeout(f"the answer was not whole {within:g} s after the request, though bytes "
                                    f"kept coming ({len(body)} so far)", request=r.request)
        # the body as read is already decoded: its content-encoding, if any, no longer applies
        headers = [(k, v) for k, v in r.headers.multi_items() if k.lower() != "content-encoding"]
        return httpx.Response(r.status_code, headers=headers, content=bytes(body), request=r.request,
                              extensions=r.extensions)


@attrs.define
class Watch:
    """Bounds one live stream, so that no engine can hold a run forever: `check(out)` after each
    line raises EventTimeout when no event came for `idle_s` seconds, and StreamOverrun when
    `most` events came without an end. A server that says nothing at all meets the read timeout."""

    idle_s: float
    most: int
    seen: int = 0
    since: float = attrs.field(factory=time.monotonic)

    @classmethod
    def of(cls, body: Mapping[str, Any], idle_s: float) -> Watch:
        """The bound of a request: 16 events a token it may make (room for a server that streams a
        character, or a piece of a tool call's arguments, at a time), each of its choices, and 256 for
        the opening, finish, usage and [DONE] events (a body without a limit: 100 000). Only a stream
        that runs on without end meets it."""
        limit = body.get("max_tokens", body.get("max_completion_tokens"))
        choices = max(int(body.get("n") or 1), int(body.get("best_of") or 1))
        most = 16 * limit * choices + 256 if isinstance(limit, int) and limit >= 0 else 100_000
        return cls(idle_s, most)

    def check(self, out: Streamed) -> None:
        now = time.monotonic()
        if out.events != self.seen:
            self.seen, self.since = out.events, now
            if self.seen > self.most:
                raise StreamOverrun(f"{self.seen} events and no end, past the {self.most} its request can "
                                    "make: the reader stopped")
        elif now - self.since > self.idle_s:
            raise EventTimeout(f"no event for {now - self.since:.0f} s after event {self.seen}, though the "
                               "connection stayed busy (keep-alive comments only)")


def parse_sse(text: str, *, status: int = 200) -> Streamed:
    """A whole SSE body (as a report keeps it) into a Streamed."""
    out = Streamed(status=status)
    if status != 200:
        out.error = text[:500]
        return out
    for line in sse_lines((text,)):
        feed(out, line)
    body_ended(out)
    return out


def terminal_findings(st: Streamed) -> list[Finding]:
    """§4.7: exactly one terminal (a finish chunk, or an in-band error), and no text after it."""
    if st.status != 200:
        return []
    out = []
    ends = len(st.finish_reasons) + bool(st.error or st.error_events)
    if ends != 1:
        out.append(finding("two_terminals" if ends else "no_reason",
                           f"{len(st.finish_reasons)} chunks carry a finish_reason ({st.finish_reasons})"
                           + (f" and an error ({st.error or 'event: error'})" if st.error or st.error_events else "")
                           + (" before [DONE]" if st.done else "")))
    if st.content_after_finish:
        out.append(finding("content_after_finish", f"content after the finish chunk: {st.content_after_finish}"))
    return out


def unterminated(exchanges: Iterable[Mapping[str, Any]]) -> list[Finding]:
    """§4.7 on every stream a case recorded: one the server answered 200 and ended itself (the
    client neither cut it nor lost the connection) without a finish chunk or an error has no
    terminal: `no_reason` when [DONE] came, `stream_cut` when the body just ended. A recorded body cut
    in the middle (wire.trim_middle) keeps its tail, where the terminal is."""
    out = []
    for i, ex in enumerate(exchanges):
        ended_by_server = isinstance(ex, Mapping) and not ex.get("connection_failed") \
            and "cut" not in (ex.get("timing_s") or {})
        if not ended_by_server or "sse" not in ex or ex.get("status") != 200:
            continue
        st = parse_sse(str(ex["sse"]))
        if st.finish_reasons or st.error or st.error_events:
            continue
        req = ex.get("request") or {}
        what = ex.get("label") or f"stream {i + 1} ({req.get('method', 'POST')} {req.get('path', '?')})"
        done = ", then [DONE]" if st.done else " and the body ended"
        out.append(finding("no_reason" if st.done else "stream_cut",
                           f"{what}: the server answered 200, sent {len(st.deltas)} delta(s){done}, with no finish chunk "
                           "or error"))
    return out


def wire_findings(st: Streamed) -> list[Finding]:
    """The OpenAI stream conventions, each a "wire" finding (symptoms.WIRE_STATEMENTS)."""
    if st.status != 200:
        return []
    out: list[Finding] = []
    if not st.done and not (st.error or st.error_events):
        out.append(finding("done_missing", "the stream did not end with data: [DONE]"))
    if st.data_after_done:
        out.append(finding("data_after_done", f"{st.data_after_done} data line(s) after [DONE]"))
    if st.malformed:
        out.append(finding("malformed", f"data lines that are not chunks of the API's shape: {st.malformed}"))
    bad = sorted({r for r in st.finish_reasons if r not in API_REASONS})
    if bad:
        out.append(finding("reason_value", f"finish_reason {bad} is not one of {sorted(API_REASONS)}"))
    out += _id_findings(st.sse_ids, [c.get("id") for c in st.chunks if "choices" in c])
    return out


def sse_number(sse_id: str) -> int | None:
    """An SSE id as the number it spells in ASCII digits ('²' is a digit to str.isdigit, not to int)."""
    return int(sse_id) if sse_id.isascii() and sse_id.isdigit() else None


def _id_findings(sse_ids: list[str], chunk_ids: Iterable[Any]) -> list[Finding]:
    out = []
    nums = [n for n in map(sse_number, sse_ids) if n is not None]
    if len(nums) == len(sse_ids) and any(b <= a for a, b in zip(nums, nums[1:])):
        out.append(finding("sse_id", f"SSE ids do not strictly increase: {sse_ids[:20]}"))
    elif len(set(sse_ids)) != len(sse_ids):
        out.append(finding("sse_id", f"SSE ids repeat: {sse_ids[:20]}"))
    distinct = {i for i in chunk_ids if i is not None}
    if len(distinct) > 1:
        out.append(finding("chunk_id", f"one response's chunks carry {len(distinct)} different ids: {sorted(distinct, key=repr)[:5]}"))
    return out


def body_findings(status: int, body: Any, raw: str) -> list[Finding]:
    """A non-streamed answer against the API's shapes (wire conventions): `body` is its parsed JSON
    (None when it is none), `raw` its text. An error answer's `{"error": {"message": ...}}`, a 200
    answer's fields that the judgement reads (ANSWER)."""
    if status >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return []
        return [finding("error_body", f"the {status} answer is not {{\"error\": {{\"message\": ...}}}}: {raw[:200]!r}")]
    if status != 200:
        return []
    why = "not a JSON object" if not isinstance(body, dict) else shape_error(body, ANSWER)
    return [] if why is None else [finding("answer_shape", f"the answer's {why}: {raw[:200]!r}")]
