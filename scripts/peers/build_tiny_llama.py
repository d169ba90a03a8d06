"""Build the tiny local Llama peer checkpoint (issue 7 item 4): nothing is downloaded.

The tokenizer is the byte-level BPE fixture of properties/fixtures.py (trained here, locally); the
model is a 2-layer LlamaConfig (seed 0) trained for a few hundred AdamW steps on the same fixture
corpus, each line ended by EOS, so that greedy runs of the black-box recipes see varied text (CJK
included) and natural EOS; the white-box cases force every token anyway. Writes config, weights,
generation config and a PreTrainedTokenizerFast into OUT (default .cache/peers/tiny-llama).

    .venv/bin/python scripts/peers/build_tiny_llama.py [--out DIR] [--steps 300]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from decodespec.properties import fixtures

ROOT = Path(__file__).resolve().parents[2]
# A plain chat template, so /v1/chat/completions of an OpenAI-compatible peer can render messages.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def train(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, steps: int) -> None:
    """Teacher-forced next-token training on the fixture corpus (every line + EOS), full batch."""
    rows = [tok(line).input_ids + [tok.eos_token_id] for line in fixtures.CORPUS]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    print(f"trained {steps} steps, final loss {loss.item():.3f}")


def build(out: Path, steps: int = 300) -> Path:
    tok_json = fixtures.byte_level_bpe(out.parent / "tokenizers")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_json), eos_token=fixtures.ENDOFTEXT,
                                  bos_token=fixtures.ENDOFTEXT, pad_token=fixtures.ENDOFTEXT)
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    eos = tok.convert_tokens_to_ids(fixtures.ENDOFTEXT)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    train(model, tok, steps)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".cache/peers/tiny-llama")
    ap.add_argument("--steps", type=int, default=300, help="training steps (0: random weights)")
    args = ap.parse_args()
    print(build(args.out, args.steps))
