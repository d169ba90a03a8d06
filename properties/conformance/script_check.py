"""Did the engine follow the forced script, and what did it put in front of the prompt? (§4.3)

A forced checkpoint (forced.py) makes greedy decoding produce a case's script; an engine that
decodes otherwise (half precision it cannot carry, a sampling default the request did not
override, a prompt it shifted or wrapped) produces other tokens, and judging the case on them
would blame the engine's stop, stream or usage handling for what is a different run. So each
answer is first compared with the script, with the best evidence the engine gives:

- token ids: each returned id against the script's;
- logprob tokens: each token's bytes (llama-server's `bytes`) against the script token's; given as
  strings only, the text they spell, as below, or each the vocabulary piece of the script's token
  (vLLM's WordPiece `##中`);
- the text alone: against the script's text, ignoring whitespace and up to the first U+FFFD in
  either (a detokenizer may legitimately differ there, and the detokenizer cases judge that), so a
  token replaced by one that spells other characters is seen, and one that differs only in spaces
  or in bytes that are no character is not. The script's text is what it adds after the prompt
  (§4.5): a token's text can depend on what stands before it (WordPiece's `##.` spells `.` after a
  word, `##.` at the start of a sequence), so the script's tokens decoded alone are the script too.

`deviation(...)` returns None when the answer is the script's (up to where the case ends the
output: a stop, a limit), else a `Deviation` naming the first output token that differs, what the
engine chose there and the sentence a report shows as the run's ERROR, never as the case's FAIL.
`left_script(...)` applies it (and `banned_eos`) to the answers of one case, on /v1/completions (each
choice's token evidence and text) and on chat (the message's content, for a case without channels).

`banned_eos(...)` names one departure by its cause (DECISIONS D66): where the reference passes
over a guarded EOS as a token (ignore_eos, D31) and the engine writes other bytes in its place, the
engine banned the EOS and wrote its runner-up, so the guard the case is about never ran.

`detect_prefix(...)` reads the prefix probe's answer (forced.Probe: its marker alone as the prompt,
max_tokens 1, greedy): the first output token is `echo[p]` when the engine put p tokens in front
of the marker (a BOS, a chat template's opening), so one request tells the shift even from a
server that reports no `usage.prompt_tokens`. The programs themselves are read relative to their
marker, so such a prefix does not move them; a template that also adds tokens after the prompt
makes the probe answer no echo token, which `detect_prefix` reports as unknown.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from ...runtime.tokenizers import HFTokenizer
from .cases import Case
from .forced import PROBE_MAX, Probe, Program
from .symptoms import Expected, first_difference, without_specials

WHY = "precision, a sampling default, or a prompt shift"
_RUNNER_UP_BYTES = 64  # the most bytes one token put in an EOS's place can spell (a search bound)
_IGNORED = frozenset(" \t\n\r\f\v")
_NO_CHARACTER = "\ufffd"  # bytes a detokenizer could not show: no evidence of the tokens past it


def _ids(items: Iterable[int] | None) -> tuple[int, ...] | None:
    """The ids as a tuple, None kept (a converter mypy can type, as `optional(tuple)` is not)."""
    return None if items is None else tuple(items)


def _pieces(items: Iterable[bytes | str] | None) -> tuple[bytes | str, ...] | None:
    """The pieces as a tuple, None kept (a converter mypy can type, as `optional(tuple)` is not)."""
    return None if items is None else tuple(items)


@attrs.frozen
class Returned:
    """What an engine returned for one request, as far as it revealed it (None: not shown)."""

    token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_ids)
    # Per-token pieces from logprobs: bytes where the server gives them, else each token's string.
    tokens: tuple[bytes | str, ...] | None = attrs.field(default=None, converter=_pieces)
    text: str | None = None

    @property
    def evidence(self) -> str:
        return "token ids" if self.token_ids is not None else "logprob tokens" if self.tokens is not None else "text"


@attrs.frozen
class Deviation:
    """Where an engine left its script: output token `position` (1-based) was `chose`, not `wanted`."""

    position: int
    chose: str
    wanted: str
    evidence: str  # what showed it: token ids, logprob tokens, or text

    @property
    def message(self) -> str:
        return (f"the engine did not follow the forced script at token {self.position}: {WHY} (it chose {self.chose} "
                f"where the script has {self.wanted}; seen in its {self.evidence})")


def _show(tok: HFTokenizer, tid: int) -> str:
    return f"id {tid} {tok.token_bytes(tid)!r}"


def deviation(program: Program, tokenizer: HFTokenizer, eos_id: int, returned: Returned,
              end: int | None = None) -> Deviation | None:
    """None when `returned` follows `program`'s script (then EOS) over its first `end` output tokens
    (the case's end: the reference's selected tokens; None: the whole script and its EOS), else the
    first Deviation, judged on the best evidence `returned` holds (see module)."""
    want = [*program.script, eos_id]
    want = want[:len(want) if end is None else end]
    if returned.token_ids is not None:
        for i, (got, w) in enumerate(zip(returned.token_ids, want)):
            if got != w:
                return Deviation(i + 1, _show(tokenizer, got) if 0 <= got < tokenizer.vocab_size else f"id {got}",
                                 _show(tokenizer, w), returned.evidence)
        return None
    pieces = [p for p in returned.tokens or () if isinstance(p, bytes)]
    if returned.tokens is not None and len(pieces) == len(returned.tokens):  # every piece given as bytes
        return _by_pieces(tokenizer, want, pieces, returned.evidence)
    if returned.tokens is not None:  # strings: a split character may sit in either token, so compare the text
        # a special token's own text (vLLM lists an EOS as "</s>") is not text the answer shows
        special = _special_texts(tokenizer)
        text = "".join(p.decode("utf-8", "replace") if isinstance(p, bytes) else p for p in returned.tokens
                       if p not in special)
        found = _by_text(tokenizer, program.prompt, want, text, returned.evidence)
        return None if found is not None and _vocab_pieces(tokenizer, want, returned.tokens) else found
    if returned.text is not None:
        return _by_text(tokenizer, program.prompt, want, returned.text, returned.evidence)
    raise ValueError("the engine's answer carries neither token ids, logprob tokens nor text: nothing to compare")


def _special_texts(tok: HFTokenizer) -> frozenset[str]:
    """The special tokens' own texts ('</s>', '<unk>'): no script text, wherever an engine shows them."""
    return frozenset(filter(None, (tok.decode([i], skip_special=False) for i in tok.special_ids)))


