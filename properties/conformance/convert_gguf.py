"""Run llama.cpp's convert_hf_to_gguf.py on a forced checkpoint with two fixes, without editing it.

    LLAMA_CPP_DIR=LLAMA_CPP_CHECKOUT python -m decodespec.properties.conformance.convert_gguf HF_DIR \
        --outfile OUT.gguf --outtype f32        (any other convert_hf_to_gguf.py argument passes on)

The wheel cannot ship llama.cpp's converter: LLAMA_CPP_DIR names a llama.cpp checkout (or the
vendor/llama.cpp of llama-cpp-python's sdist) holding convert_hf_to_gguf.py, its conversion/ package
and gguf-py/. This file imports nothing of decodespec (`python path/to/convert_gguf.py` runs it too);
its Python needs torch, transformers 5 and sentencepiece (`pip install 'decodespec[gguf]'`). The
presets run it for the llama.cpp engines (presets.toml, [gguf]).

1. Unknown BPE pre-tokenizer. For a byte-level BPE tokenizer it has no hash for, the converter's
   get_vocab_base_pre() raises "BPE pre-tokenizer was not recognized". When it does, this wrapper
   picks the name from tokenizer.json instead: a ByteLevel pre-tokenizer with use_regex (GPT-2 style,
   alone or inside a Sequence) gets "gpt-2", whose llama.cpp regex is exactly the GPT-2 split that
   tokenizers' ByteLevel applies; anything else gets "default". LLAMA_CPP_PRE=NAME forces a name.
   Known tokenizers keep the converter's own answer.
2. BOS/EOS. The converter writes tokenizer.ggml.add_bos_token only when it can parse it from
   tokenizer_config.json / the post-processor; without the key llama.cpp guesses (for "gpt2"
   vocabularies it adds BOS). The wrapper asks the HF tokenizer itself whether encoding adds BOS / EOS
   and writes both keys, always.
SentencePiece-style tokenizer.json (BPE + byte_fallback, <0xNN> tokens, Sequence decoder) goes
through the converter's own _set_vocab_llama_hf path (llama vocabulary, pre "default"); no hash.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("convert_gguf")
SOURCE = "LLAMA_CPP_DIR"


def _pre_from_tokenizer_json(dir_model: Path) -> str:
    forced = os.environ.get("LLAMA_CPP_PRE")
    if forced:
        return forced
    try:
        pre = json.loads((dir_model / "tokenizer.json").read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return "default"
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if any(p.get("type") == "ByteLevel" and p.get("use_regex", True) for p in parts):
        return "gpt-2"
    return "default"


def _patch(base: Any) -> None:
    """Fixes 1 and 2 (module docstring) on the converter's TextModel."""
    orig_pre, orig_prepare = base.TextModel.get_vocab_base_pre, base.TextModel.prepare_metadata

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        quiet = base.logger.level
        base.logger.setLevel(logging.ERROR)  # the converter's banner precedes its raise; we handle it
        try:
            return orig_pre(self, tokenizer)
        except NotImplementedError:
            res = _pre_from_tokenizer_json(Path(self.dir_model))
            log.warning("BPE pre-tokenizer not in llama.cpp's hash table; using tokenizer.ggml.pre = %r "
                        "(from tokenizer.json's pre_tokenizer; LLAMA_CPP_PRE overrides)", res)
            return res
        finally:
            base.logger.setLevel(quiet)

    def prepare_metadata(self: Any, vocab_only: bool) -> None:
        orig_prepare(self, vocab_only=vocab_only)
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.dir_model, local_files_only=True)
        except Exception as e:  # a vocab the converter read but transformers cannot
            log.warning("cannot load the HF tokenizer (%s); add_bos/add_eos left as the converter wrote them", e)
            return
        plain = tok("a b", add_special_tokens=False)["input_ids"]
        full = tok("a b")["input_ids"]
        add_bos = tok.bos_token_id is not None and len(full) > len(plain) and full[0] == tok.bos_token_id
        add_eos = tok.eos_token_id is not None and len(full) > len(plain) and full[-1] == tok.eos_token_id
        kv = self.gguf_writer.kv_data[0]
        for key, value, add in (("tokenizer.ggml.add_bos_token", add_bos, self.gguf_writer.add_add_bos_token),
                                ("tokenizer.ggml.add_eos_token", add_eos, self.gguf_writer.add_add_eos_token)):
            old = kv[key].value if key in kv else None
            if old != value:
                if key in kv:
                    del kv[key]
                log.info("%s = %s (HF tokenizer; converter had %s)", key, value, old)
                add(value)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    base.TextModel.prepare_metadata = prepare_metadata


def _refuse_wordpiece(argv: list[str]) -> None:
    """Refuse a WordPiece tokenizer before the converter writes a GGUF llama.cpp cannot load.

    The converter's Llama set_vocab has no WordPiece branch (only its BERT models write the "bert"
    vocabulary): with no tokenizer.model and no byte-fallback BPE it falls through to the GPT-2 BPE
    path, which stores the WordPiece pieces as tokenizer.ggml.model "gpt2" with no merges, and
    llama.cpp's loader rejects that file ("cannot find tokenizer merges in model file").
    """
    dirs = [Path(a) for a in argv[1:] if not a.startswith("-") and (Path(a) / "tokenizer.json").is_file()]
    for d in dirs[:1]:
        model = json.loads((d / "tokenizer.json").read_text(encoding="utf-8")).get("model") or {}
        if model.get("type") == "WordPiece":
            sys.exit(f"{d}: WordPiece tokenizer: llama.cpp's converter writes it for a Llama model as a GPT-2 BPE "
                     "vocabulary without merges, which llama.cpp refuses to load (cannot find tokenizer merges)")


def main() -> None:
    """Import the checkout's converter (and its gguf-py, unless NO_LOCAL_GGUF), patch it, run it."""
    llama = Path(os.environ.get(SOURCE, "")).resolve()
    if not os.environ.get(SOURCE) or not (llama / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"set {SOURCE} to a llama.cpp checkout (the folder of convert_hf_to_gguf.py)")
    _refuse_wordpiece(sys.argv)
    sys.path.insert(0, str(llama))
    if "NO_LOCAL_GGUF" not in os.environ:
        sys.path.insert(1, str(llama / "gguf-py"))
    import convert_hf_to_gguf  # type: ignore[import-not-found]
    from conversion import base  # type: ignore[import-not-found]

    _patch(base)
    sys.argv[0] = str(llama / "convert_hf_to_gguf.py")
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
