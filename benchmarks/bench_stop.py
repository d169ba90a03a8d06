"""Stop matching per token with 1 .. 1024 stop strings (§4.6; docs/performance.md).

One realistic byte stream (2000 tokens of 1-6 bytes of English-like text) is pushed through
StopMatcher for stop sets of different sizes. The stops are random strings of the same alphabet,
chosen so that none occurs in the text but partial matches (held bytes) do. Several rounds, the
median per token is reported, with the ratio 1024/1 (target <= 1.5: the automaton's per-byte cost
does not depend on the number of stops) and, when transformers is importable, its
StopStringCriteria on the same text with 10 stops (a byte-level BPE is trained here, no downloads).

Run: .venv/bin/python benchmarks/bench_stop.py [--rounds N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from decodespec.runtime.stop import StopMatcher

SIZES = (1, 10, 16, 256, 1024)
PASSES = 10  # passes over the stream per sample
WORDS = ["the", "of", "and", "to", "in", "is", "was", "he", "for", "it", "with", "as", "his", "on", "be", "at", "by", "had", "are", "but", "from", "or", "have", "an", "they", "which", "one", "you", "were", "all", "we", "her", "she", "there", "would", "their", "will", "when", "who", "him", "been", "has", "more", "if", "no", "out", "so", "said", "what", "up", "its", "about", "than", "into", "them", "can", "only", "other", "time", "new", "some", "could", "these", "two", "may", "first", "then", "do", "any", "like", "my", "now", "over", "such", "our", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people"]
ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def token_stream(rng: random.Random, n_tokens: int = 2000) -> list[bytes]:
    """English-like text cut into tokens of 1-6 bytes."""
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens * 2)).encode()
    tokens, i = [], 0
    while len(tokens) < n_tokens:
        size = rng.randint(1, 6)
        tokens.append(text[i : i + size])
        i += size
    return tokens


def stop_set(rng: random.Random, n: int, text: bytes) -> list[str]:
    """n random stops of 3-12 characters of the text's alphabet that never occur in the text."""
    stops: list[str] = []
    while len(stops) < n:
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 12)))
        if s.encode() not in text:
            stops.append(s)
    return stops


def pass_us(stops: list[str], tokens: list[bytes], passes: int) -> float:
    """µs per token of `passes` passes over the stream, a fresh matcher per pass."""
    t0 = time.perf_counter()
    for _ in range(passes):
        push = StopMatcher(stops).push
        for tok in tokens:
            push(tok)
    return (time.perf_counter() - t0) / (passes * len(tokens)) * 1e6


def time_matchers(sets: dict[int, list[str]], tokens: list[bytes], rounds: int) -> dict[int, float]:
    """Median µs per token for each stop set; the sets take turns within every round, so load
    on the machine falls on all of them alike."""
    samples: dict[int, list[float]] = {n: [] for n in sets}
    for stops in sets.values():  # build (and cache) every automaton outside the timed region
        pass_us(stops, tokens, 1)
    for _ in range(rounds):
        for n, stops in sets.items():
            samples[n].append(pass_us(stops, tokens, PASSES))
    return {n: statistics.median(v) for n, v in samples.items()}


def holding_pushes(stops: list[str], tokens: list[bytes]) -> int:
    """How many pushes leave bytes held back (partial matches do occur); checks for no hit."""
    m, holds = StopMatcher(stops), 0
    for tok in tokens:
        m.push(tok)
        holds += bool(m.held)
    assert m.hit is None, "benchmark stops must not occur in the text"
    return holds


def time_hf_criteria(stops: list[str], tokens: list[bytes], rounds: int) -> float | None:
    """Median µs per token of transformers' StopStringCriteria, or None without transformers."""
    try:
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
        from transformers.generation.stopping_criteria import StopStringCriteria
    except ImportError:
        return None
    text = b"".join(tokens).decode()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([text], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = torch.tensor([hf.encode(text)[: len(tokens)]])
    criteria = StopStringCriteria(hf, stops)
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for t in range(1, ids.shape[1] + 1):
            criteria(ids[:, :t], None)
        samples.append((time.perf_counter() - t0) / ids.shape[1] * 1e6)
    return statistics.median(samples)


def run(rounds: int = 5) -> dict[str, Any]:
    """Measure every stop-set size in one run; returns the figures (µs per token and ratios)."""
    rng = random.Random(4_6)
    tokens = token_stream(rng)
    text = b"".join(tokens)
    sets = {n: stop_set(rng, n, text) for n in SIZES}
    per_token = time_matchers(sets, tokens, rounds)
    holds = {n: holding_pushes(stops, tokens) for n, stops in sets.items()}
    figures: dict[str, Any] = {
        "tokens": len(tokens),
        "bytes": len(text),
        "rounds": rounds,
        "us_per_token": per_token,
        "pushes_holding": holds,
        "ratio_1024_over_1": per_token[1024] / per_token[1],
        "hf_stop_string_criteria_10_us_per_token": time_hf_criteria(
            sets[10], tokens, max(1, rounds // 2)
        ),
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    figures = run(parser.parse_args().rounds)
    print(f"StopMatcher.push over {figures['tokens']} tokens ({figures['bytes']} bytes), "
          f"median of {figures['rounds']} rounds")
    for n, us in figures["us_per_token"].items():
        holding = figures["pushes_holding"][n]
        print(f"  {n:5d} stops: {us:6.3f} µs/token  ({holding} pushes held bytes)")
    print(f"  ratio 1024/1: {figures['ratio_1024_over_1']:.2f}  (target <= 1.5)")
    hf = figures["hf_stop_string_criteria_10_us_per_token"]
    if hf is not None:
        ours = figures["us_per_token"][10]
        print(f"  transformers StopStringCriteria, 10 stops: {hf:8.2f} µs/token "
              f"({hf / ours:.0f}x StopMatcher)")


if __name__ == "__main__":
    main()
