"""Hypothesis strategies for generated script cases (§4.3, §4.5, §4.6, §4.7, §4.9).

A generated example is the `inputs` object of a script case (properties/cases' format, cases.py):
a tokenizer, a prompt, a forced script, stop strings, `max_tokens`, single stop token ids and
request fields, and for a chat example its chat settings (`inputs.chat`, chat_cases.py). What a run
draws is a `Menu`: its tokenizers, completions examples, chat examples or both. The tokenizers:

- the fuzz byte table (`TABLE`): ASCII pieces, every way of splitting a 2-, 3- and 4-byte
  character (é, €, 中, 😀) into tokens, pieces that end one character and begin the next, invalid
  bytes (ff, c0, a lone continuation byte, an encoded surrogate), a genuine U+FFFD, and EOS as a
  special token;
- the fixtures' byte-level BPE and SentencePiece byte-fallback tokenizers (properties/fixtures.py):
  words as text items, single bytes of multi-byte characters (byte items, `<0xNN>` tokens), special
  tokens other than EOS (`<unk>`, `<s>`), EOS;
- the fixtures' WordPiece tokenizer: words, words spelled as a head and its `##` continuation (no
  space between them), continuation pieces alone, its special tokens other than EOS. llama.cpp's
  GGUF converter refuses a WordPiece vocabulary (convert_gguf.py), so an engine served from GGUF
  files never draws it (`GGUF_REFUSED`, `Menu.served`).

A chat example (`chat_examples`) runs on /v1/chat/completions with one user message under the
checkpoint's chat template (ChatML, or the BOS template on the byte table) and is judged channel
by channel as the chat cases are (chat.py, D45-D47). On the byte table its script is a reasoning
section (whole or split `<think>` tags, reasoning text with split characters, the close sometimes
missing), content, and a Hermes tool call (whole or split tags, its JSON split across tokens with
multi-byte characters inside, or JSON that is no call), over `CHAT_TABLE`; on a fixture its script
is the fixture's, under ChatML. Think tags are scripted only where the example asks for reasoning:
a server's reasoning parser is the server's, not the request's (decodespec serve splits every chat
answer once started with one), so a `<think>` under `reasoning: false` would be judged against a
split nobody asked for.

Stops are cut from the script's own text (so they hit: across 1-4 tokens, inside one token, on the
last allowed token, multi-byte, overlapping or a prefix of one another, inside the reasoning or the
call, ending inside a token that begins another character), from the prompt's text, or are short
strings that may never occur; `max_tokens`, and half the time `min_tokens`, are drawn next to an
event of the script (where a stop completes, the EOS, a character completes, the script's end).
`case_of` turns an example into a Case with the decisions of spec/DECISIONS.md its features rest on
(`DECIDED_BY`), as a hand-written case names them.
"""

from __future__ import annotations

import codecs
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from hypothesis import strategies as st

from ..adapters.base import case_prompt, case_script, case_tokenizer
from ..cases import Case, bytes_json, parse_case

TABLE_EOS = 100
# The fuzz byte table's pieces, ids 101 on; no two spell the same bytes.
PIECES: tuple[bytes, ...] = (
    b"a", b"b", b"c", b"A", b"B", b"AB", b"BC", b"ab", b"bc", b" ", b"x", b"yz", b".", b"\n", b"> ",
    "é".encode(), b"\xc3", b"\xa9",  # é = c3 a9
    "€".encode(), b"\xe2", b"\x82", b"\xac", b"\xe2\x82", b"\x82\xac",  # € = e2 82 ac
    "中".encode(), b"\xe4\xb8", b"\xad", b"\xe4",  # 中 = e4 b8 ad
    "😀".encode(), b"\xf0\x9f", b"\x98\x80", b"\xf0", b"\x9f\x98\x80",  # 😀 = f0 9f 98 80
    b"a\xe2", b"\xacb", b"\xa9\xe4\xb8",  # a piece that ends one character and begins the next
    b"\xff", b"\xc0", b"\x80", b"\xed\xa0\x80",  # never valid UTF-8
    "\ufffd".encode(),  # a genuine U+FFFD
)
TABLE: Mapping[int, bytes] = {TABLE_EOS: b"</s>", **{101 + i: p for i, p in enumerate(PIECES)}}
PROMPT_PIECES = (b"> ", b"ab", "é".encode(), b"A")  # the prompt's tokens (whole characters)
_ID_OF = {p: i for i, p in TABLE.items()}
WORDS = ("hello", " world", " the", " end", "é", " café", "中文", "😀", "\ufffd", " a", "b", ".")
SPLIT = ("é", "€", "中", "😀")  # characters whose bytes a script may send one token each
REQUEST_FIELDS = ("include_stop_str_in_output", "min_tokens", "ignore_eos", "n", "echo", "logprobs",
                  "skip_special_tokens")