def _vocab_pieces(tok: HFTokenizer, want: Sequence[int], tokens: Sequence[str | bytes]) -> bool:
    """Whether string tokens name the script's tokens by their vocabulary pieces, position by
    position (vLLM lists a WordPiece continuation as `##中`, marker and all): the same tokens."""
    return bool(tokens) and all(isinstance(t, str) and t == tok.id_to_token(w) for t, w in zip(tokens, want))


def _by_pieces(tok: HFTokenizer, want: Sequence[int], pieces: Sequence[bytes], evidence: str) -> Deviation | None:
    """The pieces' bytes against the script's, as one stream: servers move the bytes of a split
    character to the token that completes it (llama-server), so only where the streams first differ
    tells; it is named at the script token that holds that byte."""
    special = {t.encode() for t in _special_texts(tok)}
    pieces = [p for p in pieces if p not in special]  # a special token's own text is not text shown
    got = b"".join(pieces)
    spans: list[tuple[int, int]] = []  # (script token index, its first byte) in the script's stream
    at = 0
    for i, w in enumerate(want):
        spans.append((i, at))
        at += 0 if w in tok.special_ids else len(tok.token_bytes(w))
    stream = b"".join(b"" if w in tok.special_ids else tok.token_bytes(w) for w in want)
    n = min(len(got), len(stream))
    cut = next((k for k in range(n) if got[k] != stream[k]), None)
    if cut is None:
        return None  # one is a prefix of the other: the answer ended, or ran on past the case's end
    i = max(j for j, start in spans if start <= cut)
    ends = list(itertools.accumulate(len(p) for p in pieces))
    chose = pieces[next(j for j, end in enumerate(ends) if end > cut)]  # the piece that holds the first wrong byte
    return Deviation(i + 1, repr(chose), _show(tok, want[i]), evidence)


