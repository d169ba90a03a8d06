"""The incremental detokenizer (§4.5): token ids in, final bytes out.

Contract, with `decode_bytes` the batch decode of the tokenizer (the §4.5 oracle):

    concat(push(t) for t in output) + finish() == decode_bytes(prompt + output) - decode_bytes(prompt)

where `-` removes the prompt's bytes from the front. Special tokens are deleted when `skip_special`
(a declared deletion, as the batch decode does). Consequences:

- a character split across tokens is held until it is complete; a split never yields U+FFFD, while
  a genuine U+FFFD (EF BF BD) is ordinary text and is emitted;
- bytes that no continuation can make valid UTF-8 fire `invalid` and raise DecodingError: the
  request fails (DECISIONS D12, strict); `finish()` on an incomplete tail does the same, while
  `discard_pending_after_stop()` drops the tail silently (after a stop hit, §4.3);
- a prompt ending inside a character does not leak its fragment: the output starts after the
  prompt's bytes (its first bytes may be the continuation bytes that complete that character);
- a leading-space rule for the first token of a sequence (Metaspace, Llama's Strip) or WordPiece's
  first-token rule applies to the prompt, not to the first output token.

Cost: O(1) per token for the decoders `runtime/tokenizers.py` models (byte-level BPE, SentencePiece
with byte fallback / Metaspace, WordPiece, an explicit byte table): a table lookup, a UTF-8 check of
the new bytes, one step of the compiled `detokenizer` table. In EMPTY (nothing pending, where the
table makes `emit` a quiet self-loop) a token whose bytes are whole UTF-8 on their own is final as
it is: one lookup in the plan's `whole` table, no check and no fire. WordPiece needs no lookahead
because `tokenizers` applies its cleanup rules to each token by itself (the tests check this
against the batch decode). For any other decoder the fallback re-decodes a bounded window (the last few tokens,
with prefix/read offsets); it is exact for the usual decoders but, unlike the table path, it cannot
tell a genuine trailing U+FFFD from a split character, so it holds one until the next token and
treats it as invalid at `finish()`.

Control state lives in a stepper of the detokenizer's table (spec/detokenizer.toml, or the table
it is given; DetokRules): every push fires `emit`, `hold` or `invalid`; finish fires `finish` or
`finish_invalid`; discard fires `discard`. Each fire runs its row's action as effects (`DETOK`
below: pass_complete, hold_partial, raise_error, pass_tail, drop_pending; machine/actions.py), so a
changed action changes the bytes a push returns, as it changes what the checker model explores; the
fast path is armed only where the table's `emit` is a self-loop that only passes bytes on
(`DetokRules.fast`). A push after the detokenizer closed is an IllegalTransition and changes nothing.
"""

from __future__ import annotations

import codecs
import enum
import functools
from collections.abc import Mapping, Sequence

import attrs

from ..machine import CompiledMachine, compiled_of, per_table
from ..machine.actions import Executor, Plan, run_phases
from ..spec import Table, default_spec
from .tokenizers import TokenIdError, Tokenizer, check_token_id, check_tokenizer, is_utf8

__all__ = ["DecodingError", "IncrementalDetokenizer"]

_INCOMPLETE = "unexpected end of data"  # CPython's reason for a valid but unfinished sequence
# (text, bytes used) of the longest decodable prefix; with final=False an unfinished character at
# the end is left over, not an error, so holding one costs no exception.
_utf8_prefix = codecs.utf_8_decode
_NOTHING: Mapping[int, bytes] = {}  # the fast table while the fast path is off; never written
_WINDOW_PREFIX = 5  # prompt tokens kept as context by the window fallback


class DecodingError(ValueError):
    """Output bytes that cannot become valid UTF-8 (§4.5, DECISIONS D12): the request fails."""

    def __init__(self, message: str, *, data: bytes = b"") -> None:
        super().__init__(message)
        self.data = data


