"""Tokenizers behind one protocol, with per-token byte tables for the detokenizer (§4.5).

The batch decode `decode(ids)` is the oracle of §4.5: the incremental detokenizer must agree with
it. To stay O(1) per token the detokenizer does not call it; it reads a `DecodePlan`, derived once
per tokenizer from the decoder that `tokenizer.json` declares:

- `first[id]` / `rest[id]`: the bytes a token contributes when it is (is not) the first token the
  decoder sees (WordPiece's `##`/space rule and Metaspace treat index 0 specially; for byte-level
  BPE both tables are the same object);
- `strip`: a leading-space rule on the whole decoded text (Llama's `Strip(' ', 1, 0)` after `Fuse`):
  up to `strip_count` leading `strip_byte` bytes of the sequence are dropped.

Special tokens are absent from the tables of a plan built with `skip_special=True` (a declared
deletion); they do not count as the first token either, exactly as the batch decode filters them
before running the decoder. A decoder this module does not model gets `plan = None`; the
detokenizer then re-decodes a bounded window (see `runtime/detokenizer.py`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

__all__ = [
    "ByteTableTokenizer", "DecodePlan", "HFTokenizer", "Tokenizer", "TokenIdError",
    "TokenizerError", "TokenizerLoadError", "check_token_id", "check_tokenizer", "is_utf8",
]


class TokenizerError(ValueError):
    """A tokenizer was given something it cannot work with."""


class TokenizerLoadError(TokenizerError):
    """A tokenizer file or folder is missing or malformed (the message names the path)."""


class TokenIdError(TokenizerError):
    """A token id that is not an int or lies outside the vocabulary."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the runtime needs from a tokenizer (§4.5). `decode` is the batch oracle."""

    vocab_size: int
    eos_id: int | None
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str: ...

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = True) -> bytes: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def id_to_token(self, token_id: int) -> str: ...

    def plan(self, *, skip_special: bool = True) -> DecodePlan | None: ...


# The protocol's members, read off its class body: its annotated attributes and its methods.
_MEMBERS = tuple(Tokenizer.__annotations__) + tuple(
    name for name, value in vars(Tokenizer).items() if callable(value) and not name.startswith("_")
)


def check_tokenizer(obj: Any) -> None:
    """Refuse an object that lacks a member of the Tokenizer protocol, naming what it lacks: the
    members `isinstance(obj, Tokenizer)` checks, by `hasattr`, at a twentieth of its cost (once
    per request). Unlike isinstance from Python 3.12 on, it accepts members a `__getattr__`
    provides (a wrapper such as bench_engine's `_NoEos`)."""
    missing = [name for name in _MEMBERS if not hasattr(obj, name)]
    if missing:
        raise TypeError(
            f"tokenizer must implement the Tokenizer protocol; {type(obj).__name__} lacks {', '.join(missing)}"
        )


@attrs.frozen(slots=True)
class DecodePlan:
    """Per-token bytes plus the sequence-start rule; see the module docstring (§4.5)."""

    kind: str
    first: Mapping[int, bytes]
    rest: Mapping[int, bytes]
    skipped: frozenset[int] = frozenset()
    strip_byte: int | None = None
    strip_count: int = 0
    # The entries of `rest` that are whole UTF-8 on their own: with nothing pending, such a token
    # is final as it is, with no check of its bytes (the detokenizer's fast path). Built
    # with the plan, O(vocabulary): a tokenizer should build its plan once, as both here do.
    whole: Mapping[int, bytes] = attrs.field(init=False, repr=False, eq=False)

    @whole.default
    def _whole(self) -> Mapping[int, bytes]:
        return {i: b for i, b in self.rest.items() if is_utf8(b)}

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Batch decode as bytes under this plan (no U+FFFD replacement; ids already checked)."""
        parts: list[bytes] = []
        table = self.first
        for i in ids:
            b = table.get(i)
            if b is None:
                continue  # a skipped special token (callers validate ids first)
            parts.append(b)
            table = self.rest
        out = b"".join(parts)
        n = 0
        while n < self.strip_count and n < len(out) and out[n] == self.strip_byte:
            n += 1
        return out[n:]


def is_utf8(data: bytes) -> bool:
    """True when `data` is whole, valid UTF-8."""
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def own_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes `token_id` contributes inside a sequence (`token_bytes`); for a decoder not modelled
    per token, its text decoded alone, special tokens as text. TokenIdError for an id the tokenizer
    cannot decode (D20)."""
    try:
        return tokenizer.token_bytes(token_id)
    except TokenIdError:
        raise
    except TokenizerError:  # no per-token model of this decoder
        return tokenizer.decode([token_id], skip_special=False).encode("utf-8")