# A chat request's: no `echo` (a completions field) and no `n` (the chat judge reads one choice), as
# the suite's chat variants (chat_cases.chat_variants); `logprobs` only where no channel splits the
# answer (the per-token reports are aligned with the content's text, D59).
CHAT_REQUEST_FIELDS = ("include_stop_str_in_output", "min_tokens", "ignore_eos", "logprobs", "skip_special_tokens")

# The chat examples' byte table: the fuzz table, the reasoning and tool-call tags whole and split
# (a tag split across tokens must never leak, D45), reasoning words, and the pieces of Hermes calls
# (`{"name": ..., "arguments": {...}}`) whose argument values hold multi-byte characters.
THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE = b"<think>", b"</think>", b"<tool_call>", b"</tool_call>"
CHAT_PIECES: tuple[bytes, ...] = (
    THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE, b"<th", b"ink>", b"</th", b"<tool", b"_call>", b"</tool",
    b"Let me", b" check", b" think", b"Hi!",
    b'{"name": "get_weather", ', b'"arguments": {"city": "', b'{"name": ', b'"get_weather", "arguments": ',
    b'{"city": "', b'"}}', b'"}', b"}", b"Paris", b"Z", b"\xbc", b"rich", b'{"name": 1}',
)
CHAT_TABLE: Mapping[int, bytes] = {**TABLE, **{200 + i: p for i, p in enumerate(CHAT_PIECES)}}
_CHAT_ID = {p: i for i, p in CHAT_TABLE.items()}

assert len(set(TABLE.values())) == len(TABLE), "two fuzz table ids spell the same bytes"
assert len(set(CHAT_TABLE.values())) == len(CHAT_TABLE), "two chat table ids spell the same bytes"


def table_spec(ids: Sequence[int], table: Mapping[int, bytes] = TABLE) -> dict[str, Any]:
    """The inline table of the ids a case uses (and EOS), in cases.py's JSON shape."""
    return {"table": {str(i): bytes_json(table[i]) for i in sorted({*ids, TABLE_EOS} & set(table))}, "eos": TABLE_EOS}


# ---- scripts ----------------------------------------------------------------------------------------


# Each split character of SPLIT as the fuzz table's pieces that send it one part at a time.
SPLIT_IDS: tuple[tuple[int, ...], ...] = (
    (_ID_OF[b"\xc3"], _ID_OF[b"\xa9"]), (_ID_OF[b"\xe2"], _ID_OF[b"\x82"], _ID_OF[b"\xac"]),
    (_ID_OF[b"\xe4\xb8"], _ID_OF[b"\xad"]), (_ID_OF[b"\xf0"], _ID_OF[b"\x9f\x98\x80"]))


# Runs whose middle token completes one character and begins the next (`a`+e2 then 82 ac; c3 then
# a9+e4b8 then ad): a stop ending on the first character completes with bytes pending past it.
RUN_ON_IDS: tuple[tuple[int, ...], ...] = (
    (_ID_OF[b"a\xe2"], _ID_OF[b"\x82\xac"]), (_ID_OF[b"\xc3"], _ID_OF[b"\xa9\xe4\xb8"], _ID_OF[b"\xad"]))


def table_text(min_size: int, max_size: int) -> st.SearchStrategy[list[int]]:
    """A run of the fuzz table's pieces (EOS aside), now and then a split character sent whole in
    pieces or a run whose token runs on into the next character (RUN_ON_IDS)."""
    pieces = st.sampled_from(sorted(TABLE.keys() - {TABLE_EOS})).map(lambda i: [i])
    split = st.sampled_from(SPLIT_IDS + RUN_ON_IDS).map(list)
    return st.lists(st.one_of(pieces, split), min_size=min_size, max_size=max_size).map(
        lambda parts: [i for p in parts for i in p])


