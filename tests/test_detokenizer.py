"""The incremental detokenizer against the batch decode (§4.5), with finish/discard of §4.3.

The oracle is each tokenizer's own batch `decode` (tokenizers' Rust decode for HFTokenizer). The
output of a request is defined as decode(prompt + output) with decode(prompt) removed from the front,
as bytes; special tokens are a declared deletion when `skip_special`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, decoders

from decodespec.machine import IllegalTransition
from decodespec.properties import fixtures
from decodespec.runtime.detokenizer import DecodingError, IncrementalDetokenizer
from decodespec.runtime.tokenizers import ByteTableTokenizer, HFTokenizer, TokenIdError

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """The three locally trained tokenizers, a byte table, and one decoder only the window handles."""
    folder = tmp_path_factory.mktemp("detok")
    out = {k: HFTokenizer(b(folder)) for k, b in fixtures.BUILDERS.items()}
    table = {i: bytes([i]) for i in range(256)}
    table.update({256: "中".encode(), 257: "😀".encode(), 258: b"AB", 259: b"CD", 260: b""})
    out["byte_table"] = ByteTableTokenizer(table, eos_id=260)
    spec = json.loads(fixtures.byte_level_bpe(folder).read_text())
    spec["decoder"] = json.loads(
        decoders.Sequence([decoders.ByteLevel(), decoders.Replace(Regex("\\u0000"), "")]).__getstate__()
    )
    (folder / "window").mkdir()
    (folder / "window" / "tokenizer.json").write_text(json.dumps(spec))
    out["window"] = HFTokenizer(folder / "window")
    assert out["window"].plan() is None
    return out


def byte_ids(tok, data: bytes) -> list[int]:
    """Token ids that spell `data` one byte per token (byte-level alphabet or <0xNN> fallback)."""
    if isinstance(tok, ByteTableTokenizer):
        return list(data)
    if tok.plan() is not None and tok.plan().kind == "Sequence":
        return [tok.backend.token_to_id(f"<0x{b:02X}>") for b in data]
    single = {tok.backend.id_to_token(i): i for i in range(tok.vocab_size)}
    alphabet = {b: single[c] for c, b in _byte_alphabet().items()}
    return [alphabet[b] for b in data]


def _byte_alphabet() -> dict[str, int]:
    keep = [*range(33, 127), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, n = {}, 0
    for b in range(256):
        out[chr(b) if b in keep else chr(256 + n)] = b
        n += b not in keep
    return out


def piece(tok, text: str) -> int:
    """The id of `text` as one vocabulary piece (no Metaspace prefix)."""
    return tok.backend.token_to_id(text) if isinstance(tok, HFTokenizer) else tok.encode(text)[0]


def run(tok, ids, *, prompt=(), skip_special=True):
    """(list of push results, finish result)."""
    d = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special=skip_special)
    pushes = [d.push(i) for i in ids]
    return pushes, d.finish()


# -- split characters ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback", "byte_table", "window"])
@pytest.mark.parametrize("text", ["中", "😀", "👍🏽", "é"])
def test_split_character_is_held_until_complete_and_never_replaced(toks, kind, text):
    """§4.5: a character split over byte tokens yields nothing, then all its bytes at once, no U+FFFD."""
    tok = toks[kind]
    data = text.encode()
    ids = byte_ids(tok, data)
    d = IncrementalDetokenizer(tok)
    out = [d.push(i) for i in ids]
    first = len(text[0].encode())
    assert out[: first - 1] == [b""] * (first - 1)
    assert b"".join(out) == data and FFFD.encode() not in b"".join(out)
    assert d.finish() == b""


def test_pending_bytes_and_state_follow_the_table(toks):
    """§4.5: a held fragment puts the table in PENDING; completing it returns to EMPTY."""
    tok = toks["byte_level_bpe"]
    e4, b8, ad = byte_ids(tok, "中".encode())
    d = IncrementalDetokenizer(tok)
    assert d.state == "EMPTY"
    assert d.push(e4) == b"" and d.pending == b"\xe4" and d.state == "PENDING"
    assert d.push(b8) == b"" and d.pending == b"\xe4\xb8"
    assert d.push(ad) == "中".encode() and d.pending == b"" and d.state == "EMPTY"


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback"])
def test_zwj_sequence_streams_character_by_character(toks, kind):
    """§4.5: a ZWJ family is several characters; each is emitted once complete, none is replaced."""
    tok = toks[kind]
    text = "👩\u200d👩\u200d👧\u200d👦"
    ids = tok.encode(text) + byte_ids(tok, text.encode())
    pushes, tail = run(tok, ids)
    assert b"".join(pushes) + tail == (text + text).encode()
    for chunk in pushes:
        chunk.decode()  # every chunk is whole characters


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback"])
def test_combining_mark_split_from_its_base(toks, kind):
    """§4.5: 'e' is final at once; the split U+0301 is held, then emitted; the batch decode agrees."""
    tok = toks[kind]
    ids = [piece(tok, "e")] + byte_ids(tok, "\u0301".encode())
    pushes, tail = run(tok, ids, prompt=tok.encode("x"))
    assert pushes[-3:] == [b"e", b"", "\u0301".encode()] and tail == b""
    assert tok.decode(tok.encode("x") + ids) == "xe\u0301"


# -- invalid bytes and U+FFFD ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback", "byte_table"])
@pytest.mark.parametrize("bad", [b"\xff", b"\x80", b"\xe4A", b"\xed\xa0", b"\xc0\xaf"])
def test_bytes_no_continuation_can_repair_raise_decoding_error(toks, kind, bad):
    """§4.5, D12: an impossible byte fails the request at the push that brings it; the table is FAILED."""
    tok = toks[kind]
    d = IncrementalDetokenizer(tok)
    ids = byte_ids(tok, bad)
    with pytest.raises(DecodingError, match="invalid UTF-8"):
        for i in ids:
            d.push(i)
    assert d.state == "FAILED"
    assert FFFD in tok.decode(ids)  # the batch decode agrees: it had to replace
    with pytest.raises(IllegalTransition):
        d.push(ids[0])
    assert d.state == "FAILED"


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback", "byte_table", "window"])
def test_genuine_replacement_character_is_emitted(toks, kind):
    """§4.5: U+FFFD written by the model is text (EF BF BD), not a decoding failure."""
    tok = toks[kind]
    data = "a\ufffdb".encode()
    pushes, tail = run(tok, byte_ids(tok, data))
    assert b"".join(pushes) + tail == data


# -- finish and discard (§4.3) -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback", "byte_table", "window"])
def test_finish_on_an_unfinished_character_raises_but_discard_after_stop_does_not(toks, kind):
    """§4.3/§4.5: finish() fails on an incomplete tail; after a stop hit the tail is dropped silently."""
    tok = toks[kind]
    ids = byte_ids(tok, b"ok\xf0\x9f\x98")
    d = IncrementalDetokenizer(tok)
    assert b"".join(d.push(i) for i in ids) == b"ok"
    with pytest.raises(DecodingError):
        d.finish()
    assert d.state == "FAILED"
    d = IncrementalDetokenizer(tok)
    for i in ids:
        d.push(i)
    assert d.pending
    assert d.discard_pending_after_stop() is None
    assert d.state == "DISCARDED" and d.pending == b""
    with pytest.raises(IllegalTransition):
        d.finish()


def test_finish_twice_is_illegal_and_keeps_the_state(toks):
    """§4.3: the detokenizer closes once; the table rejects a second finish or a later push."""
    d = IncrementalDetokenizer(toks["byte_table"])
    assert d.push(258) == b"AB" and d.finish() == b""
    for call in (d.finish, lambda: d.push(259), d.discard_pending_after_stop):
        with pytest.raises(IllegalTransition):
            call()
        assert d.state == "FINISHED"


def test_a_whole_token_passes_straight_through_only_with_nothing_pending(toks):
    """A token whose bytes are whole UTF-8 is final as it is only in EMPTY; after an
    unfinished lead byte the same token is checked with it, and here no continuation can repair it."""
    whole = toks["byte_table"].plan().whole
    d = IncrementalDetokenizer(toks["byte_table"])
    assert d.push(258) == b"AB" and d.state == "EMPTY"
    assert d._fast is whole  # armed: the next whole token is one lookup
    assert d.push(0xE4) == b"" and d.state == "PENDING"
    assert d._fast is not whole and not d._fast  # disarmed while a character is pending
    with pytest.raises(DecodingError, match="invalid UTF-8"):
        d.push(258)
    assert d.state == "FAILED" and not d._fast
    with pytest.raises(IllegalTransition):
        d.push(258)
    ok = IncrementalDetokenizer(toks["byte_table"])
    ok.push(0xE4), ok.push(0xB8)
    assert ok.push(0xAD) == "中".encode() and ok.state == "EMPTY" and ok._fast is whole  # re-armed


# -- the prompt context ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback", "byte_table"])
def test_prompt_ending_inside_a_character_does_not_leak_its_fragment(toks, kind):
    """§4.5: with the prompt ending in E4 B8, the output starts at AD (prompt bytes are not re-sent)."""
    tok = toks[kind]
    e4, b8, ad = byte_ids(tok, "中".encode())
    prompt = tok.encode("hi ") + [e4, b8]
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert d.pending == b"" and d.state == "EMPTY"
    bang = piece(tok, "!")
    out = d.push(ad) + d.push(bang) + d.finish()
    assert out == b"\xad!"
    full, pre = tok.decode_bytes(prompt + [ad, bang]), tok.decode_bytes(prompt)
    assert full == pre + out and full.decode() == tok.decode(prompt + [ad, bang])


def test_prompt_fragment_alone_is_not_an_output_error(toks):
    """§4.5: an unfinished prompt character with no output is the prompt's business: finish() is b""."""
    tok = toks["byte_level_bpe"]
    d = IncrementalDetokenizer(tok, prompt_ids=byte_ids(tok, b"\xe4"))
    assert d.finish() == b"" and d.state == "FINISHED"
    d = IncrementalDetokenizer(tok, prompt_ids=byte_ids(tok, b"\xe4"))
    with pytest.raises(DecodingError):
        d.push(piece(tok, "A"))