def check_token_id(token_id: Any, vocab_size: int) -> int:
    if type(token_id) is not int:
        index = getattr(token_id, "__index__", None)  # numpy / torch integer scalars
        if isinstance(token_id, bool) or index is None:
            raise TokenIdError(f"token id must be an int, got {type(token_id).__name__}: {token_id!r}")
        try:
            token_id = int(index())
        except TypeError:  # a tensor with more than one element, for example
            raise TokenIdError(f"token id must be an int, got {type(token_id).__name__}: {token_id!r}") from None
    if not 0 <= token_id < vocab_size:
        raise TokenIdError(f"token id {token_id} is outside the vocabulary (ids 0..{vocab_size - 1})")
    return token_id


# --------------------------------------------------------------------------------------------
# ByteTableTokenizer


class ByteTableTokenizer:
    """An explicit id -> bytes map, for hand-computable fixtures (§4.6: 101 -> b"AB", 102 -> b"CD").

    Decoding concatenates the bytes; `decode` replaces invalid UTF-8 with U+FFFD, `decode_bytes`
    does not. `eos_id`, when given, must be in the table and is the only special id (skipped by
    default). `encode` is greedy longest match over the non-special entries.
    """

    def __init__(self, table: Mapping[int, bytes], *, eos_id: int | None = None) -> None:
        if not isinstance(table, Mapping) or not table:
            raise TokenizerError(f"table must be a non-empty mapping of int -> bytes, got {table!r}")
        clean: dict[int, bytes] = {}
        for k, v in table.items():
            if isinstance(k, bool) or not isinstance(k, int):
                raise TokenizerError(f"table key {k!r} is not an int token id")
            if k < 0:
                raise TokenizerError(f"table key {k} is a negative token id")
            if not isinstance(v, (bytes, bytearray)):
                raise TokenizerError(f"table value for id {k} must be bytes, got {type(v).__name__}: {v!r}")
            clean[k] = bytes(v)
        if eos_id is not None and eos_id not in clean:
            raise TokenizerError(f"eos_id {eos_id!r} is not a key of the table")
        self._table = clean
        self.vocab_size = max(clean) + 1
        self.eos_id = eos_id
        self.special_ids = frozenset() if eos_id is None else frozenset({eos_id})
        self.eos_ids = self.special_ids
        self._by_bytes = {v: k for k, v in sorted(clean.items(), reverse=True) if v and k not in self.special_ids}
        self._max_len = max((len(b) for b in self._by_bytes), default=0)
        self._plans = {
            skip: DecodePlan(
                kind="byte_table",
                first=(t := {k: v for k, v in clean.items() if not (skip and k in self.special_ids)}),
                rest=t,
                skipped=self.special_ids if skip else frozenset(),
            )
            for skip in (True, False)
        }

    def _checked(self, ids: Iterable[int]) -> list[int]:
        out = []
        for i in ids:
            i = check_token_id(i, self.vocab_size)
            if i not in self._table:
                raise TokenIdError(f"token id {i} is not in the byte table")
            out.append(i)
        return out

    def encode(self, text: str) -> list[int]:
        """Greedy longest match of `text`'s UTF-8 bytes; a byte no entry covers is an error."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, got {type(text).__name__}")
        data, pos, ids = text.encode(), 0, []
        while pos < len(data):
            for n in range(min(self._max_len, len(data) - pos), 0, -1):
                tid = self._by_bytes.get(data[pos : pos + n])
                if tid is not None:
                    ids.append(tid)
                    pos += n
                    break
            else:
                raise TokenizerError(f"no table entry matches byte {data[pos]:#04x} at offset {pos} of {text!r}")
        return ids

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = True) -> bytes:
        return self._plans[skip_special].decode_bytes(self._checked(ids))

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._table[self._checked((token_id,))[0]]

    def id_to_token(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", "backslashreplace")

    def plan(self, *, skip_special: bool = True) -> DecodePlan:
        return self._plans[skip_special]

    def __repr__(self) -> str:
        return f"ByteTableTokenizer({len(self._table)} ids, eos_id={self.eos_id})"


# --------------------------------------------------------------------------------------------
# HFTokenizer: decoder JSON -> DecodePlan


def _bytes_to_unicode() -> dict[str, int]:
    """The byte-level alphabet of GPT-2 (printable bytes map to themselves, others to U+0100...)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL = _bytes_to_unicode()  # byte-level char -> byte