def _with_eos(draw: st.DrawFn, script: list[Any], eos: Any) -> list[Any]:
    """`script` with EOS inserted anywhere, half the time."""
    if draw(st.booleans()):
        script.insert(draw(st.integers(0, len(script))), eos)
    return script


@st.composite
def table_script(draw: st.DrawFn) -> tuple[list[Any], list[Any]]:
    """(prompt items, script items) over the fuzz byte table: a run of its pieces (table_text), EOS
    anywhere (rarely in the middle)."""
    script: list[Any] = _with_eos(draw, draw(table_text(1, 8)), TABLE_EOS)
    prompt = draw(st.lists(st.sampled_from([_ID_OF[p] for p in PROMPT_PIECES]), min_size=1, max_size=3))
    return prompt, script


def _bytes_of(item: Callable[[int], dict[str, str]]) -> tuple[tuple[dict[str, str], ...], ...]:
    """SPLIT's characters, each as one script item per byte (`item(byte)`)."""
    return tuple(tuple(item(b) for b in ch.encode()) for ch in SPLIT)


@attrs.frozen
class FixtureItems:
    """What a script may send on one fixture tokenizer (properties/fixtures.py): words (text items),
    runs of items that spell one word in parts (single bytes of a split character; a WordPiece word
    as its head and `##` rest), and special tokens other than EOS."""

    words: tuple[str, ...]
    parts: tuple[tuple[dict[str, str], ...], ...]
    specials: tuple[str, ...] = ()


def _pieces(*tokens: str) -> tuple[dict[str, str], ...]:
    return tuple({"token": t} for t in tokens)


# WordPiece has no byte tokens and no U+FFFD (its normalizer drops it): its words spell whole
# characters, its parts a word's head and `##` rest or a continuation piece that joins the word before.
FIXTURE_ITEMS: Mapping[str, FixtureItems] = {
    "byte_level_bpe": FixtureItems(WORDS, _bytes_of(lambda b: {"bytes": f"{b:02x}"})),
    "sentencepiece_byte_fallback": FixtureItems(WORDS, _bytes_of(lambda b: {"token": f"<0x{b:02X}>"}), ("<unk>", "<s>")),
    "wordpiece": FixtureItems(("hello", " world", " the", " end", "Café", "中", "文", "😀", ".", " a", "b", "naïve"),
                              (_pieces("hel", "##lo"), _pieces("Caf", "##é"), _pieces("Emo", "##ji"),
                               _pieces("jal", "##apeño"), _pieces("Ång", "##ström"), _pieces("##中"), _pieces("##😀"),
                               _pieces("##.")), ("[UNK]", "[CLS]")),
}
FIXTURES = tuple(FIXTURE_ITEMS)
TOKENIZERS = ("byte_table", *FIXTURES)
# Fixtures llama.cpp's GGUF converter refuses (convert_gguf._refuse_wordpiece): an engine served
# from GGUF files never sees their checkpoints.
GGUF_REFUSED = frozenset({"wordpiece"})


@st.composite
def fixture_script(draw: st.DrawFn, name: str) -> tuple[list[Any], list[Any]]:
    """(prompt items, script items) over the fixture tokenizer `name` (FIXTURE_ITEMS): words, words
    in parts, its special tokens, EOS."""
    items = FIXTURE_ITEMS[name]
    word = st.sampled_from(items.words).map(lambda w: [{"text": w}])
    parts = st.sampled_from(items.parts).map(list)
    kinds = [word, parts, *([st.sampled_from(items.specials).map(lambda t: [{"token": t}])] if items.specials else [])]
    drawn = draw(st.lists(st.one_of(*kinds), min_size=1, max_size=6))
    script: list[Any] = _with_eos(draw, [i for p in drawn for i in p], {"eos": True})
    prompt = [{"text": draw(st.sampled_from(("The", "hello", " café")))}]
    return prompt, script


# ---- chat scripts -------------------------------------------------------------------------------------