@functools.lru_cache(maxsize=4096)
def _unfinished(tail: bytes) -> tuple[int, int, str] | None:
    """None when `tail` (the 1-3 bytes `_utf8_prefix` left over) may still become a character;
    else (start, end, reason) of its invalid bytes. The incremental decoder defers some errors
    (a surrogate's ED A0, say) that the strict one reports at once (D12: report them now)."""
    try:
        tail.decode()
    except UnicodeDecodeError as e:
        return None if e.reason == _INCOMPLETE and e.start == 0 else (e.start, e.end, e.reason)
    return None


def _incomplete_tail(data: bytes) -> int:
    """Length of the trailing unfinished (but so far valid) UTF-8 sequence of `data`, or 0."""
    for k in range(1, min(3, len(data)) + 1):
        lead = data[-k]
        if lead >= 0xC0:
            tail = data[-k:]
            return k if not is_utf8(tail) and _unfinished(tail) is None else 0
        if lead < 0x80:
            return 0
    return 0


class IncrementalDetokenizer:
    """Bytes out per token, agreeing with the batch decode (§4.5). See the module docstring."""

    __slots__ = (
        "_tok", "_skip", "_ctl", "_fire", "_cur", "_rest", "_skipped", "_strip_byte", "_strip_left",
        "_pending", "_hidden", "_window", "_whole", "_fast", "held_bytes",
        "_rules", "_steady", "_emit_plain", "_hold_plain",
    )

    def __init__(self, tokenizer: Tokenizer, *, prompt_ids: Sequence[int] = (), skip_special: bool = True,
                 table: Table | None = None) -> None:
        check_tokenizer(tokenizer)
        prompt = [check_token_id(t, tokenizer.vocab_size) for t in prompt_ids]
        self._tok = tokenizer
        self._skip = skip_special
        rules = self._rules = detok_rules(table or default_spec()["detokenizer"])
        # read per token: a slot each
        self._steady, self._emit_plain, self._hold_plain = rules.fast, rules.emit_plain, rules.hold_plain
        self._ctl = rules.machine.new()
        self._fire = self._ctl.fire
        self._pending = b""  # held bytes; the first `_hidden` of them belong to the prompt
        self._hidden = 0
        # Output bytes held back (`pending`'s length, kept as a plain int for the per-token path;
        # always 0 on the window path, which holds tokens, not bytes).
        self.held_bytes = 0
        self._cur: Mapping[int, bytes]
        self._rest: Mapping[int, bytes]
        self._skipped: frozenset[int]
        self._window: _Window | None
        self._whole: Mapping[int, bytes] | None
        self._fast: Mapping[int, bytes]
        plan = tokenizer.plan(skip_special=skip_special)
        if plan is None:
            self._cur = self._rest = {}  # every push takes the window path
            self._skipped = frozenset()
            self._strip_byte, self._strip_left = None, 0
            self._window = _Window(tokenizer, prompt, skip_special)
            self._whole, self._fast = None, _NOTHING
            return
        self._window = None
        self._cur, self._rest, self._skipped = plan.first, plan.rest, plan.skipped
        self._whole = plan.whole
        self._strip_byte, self._strip_left = plan.strip_byte, plan.strip_count
        self._prime(prompt)
        self._sync()

    def _prime(self, prompt: list[int]) -> None:
        """Consume the prompt: first-token and leading-space rules, and its unfinished character."""
        tail = b""
        for tid in prompt:
            chunk = self._cur.get(tid)
            if chunk is None:
                continue  # a skipped special token
            self._cur = self._rest
            if self._strip_left:
                chunk = self._strip(chunk)
            tail = (tail + chunk)[-4:]
        k = _incomplete_tail(tail)
        self._pending = tail[len(tail) - k :] if k else b""
        self._hidden = k

    def _strip(self, chunk: bytes) -> bytes:
        """The leading-space rule at sequence start (Strip after Fuse); updates `_strip_left`."""
        n, left = 0, self._strip_left
        while left and n < len(chunk) and chunk[n] == self._strip_byte:
            n, left = n + 1, left - 1
        self._strip_left = left if n == len(chunk) else 0
        return chunk[n:]

    # -- the hot path ---------------------------------------------------------------------------

    def push(self, token_id: int) -> bytes:
        """Bytes that became final with `token_id` (possibly b""); raises DecodingError (§4.5)."""
        chunk = self._fast.get(token_id) if type(token_id) is int else None
        if chunk is not None:  # EMPTY, nothing pending: a whole token is final as it is
            return chunk
        chunk = self._cur.get(token_id) if type(token_id) is int else None
        if chunk is None or self._strip_left:
            if self._window is not None:
                return self._window_push(token_id)
            chunk = self._resolve(token_id, chunk)
            if chunk is None:
                return b""
        pend = self._pending
        data = pend + chunk if pend else chunk
        try:  # the complete characters: an unfinished one at the end is held, never an error
            done = _utf8_prefix(data, "strict", False)[1]
        except UnicodeDecodeError as e:
            return self._invalid(data, e.start, e.end, e.reason)
        self._cur = self._rest
        state = self._ctl.state
        if done < len(data):
            bad = _unfinished(data[done:])
            if bad is None:  # `data[done:]` is an unfinished character
                if state in self._hold_plain:  # the row's effects, without the phase loop
                    self._fire("hold")
                    out = self._complete(data, done)
                    self._keep(data, done)
                    self._sync()
                    return out
                return self._move("hold", {"data": data, "cut": done})
            return self._invalid(data, done + bad[0], done + bad[1], bad[2])
        if state in self._emit_plain:
            self._fire("emit")
            out = self._complete(data, done)
            self._sync()
            return out
        return self._move("emit", {"data": data, "cut": done})

    def _complete(self, data: bytes, cut: int) -> bytes:
        """pass_complete: the complete characters `data[:cut]` go on (the prompt's own bytes left
        out); once any did, nothing is held (what is unfinished is kept only by hold_partial)."""
        if cut:
            out = data[self._hidden : cut]
            self._pending, self._hidden, self.held_bytes = b"", 0, 0
            return out
        return b""

    def _keep(self, data: bytes, cut: int) -> None:
        """hold_partial: the unfinished character `data[cut:]` is held for the next token."""
        self._pending = data[cut:]
        self.held_bytes = len(self._pending) - self._hidden

    def _move(self, event: str, ctx: dict) -> bytes:
        """Fire `event` and run its row's effects (the DETOK executor below) on `ctx`: `data`, the
        bytes at hand, complete up to `cut` (a push), or the tail (finish); `why`, what is wrong
        with invalid bytes. Returns the bytes the effects passed on; raises the DecodingError an
        effect made; a refused event (after the end) raises IllegalTransition and changes nothing."""
        run_phases(self._rules.plans.get((self._ctl.state._value_, event)), (self, ctx), self._fire, (event,))
        self._sync()
        error = ctx.get("error")
        if error is not None:
            raise error from None
        return ctx.get("out", b"")

    def _sync(self) -> None:
        """Arm the fast path of `push` exactly where it is exact: a state whose `emit` row is a
        self-loop that only passes the bytes on (`DetokRules.fast`, derived from the table), nothing
        pending, past the first-token and strip rules."""
        steady = (
            self._ctl.state in self._steady and not self._pending and not self._strip_left
            and self._cur is self._rest and self._whole is not None
        )
        self._fast = self._whole if steady and self._whole is not None else _NOTHING

    def _resolve(self, token_id: int, chunk: bytes | None) -> bytes | None:
        """The slow cases: an int-like id, a skipped special token (None), the leading-space rule."""
        if chunk is None:
            tid = check_token_id(token_id, self._tok.vocab_size)
            chunk = self._cur.get(tid)
            if chunk is None:
                if tid not in self._skipped:
                    raise TokenIdError(f"token id {tid} has no entry in the tokenizer's decode table")
                # deleted, and it does not count as the first token either: what is held stays held
                self._move("hold" if len(self._pending) > self._hidden else "emit", {"data": self._pending, "cut": 0})
                return None
        if self._strip_left:
            if self._ctl.terminal:
                self._fire("emit")  # raises: closed, nothing changed
            chunk = self._strip(chunk)
        return chunk

    def _invalid(self, data: bytes, start: int, end: int, reason: str) -> bytes:
        """Bytes no later token can repair: fire `invalid` (its row raises DecodingError, D12)."""
        return self._move("invalid", {"data": data, "why": (
            f"invalid UTF-8 in the output: {data[start:end].hex(' ')} at offset {start} of {data!r} ({reason}); "
            "no later token can repair it (§4.5, DECISIONS D12)")})

    def _window_push(self, token_id: int) -> bytes:
        tid = check_token_id(token_id, self._tok.vocab_size)
        if self._ctl.terminal:
            self._fire("emit")  # raises: closed, nothing changed
        window = self._window
        assert window is not None, "the window path runs only for a tokenizer without a decode plan"
        out, held = window.push(tid)  # the window holds tokens, not bytes: nothing pending here
        return self._move("hold" if held else "emit", {"data": out, "cut": len(out)})

    # -- the end of the output -----------------------------------------------------------------

    def finish(self) -> bytes:
        """Drain the tail at a normal end (§4.3); an unfinished character raises DecodingError."""
        if self._window is not None:
            if self._ctl.terminal:
                self._fire("finish")  # raises: closed
            tail, bad = self._window.finish()
            if bad:
                return self._move("finish_invalid", {"data": tail, "why": (
                    f"the output ends with invalid text {tail!r} (§4.3, DECISIONS D12)")})
            return self._move("finish", {"data": tail})
        tail = self._pending[self._hidden :]
        if tail:
            return self._move("finish_invalid", {"data": tail, "why": (
                f"the output ends inside a UTF-8 character: {tail.hex(' ')} can never be completed "
                "(§4.3, DECISIONS D12)")})
        return self._move("finish", {"data": tail})

    def discard_pending_after_stop(self) -> None:
        """Drop the held tail: after a stop hit it lies past the stop point (§4.3, §4.6)."""
        self._move("discard", {})

    @property
    def pending(self) -> bytes:
        """Output bytes held back (the prompt's unfinished character is not counted)."""
        if self._window is not None:
            return self._window.pending()
        return self._pending[self._hidden :]

    @property
    def held(self) -> bytes:
        """Every byte held back, the prompt's unfinished character included: what the next
        token's bytes continue (the UTF-8 guard's input, D16). The window path holds tokens, not
        bytes: asking it is an error (a guarded request needs a tokenizer with a byte table)."""
        if self._window is not None:
            raise TypeError(f"{type(self._tok).__name__}: the detokenizer holds tokens, not bytes (no byte table)")
        return self._pending

    @property
    def state(self):
        """The control state of the `detokenizer` table (EMPTY, PENDING or a terminal state)."""
        return self._ctl.state

    def __repr__(self) -> str:
        return f"<IncrementalDetokenizer {self._ctl.state.value} pending={self.pending!r}>"