_BYTE_TOKEN = re.compile(rb"<0x([0-9A-Fa-f]{2})>")
_WORDPIECE_CLEANUP = (
    (b" .", b"."), (b" ?", b"?"), (b" !", b"!"), (b" ,", b","), (b" ' ", b"'"), (b" n't", b"n't"),
    (b" 'm", b"'m"), (b" do not", b" don't"), (b" 's", b"'s"), (b" 've", b"'ve"), (b" 're", b"'re"),
)


class _Unsupported(Exception):
    """The decoder has a step this module does not model (the window fallback is used)."""


def _byte_level(tok: bytes) -> bytes:
    text = tok.decode("utf-8", "surrogateescape")
    try:
        return bytes(BYTE_LEVEL[c] for c in text)
    except KeyError:
        return tok  # a token with a character outside the alphabet is kept as its UTF-8


def _steps(decoder: Mapping[str, Any] | None) -> tuple[list, int | None, int]:
    """Per-token functions `f(tok: bytes, first: bool) -> bytes` and the fused leading-strip rule:
    each decoder of the sequence by its type (_DECODERS); after a fusing one only a Strip of the
    start by one byte."""
    if decoder is None:  # tokenizers joins the tokens with single spaces
        return [lambda t, first: t if first else b" " + t], None, 0
    seq = decoder["decoders"] if decoder.get("type") == "Sequence" else [decoder]
    steps: list = []
    fused = False
    strip_byte, strip_count = None, 0
    for d in seq:
        kind = d.get("type")
        if fused and kind not in ("Fuse", "Strip"):
            raise _Unsupported(f"{kind} after Fuse/ByteLevel")
        if fused and kind == "Strip":
            strip_byte, strip_count = _fused_strip(d)
            continue
        if kind not in _DECODERS:
            raise _Unsupported(f"decoder {kind}")
        if (step := _DECODERS[kind](d)) is not None:
            steps.append(step)
        fused = fused or kind in _FUSING
    return steps, strip_byte, strip_count


_Step = Callable[[bytes, bool], bytes]


def _replace(d: Mapping[str, Any]) -> _Step:
    pat = d.get("pattern", {})
    if "String" not in pat:
        raise _Unsupported("Replace with a regex pattern")
    old, new = pat["String"].encode(), d["content"].encode()
    return lambda t, first: t.replace(old, new)


def _strip_step(d: Mapping[str, Any]) -> _Step:
    content, start, stop = d["content"].encode(), int(d["start"]), int(d["stop"])
    return lambda t, first: _strip(t, content, start, stop)


def _fused_strip(d: Mapping[str, Any]) -> tuple[int, int]:
    """A Strip after Fuse: the one byte stripped from the start of the whole text, and how many times."""
    content, start, stop = d["content"].encode(), int(d["start"]), int(d["stop"])
    if stop or len(content) != 1:
        raise _Unsupported("Strip of the end or of a multi-byte character after Fuse")
    return content[0], start


