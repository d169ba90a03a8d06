"""The tokenizer protocol and its per-token decode plans agree with the batch decode (§4.5)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, decoders

from decodespec.properties import fixtures
from decodespec.runtime.tokenizers import (
    ByteTableTokenizer,
    HFTokenizer,
    TokenIdError,
    TokenizerError,
    TokenizerLoadError,
)
from decodespec.runtime.tokenizers import (
    Tokenizer as TokenizerProtocol,
)

KINDS = tuple(fixtures.BUILDERS)


@pytest.fixture(scope="module")
def fx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="module")
def hf(fx_dir):
    return {k: HFTokenizer(b(fx_dir)) for k, b in fixtures.BUILDERS.items()}


def _variant(fx_dir, name: str, decoder) -> HFTokenizer:
    """The Llama-style fixture with another decoder, written to its own folder."""
    spec = json.loads(fixtures.sentencepiece_byte_fallback(fx_dir).read_text())
    spec["decoder"] = None if decoder is None else json.loads(decoder.__getstate__())
    out = fx_dir / name
    out.mkdir(exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return HFTokenizer(out)


# -- ByteTableTokenizer ----------------------------------------------------------------------


def test_byte_table_fixture_of_4_6_decodes_by_concatenation():
    """§4.6: 101 -> "AB", 102 -> "CD" decode to "ABCD"; encode is greedy longest match."""
    tok = ByteTableTokenizer({101: b"AB", 102: b"CD", 103: b"A", 104: b"B"})
    assert tok.decode([101, 102]) == "ABCD"
    assert tok.decode_bytes([103, 104, 102]) == b"ABCD"
    assert tok.encode("ABCDA") == [101, 102, 103]
    assert tok.vocab_size == 105 and tok.token_bytes(102) == b"CD"
    assert isinstance(tok, TokenizerProtocol)


def test_byte_table_eos_is_special_and_skipped_by_default():
    """§4.5: the EOS is a declared deletion unless skip_special=False; encode never produces it."""
    tok = ByteTableTokenizer({1: b"a", 2: b"</s>"}, eos_id=2)
    assert tok.special_ids == frozenset({2})
    assert tok.decode([1, 2, 1]) == "aa"
    assert tok.decode([1, 2], skip_special=False) == "a</s>"
    with pytest.raises(TokenizerError, match="no table entry matches byte 0x3c"):
        tok.encode("</s>")


def test_byte_table_decode_replaces_invalid_utf8_but_decode_bytes_does_not():
    """§4.5: decode is the lossy text oracle, decode_bytes the raw bytes."""
    tok = ByteTableTokenizer({1: b"\xe4", 2: b"\xb8\xad", 3: b"\xff"})
    assert tok.decode([1, 2]) == "中"
    assert tok.decode([3]) == "\ufffd" and tok.decode_bytes([3]) == b"\xff"


@pytest.mark.parametrize(
    ("table", "kwargs", "message"),
    [
        ({}, {}, "non-empty mapping"),
        ([(1, b"a")], {}, "non-empty mapping"),
        ({"1": b"a"}, {}, "table key '1' is not an int"),
        ({True: b"a"}, {}, "table key True is not an int"),
        ({-1: b"a"}, {}, "negative token id"),
        ({1: "a"}, {}, "table value for id 1 must be bytes, got str"),
        ({1: b"a"}, {"eos_id": 2}, "eos_id 2 is not a key"),
    ],
)
def test_byte_table_rejects_malformed_tables(table, kwargs, message):
    """Bad fixtures fail loudly at construction, naming the offending entry."""
    with pytest.raises(TokenizerError, match=message):
        ByteTableTokenizer(table, **kwargs)


@pytest.mark.parametrize(("bad", "message"), [(7, "not in the byte table"), (99, "outside the vocabulary"),
                                               (-1, "outside"), ("1", "must be an int"), (True, "must be an int")])
def test_byte_table_rejects_unknown_ids(bad, message):
    """A decode of an id that is not in the table is an error, not a silent drop."""
    tok = ByteTableTokenizer({1: b"a", 9: b"b"})
    with pytest.raises(TokenIdError, match=message):
        tok.decode([1, bad])


# -- HFTokenizer: loading ----------------------------------------------------------------------


def test_hf_tokenizer_loads_a_file_or_a_folder(fx_dir):
    path = fixtures.byte_level_bpe(fx_dir)
    a, b = HFTokenizer(path), HFTokenizer(path.parent)
    assert a.vocab_size == b.vocab_size == 600
    assert a.encode("hello world") == b.encode("hello world")
    assert isinstance(a, TokenizerProtocol)


def test_hf_tokenizer_load_errors_name_the_path(tmp_path):
    """Missing file, folder without tokenizer.json, broken JSON and non-tokenizer JSON are clear errors."""
    with pytest.raises(TokenizerLoadError, match="does not exist"):
        HFTokenizer(tmp_path / "nope.json")
    with pytest.raises(TokenizerLoadError, match="holds no tokenizer.json"):
        HFTokenizer(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="is not valid JSON"):
        HFTokenizer(bad)
    bad.write_text('{"vocab": {}}')
    with pytest.raises(TokenizerLoadError, match="no 'model' key"):
        HFTokenizer(bad)
    bad.write_text('{"model": {"type": "Nonsense"}}')
    with pytest.raises(TokenizerLoadError, match="could not be loaded"):
        HFTokenizer(bad)


def test_hf_eos_and_special_ids_come_from_added_tokens(hf):
    """The EOS is an added special token with a conventional name; specials are the added ones."""
    assert hf["byte_level_bpe"].eos_id == 0 and hf["byte_level_bpe"].special_ids == frozenset({0})
    sp = hf["sentencepiece_byte_fallback"]
    assert sp.eos_id == sp.backend.token_to_id("</s>") and sp.special_ids == frozenset({0, 1, 2})
    assert hf["wordpiece"].eos_id == hf["wordpiece"].backend.token_to_id("[SEP]")


def test_hf_eos_prefers_the_sibling_configs(fx_dir, tmp_path):
    """tokenizer_config.json's eos_token wins, then config.json's eos_token_id, then the argument."""
    (tmp_path / "tokenizer.json").write_text(fixtures.sentencepiece_byte_fallback(fx_dir).read_text())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert HFTokenizer(tmp_path).eos_id == 1
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}}))
    assert HFTokenizer(tmp_path).eos_id == 0
    assert HFTokenizer(tmp_path, eos_id=2).eos_id == 2
    (tmp_path / "config.json").write_text("{oops")
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerLoadError, match="config.json is not valid JSON"):
        HFTokenizer(tmp_path)


# -- HFTokenizer: plans agree with the batch decode -------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_token_alone_and_second_matches_the_batch_decode(hf, kind):
    """§4.5: the per-token table reproduces tokenizers' decode for each id in both positions."""
    tok = hf[kind]
    anchor = tok.encode("ok")[0]
    for skip in (True, False):
        for tid in range(tok.vocab_size):
            for ids in ([tid], [anchor, tid]):
                text = tok.decode(ids, skip_special=skip)
                raw = tok.decode_bytes(ids, skip_special=skip)
                try:
                    assert raw.decode() == text, (kind, ids, skip)
                except UnicodeDecodeError:
                    assert "\ufffd" in text, (kind, ids, skip)