# ---- the runtime's implementation of every detokenizer effect (machine/actions.py) -----------
# Each runs as (detokenizer, ctx); `_move` runs them by phase, as the checker model runs its own.
DETOK = Executor("detokenizer", "the runtime (detokenizer.IncrementalDetokenizer)")


@DETOK.effect("pass_complete")
def _pass_complete(d: IncrementalDetokenizer, ctx: dict) -> None:
    ctx["out"] = d._complete(ctx["data"], ctx["cut"])


@DETOK.effect("hold_partial")
def _hold_partial(d: IncrementalDetokenizer, ctx: dict) -> None:
    d._keep(ctx["data"], ctx["cut"])


@DETOK.effect("raise_error")
def _raise_error(d: IncrementalDetokenizer, ctx: dict) -> None:
    """The bytes can never become text: the push (or finish) raises DecodingError (D12)."""
    d._pending, d._hidden, d.held_bytes = b"", 0, 0
    ctx["error"] = DecodingError(ctx["why"], data=ctx["data"])


@DETOK.effect("pass_tail")
def _pass_tail(d: IncrementalDetokenizer, ctx: dict) -> None:
    """finish(): the held bytes go on, final."""
    ctx["out"] = ctx["data"]
    d._pending, d._hidden, d.held_bytes = b"", 0, 0