def _metaspace(d: Mapping[str, Any]) -> _Step:
    rep = d.get("replacement", "▁").encode()
    prepend = d.get("prepend_scheme", "always" if d.get("add_prefix_space", True) else "never")
    drop_first = prepend != "never"
    return lambda t, first: t.replace(rep, b"" if first and drop_first else b" ")


def _wordpiece_step(d: Mapping[str, Any]) -> _Step:
    prefix, cleanup = d.get("prefix", "##").encode(), bool(d.get("cleanup", True))
    return lambda t, first: _wordpiece(t, first, prefix, cleanup)


# A tokenizer.json decoder type -> its per-token step (None: no step of its own).
_DECODERS: dict[str, Callable[[Mapping[str, Any]], _Step | None]] = {
    "ByteLevel": lambda d: lambda t, first: _byte_level(t),
    "Fuse": lambda d: None,
    "Replace": _replace,
    "ByteFallback": lambda d: lambda t, first: bytes([int(m.group(1), 16)]) if (m := _BYTE_TOKEN.fullmatch(t)) else t,
    "Strip": _strip_step,
    "Metaspace": _metaspace,
    "WordPiece": _wordpiece_step,
}
# The decoders after which the pieces are one text: only a Strip of its start may follow.
_FUSING = frozenset({"ByteLevel", "Fuse"})


def _strip(tok: bytes, content: bytes, start: int, stop: int) -> bytes:
    chars = tok.decode("utf-8", "surrogateescape")
    c = content.decode()
    a, z = 0, len(chars)
    while a < start and a < z and chars[a] == c:
        a += 1
    n = 0
    while n < stop and z > a and chars[z - 1] == c:
        z, n = z - 1, n + 1
    return chars[a:z].encode("utf-8", "surrogateescape")


def _wordpiece(tok: bytes, first: bool, prefix: bytes, cleanup: bool) -> bytes:
    """tokenizers' WordPiece decoder: the cleanup runs on each token by itself (verified in tests)."""
    if not first:
        tok = tok[len(prefix):] if tok.startswith(prefix) else b" " + tok
    if cleanup:
        for old, new in _WORDPIECE_CLEANUP:
            tok = tok.replace(old, new)
    return tok


_EOS_NAMES = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<eos>", "<|end|>", "[SEP]")


