"""Build the tiny local Llama peer checkpoint (issue 7 item 4): nothing is downloaded.

The tokenizer is the byte-level BPE fixture of properties/fixtures.py (trained here, locally); the
model is a 2-layer LlamaConfig with random weights (seed 0): the conformance cases force every
token with a logits processor, so the weights only need to exist. Writes config, weights,
generation config and a PreTrainedTokenizerFast into OUT (default .cache/peers/tiny-llama).

    .venv/bin/python scripts/peers/build_tiny_llama.py [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from decodespec.properties import fixtures

ROOT = Path(__file__).resolve().parents[2]


def build(out: Path) -> Path:
    tok_json = fixtures.byte_level_bpe(out.parent / "tokenizers")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_json), eos_token=fixtures.ENDOFTEXT,
                                  bos_token=fixtures.ENDOFTEXT, pad_token=fixtures.ENDOFTEXT)
    torch.manual_seed(0)
    eos = tok.convert_tokens_to_ids(fixtures.ENDOFTEXT)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".cache/peers/tiny-llama")
    print(build(ap.parse_args().out))
