"""Train the embedded default model (runtime/assets/default) from text this script writes itself.

Nothing is downloaded: a seeded generator writes short stories, dialogues, question/answer pairs
and a few lines of CJK text; documents are joined with the `<|endoftext|>` token, the EOS of the
model (§4.3: EOS ends a request before detokenization). A byte-level BPE tokenizer is trained on
that text, then a TinyLM with AdamW on CPU. Every seed is fixed, so a rerun on the same torch
build gives the same files.

    .venv/bin/python scripts/train_default.py            # writes runtime/assets/default/
    .venv/bin/python scripts/train_default.py --steps 50 --out /tmp/x   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decodespec.runtime.tinylm import ASSETS, TinyLM, TinyLMConfig

EOS = "<|endoftext|>"

NAMES = ["Mia", "Tom", "Ana", "Leo", "Sam", "Nora", "Ben", "Lily"]
ANIMALS = ["cat", "dog", "bird", "fox", "rabbit", "duck"]
ADJECTIVES = ["little", "happy", "brave", "sleepy", "curious", "kind"]
PLACES = ["the park", "the garden", "the river", "the old house", "the market", "the school"]
THINGS = ["a red ball", "a blue kite", "a small box", "a green hat", "a big book", "an apple"]
FEELINGS = ["happy", "tired", "hungry", "surprised", "glad", "sad"]
WEATHER = ["It was a sunny day.", "It was raining.", "The wind was cold.", "The sky was blue."]
COLORS = {"sky": "blue", "grass": "green", "sun": "yellow", "snow": "white", "night": "dark"}
CJK = ["小猫在花园里玩。", "今天天气很好。", "我们去公园吧。", "小狗喜欢吃苹果。", "谢谢你，朋友。", "晚上我们看书。"]


def _story(r: random.Random) -> str:
    hero, friend = r.sample(NAMES, 2)
    animal, adj = r.choice(ANIMALS), r.choice(ADJECTIVES)
    lines = [f"Once upon a time, there was a {adj} {animal} named {hero}."]
    steps = [
        f"{r.choice(WEATHER)}",
        f"{hero} went to {r.choice(PLACES)}.",
        f"There, {hero} found {r.choice(THINGS)}.",
        f"{hero} met {friend} near {r.choice(PLACES)}.",
        f"{friend} said, \"Let us play together!\"",
        f"They played with {r.choice(THINGS)} all day.",
        f"{hero} felt {r.choice(FEELINGS)}.",
    ]
    lines += r.sample(steps, r.randint(3, 5))
    lines.append(f"At night, {hero} went home and slept. The end.")
    return " ".join(lines)


def _dialogue(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    place, thing = r.choice(PLACES), r.choice(THINGS)
    return "\n".join([
        f"{a}: Hello, {b}! How are you?",
        f"{b}: I am {r.choice(FEELINGS)}, thank you. And you?",
        f"{a}: I am fine. Do you want to go to {place}?",
        f"{b}: Yes! Can we take {thing}?",
        f"{a}: Of course. Let us go.",
    ])


def _qa(r: random.Random) -> str:
    pairs = []
    for _ in range(r.randint(2, 4)):
        kind = r.randrange(3)
        if kind == 0:
            thing = r.choice(list(COLORS))
            pairs.append(f"Q: What color is the {thing}?\nA: The {thing} is {COLORS[thing]}.")
        elif kind == 1:
            x, y = r.randint(1, 5), r.randint(1, 4)
            pairs.append(f"Q: What is {x} plus {y}?\nA: {x} plus {y} is {x + y}.")
        else:
            name, place = r.choice(NAMES), r.choice(PLACES)
            pairs.append(f"Q: Where did {name} go?\nA: {name} went to {place}.")
    return "\n".join(pairs)


def _cjk(r: random.Random) -> str:
    return "\n".join(r.sample(CJK, r.randint(2, 3)))


def make_corpus(n_docs: int, seed: int) -> list[str]:
    """Documents from a seeded mix: stories 50%, dialogues 25%, Q/A 20%, CJK lines 5%."""
    r = random.Random(seed)
    makers = [_story] * 10 + [_dialogue] * 5 + [_qa] * 4 + [_cjk]
    return [r.choice(makers)(r) for _ in range(n_docs)]


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ASSETS)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--docs", type=int, default=12000)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    docs = make_corpus(args.docs, seed=1234)
    tok = train_tokenizer(docs, vocab_size=768)
    data = encode_stream(tok, docs)
    eos = tok.token_to_id(EOS)
    config = TinyLMConfig(
        vocab_size=tok.get_vocab_size(), d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
        d_ff=384, context_limit=256, eos_token_id=eos,
    )
    model = TinyLM(config, name="default")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"corpus {len(docs)} docs, {data.numel()} tokens; vocab {config.vocab_size}; params {n_params}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    warmup = max(1, args.steps // 20)
    losses: list[float] = []
    t_train = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        window = torch.stack([data[s : s + args.seq + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  lr {lr:.2e}  {time.perf_counter() - t_train:.0f}s", flush=True)
    train_s = time.perf_counter() - t_train
    model.eval()

    args.out.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    tok.save(str(args.out / "tokenizer.json"))
    samples = {p: _greedy(model, tok, p, 60) for p in ["Once upon a time", "Mia: Hello", "Q: What color is the sky?\nA:"]}
    final = sum(losses[-20:]) / len(losses[-20:])
    figures = {
        "params": n_params, "vocab_size": config.vocab_size, "corpus_docs": len(docs),
        "corpus_tokens": int(data.numel()), "steps": args.steps, "batch": args.batch,
        "seq": args.seq, "final_loss_mean20": round(final, 4), "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__,
    }
    (args.out / "README.md").write_text(_readme(figures, samples))
    print(json.dumps(figures, indent=2))
    for p, s in samples.items():
        print(f"--- {p!r}\n{s}")


def _greedy(model: TinyLM, tok: Tokenizer, prompt: str, n: int) -> str:
    ids = tok.encode(prompt).ids
    logits, cache = model.prefill(ids)
    out: list[int] = []
    for _ in range(n):
        t = int(logits.argmax())
        if t == model.eos_token_id:
            return prompt + tok.decode(out) + EOS
        out.append(t)
        if cache.length >= model.context_limit:
            break
        logits = model.decode_one([cache], [t])[0]
    return prompt + tok.decode(out)


def _readme(fig: dict, samples: dict[str, str]) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in fig.items())
    shown = "\n\n".join(f"```\n{s}\n```" for s in samples.values())
    return f"""# The embedded default model

Made by `scripts/train_default.py` (no downloads, fixed seeds): a seeded generator writes short
stories, dialogues, question/answer pairs and a few CJK lines; documents are separated by
`{EOS}` (the EOS id in config.json). A byte-level BPE tokenizer (`tokenizer.json`) is trained on
that text, then a TinyLM (Llama-style: RMSNorm, RoPE, grouped KV heads, SwiGLU, tied embeddings)
is trained with AdamW on CPU.

| figure | value |
|---|---|
{rows}

Greedy samples (prompt included):

{shown}
"""


if __name__ == "__main__":
    main()