class HFTokenizer:
    """A local `tokenizer.json` (or a folder holding one), via the `tokenizers` library (§4.5).

    `eos_id` is taken from the argument, else a sibling `tokenizer_config.json` (`eos_token`) or
    `config.json` / `generation_config.json` (`eos_token_id`), else the first added special token
    with a conventional end name. `special_ids` are the added tokens marked special.
    """

    def __init__(self, path: str | Path, *, eos_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
            if not p.is_file():
                raise TokenizerLoadError(f"folder {path} holds no tokenizer.json")
        elif not p.is_file():
            raise TokenizerLoadError(f"tokenizer file {path} does not exist")
        try:
            spec = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerLoadError(f"{p} is not valid JSON: {e}") from None
        if not isinstance(spec, dict) or "model" not in spec:
            raise TokenizerLoadError(f"{p} is JSON but not a tokenizer.json (no 'model' key)")
        try:
            self._tok = _RustTokenizer.from_file(str(p))
        except Exception as e:  # the Rust loader raises a bare Exception
            raise TokenizerLoadError(f"{p} could not be loaded by tokenizers: {e}") from None
        self.path = p
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        added = spec.get("added_tokens") or []
        self.special_ids = frozenset(a["id"] for a in added if a.get("special"))
        self.decoder_spec: Mapping[str, Any] | None = spec.get("decoder")
        self.eos_id = check_token_id(eos_id, self.vocab_size) if eos_id is not None else self._find_eos(added)
        # Every id that ends the output: eos_id, and (with no eos_id given) every one the checkpoint's
        # generation_config.json / config.json lists (Llama 3 lists several; §4.6).
        self.eos_ids: frozenset[int] = frozenset(() if self.eos_id is None else (self.eos_id,)) | (
            frozenset() if eos_id is not None else self._listed_eos())
        config = _read_json(p.parent / "tokenizer_config.json")
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None  # Jinja, for chat servers
        # The special tokens a chat template names (bos_token, eos_token), as transformers passes them.
        self.template_tokens: Mapping[str, str] = {
            k: v["content"] if isinstance(v, dict) else v for k in ("bos_token", "eos_token")
            if isinstance(v := config.get(k), str) or isinstance(v, dict) and isinstance(v.get("content"), str)}
        self._plans: dict[bool, DecodePlan | None] = {}

    def _find_eos(self, added: list[dict]) -> int | None:
        folder = self.path.parent
        cfg = _read_json(folder / "tokenizer_config.json")
        tok = cfg.get("eos_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and (tid := self._tok.token_to_id(tok)) is not None:
            return tid
        for name in ("generation_config.json", "config.json"):
            eid = _read_json(folder / name).get("eos_token_id")
            if isinstance(eid, list) and eid:
                eid = eid[0]
            if isinstance(eid, int) and 0 <= eid < self.vocab_size:
                return eid
        specials = {a["content"]: a["id"] for a in added if a.get("special")}
        return next((specials[n] for n in _EOS_NAMES if n in specials), None)

    def _listed_eos(self) -> frozenset[int]:
        out: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eid = _read_json(self.path.parent / name).get("eos_token_id")
            for i in eid if isinstance(eid, list) else [eid]:
                if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size:
                    out.add(i)
        return frozenset(out)

    def plan(self, *, skip_special: bool = True) -> DecodePlan | None:
        """The per-token tables for this tokenizer's decoder, built once; None if not modelled."""
        if skip_special not in self._plans:
            self._plans[skip_special] = self._build_plan(skip_special)
        return self._plans[skip_special]

    def _build_plan(self, skip_special: bool) -> DecodePlan | None:
        try:
            steps, strip_byte, strip_count = _steps(self.decoder_spec)
        except _Unsupported:
            return None
        skipped = self.special_ids if skip_special else frozenset()
        first: dict[int, bytes] = {}
        rest: dict[int, bytes] = {}
        for tid in range(self.vocab_size):
            tok = self._tok.id_to_token(tid)
            if tok is None or tid in skipped:
                continue
            raw = tok.encode("utf-8", "surrogateescape")
            a = b = raw
            for f in steps:
                a, b = f(a, True), f(b, False)
            first[tid], rest[tid] = a, b
        kind = str((self.decoder_spec or {}).get("type", "none"))
        return DecodePlan(
            kind=kind, first=rest if first == rest else first, rest=rest,
            skipped=skipped, strip_byte=strip_byte, strip_count=strip_count,
        )

    def _checked(self, ids: Iterable[int]) -> list[int]:
        return [check_token_id(i, self.vocab_size) for i in ids]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """The batch decode of `tokenizers` itself: the oracle of §4.5."""
        return self._tok.decode(self._checked(ids), skip_special_tokens=skip_special)

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = True) -> bytes:
        """Batch decode before U+FFFD replacement (the plan); a not-modelled decoder encodes `decode`."""
        ids = self._checked(ids)
        plan = self.plan(skip_special=skip_special)
        if plan is None:
            return self.decode(ids, skip_special=skip_special).encode()
        return plan.decode_bytes(ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes inside a sequence (not as the first token)."""
        tid = check_token_id(token_id, self.vocab_size)
        plan = self.plan(skip_special=False)
        if plan is None:
            kind = (self.decoder_spec or {}).get("type")
            raise TokenizerError(f"decoder {kind} is not modelled per token; token_bytes() is undefined")
        return plan.rest[tid]

    def id_to_token(self, token_id: int) -> str:
        piece = self._tok.id_to_token(check_token_id(token_id, self.vocab_size))
        if piece is None:
            raise TokenizerError(f"token id {token_id} has no piece in the tokenizer's vocabulary")
        return piece

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer` (for DecodeStream comparisons)."""
        return self._tok

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerLoadError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}