def test_leading_space_rule_applies_to_the_prompt_not_the_output(toks):
    """§4.5: Llama's Strip drops the sequence's first space; after a prompt the output keeps its space."""
    tok = toks["sentencepiece_byte_fallback"]
    word, prompt = tok.encode("hello world")[-1:], tok.encode("hello")
    assert tok.id_to_token(word[0]).startswith("▁")
    alone, _ = run(tok, word)
    after, _ = run(tok, word, prompt=prompt)
    assert b"".join(alone) == tok.decode(word).encode() == b"world"
    assert b"".join(after) == b" world"
    assert tok.decode(prompt + word).encode() == tok.decode(prompt).encode() + b" world"


def test_leading_space_rule_survives_a_prompt_of_only_special_tokens(toks):
    """§4.5: skipped specials decode to nothing, so the first output token is still the sequence start."""
    tok = toks["sentencepiece_byte_fallback"]
    word = tok.encode("hello world")[-1:]
    pushes, _ = run(tok, word, prompt=[tok.backend.token_to_id("<s>")])
    assert b"".join(pushes) == b"world" == tok.decode([tok.backend.token_to_id("<s>")] + word).encode()


def test_wordpiece_prefix_space_and_cleanup(toks):
    """§4.5: '##' glues to the previous word, others get a space, '.' loses it; the first token keeps '##'."""
    tok = toks["wordpiece"]
    tid = tok.backend.token_to_id
    ids = [tid("hel"), tid("##lo"), tid("it"), tid("'"), tid("s"), tid(".")]
    pushes, tail = run(tok, ids)
    assert pushes == [b"hel", b"lo", b" it", b" '", b" s", b"."] and tail == b""
    assert b"".join(pushes).decode() == tok.decode(ids) == "hello it ' s."
    assert run(tok, [tid("##s")])[0] == [b"##s"]
    assert run(tok, [tid("##s")], prompt=[tid("it")])[0] == [b"s"]
    assert run(tok, [tid("it")], prompt=[tid("[CLS]")])[0] == [b"it"]