# Each tag whole or split across two tokens.
TAG_SPELLINGS: Mapping[bytes, tuple[tuple[bytes, ...], ...]] = {
    THINK_OPEN: ((THINK_OPEN,), (b"<th", b"ink>")), THINK_CLOSE: ((THINK_CLOSE,), (b"</th", b"ink>")),
    CALL_OPEN: ((CALL_OPEN,), (b"<tool", b"_call>")), CALL_CLOSE: ((CALL_CLOSE,), (b"</tool", b"_call>")),
}
# A call's JSON up to its argument's value, the value's closing, and bodies that are no call (D47:
# content). The value in between is drawn from CALL_VALUE: ASCII and multi-byte characters, whole
# or split across tokens (ü = c3 bc, 中, 😀).
CALL_HEADS: tuple[tuple[bytes, ...], ...] = (
    (b'{"name": "get_weather", ', b'"arguments": {"city": "'), (b'{"name": ', b'"get_weather", "arguments": ', b'{"city": "'))
CALL_TAILS: tuple[tuple[bytes, ...], ...] = ((b'"}}',), (b'"}', b"}"))
CALL_VALUE: tuple[tuple[bytes, ...], ...] = (
    (b"Paris",), (b"Z", b"\xc3", b"\xbc", b"rich"), (b"\xe4\xb8", b"\xad"), ("中".encode(),), (b"\xf0", b"\x9f\x98\x80"),
    ("é".encode(),))
BAD_CALLS: tuple[tuple[bytes, ...], ...] = ((b'{"name": 1}',), (b'{"name": ', b"Paris"))


def _ids(*runs: Sequence[bytes]) -> list[int]:
    return [_CHAT_ID[b] for run in runs for b in run]


@st.composite
def chat_table_script(draw: st.DrawFn, reasoning: bool) -> tuple[list[Any], list[Any]]:
    """(prompt items, script items) of a chat example over CHAT_TABLE (see module): a reasoning
    section where `reasoning` (half the time; its close missing one time in five), content, a call
    (half the time; where the example asks for no tools its tags are content text), more content,
    EOS anywhere."""
    def tag(t: bytes) -> st.SearchStrategy[list[int]]:
        return st.sampled_from(TAG_SPELLINGS[t]).map(lambda run: _ids(run))

    words = st.sampled_from([b"Let me", b" check", b" think", b"Hi!"]).map(lambda w: _ids([w]))
    text = st.lists(st.one_of(table_text(1, 2), words), max_size=3).map(lambda parts: [i for p in parts for i in p])
    script: list[Any] = []
    if reasoning and draw(st.booleans()):
        script += draw(tag(THINK_OPEN)) + draw(text)
        script += draw(tag(THINK_CLOSE)) if draw(st.integers(0, 4)) else []
    script += draw(text)
    if draw(st.booleans()):
        body = draw(st.sampled_from(BAD_CALLS)) if draw(st.integers(0, 5)) == 0 else \
            (*draw(st.sampled_from(CALL_HEADS)), *[b for v in draw(st.lists(st.sampled_from(CALL_VALUE), min_size=1,
                                                                            max_size=3)) for b in v],
             *draw(st.sampled_from(CALL_TAILS)))
        script += draw(tag(CALL_OPEN)) + _ids(body)
        script += draw(tag(CALL_CLOSE)) if draw(st.integers(0, 4)) else []
        script += draw(text)
    script = _with_eos(draw, script or _ids([b"Hi!"]), TABLE_EOS)
    prompt = draw(st.lists(st.sampled_from([_ID_OF[p] for p in PROMPT_PIECES]), min_size=1, max_size=3))
    return prompt, script


# ---- what the script spells, and its events ---------------------------------------------------------


