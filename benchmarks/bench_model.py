"""TinyLM decode_one over an active batch vs a bare loop of batch-1 calls (§4.4; docs/performance.md).

For batch sizes 1..64, B sequences with different prompt lengths (8..40 tokens) are prefilled,
then STEPS decode steps run two ways on copies of the same caches: one `decode_one` over the whole
active batch, and a Python loop calling `decode_one` once per sequence. Several rounds, the median
is reported as tokens/s for each and the ratio batched/looped (> 1: the padded batch gather pays).
The model is the embedded default (runtime/assets/default).

Run: .venv/bin/python benchmarks/bench_model.py [--rounds N] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodespec.runtime.models import TinyLM

STEPS = 16
BATCHES = (1, 4, 16, 64)


def _caches(model: TinyLM, b: int):
    prompts = [[(7 * i + j) % model.vocab_size for j in range(8 + (i * 5) % 33)] for i in range(b)]
    return model.prefill_batch(prompts)[1]


def _run(model: TinyLM, b: int, batched: bool) -> float:
    caches = _caches(model, b)
    toks = [1] * b
    t0 = time.perf_counter()
    for _ in range(STEPS):
        if batched:
            model.decode_one(caches, toks)
        else:
            for c, t in zip(caches, toks):
                model.decode_one([c], [t])
    return b * STEPS / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = TinyLM.default()
    print(f"TinyLM default, {sum(p.numel() for p in model.parameters())} params, {args.threads} threads, "
          f"{STEPS} steps, median of {args.rounds} rounds")
    print(f"{'batch':>5} {'batched tok/s':>14} {'looped tok/s':>13} {'ratio':>6}")
    for b in BATCHES:
        batched, looped = [], []
        for _ in range(args.rounds):  # interleaved, so load changes hit both alike
            batched.append(_run(model, b, True))
            looped.append(_run(model, b, False))
        mb, ml = statistics.median(batched), statistics.median(looped)
        print(f"{b:>5} {mb:>14.0f} {ml:>13.0f} {mb / ml:>6.2f}")


if __name__ == "__main__":
    main()