@DETOK.effect("drop_pending")
def _drop_pending(d: IncrementalDetokenizer, ctx: dict) -> None:
    """The held bytes lie past the end of the output: thrown away (the window's held tokens too)."""
    d._pending, d._hidden, d.held_bytes = b"", 0, 0
    if d._window is not None:
        d._window.clear()


@attrs.frozen(eq=False)
class DetokRules:
    """A detokenizer table as IncrementalDetokenizer runs it (§4.5): its machine, each pair's plan,
    and the fast paths of `push` derived from the rows. `fast`: where `emit` is a self-loop that
    only passes the bytes on, so a whole token there is final as it is. `emit_plain`, `hold_plain`:
    where a push's row runs exactly pass_complete (and hold_partial), which push runs itself,
    without the phase loop's ctx (the per-token cost of a split character); any other action there
    goes through `_move`."""

    machine: CompiledMachine
    plans: Mapping[tuple[str, str], Plan]
    fast: frozenset[enum.Enum]
    emit_plain: frozenset[enum.Enum]
    hold_plain: frozenset[enum.Enum]

    @classmethod
    def of(cls, table: Table) -> DetokRules:
        machine, plans = compiled_of(table), DETOK.plans(table)

        def states(event: str, effects: tuple[str, ...], loop: bool = False) -> frozenset[enum.Enum]:
            return frozenset(machine.State[s] for (s, e), plan in plans.items() if e == event and plan.effects == effects
                             and (not loop or table.decision(s, e).target == s))

        return cls(machine, plans, states("emit", ("pass_complete",), loop=True), states("emit", ("pass_complete",)),
                   states("hold", ("pass_complete", "hold_partial")))