# -- special tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback", "wordpiece", "byte_table"])
def test_special_tokens_are_a_declared_deletion(toks, kind):
    """§4.5: with skip_special the EOS yields nothing (even inside a split character); without, its text."""
    tok = toks[kind]
    ids = tok.encode("ok") + [tok.eos_id] + tok.encode("ok")
    pushes, _ = run(tok, ids)
    assert pushes[len(tok.encode("ok"))] == b""
    assert b"".join(pushes).decode() == tok.decode(ids)
    kept, _ = run(tok, ids, skip_special=False)
    assert b"".join(kept).decode() == tok.decode(ids, skip_special=False)
    if kind != "wordpiece":
        e4, b8, ad = byte_ids(tok, "中".encode())
        assert b"".join(run(tok, [e4, tok.eos_id, b8, ad])[0]) == "中".encode()


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 10_000, "5", 5.0, True, None])
def test_bad_token_ids_are_rejected_without_changing_state(toks, bad):
    """A non-int or out-of-vocabulary id is a TokenIdError (a ValueError); the table does not move."""
    tok = toks["byte_level_bpe"]
    d = IncrementalDetokenizer(tok)
    d.push(byte_ids(tok, b"\xe4")[0])
    with pytest.raises(TokenIdError):
        d.push(bad)
    assert d.state == "PENDING" and d.pending == b"\xe4"