@attrs.frozen
class Spelled:
    """An example on its own tokenizer: the script's ids, each token's bytes as decoding the script
    so far adds them (EOS adds none), the prompt's bytes, the 1-based index of the first EOS."""

    ids: tuple[int, ...]
    pieces: tuple[bytes, ...]
    prompt: bytes
    eos_at: int | None

    @property
    def text(self) -> bytes:
        return b"".join(self.pieces)

    def completes(self, stop: str) -> int | None:
        """The token that completes the first occurrence of `stop` in the script's text."""
        at, ends = self.text.find(stop.encode()), list(itertools.accumulate(map(len, self.pieces)))
        return None if at < 0 else next(k + 1 for k, e in enumerate(ends) if e >= at + len(stop.encode()))

    def pending_stops(self) -> list[str]:
        """Stops that complete inside a token whose bytes run on into an unfinished character: the
        text up to the last character each such token completes, its last one or two characters
        (that last character never a U+FFFD, which may stand for invalid bytes), so the detokenizer
        holds bytes past the stop when it completes (§4.3, §4.6)."""
        dec, said, out = codecs.getincrementaldecoder("utf-8")("replace"), "", []
        for piece in self.pieces:
            new = dec.decode(piece)
            said += new
            if new and dec.getstate()[0] and not new.endswith("\ufffd"):
                out += [said[-1:], said[-2:]]
        return list(dict.fromkeys(out))

    def events(self, stops: Sequence[str]) -> list[int]:
        """The 1-based token indexes where something happens: a stop completes, a character
        completes, the EOS, the last token."""
        out = {len(self.pieces)} | ({self.eos_at} if self.eos_at else set())
        out |= {k for s in stops if (k := self.completes(s)) is not None}
        out |= {k + 1 for k, p in enumerate(self.pieces) if p and (p[-1] < 0x80 or len(p) > 1)}
        return sorted(out)


def spelled(inputs: Mapping[str, Any]) -> Spelled:
    """What an example's prompt and script spell on its own tokenizer (Spelled)."""
    case = _bare("fuzz/spell/001", inputs)
    tok = case_tokenizer(case)
    prompt, script = case_prompt(case, tok), case_script(case, tok)
    eos = getattr(tok, "eos_id", None)
    head = tok.decode_bytes(prompt)
    pieces, before = [], b""
    for k in range(1, len(script) + 1):
        full = tok.decode_bytes(prompt + [t for t in script[:k] if t != eos])[len(head):]
        pieces.append(full[len(before):] if full.startswith(before) else b"")
        before = full
    return Spelled(tuple(script), tuple(pieces), head,
                   next((i + 1 for i, t in enumerate(script) if t == eos), None))


@st.composite
def stops_for(draw: st.DrawFn, text: str, prompt: str, pending: Sequence[str] = ()) -> list[str]:
    """Stop strings: cut from the script's text (1-4 tokens' worth or inside one), a prefix or an
    overlapping neighbour of another, from the prompt's text, one of `pending` (Spelled.pending_stops),
    or short strings that may not occur."""
    def cut() -> str:
        if not text:
            return "x"
        i = draw(st.integers(0, len(text) - 1))
        return text[i:i + draw(st.integers(1, 4))]

    out: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(("cut", "cut", "prefix", "overlap", "prompt", "pending", "other")))
        if kind in ("pending", "cut") and pending and draw(st.booleans()):
            out.append(draw(st.sampled_from(tuple(pending))))
        elif kind == "prefix" and out and len(out[-1]) > 1:
            out.append(out[-1][:draw(st.integers(1, len(out[-1]) - 1))])
        elif kind == "overlap" and out and (at := text.find(out[-1])) >= 0:
            out.append(text[at + 1:at + 1 + draw(st.integers(1, 3))] or cut())
        elif kind == "prompt" and prompt:
            out.append(prompt[-draw(st.integers(1, min(3, len(prompt)))):])
        elif kind == "other":
            out.append(draw(st.sampled_from(("z", "é", "€", "\ufffd", "AB", "b.", "中"))))
        else:
            out.append(cut())
    return list(dict.fromkeys(s for s in out if s))


# A request field's value that changes the run, where it is not `true`; a chat request's logprobs
# is a flag.
FIELD_VALUES: Mapping[bool, Mapping[str, Any]] = {
    False: {"n": 2, "skip_special_tokens": False, "logprobs": 1},
    True: {"skip_special_tokens": False, "logprobs": True},
}


@st.composite
def request_fields(draw: st.DrawFn, n_tokens: int, eos_at: int | None, names: Sequence[str] = REQUEST_FIELDS,
                   chat: bool = False, events: Sequence[int] = ()) -> dict[str, Any]:
    """A few of the request fields `names`, at values that change the run (FIELD_VALUES; min_tokens
    up to one past the EOS, half the time on or just past one of the script's `events`, where a
    stop that completes within min_tokens is still a stop, D31)."""
    out: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(tuple(names)), max_size=2, unique=True)):
        if name == "min_tokens":
            top = max(1, min(n_tokens, (eos_at or n_tokens) + 1))
            near = sorted({e + d for e in events for d in (0, 1) if 1 <= e + d <= top})
            on_event = bool(near) and draw(st.booleans())
            out[name] = draw(st.sampled_from(near)) if on_event else draw(st.integers(1, top))
        else:
            out[name] = FIELD_VALUES[chat].get(name, True)
    return out