@pytest.mark.parametrize("kind", KINDS)
@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_plan_decode_bytes_agrees_with_batch_decode(hf, kind, data):
    """§4.5: decode_bytes is the batch decode before U+FFFD replacement, on any id sequence."""
    tok = hf[kind]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=12))
    skip = data.draw(st.booleans())
    text, raw = tok.decode(ids, skip_special=skip), tok.decode_bytes(ids, skip_special=skip)
    assert raw.decode("utf-8", "replace") == text or "\ufffd" in text


def test_wordpiece_cleanup_is_applied_per_token_by_tokenizers(hf):
    """§4.5: tokenizers cleans each token alone, so " ' " across tokens stays; no lookahead is needed."""
    tok = hf["wordpiece"]
    ids = [tok.backend.token_to_id(t) for t in ("it", "'", "s", ".")]
    assert tok.decode(ids) == "it ' s." == tok.decode_bytes(ids).decode()


def test_wordpiece_first_token_keeps_its_prefix(hf):
    """§4.5: '##' is only removed after the first token; a skipped [CLS] does not count as first."""
    tok = hf["wordpiece"]
    cls, s = tok.backend.token_to_id("[CLS]"), tok.backend.token_to_id("##s")
    assert tok.decode([cls, s]) == "##s" == tok.decode_bytes([cls, s]).decode()
    assert tok.decode([cls, s], skip_special=False) == "[CLS]s"


def test_llama_strip_rule_drops_one_leading_space_of_the_sequence(hf):
    """§4.5: Strip(' ', 1, 0) after Fuse removes the first space of the whole text only."""
    tok = hf["sentencepiece_byte_fallback"]
    ids = tok.encode("hello world")
    assert tok.decode_bytes(ids) == b"hello world" == tok.decode(ids).encode()
    assert tok.plan().strip_count == 1 and tok.plan().strip_byte == ord(" ")


@pytest.mark.parametrize(
    ("name", "decoder", "modelled"),
    [
        ("metaspace_first", decoders.Metaspace(prepend_scheme="first"), True),
        ("metaspace_never", decoders.Metaspace(prepend_scheme="never"), True),
        ("no_decoder", None, True),
        ("per_token_strip", decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)]), True),
        ("regex_replace", decoders.Sequence([decoders.Replace(Regex("▁+"), " ")]), False),
        ("bpe_decoder", decoders.BPEDecoder(suffix="</w>"), False),
    ],
)
def test_other_decoders_are_modelled_or_left_to_the_window(fx_dir, name, decoder, modelled):
    """§4.5: Metaspace, no decoder and per-token Strip get tables; others get plan None."""
    tok = _variant(fx_dir, name, decoder)
    assert (tok.plan() is not None) == modelled
    for text in ("hello world", "a▁b c", "中文 😀"):
        ids = tok.encode(text)
        for cut in range(len(ids) + 1):
            part = ids[cut:]
            assert tok.decode_bytes(part).decode("utf-8", "replace") == tok.decode(part) or "\ufffd" in tok.decode(part)
    if not modelled:
        with pytest.raises(TokenizerError, match="not modelled per token"):
            tok.token_bytes(5)


def test_byte_level_token_bytes_are_raw_bytes(hf):
    """§4.5: a byte-level token is one byte of a split character, not text."""
    tok = hf["byte_level_bpe"]
    ids = [tok.backend.token_to_id(c) for c in ("ä", "¸", "Ń")]  # E4 B8 AD = 中 in the byte alphabet
    assert [tok.token_bytes(i) for i in ids] == [b"\xe4", b"\xb8", b"\xad"]
    assert tok.decode(ids) == "中"


def test_hf_rejects_ids_outside_the_vocabulary(hf):
    tok = hf["byte_level_bpe"]
    with pytest.raises(TokenIdError, match="token id 600 is outside the vocabulary"):
        tok.decode([1, 600])
    with pytest.raises(TypeError, match="encode\\(\\) takes str"):
        tok.encode(b"x")  # type: ignore[arg-type]
