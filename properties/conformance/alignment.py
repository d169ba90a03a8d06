"""Per-token reports against the text of each stream chunk (§4.5-§4.7, DECISIONS D59).

A case whose invariant is `stream_tokens_aligned` is sent once more, streamed, asking for what the
engine can report per token: logprobs (completions: `logprobs: 1`; chat: `logprobs: true,
top_logprobs: 1`) and vLLM's `return_token_ids` (dropped when the server refuses it). Each chunk's
entries are read (`chunk_reports`) and judged against the forced script (`judge_alignment`):

1. over the whole stream the entries are the tokens the reference selected, in order, each once
   (`tokens_lost`, `tokens_extra`, `tokens_wrong`); the last one may be left out when it is not
   text (the EOS or stop token that ended the run: D15 counts it either way);
2. after every chunk the text so far is a byte prefix of the entries' bytes so far
   (`text_before_token` where the text runs ahead, `token_bytes_differ` where they disagree);
3. before the finish chunk the entries lead the text only by an unfinished UTF-8 character and at
   most (the longest stop string - 1) characters a stop may still take (`tokens_ahead`).

The stream asking for reports (`stream_reported`) is also where a script case whose stream holds
text back for a stop judges its hold-back (§4.6, judgement.judge_observed): a case sends it once for
both (`stream_for_reports`).

An entry's bytes are the engine's own where it gives them (chat `bytes`; a completions token string
that is whole text), else the script token's (a token id, a string that cannot show its bytes:
`bytes:\\x..`, U+FFFD, vLLM's `token_id:N`); a not-text token (EOS, a special token where the
request skips special tokens) spells nothing.
A stream that reports no entries at all leaves the case n/a.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ...runtime.tokenizers import TokenIdError, own_bytes
from .adapters.base import Finding
from .symptoms import Expected, finding
from .wire import Streamed, first_choice, logprob_pieces, token_ids

INVARIANT = "stream_tokens_aligned"
_LOSSY = ("bytes:", "token_id:")


def aligned(case: Any) -> bool:
    """Whether the case judges per-token reports (its invariant is stream_tokens_aligned)."""
    return getattr(case, "invariant", None) == INVARIANT


def ask(body: dict[str, Any], chat: bool, ids: bool = True) -> dict[str, Any]:
    """`body` streamed, asking for logprobs (one alternative) and, with `ids`, vLLM's token ids."""
    out = {**body, "stream": True, **({"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1})}
    out.pop("stream_options", None)
    return {**out, "return_token_ids": True} if ids else out


def asks_reports(body: dict[str, Any]) -> bool:
    """Whether a request body asks for per-token reports (`ask`'s fields)."""
    return bool(body.get("logprobs") or body.get("return_token_ids"))


@attrs.frozen
class ChunkReport:
    """One choice chunk: its text (chat: content and reasoning), its token ids and its logprob
    pieces (chat: `bytes` where given, else `token`; completions: `tokens`), None where absent."""

    text: bytes
    ids: tuple[int, ...] | None
    pieces: tuple[bytes | str, ...] | None
    finish: bool

    @property
    def count(self) -> int | None:
        return len(self.ids) if self.ids is not None else len(self.pieces) if self.pieces is not None else None


def chunk_reports(st: Streamed) -> list[ChunkReport]:
    """Every choice chunk of a stream (choice 0), in order, with what it reports."""
    out = []
    for choice in st.choices():
        if choice.get("index", 0) != 0:
            continue
        if "delta" in choice:
            d = choice.get("delta") or {}
            text = "".join(t for t in (d.get("reasoning_content") or d.get("reasoning"), d.get("content"))
                           if isinstance(t, str))
        else:
            given = choice.get("text")
            text = given if isinstance(given, str) else ""
        out.append(ChunkReport(text.encode("utf-8"), token_ids(choice), logprob_pieces(choice.get("logprobs")),
                               bool(choice.get("finish_reason"))))
    return out


def message_report(data: Any, chat: bool) -> ChunkReport | None:
    """A non-streamed answer's choice 0 as one chunk (None when it is no answer)."""
    c = first_choice(data)
    if not c:
        return None
    holder = c.get("message") if chat else c
    text = holder.get("content" if chat else "text") if isinstance(holder, dict) else None
    text = text if isinstance(text, str) else ""
    return ChunkReport(text.encode("utf-8"), token_ids(c), logprob_pieces(c.get("logprobs")), True)


def reports_tokens(reports: Sequence[ChunkReport]) -> bool:
    return any(r.ids is not None or r.pieces is not None for r in reports)


@attrs.frozen
class Want:
    """What the reference selected: `tokens` in order; whether the last is no text (may be left out);
    `unsent`: how many last tokens a run that failed never sent a byte of (they may be left out);
    `echo`: the text before the first token (the prompt, echoed: D33); `sent`: how many bytes the
    whole answer sends (its output, the echo included; None: unknown), so a token's bytes past it, cut by a stop
    inside that token, are never text the chunks still owe."""

    tokens: tuple[int, ...]
    last_not_text: bool
    stops: tuple[str, ...]
    not_text: frozenset[int]
    unsent: int = 0
    echo: bytes = b""
    sent: int | None = None


def _token_bytes(tok: Any, tid: int, not_text: frozenset[int]) -> bytes:
    return b"" if tid in not_text else own_bytes(tok, tid)


def _piece_bytes(tok: Any, piece: bytes | str | None, tid: int | None, not_text: frozenset[int]) -> bytes:
    """The bytes one entry spells: the engine's own where it shows them, else its token's (an id the
    tokenizer has not spells nothing: `tokens_wrong` names it)."""
    if tid is not None and tid in not_text:
        return b""
    if isinstance(piece, bytes):
        return piece
    if isinstance(piece, str) and "\ufffd" not in piece and not piece.startswith(_LOSSY):
        return piece.encode("utf-8")
    try:
        return b"" if tid is None else _token_bytes(tok, tid, not_text)
    except TokenIdError:
        return b""


def _matches(tok: Any, piece: bytes | str, tid: int, not_text: frozenset[int]) -> bool:
    """Whether a logprob piece can be token `tid`: its bytes, or a string it may be shown as."""
    if tid in not_text:
        return True  # a special token's own text differs by server ("</s>", "", its name)
    own = _token_bytes(tok, tid, not_text)
    if isinstance(piece, bytes):  # its bytes, or as servers show a piece of a character: U+FFFD, nothing, the
        # whole character at the token that completes it; whether they spell the text is rule 2's question
        return piece in (own, own.decode("utf-8", "replace").encode(), b"") or piece.endswith(own)
    return (piece == own.decode("utf-8", "replace") or piece.startswith(_LOSSY) or "\ufffd" in piece
            or piece == tok.decode([tid]))


def _held(lag: bytes, stops: Sequence[str]) -> str | None:
    """None when `lag` (the entries' bytes past the text, before the finish) may be held: an
    unfinished character at its end, and before it at most longest-stop - 1 characters; else why not."""
    cut = len(lag)
    for k in range(1, min(3, len(lag)) + 1):  # an unfinished character at the end
        lead = lag[-k]
        if lead & 0xC0 != 0x80:
            need = 1 if lead < 0x80 else 2 if lead >> 5 == 6 else 3 if lead >> 4 == 14 else 4
            cut = len(lag) - k if k < need else len(lag)
            break
    try:
        chars = len(lag[:cut].decode("utf-8"))
    except UnicodeDecodeError:
        return f"{lag!r} is no text the chunk could still send"
    room = max((len(s) for s in stops), default=1) - 1
    if chars > room:
        return (f"{chars} character(s) {lag[:cut].decode('utf-8')!r} ahead of the text, more than "
                + (f"the {room} a stop of {room + 1} characters may hold" if stops else "nothing: the request has no stop strings"))
    return None


def judge_alignment(reports: Sequence[ChunkReport], want: Want, tok: Any, where: str) -> list[Finding]:
    """D59's three rules over one answer's chunks (see module); [] when they hold."""
    ids, pieces = _entries(reports)
    n = len(ids) if ids is not None else len(pieces or [])
    return [*_count_findings(n, want, where), *_token_findings(ids, pieces, want, tok, where),
            *_chunk_findings(reports, want, tok, where)]


def _entries(reports: Sequence[ChunkReport]) -> tuple[list[int] | None, list[bytes | str] | None]:
    """The answer's token ids and its logprob pieces, each over all its chunks; None where a chunk
    with entries does not report that kind."""
    ids = [i for r in reports for i in (r.ids or ())] if all(r.ids is not None for r in reports if r.count) else None
    pieces = [p for r in reports for p in (r.pieces or ())] if all(r.pieces is not None for r in reports if r.count) \
        else None
    return ids, pieces


def _count_findings(n: int, want: Want, where: str) -> list[Finding]:
    """Rule 1's count: every token the run selected reported once, the last one left out where it
    is not text or was never sent (D15)."""
    full = len(want.tokens)
    spare = max(int(want.last_not_text), want.unsent)
    if full - spare <= n <= full:
        return []
    leave = (f"the last {want.unsent}, never sent before the run failed, may be left out" if want.unsent else
             "the last, not text, may be left out" if want.last_not_text else "each once")
    return [finding("tokens_lost" if n < full - spare else "tokens_extra",
                    f"{where}: {n} token(s) reported, the run selected {full} ({leave})")]


def _token_findings(ids: list[int] | None, pieces: list[bytes | str] | None, want: Want, tok: Any,
                    where: str) -> list[Finding]:
    """Rule 1's order: the first reported entry (an id, else a piece) that is not the token the run
    selected there."""
    full = list(want.tokens)
    if ids is not None:
        bad = next((k for k, (g, w) in enumerate(zip(ids, full)) if g != w), None)
        return [] if bad is None else [
            finding("tokens_wrong", f"{where}: token {bad + 1} reported as id {ids[bad]}, the run selected "
                                    f"{full[bad]} (reported {ids[:12]}, selected {full[:12]})")]
    if pieces is None:
        return []
    bad = next((k for k, (g, w) in enumerate(zip(pieces, full)) if not _matches(tok, g, w, want.not_text)), None)
    return [] if bad is None else [
        finding("tokens_wrong", f"{where}: token {bad + 1} reported as {pieces[bad]!r}, the run selected "
                                f"id {full[bad]} {_token_bytes(tok, full[bad], want.not_text)!r}")]


def _chunk_findings(reports: Sequence[ChunkReport], want: Want, tok: Any, where: str) -> list[Finding]:
    """Rules 2 and 3, chunk by chunk, on the bytes the entries spell: the first chunk after which
    the text is no prefix of them, or they run further ahead of it than a hold-back explains."""
    spelled, text, k = bytearray(want.echo), bytearray(), 0
    for c, r in enumerate(reports):
        spelled += _spelled_by(r, want, tok, k)
        k += r.count or 0
        text += r.text
        if not bytes(spelled).startswith(bytes(text)):
            common = next((i for i, (a, b) in enumerate(zip(spelled, text)) if a != b), min(len(spelled), len(text)))
            kind = "text_before_token" if common == len(spelled) else "token_bytes_differ"
            return [finding(kind, f"{where}: after chunk {c + 1} the text is {bytes(text)[-40:]!r} but its "
                                  f"{k} reported token(s) spell {bytes(spelled)[-40:]!r}")]
        # the echoed prompt is text no token spells, and the bytes a stop cut are never sent: only the
        # tokens' bytes past the text and within the answer can run ahead
        end = len(spelled) if want.sent is None else min(len(spelled), want.sent)
        if not r.finish and (why := _held(bytes(spelled[max(len(text), len(want.echo)):end]), want.stops)):
            return [finding("tokens_ahead", f"{where}: after chunk {c + 1} the reported tokens run {why}")]
    return []


def _spelled_by(r: ChunkReport, want: Want, tok: Any, k: int) -> bytes:
    """The bytes chunk `r`'s entries spell, its first entry the run's token k (an entry's own id
    where the chunk reports ids, else the selected token's)."""
    out = bytearray()
    for j in range(r.count or 0):
        tid = r.ids[j] if r.ids is not None else want.tokens[k + j] if k + j < len(want.tokens) else None
        piece = r.pieces[j] if r.pieces is not None and j < len(r.pieces) else None
        out += _piece_bytes(tok, piece, tid, want.not_text)
    return bytes(out)


def want_of(a: Any, case: Any) -> Want:
    """What the reference selected for `case` on the served checkpoint (a ScriptServer's)."""
    res = a.reference(case)
    tok = a.checkpoint.tokenizer
    # a special token is text where the request keeps special tokens (D33): an EOS a guard passed over too
    shown = case.inputs.get("request", {}).get("skip_special_tokens") is False
    not_text = frozenset() if shown else frozenset(getattr(tok, "special_ids", ())) | {a.checkpoint.eos_id}
    ends = not_text | {a.checkpoint.eos_id} | {s[0] for s in case.inputs.get("stop_token_ids") or () if len(s) == 1}
    tokens = tuple(res.tokens)
    echo = (tok.decode_bytes(list(a.checkpoint.programs[case.id].prompt))
            if case.inputs.get("request", {}).get("echo") else b"")
    unsent = _unsent(res, tokens, tok, not_text, len(res.output) - len(echo)) if res.state.name == "FAILED" else 0
    return Want(tokens, bool(tokens) and tokens[-1] in ends, tuple(case.inputs.get("stop") or ()), not_text,
                unsent, echo, len(res.output))  # the reference's output holds the echo


def _unsent(res: Any, tokens: Sequence[int], tok: Any, not_text: frozenset[int], sent: int) -> int:
    """How many last tokens of a failed run sent none of their bytes: those selected after its last
    delta, and those whose bytes stood past the `sent` bytes of its output (held for a stop that
    might still match, or an unfinished character, when it failed: §4.6, D12)."""
    after = 0
    for e in res.events:
        after = 0 if e.kind == "response.delta" else after + (e.kind == "token.selected")
    at, last = 0, 0  # bytes before token k; the last token with a byte sent
    for k, t in enumerate(tokens, 1):
        size = len(_token_bytes(tok, t, not_text))
        last = k if size and at < sent else last
        at += size
    return max(after, len(tokens) - last)


def stream_reported(a: Any, path: str, body: dict[str, Any], chat: bool) -> tuple[Streamed, bool]:
    """`body` streamed asking for per-token reports (`ask`), and whether the request that answered
    asks for token ids: a server that refuses vLLM's return_token_ids (4xx) is asked for logprobs alone."""
    st = a.stream_body(path, ask(body, chat))
    if 400 <= st.status < 500:
        return a.stream_body(path, ask(body, chat, ids=False)), False
    return st, True


def stream_for_reports(a: Any, case: Any, held: Expected | None, plain: Streamed, body: dict[str, Any], path: str,
                       chat: bool) -> tuple[Streamed, bool] | None:
    """The stream asking for per-token reports (`stream_reported`) where a script case needs one:
    its reports are judged (`aligned`), or its stream holds text back for a stop (`held`, the
    reference's answer, §4.6) and its `plain` stream showed nothing of the tokens behind its chunks
    (D59); else None. One per case: the sweep's limits send none."""
    if aligned(case) or (held is not None and held.holds_back and not plain.timeline().shows_tokens):
        return stream_reported(a, path, body, chat)
    return None


def run_alignment(a: Any, case: Any, body: dict[str, Any], path: str, chat: bool,
                  reported: tuple[Streamed, bool] | None = None) -> tuple[list[Finding], str | None]:
    """Send `body` streamed and not, asking for per-token reports, and judge both (D59): (findings,
    None), or ([], why the case is n/a: the engine reports nothing per token). `reported` is the
    stream already sent (`stream_reported`), where the caller sent it."""
    st, ids = reported or stream_reported(a, path, body, chat)
    reports = chunk_reports(st)
    if st.status != 200 or not reports_tokens(reports):
        return [], (f"the engine reports no logprobs or token ids with a stream (status {st.status}"
                    f"{': ' + str(st.error)[:200] if st.error else ''}): nothing to align (D59)")
    want = want_of(a, case)
    tok = a.checkpoint.tokenizer
    found = judge_alignment(reports, want, tok, "stream")
    status, data, _ = a.post(path, {**ask(body, chat, ids=ids), "stream": False})
    whole = message_report(data, chat) if status == 200 else None
    if whole is not None and whole.count is not None:
        found += judge_alignment([whole], want, tok, "non-streamed answer")
    return found, None