# Chat examples over the byte table are the ones whose scripts hold the channels' tags and calls:
# drawn three times as often as a fixture's.
CHAT_WEIGHT: Mapping[str, int] = {"byte_table": 3}


@attrs.frozen
class Menu:
    """What a run draws: examples over `tokenizers`, completions ones, chat ones (see module) or both."""

    tokenizers: tuple[str, ...] = TOKENIZERS
    completions: bool = True
    chat: bool = False

    def __attrs_post_init__(self) -> None:
        if unknown := sorted(set(self.tokenizers) - set(TOKENIZERS)):
            raise ValueError(f"Menu: no tokenizer {unknown[0]!r} to draw (known: {', '.join(TOKENIZERS)})")
        if not self.tokenizers or not (self.completions or self.chat):
            raise ValueError("Menu: nothing to draw (no tokenizer, or neither completions nor chat examples)")

    def served(self, gguf: bool) -> Menu:
        """This menu without the fixtures a GGUF converter refuses, where the engine loads GGUF files."""
        return attrs.evolve(self, tokenizers=tuple(t for t in self.tokenizers if t not in GGUF_REFUSED)) if gguf else self

    @property
    def kinds(self) -> tuple[tuple[bool, str], ...]:
        """(chat, tokenizer) of every kind of example drawn, a kind as often as CHAT_WEIGHT says."""
        return tuple((chat, t) for chat in (False, True) if (self.chat if chat else self.completions)
                     for t in self.tokenizers for _ in range(CHAT_WEIGHT.get(t, 1) if chat else 1))


COMPLETIONS = Menu()  # every completions example, over every tokenizer


@st.composite
def chat_settings(draw: st.DrawFn, tokenizer: str) -> dict[str, Any]:
    """A chat example's `inputs.chat`: its template (the BOS template on the byte table only, as the
    suite's chat variants), reasoning and tools asked or not."""
    template = draw(st.sampled_from(("chatml", "bos"))) if tokenizer == "byte_table" else "chatml"
    return {"template": template, **{flag: True for flag in ("reasoning", "tools") if draw(st.booleans())}}


@st.composite
def examples(draw: st.DrawFn, menu: Menu = COMPLETIONS) -> dict[str, Any]:
    """One generated example: a script case's `inputs` (see module)."""
    chat_on, kind = draw(st.sampled_from(menu.kinds))
    chat = draw(chat_settings(kind)) if chat_on else None
    table = CHAT_TABLE if chat is not None else TABLE
    if kind != "byte_table":
        prompt, script = draw(fixture_script(kind))
    elif chat is not None:
        prompt, script = draw(chat_table_script(bool(chat.get("reasoning"))))
    else:
        prompt, script = draw(table_script())
    base: dict[str, Any] = {"tokenizer": table_spec([*prompt, *script], table) if kind == "byte_table" else {"fixture": kind},
                            "prompt": prompt, "script": script, "max_tokens": len(script),
                            **({"chat": chat} if chat is not None else {})}
    sp = spelled(base)
    ids, eos_at = sp.ids, sp.eos_at
    stops = draw(stops_for(sp.text.decode("utf-8", "replace"), sp.prompt.decode("utf-8", "replace"), sp.pending_stops()))
    events = sp.events(stops)
    limits = sorted({max(1, e + d) for e in events for d in (-1, 0, 1)})
    out = {**base, "max_tokens": draw(st.sampled_from(limits))}
    if stops:
        out["stop"] = stops
    if draw(st.integers(0, 5)) == 0:
        out["stop_token_ids"] = [[draw(st.sampled_from(ids))]]
    names = REQUEST_FIELDS if chat is None else \
        tuple(n for n in CHAT_REQUEST_FIELDS if n != "logprobs" or not (chat.get("reasoning") or chat.get("tools")))
    fields = draw(request_fields(len(ids), eos_at, names, chat is not None, events))
    if fields:
        out["request"] = fields
    return settled(out, sp)


