"""Hypothesis strategies for generated script cases (§4.3, §4.5, §4.6, §4.9).

A generated example is the `inputs` object of a script case (properties/cases' format, cases.py):
a tokenizer, a prompt, a forced script, stop strings, `max_tokens`, single stop token ids and
request fields. `examples()` draws them over two tokenizers:

- the fuzz byte table (`TABLE`): ASCII pieces, every way of splitting a 2-, 3- and 4-byte
  character (é, €, 中, 😀) into tokens, pieces that end one character and begin the next, invalid
  bytes (ff, c0, a lone continuation byte, an encoded surrogate), a genuine U+FFFD, and EOS as a
  special token;
- the fixtures' byte-level BPE and SentencePiece byte-fallback tokenizers (properties/fixtures.py):
  words as text items, single bytes of multi-byte characters (byte items, `<0xNN>` tokens), special
  tokens other than EOS (`<unk>`, `<s>`), EOS.

Stops are cut from the script's own text (so they hit: across 1-4 tokens, inside one token, on the
last allowed token, multi-byte, overlapping or a prefix of one another), from the prompt's text,
or are short strings that may never occur; `max_tokens` is drawn next to an event of the script
(where a stop completes, the EOS, a character completes, the script's end). `case_of` turns an
example into a Case with the decisions of spec/DECISIONS.md its features rest on (`DECIDED_BY`),
as a hand-written case names them.
"""

from __future__ import annotations

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

assert len(set(TABLE.values())) == len(TABLE), "two fuzz table ids spell the same bytes"


def table_spec(ids: Sequence[int]) -> dict[str, Any]:
    """The inline table of the ids a case uses (and EOS), in cases.py's JSON shape."""
    return {"table": {str(i): bytes_json(TABLE[i]) for i in sorted({*ids, TABLE_EOS} & set(TABLE))}, "eos": TABLE_EOS}


# ---- scripts ----------------------------------------------------------------------------------------


@st.composite
def table_script(draw: st.DrawFn) -> tuple[list[Any], list[Any]]:
    """(prompt items, script items) over the fuzz byte table: the script a run of pieces, a split
    character now and then sent whole in pieces, EOS anywhere (rarely in the middle)."""
    pieces = st.sampled_from(sorted(TABLE.keys() - {TABLE_EOS}))
    split = st.sampled_from([[_ID_OF[b"\xc3"], _ID_OF[b"\xa9"]],
                             [_ID_OF[b"\xe2"], _ID_OF[b"\x82"], _ID_OF[b"\xac"]],
                             [_ID_OF[b"\xe4\xb8"], _ID_OF[b"\xad"]],
                             [_ID_OF[b"\xf0"], _ID_OF[b"\x9f\x98\x80"]]])
    parts = draw(st.lists(st.one_of(pieces.map(lambda i: [i]), split), min_size=1, max_size=8))
    script: list[Any] = [i for p in parts for i in p]
    if draw(st.booleans()):
        script.insert(draw(st.integers(0, len(script))), TABLE_EOS)
    prompt = draw(st.lists(st.sampled_from([_ID_OF[p] for p in PROMPT_PIECES]), min_size=1, max_size=3))
    return prompt, script


# How a script names one byte of a split character, and the special tokens (besides EOS) it may
# send, per fixture tokenizer (properties/fixtures.py).
FIXTURE_ITEMS: Mapping[str, tuple[Callable[[int], dict[str, str]], tuple[str, ...]]] = {
    "byte_level_bpe": (lambda b: {"bytes": f"{b:02x}"}, ()),
    "sentencepiece_byte_fallback": (lambda b: {"token": f"<0x{b:02X}>"}, ("<unk>", "<s>")),
}
FIXTURES = tuple(FIXTURE_ITEMS)
TOKENIZERS = ("byte_table", *FIXTURES)


@st.composite
def fixture_script(draw: st.DrawFn, name: str) -> tuple[list[Any], list[Any]]:
    """(prompt items, script items) over the fixture tokenizer `name`: words, single bytes of split
    characters, its special tokens, EOS."""
    byte, specials = FIXTURE_ITEMS[name]
    word = st.sampled_from(WORDS).map(lambda w: [{"text": w}])
    split = st.sampled_from(SPLIT).map(lambda ch: [byte(b) for b in ch.encode()])
    kinds = [word, split, *([st.sampled_from(specials).map(lambda t: [{"token": t}])] if specials else [])]
    parts = draw(st.lists(st.one_of(*kinds), min_size=1, max_size=6))
    script: list[Any] = [i for p in parts for i in p]
    if draw(st.booleans()):
        script.insert(draw(st.integers(0, len(script))), {"eos": True})
    prompt = [{"text": draw(st.sampled_from(("The", "hello", " café")))}]
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
def stops_for(draw: st.DrawFn, text: str, prompt: str) -> list[str]:
    """Stop strings: cut from the script's text (1-4 tokens' worth or inside one), a prefix or an
    overlapping neighbour of another, from the prompt's text, or short strings that may not occur."""
    def cut() -> str:
        if not text:
            return "x"
        i = draw(st.integers(0, len(text) - 1))
        return text[i:i + draw(st.integers(1, 4))]

    out: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(("cut", "cut", "prefix", "overlap", "prompt", "other")))
        if kind == "prefix" and out and len(out[-1]) > 1:
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


