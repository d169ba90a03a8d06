"""Which tokens a stream chunk reports, and their log-probabilities (§4.5, §4.6, §4.7; DECISIONS D59).

§4.7 keeps three timelines apart: the model selects a token, the server sends bytes, the client
draws. A chunk that carries per-token data (logprob entries, token ids) ties the first two together,
so it must say which selected tokens the text it carries comes from. §4.5 states the tie for the
whole output: the bytes sent, with the detokenizer's final buffer, are the batch decode of the
selected tokens, minus the stretches recorded as cut (a stop string, a control token). D59 applies
it chunk by chunk, and `Releaser` is the reference's side of it:

- a token is reported by the first chunk that sends any of its bytes (`start < released`): a
  chunk never carries text of a token not yet reported, and what a token has still held back (a
  possible stop's prefix, §4.6; the rest of a character, §4.5) follows in a later chunk's text;
- a token none of whose bytes is ever sent (EOS and the other not-text tokens, a token whose bytes
  a stop cut) is reported by the next chunk that sends a byte of a later token, or by the finish
  chunk, which reports every selected token not reported yet: each selected token exactly once,
  in order, so the entries count what usage.completion_tokens counts (D7).

A chunk also says when it went out, in the run's own terms: `selected(seq)` is how many tokens
the run had selected when it released the delta `seq` (token.selected and response.delta in its
trace), the selection timeline §4.6's hold-back is judged by, which the reports above, tied to the
text, do not show (a token held whole is reported with a later chunk).

Where the bytes of a token are comes from the run's byte marks (`RequestRun.byte_marks`: the
detokenizer's output through each token, held bytes included), never from re-decoding: a token's
entry holds exactly the bytes the detokenizer made of it (`TokenEntry.data`, None when it made
none). `token_scores` is the per-token log-probability the run keeps when its request asks
(`Request.logprobs`): log-softmax of the model's logits at that step, before any shaping (as vLLM's
default `raw_logprobs`), with the `top` most likely alternatives.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from .tokenizers import own_bytes

LOGPROB_FLOOR = -9999.0  # what OpenAI and vLLM send for a probability of zero (JSON has no -inf)


@attrs.frozen
class TokenEntry:
    """One selected token as a chunk reports it: its 0-based place in the output, its id, the bytes
    the detokenizer made of it (None: none, e.g. EOS), where its text starts in the answer's text
    (characters), and its log-probability with the top alternatives (None when not asked)."""

    index: int
    token_id: int
    data: bytes | None
    offset: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def token_scores(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(log p(token), the `top` most likely (id, log p), most likely first) from one step's logits [V]."""
    lp = torch.log_softmax(logits.detach().to(torch.float32), dim=-1)
    chosen = max(float(lp[token]), LOGPROB_FLOOR)
    if top <= 0:
        return chosen, ()
    values, ids = torch.topk(lp, min(top, lp.shape[0]))
    return chosen, tuple((int(i), max(float(v), LOGPROB_FLOOR)) for v, i in zip(values.tolist(), ids.tolist()))


class ScoreLog(list[tuple[float, tuple[tuple[int, float], ...]]]):
    """Each selected token's token_scores with its `top` alternatives, in order (D59): kept for a
    request that asks for logprobs; append-only, read by index as the engine thread appends."""

    __slots__ = ("top",)

    def __init__(self, top: int) -> None:
        super().__init__()
        self.top = top

    def record(self, logits: torch.Tensor, token: int) -> None:
        """Append `token`'s scores from the logits it was chosen from."""
        self.append(token_scores(logits, token, self.top))


class Releaser:
    """One reader's view of one run: feed it the stream's delta bytes in order (`delta`), then
    `finish()` once the run ended; each call returns the entries that chunk reports (D59). Reads
    the run's tokens, byte marks and scores as the engine thread appends them (append-only lists:
    every entry a chunk needs was written before the chunk's bytes were put on the stream)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._echo = int(getattr(run, "echo_len", 0) or 0)  # the echoed prompt is no token's (D33)
        self._text = bytearray()  # the output's bytes sent so far, the echo aside
        self._next = 0  # the first token not reported yet
        self._pos = 0  # offset bookkeeping: a byte position in _text and the characters before it
        self._chars = 0
        self._echo_chars = 0  # text offsets count the echoed prompt's characters too
        self._read = 0  # the run's trace events read so far (`selected`)
        self._selected = 0  # tokens selected as of the last event read
        self._at: dict[int, int] = {}  # delta seq -> tokens selected when it was released

    def delta(self, data: bytes) -> list[TokenEntry]:
        """The entries of a chunk that sends `data`: the tokens whose first byte is now sent, and
        the byteless ones before them."""
        if self._echo:
            skip = min(self._echo, len(data))
            self._echo -= skip
            self._echo_chars += sum(1 for b in data[:skip] if b & 0xC0 != 0x80)
            data = data[skip:]
        self._text += data
        sent = len(self._text)
        marks = self.run.byte_marks
        upto = self._next
        while upto < len(self.run.tokens) and upto <= len(marks) and (marks[upto - 1] if upto else 0) < sent:
            upto += 1
        return self._entries(upto)

    def selected(self, seq: int) -> int:
        """How many tokens the run had selected when it released delta `seq` (its trace is written
        before the delta reaches a reader)."""
        for e in self.run.trace.since(self._read):
            self._read += 1
            if e.kind == "token.selected":
                self._selected = e.data["step"]
            elif e.kind == "response.delta":
                self._at[e.data["seq"]] = self._selected
        return self._at.pop(seq)

    def finish(self) -> list[TokenEntry]:
        """The finish chunk's entries: every selected token not reported yet."""
        return self._entries(len(self.run.tokens))

    def _entries(self, upto: int) -> list[TokenEntry]:
        run, marks = self.run, self.run.byte_marks
        scores = getattr(run, "scores", None)
        out = []
        for i in range(self._next, upto):
            start = marks[i - 1] if i else 0
            end = marks[i] if i < len(marks) else start
            out.append(TokenEntry(i, run.tokens[i], self._bytes(run.tokens[i], start, end), self._offset(start),
                                  *(scores[i] if scores is not None and i < len(scores) else (None, ()))))
        self._next = max(self._next, upto)
        return out

    def _bytes(self, token: int, start: int, end: int) -> bytes | None:
        """What the detokenizer made of the token: the sent bytes in its span, and past what is sent
        (held, or cut by a stop) the tail of the token's own bytes."""
        if end <= start:
            return None
        sent = bytes(self._text[start:min(end, len(self._text))])
        if len(sent) == end - start:
            return sent
        own = own_bytes(self.run.tokenizer, token)
        missing = end - start - len(sent)
        return sent + own[-missing:] if missing <= len(own) else sent + own

    def _offset(self, start: int) -> int:
        """The character of the sent text where byte `start` lies (a token that begins inside a
        character begins at that character; past what is sent: the text's length)."""
        stop = min(start, len(self._text))
        if stop < self._pos:
            self._pos, self._chars = 0, 0
        self._chars += sum(1 for b in self._text[self._pos:stop] if b & 0xC0 != 0x80)
        self._pos = stop
        inside = stop < len(self._text) and self._text[stop] & 0xC0 == 0x80
        return self._echo_chars + (self._chars - 1 if inside and self._chars else self._chars)