STAND_IN = 5  # the logit_bias of the token greedy takes where min_tokens masks the scripted one


def settled(inputs: Mapping[str, Any], sp: Spelled | None = None) -> dict[str, Any]:
    """`inputs` made a runnable case whose answer the forced checkpoint decides: max_tokens at least 1
    and at most the script's tokens (the reference's scripted model has nothing to force past them:
    the forced checkpoint's EOS after a script is what a scripted EOS item says), min_tokens at most
    max_tokens; and where min_tokens masks a scripted EOS or stop token id (D31), a script token
    biased by STAND_IN to be greedy's choice there, as the hand-written min_tokens cases do: the
    forced checkpoint leaves every unscripted token at the same logit, so without it the choice is
    a tie that no engine need break as the reference does (else min_tokens stops short of it)."""
    sp = sp or spelled(inputs)
    out = {**inputs, "max_tokens": max(1, min(int(inputs["max_tokens"]), len(sp.ids)))}
    req = dict(out.get("request", {}))
    if req.get("min_tokens", 0) > out["max_tokens"]:
        req["min_tokens"] = out["max_tokens"]
    stop_ids = _stop_ids(out)
    masked = sorted(_at_stop_ids(out, sp) | ({sp.eos_at} if sp.eos_at else set()))
    if req.get("min_tokens") and masked and masked[0] <= req["min_tokens"]:
        stand_in = next((t for t in sp.ids if t not in stop_ids and t != _eos_id(sp)), None)
        if stand_in is not None:
            req["logit_bias"] = {str(stand_in): STAND_IN}
        elif masked[0] > 1:
            req["min_tokens"] = masked[0] - 1
        else:
            del req["min_tokens"]
    out.pop("request", None)
    return {**out, **({"request": req} if req else {})}


def well_posed(inputs: Mapping[str, Any]) -> bool:
    """Whether a chat example scripts think tags only where it asks for reasoning (see module); a
    completions example is."""
    chat = inputs.get("chat")
    if chat is None or chat.get("reasoning"):
        return True
    return not any(t in spelled(inputs).text for t in (THINK_OPEN, THINK_CLOSE))


def _eos_id(sp: Spelled) -> int | None:
    return sp.ids[sp.eos_at - 1] if sp.eos_at else None


# ---- examples as cases --------------------------------------------------------------------------------