def _after(tok: HFTokenizer, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The text `ids` add after `prompt` (the decode of both past the prompt's own), or their decode
    alone where the prompt's text does not begin the whole's."""
    head, whole = tok.decode(list(prompt)), tok.decode([*prompt, *ids])
    return whole[len(head):] if whole.startswith(head) else tok.decode(list(ids))


def _by_text(tok: HFTokenizer, prompt: Sequence[int], want: Sequence[int], text: str, evidence: str) -> Deviation | None:
    """The text against the script's, read after the prompt or decoded alone (a detokenizer that
    decodes the output without the prompt spells WordPiece's `##.` with its marker at the start,
    §4.5): the script's tokens either way, the engine followed them, and the detokenizer cases judge
    the text; else the deviation read after the prompt."""
    after = _text_deviation(tok, prompt, want, text, evidence)
    return None if after is None or _text_deviation(tok, (), want, text, evidence) is None else after


def _text_deviation(tok: HFTokenizer, prompt: Sequence[int], want: Sequence[int], text: str,
                    evidence: str) -> Deviation | None:
    text = text.split(_NO_CHARACTER)[0]
    for own in _special_texts(tok):
        text = text.replace(own, "")  # a special token's own text (vLLM's chat sends '<unk>') spells no script text
    kept = [j for j, c in enumerate(text) if c not in _IGNORED]  # where each compared character stands
    got = [text[j] for j in kept]
    seen: list[str] = []
    for i, w in enumerate(want):
        spelled = _after(tok, prompt, want[: i + 1]).split(_NO_CHARACTER)
        seen += [c for c in spelled[0] if c not in _IGNORED][len(seen):]
        if len(spelled) > 1:
            return None  # the script's own text has no character here: nothing further to compare
        upto = min(len(seen), len(got))
        if got[:upto] != seen[:upto]:
            at = kept[next(j for j in range(upto) if got[j] != seen[j])]
            return Deviation(i + 1, repr(text[at:at + 12]), _show(tok, w), f"{evidence}, whitespace aside")
        if len(got) <= len(seen):
            return None  # the engine's text ends here: a prefix of the script's
    return None


def left_script(checkpoint: Any, case: Case, exp: Expected, ref_tokens: Sequence[int],
                answers: Sequence[Returned]) -> str | None:
    """D27: where the engine left its forced script before the case's end (then nothing of the case
    can be judged: an ERROR naming the position, never a FAIL), else None. `checkpoint` is the
    forced checkpoint served (checkpoints.Checkpoint), `ref_tokens` the reference's selected tokens
    on it, `answers` what each answer (each choice; the chat message's content) showed."""
    prog = checkpoint.programs[case.id]
    for answer in answers:  # a guarded EOS banned, not passed over (D66): from the token ids where given
        if answer.token_ids is not None:
            banned = banned_eos_id(exp, prog.script, ref_tokens, answer.token_ids, checkpoint.tokenizer)
        else:
            banned = banned_eos(exp, prog.script, ref_tokens, answer.text.encode()) if answer.text is not None else None
        if banned:
            return banned
    req = case.inputs.get("request", {})
    if req.get("echo") or req.get("skip_special_tokens") is False:
        return None  # the text is no longer the decode of the tokens alone: the case judges it
    # Judged up to where the reference itself leaves the script (a logit_bias, min_tokens or ignore_eos
    # the case sets): past it, following the field is the case's own question.
    same = first_difference(ref_tokens, [*prog.script, checkpoint.eos_id])
    if exp.guard_passed and exp.eos_at is not None:  # how a guarded EOS is passed over is the case's question; a ban is named above
        same = min(same, exp.eos_at - 1)
    for answer in answers:
        d = deviation(prog, checkpoint.tokenizer, checkpoint.eos_id, answer, end=min(exp.selected, same))
        if d is not None:
            return d.message
    return None


def banned_eos(exp: Expected, script: Sequence[int], ref_tokens: Sequence[int], text: bytes) -> str | None:
    """D66: the ERROR of an answer whose `text` has other bytes where the reference passes over the
    script's first EOS as a token (a guard turned its check off, D31), the text around them the
    reference's; else None (the case judges the answer).

    Read from the text, so every endpoint has the evidence: the answer opens with the script's text
    before that EOS and, after k bytes of its own (1 <= k <= _RUNNER_UP_BYTES), goes on as the
    reference does; where that EOS is the reference's last token (the run ends at the limit on it),
    the answer ends after its k bytes. The EOS's own text there (skip_special_tokens false, or an EOS
    sent as text) is the token passed over, not a ban, and so is the text of a special token before
    it that the reference sends none of. Where the reference itself chose another
    token at that EOS (min_tokens' mask, D32), nothing is decided here."""
    at = exp.eos_at
    if at is None or not exp.guard_passed or exp.echo_len or len(ref_tokens) < at or ref_tokens[at - 1] != script[at - 1]:
        return None
    head, eos_text = exp.script_text, exp.eos_text
    if not (text.startswith(head) and exp.output.startswith(head)):
        return None  # left the script before it: deviation()'s, or the case's to judge
    # a special token's text the reference does not send (D33) is that token's, not one in the EOS's place
    got, after = without_specials(exp, text[len(head):]), exp.output[len(head):]
    if eos_text and after.startswith(eos_text):
        after = after[len(eos_text):]  # the reference writes the passed-over EOS's text
    if eos_text and got.startswith(eos_text):
        return None
    if not after:  # the run ends on the EOS: one token of the engine's own in its place, then nothing
        return _banned(at, repr(got)) if len(ref_tokens) == at and 0 < len(got) <= _RUNNER_UP_BYTES else None

    def agrees(k: int) -> bool:
        n = min(len(got) - k, len(after))
        return got[k:k + n] == after[:n]

    k = next((k for k in range(min(len(got), _RUNNER_UP_BYTES) + 1) if agrees(k)), None)
    if not k:  # 0: the reference's bytes at the EOS; None: not one token in its place
        return None
    return _banned(at, repr(got[:k]))


def banned_eos_id(exp: Expected, script: Sequence[int], ref_tokens: Sequence[int], ids: Sequence[int],
                  tok: HFTokenizer) -> str | None:
    """banned_eos from an answer's token ids: where the reference selects the script's first EOS
    as a token (a guard passed, D31) and the answer has the reference's ids before it and another
    id in its place; else None."""
    at = exp.eos_at
    if at is None or not exp.guard_passed or len(ref_tokens) < at or ref_tokens[at - 1] != script[at - 1] or len(ids) < at:
        return None
    if list(ids[:at - 1]) != list(ref_tokens[:at - 1]) or ids[at - 1] == ref_tokens[at - 1]:
        return None
    wrote = ids[at - 1]
    return _banned(at, _show(tok, wrote) if 0 <= wrote < tok.vocab_size else f"id {wrote}")


def _banned(at: int, wrote: str) -> str:
    return (f"the engine did not pass over the guarded EOS at token {at}: it wrote {wrote} in its place, "
            "where the reference selects the EOS and goes on (D31). An engine that bans the EOS (llama.cpp biases "
            "every end-of-generation token to -inf) never runs the guard this case is about, so nothing of it "
            "can be judged (D27, D66)")


@attrs.frozen
class Prefix:
    """What the prefix probe says stood before the prompt: `tokens` of them (None: unknown); with
    `at_least`, PROBE_MAX or more."""

    tokens: int | None
    at_least: bool
    note: str


def detect_prefix(probe: Probe, tokenizer: HFTokenizer, returned: Returned) -> Prefix:
    """How many tokens the engine put in front of the probe's prompt, read from its first output
    token (id, logprob bytes or string, or the text's first character)."""
    texts = [tokenizer.decode([t]).strip() for t in probe.echo]
    if returned.token_ids:
        first = next((p for p, t in enumerate(probe.echo) if t == returned.token_ids[0]), None)
        shown = _show(tokenizer, returned.token_ids[0]) if 0 <= returned.token_ids[0] < tokenizer.vocab_size else ""
    else:
        if returned.tokens:
            piece = returned.tokens[0]
            text, shown = (piece.decode("utf-8", "replace") if isinstance(piece, bytes) else piece).strip(), repr(piece)
        else:
            text, shown = (returned.text or "").lstrip()[:1], repr(returned.text)
        first = texts.index(text) if text in texts else None
    if first is None:
        return Prefix(None, False, f"the prefix probe answered {shown or 'nothing'}, none of its echo tokens "
                                   f"{texts}: the engine changed the prompt beyond a prefix (a template after it?) "
                                   "or does not decode greedily")
    if first == PROBE_MAX:
        return Prefix(PROBE_MAX, True, f"the engine put {PROBE_MAX} or more tokens before the prompt")
    return Prefix(first, False, f"the engine put {first} token(s) before the prompt (the prefix probe answered "
                                f"{shown})")


@attrs.frozen
class Placed:
    """How an answer's usage.prompt_tokens stands against the prompt the engine ran (D26):
    `changed`, why the engine ran another prompt (the case is then n/a); `miscounted`, how the
    count disagrees with the prompt the probe shows it ran (an accounting finding, the case judged)."""

    changed: str | None = None
    miscounted: str | None = None


def prompt_placed(sent: int | None, ids: int, prefix: Prefix, *, as_text: bool) -> Placed:
    """`sent` (the answer's usage.prompt_tokens; None: not reported) for a prompt of `ids` ids, sent
    as ids or (`as_text`) as their text, on an engine whose prefix probe says `prefix` (D26).

    Sent as ids on an engine whose probe tells its prefix, the prompt run is known: p tokens, then
    the ids; a count that differs miscounts it. Sent as text, the engine tokenizes it itself, and a
    count other than ids + p says it made other tokens of it; with the prefix unknown, a count other
    than the ids says the prompt was changed beyond a prefix: in both the prompt is not the one the
    forced checkpoint steers."""
    if sent is None:
        return Placed(changed=None if prefix.tokens is not None else
                      f"the server reports no usage, and {prefix.note}: the forced checkpoint steers only a "
                      "prompt it can place")
    if prefix.tokens is None or as_text:
        ran = ids + (prefix.tokens or 0)
        if sent == ran:
            return Placed()
        how = f"sent as text, the server made {sent} prompt tokens of the {ids} ids" if as_text else \
            f"the server made {sent} prompt tokens of the {ids} ids"
        return Placed(changed=f"{how}, and {prefix.note}: the forced checkpoint steers only a prompt it can place")
    ran = ids + prefix.tokens
    if sent == ran or (prefix.at_least and sent > ran):
        return Placed()
    least = "at least " if prefix.at_least else ""
    return Placed(miscounted=f"usage.prompt_tokens is {sent}, but the prompt the engine ran is {least}{ran} tokens: "
                             f"the {ids} ids sent and the {least}{prefix.tokens} token(s) the engine put before them, "
                             "as the prefix probe shows (D26)")