detok_rules = per_table(DetokRules.of)


class _Window:
    """Bounded re-decode for decoders without a per-token table (prefix/read offsets).

    `decode(ids[prefix:])` minus `decode(ids[prefix:read])` is the new text; it is held while it
    ends in U+FFFD (probably a split character). Only the tokens from `prefix` on are kept.
    """

    __slots__ = ("_tok", "_skip", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], skip_special: bool) -> None:
        self._tok, self._skip = tokenizer, skip_special
        self._ids = prompt[-_WINDOW_PREFIX:]
        self._prefix, self._read = 0, len(self._ids)

    def _texts(self) -> tuple[str, str]:
        ids, dec = self._ids, self._tok.decode
        return dec(ids[self._prefix : self._read], skip_special=self._skip), dec(ids[self._prefix :], skip_special=self._skip)

    def push(self, tid: int) -> tuple[bytes, bool]:
        """(new final bytes, whether tokens are still held)."""
        self._ids.append(tid)
        before, after = self._texts()
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            out = after[len(before) :].encode()
            self._ids = self._ids[self._read :]
            self._prefix, self._read = 0, len(self._ids)
            return out, False
        return b"", self._read < len(self._ids)

    def finish(self) -> tuple[bytes, bool]:
        before, after = self._texts()
        tail = after[len(before) :]
        return tail.encode(), tail.endswith("\ufffd")

    def pending(self) -> bytes:
        before, after = self._texts()
        return after[len(before) :].encode()

    def clear(self) -> None:
        self._ids, self._prefix, self._read = [], 0, 0