def _req(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    return inputs.get("request", {})


def _chat(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    return inputs.get("chat") or {}


def _in_prompt(i: Mapping[str, Any], sp: Spelled) -> bool:
    """Whether a stop occurs across the prompt's text and the script's: starting in the prompt and
    ending past it (one wholly inside the prompt no engine's stop check sees end a sequence)."""
    whole, cut = sp.prompt + sp.text, len(sp.prompt)
    return any(at < cut < at + len(b) for s in i.get("stop", ()) if (b := s.encode())
               for at in range(max(0, cut - len(b) + 1), cut) if whole.startswith(b, at))


_SPECIAL_NAMES = frozenset(t for items in FIXTURE_ITEMS.values() for t in items.specials)


def _special_in_script(i: Mapping[str, Any], sp: Spelled) -> bool:
    """Whether the script selects a special token: its EOS, or a fixture's (`<unk>`, `[CLS]`, ...)."""
    return sp.eos_at is not None or any(isinstance(x, dict) and x.get("token") in _SPECIAL_NAMES for x in i["script"])


def _stop_ids(i: Mapping[str, Any]) -> set[int]:
    """The example's stop token ids (each drawn as a one-token sequence)."""
    return {s[0] for s in i.get("stop_token_ids", ()) if len(s) == 1}


def _at_stop_ids(i: Mapping[str, Any], sp: Spelled) -> set[int]:
    """The tokens (1-based) at which the script selects a stop token id."""
    ids = _stop_ids(i)
    return {k + 1 for k, t in enumerate(sp.ids) if t in ids}


def _guard_reaches(i: Mapping[str, Any], sp: Spelled) -> bool:
    """Whether min_tokens or ignore_eos can change the run (D31): an end (the EOS, a stop string, a
    stop token id) at a token within min_tokens and the limit, or under ignore_eos the EOS within the
    limit; past them the guard turns nothing off."""
    r, limit = _req(i), int(i["max_tokens"])
    upto = min(int(r.get("min_tokens") or 0), limit)
    return any(k <= upto for k in _ends_run(i, sp) | _at_stop_ids(i, sp)) or \
        bool(r.get("ignore_eos") and sp.eos_at and sp.eos_at <= limit)


def _ends_run(i: Mapping[str, Any], sp: Spelled) -> set[int]:
    """The tokens at which a stop or the EOS would end the run."""
    return {k for s in i.get("stop", ()) if (k := sp.completes(s)) is not None} | ({sp.eos_at} if sp.eos_at else set())


# The decisions of spec/DECISIONS.md a generated case rests on, by what it holds (as hand-written
# cases name them): several stops the script's text holds, or one across the prompt and the output
# (D3), a stop or EOS on the last allowed token (D4), a stop or EOS within the limit, counted in usage
# (D7), min_tokens or ignore_eos over an end they turn off (D31), what the output holds: echo, a kept stop,
# special tokens' text where the script selects one (D33), n choices (D34), a reasoning channel (D45),
# tool calls (D47), per-token reports (D59). A field that cannot change the run names no decision,
# so a finding there rests on the chapter.
DECIDED_BY: tuple[tuple[str, Callable[[Mapping[str, Any], Spelled], bool]], ...] = (
    ("D3", lambda i, sp: sum(s.encode() in sp.text for s in i.get("stop", ())) > 1 or _in_prompt(i, sp)),
    ("D4", lambda i, sp: i["max_tokens"] in _ends_run(i, sp)),
    ("D7", lambda i, sp: any(k <= i["max_tokens"] for k in _ends_run(i, sp))),
    ("D31", _guard_reaches),
    ("D33", lambda i, sp: bool(_req(i).get("echo")
                               or (_req(i).get("include_stop_str_in_output") and (i.get("stop") or i.get("stop_token_ids")))
                               or ("skip_special_tokens" in _req(i) and _special_in_script(i, sp)))),
    ("D34", lambda i, sp: int(_req(i).get("n", 1)) > 1),
    ("D45", lambda i, sp: bool(_chat(i).get("reasoning"))),
    ("D47", lambda i, sp: bool(_chat(i).get("tools"))),
    ("D59", lambda i, sp: "logprobs" in _req(i)),
)

# The invariant and section a generated case is filed under: the first row whose test holds.
FILED_UNDER: tuple[tuple[str, str, Callable[[Mapping[str, Any]], bool]], ...] = (
    ("stream_tokens_aligned", "§4.7", lambda i: "logprobs" in _req(i)),
    ("calls_only_when_closed", "§4.7", lambda i: bool(_chat(i).get("tools"))),
    ("think_tags_never_text", "§4.7", lambda i: bool(_chat(i).get("reasoning"))),
    ("stop_bytes_never_emitted", "§4.6", lambda i: bool(i.get("stop") or i.get("stop_token_ids"))),
    ("eos_guards_respected", "§4.6", lambda i: bool(_req(i).get("min_tokens") or _req(i).get("ignore_eos"))),
    ("length_respected", "§4.3", lambda i: i["max_tokens"] < len(i["script"])),
    ("detok_concat_equals_batch", "§4.5", lambda i: True),
)


def _bare(case_id: str, inputs: Mapping[str, Any], **more: Any) -> Case:
    invariant, anchor = next((inv, sec) for inv, sec, test in FILED_UNDER if test(inputs))
    return parse_case({"id": case_id, "anchor": anchor, "grade": "MUST", "invariant": invariant,
                       "description": "A generated example (decodespec fuzz).", "kind": "script",
                       "inputs": dict(inputs), **more})


def case_of(case_id: str, inputs: Mapping[str, Any], *, description: str = "",
            expect: Mapping[str, Any] | None = None) -> Case:
    """The script case of a generated example, filed under its invariant (FILED_UNDER), resting on
    the decisions its features name (DECIDED_BY); cases.parse_case checks it."""
    sp = spelled(inputs)
    more: dict[str, Any] = {"expect": dict(expect or {}), "decisions": [d for d, test in DECIDED_BY if test(inputs, sp)]}
    if description:
        more["description"] = description
    return _bare(case_id, inputs, **more)