@st.composite
def request_fields(draw: st.DrawFn, n_tokens: int, eos_at: int | None) -> dict[str, Any]:
    """A few of the request fields (REQUEST_FIELDS), at values that change the run."""
    out: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(REQUEST_FIELDS), max_size=2, unique=True)):
        if name == "min_tokens":
            out[name] = draw(st.integers(1, max(1, min(n_tokens, (eos_at or n_tokens) + 1))))
        elif name == "n":
            out[name] = 2
        elif name == "skip_special_tokens":
            out[name] = False
        elif name == "logprobs":
            out[name] = 1
        else:
            out[name] = True
    return out


@st.composite
def examples(draw: st.DrawFn, tokenizers: Sequence[str] = TOKENIZERS) -> dict[str, Any]:
    """One generated example: a script case's `inputs` (see module)."""
    kind = draw(st.sampled_from(tuple(tokenizers)))
    prompt, script = draw(table_script() if kind == "byte_table" else fixture_script(kind))
    base: dict[str, Any] = {"tokenizer": table_spec([*prompt, *script]) if kind == "byte_table" else {"fixture": kind},
                            "prompt": prompt, "script": script, "max_tokens": len(script)}
    sp = spelled(base)
    ids, eos_at = sp.ids, sp.eos_at
    stops = draw(stops_for(sp.text.decode("utf-8", "replace"), sp.prompt.decode("utf-8", "replace")))
    limits = sorted({max(1, e + d) for e in sp.events(stops) for d in (-1, 0, 1)})
    out = {**base, "max_tokens": draw(st.sampled_from(limits))}
    if stops:
        out["stop"] = stops
    if draw(st.integers(0, 5)) == 0:
        out["stop_token_ids"] = [[draw(st.sampled_from(ids))]]
    fields = draw(request_fields(len(ids), eos_at))
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
    stop_ids = {s[0] for s in out.get("stop_token_ids", ()) if len(s) == 1}
    masked = sorted({k + 1 for k, t in enumerate(sp.ids) if t in stop_ids} | ({sp.eos_at} if sp.eos_at else set()))
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


def _eos_id(sp: Spelled) -> int | None:
    return sp.ids[sp.eos_at - 1] if sp.eos_at else None


# ---- examples as cases --------------------------------------------------------------------------------


def _req(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    return inputs.get("request", {})


def _in_prompt(i: Mapping[str, Any], sp: Spelled) -> bool:
    """Whether a stop occurs across the prompt's text and the script's, starting in the prompt."""
    whole = sp.prompt + sp.text
    return any(0 <= whole.find(s.encode()) < len(sp.prompt) for s in i.get("stop", ()))


def _ends_run(i: Mapping[str, Any], sp: Spelled) -> set[int]:
    """The tokens at which a stop or the EOS would end the run."""
    return {k for s in i.get("stop", ()) if (k := sp.completes(s)) is not None} | ({sp.eos_at} if sp.eos_at else set())


# The decisions of spec/DECISIONS.md a generated case rests on, by what it holds (as hand-written
# cases name them): several stops or one the prompt's text begins (D3), a stop or EOS on the last
# allowed token (D4), a stop or EOS within the limit, counted in usage (D7), min_tokens or ignore_eos
# (D31), what the output holds (D33), n choices (D34), per-token reports (D59).
DECIDED_BY: tuple[tuple[str, Callable[[Mapping[str, Any], Spelled], bool]], ...] = (
    ("D3", lambda i, sp: len(i.get("stop", ())) > 1 or _in_prompt(i, sp)),
    ("D4", lambda i, sp: i["max_tokens"] in _ends_run(i, sp)),
    ("D7", lambda i, sp: any(k <= i["max_tokens"] for k in _ends_run(i, sp))),
    ("D31", lambda i, sp: bool(_req(i).get("min_tokens") or _req(i).get("ignore_eos"))),
    ("D33", lambda i, sp: any(k in _req(i) for k in ("include_stop_str_in_output", "echo", "skip_special_tokens"))),
    ("D34", lambda i, sp: int(_req(i).get("n", 1)) > 1),
    ("D59", lambda i, sp: "logprobs" in _req(i)),
)

# The invariant and section a generated case is filed under: the first row whose test holds.
FILED_UNDER: tuple[tuple[str, str, Callable[[Mapping[str, Any]], bool]], ...] = (
    ("stream_tokens_aligned", "§4.7", lambda i: "logprobs" in _req(i)),
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