def test_integer_scalars_from_numpy_are_accepted(toks):
    tok = toks["byte_level_bpe"]
    ids = tok.encode("héllo 中")
    assert b"".join(run(tok, [np.int64(i) for i in ids])[0]) == "héllo 中".encode()


def test_constructor_rejects_a_non_tokenizer_and_bad_prompt_ids(toks):
    with pytest.raises(TypeError, match="Tokenizer protocol"):
        IncrementalDetokenizer(object())  # type: ignore[arg-type]
    with pytest.raises(TokenIdError, match="outside the vocabulary"):
        IncrementalDetokenizer(toks["wordpiece"], prompt_ids=[10_000])


def test_the_tokenizer_check_refuses_exactly_what_the_protocol_refuses(toks):
    """check_tokenizer (once per request) is isinstance(obj, Tokenizer) without typing's cost: an
    object lacking any one member of the protocol is refused by both, naming the member."""
    import typing

    from decodespec.runtime.tokenizers import Tokenizer, check_tokenizer

    members = sorted(typing._get_protocol_attrs(Tokenizer))
    full = {name: getattr(toks["byte_table"], name) for name in members}
    assert isinstance(type("Full", (), full)(), Tokenizer)
    check_tokenizer(type("Full", (), full)())
    for name in members:
        lacking = type("Lacking", (), {k: v for k, v in full.items() if k != name})()
        assert not isinstance(lacking, Tokenizer)
        with pytest.raises(TypeError, match=f"Lacking lacks {name}$"):
            check_tokenizer(lacking)


# -- the property: concat(pushes) + finish == batch decode, append-only ---------------------


_CHARS = "".join(sorted(set("".join(fixtures.CORPUS)))) + "\ufffd🦀ß"


