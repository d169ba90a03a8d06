"""Small real tokenizers, trained locally at test time (§4.5).

Each builder trains a tokenizer with the `tokenizers` library on the text below (ASCII prose,
accented Latin, CJK, emoji, ZWJ sequences, combining marks), writes `tokenizer.json` under the
given folder and returns its path. Nothing is downloaded. Results are cached per process and per
folder, so a session-scoped tmp folder pays the training (well under a second each) once.

The three shapes are the decoders the incremental detokenizer must reproduce:

- `byte_level_bpe`: GPT-2 style, ByteLevel pre-tokenizer and decoder (every byte is a token, so a
  multi-byte character can be split across tokens);
- `sentencepiece_byte_fallback`: Llama style, BPE with `byte_fallback` (`<0xNN>` tokens), Metaspace
  pre-tokenizer, decoder Sequence[Replace('▁', ' '), ByteFallback, Fuse, Strip(' ', 1, 0)] (the
  leading-space rule at sequence start);
- `wordpiece`: BERT style, `##` continuation prefix, decoder WordPiece(cleanup=True).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Training text written for this project: prose plus the character classes the docstring lists.
CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. Isn't it? It's fine, we're done!",
    "A stop string may span two or three tokens; the stream must hold it back.",
    "Streaming output must equal the batch decode, byte for byte, at the end.",
    "Café, naïve, façade, jalapeño, Ångström, Œuvre, smørrebrød, São Paulo.",
    "Combining marks: e\u0301, a\u0308, n\u0303, o\u0302 and Z\u0336a\u0336 stay attached.",
    "中文分词器会把一个汉字拆成多个字节。增量解码必须等待完整的字符。",
    "日本語のテキストも同じです。한국어 문장도 마찬가지입니다.",
    "Emoji: 😀 🎉 🚀 👍🏽 and flags 🇫🇷 🇯🇵 travel in four bytes.",
    "ZWJ families: 👩\u200d👩\u200d👧\u200d👦 and 🧑\u200d💻 and 🏳\ufe0f\u200d🌈 are single glyphs.",
    "Numbers 0123456789, symbols @#$%^&*()[]{}<>/\\|~`+=_- and quotes \"'.",
    "hello world hello there the end of the line is near, said the model.",
    "Replacement char \ufffd is a real character and must be emitted when present.",
)

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
ENDOFTEXT = "<|endoftext|>"
CLS, SEP, WP_UNK, PAD = "[CLS]", "[SEP]", "[UNK]", "[PAD]"

_CACHE: dict[tuple[str, str], Path] = {}


def _write(tok: Tokenizer, folder: Path, name: str) -> Path:
    out = folder / name
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tok.save(str(path))
    return path


def _cached(kind: str, tmp_dir: str | Path, build) -> Path:
    key = (kind, str(Path(tmp_dir).resolve()))
    path = _CACHE.get(key)
    if path is None or not path.exists():
        path = _CACHE[key] = build(Path(tmp_dir))
    return path


def byte_level_bpe(tmp_dir: str | Path) -> Path:
    """GPT-2 style byte-level BPE with `<|endoftext|>` as its EOS (id 0)."""

    def build(folder: Path) -> Path:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=[ENDOFTEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(CORPUS, trainer)
        return _write(tok, folder, "byte_level_bpe")

    return _cached("byte_level_bpe", tmp_dir, build)


def sentencepiece_byte_fallback(tmp_dir: str | Path) -> Path:
    """Llama style: BPE with byte fallback, Metaspace pre-tokenizer, the Llama decoder chain.

    `<unk>`, `<s>`, `</s>` are special (ids 0-2); the 256 `<0xNN>` byte tokens are ordinary vocabulary
    (ids 3-258). The alphabet stops at U+2000, so CJK, emoji and ZWJ fall back to bytes.
    """

    def build(folder: Path) -> Path:
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        tok = Tokenizer(models.BPE(unk_token=UNK, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=700, special_tokens=[UNK, BOS, EOS, *byte_tokens], show_progress=False
        )
        # Only characters below U+2000 enter the alphabet (deterministically, unlike limit_alphabet):
        # CJK, emoji and ZWJ always fall back to <0xNN> byte tokens.
        tok.train_from_iterator(("".join(c for c in line if ord(c) < 0x2000) for line in CORPUS), trainer)
        # The byte tokens were reserved as special tokens to fix their ids; make them plain vocabulary.
        spec = json.loads(tok.to_str())
        spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] not in set(byte_tokens)]
        spec["model"]["byte_fallback"] = True
        return _write(Tokenizer.from_str(json.dumps(spec)), folder, "sentencepiece_byte_fallback")

    return _cached("sentencepiece_byte_fallback", tmp_dir, build)


def wordpiece(tmp_dir: str | Path) -> Path:
    """BERT style WordPiece (no lowercasing, accents kept), `[SEP]` as its EOS.

    The vocabulary is built, not trained (the WordPiece trainer breaks ties differently from run to
    run): every character alone and as `##c`, every word of the corpus, and each longer word split
    as its first three characters plus a `##` rest, so `hello` also spells as `hel ##lo`.
    """

    def build(folder: Path) -> Path:
        norm = normalizers.BertNormalizer(lowercase=False, strip_accents=False)
        pre = pre_tokenizers.BertPreTokenizer()
        words = sorted({w for line in CORPUS for w, _ in pre.pre_tokenize_str(norm.normalize_str(line))})
        chars = sorted({c for w in words for c in w})
        pieces = [p for w in words if len(w) > 3 for p in (w[:3], "##" + w[3:])]
        entries = [PAD, WP_UNK, CLS, SEP, *chars, *("##" + c for c in chars), *pieces, *words]
        vocab = {t: i for i, t in enumerate(dict.fromkeys(entries))}
        tok = Tokenizer(models.WordPiece(vocab, unk_token=WP_UNK))
        tok.normalizer = norm
        tok.pre_tokenizer = pre
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
        tok.add_special_tokens([PAD, WP_UNK, CLS, SEP])
        return _write(tok, folder, "wordpiece")

    return _cached("wordpiece", tmp_dir, build)


BUILDERS = {
    "byte_level_bpe": byte_level_bpe,
    "sentencepiece_byte_fallback": sentencepiece_byte_fallback,
    "wordpiece": wordpiece,
}