@st.composite
def id_sequences(draw, tok):
    """Ids mixing ordinary encodings, single-byte tokens (forced splits), specials and random ids."""
    parts: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        how = draw(st.sampled_from(["encode", "bytes", "special", "random"]))
        text = draw(st.text(alphabet=_CHARS, max_size=6))
        if how == "encode" or how == "bytes" and not isinstance(tok.plan(), type(None)) and tok.plan().kind == "WordPiece":
            parts += tok.encode(text)
        elif how == "bytes":
            parts += byte_ids(tok, text.encode())
        elif how == "special" and tok.special_ids:
            parts.append(draw(st.sampled_from(sorted(tok.special_ids))))
        else:
            parts += draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=2))
    return parts


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback", "wordpiece", "byte_table", "window"])
@settings(deadline=None, max_examples=200)
@given(data=st.data())
def test_streamed_bytes_equal_the_batch_decode_and_only_append(toks, kind, data):
    """§4.5: concat(pushes) + finish() == decode(prompt+out) - decode(prompt); every prefix stays a prefix.

    The oracle is the tokenizer's batch decode (text). A DecodingError is only allowed where the batch
    decode had to insert U+FFFD; where it succeeds, the emitted stream never gets ahead of the final text.
    """
    tok = toks[kind]
    ids = data.draw(id_sequences(tok))
    cut = data.draw(st.integers(0, len(ids)))
    skip = data.draw(st.booleans())
    prompt, out = ids[:cut], ids[cut:]
    full = tok.decode(prompt + out, skip_special=skip)
    pre = tok.decode(prompt, skip_special=skip)
    d = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special=skip)
    emitted: list[bytes] = []
    try:
        for i in out:
            emitted.append(d.push(i))
        emitted.append(d.finish())
    except DecodingError:
        assert FFFD in full
        return
    got = b"".join(emitted)
    if FFFD not in pre and FFFD not in full:
        expected = full.encode()[len(pre.encode()) :]
        assert full.encode().startswith(pre.encode())
        assert got == expected
        so_far = b""
        for chunk in emitted:
            so_far += chunk
            assert expected.startswith(so_far)
    if kind != "window":  # nothing is lost or held too long: emitted + pending is everything so far
        raw_full = tok.decode_bytes(prompt + out, skip_special=skip)
        raw_pre = tok.decode_bytes(prompt, skip_special=skip)
        assert raw_pre + got == raw_full or not raw_full.startswith(raw_pre)


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_byte_fallback", "byte_table"])
@settings(deadline=None, max_examples=100)
@given(data=st.data())
def test_hold_back_is_minimal(toks, kind, data):
    """§4.5: after every push the held bytes are exactly the unfinished character (at most 3 bytes).

    A one-byte prompt keeps Llama's sequence-start space rule out of the way.
    """
    tok = toks[kind]
    text = data.draw(st.text(alphabet=_CHARS.replace("\ufffd", ""), min_size=1, max_size=8))
    ids = byte_ids(tok, text.encode())
    d = IncrementalDetokenizer(tok, prompt_ids=byte_ids(tok, b"x"))
    so_far = b""
    raw = text.encode()
    for n, i in enumerate(ids, 1):
        so_far += d.push(i)
        assert so_far + d.pending == raw[:n]
        assert len(d.pending) <= 3
        so_far.decode()  # only whole characters left the detokenizer
        assert (d.state == "PENDING") == bool(d.pending)
    assert d.finish() == b"" and so_far == raw


def test_held_bytes_is_the_length_of_what_is_pending():
    """The plain int the per-token path reads (usage D7) agrees with `pending` at every push."""
    from decodespec.runtime import ByteTableTokenizer, IncrementalDetokenizer

    tok = ByteTableTokenizer({1: b"a", 2: b"\xe4", 3: b"\xb8", 4: b"\xad", 5: b""}, eos_id=5)
    for prompt in ((1,), (1, 2), (1, 2, 3)):
        d = IncrementalDetokenizer(tok, prompt_ids=prompt)
        for t in (3, 4, 2, 3, 4, 1, 2):
            try:
                d.push(t)
            except Exception:
                break
            assert d.held_bytes == len(d.pending), (prompt, t)
