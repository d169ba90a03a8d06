"""Framework cost per request-token, choose excluded (§4.3-§4.8; docs/performance.md).

What the reference adds to every generated token: detokenizer (§4.5) + stop matcher with 10 stop
strings (§4.6) + ordered stream with its reader (§4.7, §4.8) + lifecycle table (§4.1) + trace.
The same precomputed ids (byte-level BPE trained locally on text with CJK, emoji and ZWJ
sequences, so characters split across tokens) go through three contenders, side by side in every
round:

- `ours`: a RequestRun driven phase by phase as generate() drives it (check_point, select,
  begin_decode, end_decode; the stream read inline). The model is a stub whose cache only counts;
  each id is handed to `select(token)` as the Engine hands over its batch argmax, so choose and the
  model step are bypassed and all the rest is the real per-token path;
- `floor`: a bare loop over the same ids appending each token's bytes to a list;
- `transformers`: `StopStringCriteria` called per token on the growing input_ids (slices of one
  tensor, cheaper than generate's torch.cat) plus `TextIteratorStreamer.put` per token with a
  consumer thread draining it, as generate() with `stop_strings` and that streamer would.

The stop strings never occur in the output but their beginnings often do, so the matcher holds
bytes back on many tokens. Targets (`targets` in the output): ours < 5 µs per token; transformers /
ours >= 50 and >= 100 (DECISIONS D67 says where the 100x one's bound lies; docs/performance.md has the
benchmarks).

With `--baseline CHECKOUT` the same figures of another checkout (its .venv and its own
benchmarks/bench_framework.py, one round a call in a subprocess) are taken in every round beside
these: the code before a change, side by side in one session.

Run: .venv/bin/python benchmarks/bench_framework.py [--rounds N] [--tokens N] [--layout lines|paragraphs]
     [--baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import in_checkout, interleaved, ratio, stat

from decodespec.properties import fixtures
from decodespec.runtime.request import Request
from decodespec.runtime.runner import RequestRun
from decodespec.runtime.tokenizers import HFTokenizer
from decodespec.spec import FinishReason

QUICK = {"rounds": 1, "n_tokens": 200}
N_STOPS = 10
PROMPT = "Streaming output must equal the batch decode."


class _Cache:
    """A cache that only counts (the stub model's); RequestRun reads `length` and calls `free`."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def free(self) -> None:
        pass


class _StubModel:
    """Just what RequestRun reads from a model; the kernels are never called."""

    name = "stub"
    device = torch.device("cpu")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.context_limit = 1 << 30


# How the fixture corpus is laid out as model output. transformers' TextIteratorStreamer re-decodes
# its cache up to the last newline on every token, so its cost grows with the line: `lines` (about
# 60 characters each) is its cheapest case, `paragraphs` (about 800 characters, a blank line
# between) is the prose a model writes. Ours does the same work per token in both.
LAYOUTS: dict[str, Callable[[tuple[str, ...]], str]] = {
    "lines": lambda corpus: "\n".join(corpus) + "\n",
    "paragraphs": lambda corpus: " ".join(corpus) + "\n\n",
}


def output_ids(tok: HFTokenizer, n: int, layout: str = "lines") -> list[int]:
    """n ids of the fixture corpus (prose, accents, CJK, emoji, ZWJ) laid out as `layout`,
    EOS-free, ending on a character boundary."""
    ids: list[int] = []
    text = LAYOUTS[layout](fixtures.CORPUS)
    while len(ids) < n:
        ids += tok.encode(text)
    ids = [i for i in ids if i != tok.eos_id][:n]
    while True:
        try:
            tok.decode_bytes(ids).decode()
            return ids
        except UnicodeDecodeError:
            ids.pop()


def stop_strings(text: str, rng: random.Random, n: int = N_STOPS) -> list[str]:
    """n stops that never occur in `text`: a piece of it (2-6 characters, so partial matches and
    held bytes are common) followed by a character that breaks the match."""
    stops: list[str] = []
    while len(stops) < n:
        k = rng.randint(2, 6)
        at = rng.randrange(len(text) - k)
        s = text[at : at + k] + rng.choice("§¤#~")
        if s not in text and s.strip() == s and s not in stops:
            stops.append(s)
    return stops


def prefilled(tok: HFTokenizer, prompt: list[int], n: int, stops: list[str]) -> tuple[RequestRun, _Cache, torch.Tensor]:
    """A RequestRun of the stub model past its prefill, reading its own stream as generate()
    does, with room for `n` tokens: the run, its counting cache and the logits it is handed."""
    run = RequestRun(Request(prompt, stop=stops, max_output_tokens=n + 1), model=_StubModel(tok.vocab_size),
                     tokenizer=tok)
    run.inline_reader = True  # generate()'s own reading of the stream
    logits = torch.zeros(1)
    cache = _Cache(len(prompt))
    run.admit()
    run.check_point()
    run.begin_prefill()
    run.end_prefill(logits, cache)
    return run, cache, logits


def drive(run: RequestRun, ids: list[int], cache: _Cache, logits: torch.Tensor) -> None:
    """The per-token path of `ours`: each id through the phases generate() runs per token, the
    id handed to `select` as the Engine hands over its batch argmax."""
    check_point, select, begin_decode, end_decode = run.check_point, run.select, run.begin_decode, run.end_decode
    for token in ids:
        check_point()
        select(token)
        begin_decode()
        cache.length += 1
        end_decode(logits)


def run_ours(tok: HFTokenizer, prompt: list[int], ids: list[int], stops: list[str],
             clock: Callable[[], float] = time.process_time) -> tuple[float, bytes, float, float]:
    """µs per token of the RequestRun per-token path, the output it streamed, µs per token of
    the end of the request (drain, terminal event, the Result), and µs per token of reading the
    Result's trace (its Events are built from the raw entries then, not on the per-token path)."""
    n = len(ids)
    run, cache, logits = prefilled(tok, prompt, n, stops)
    t0 = clock()
    drive(run, ids, cache, logits)
    elapsed = clock() - t0
    run.fire("length")  # the script is done; end the request as the length limit would
    t1 = clock()
    result = run.finish()
    t2 = clock()
    events = result.events
    reading = clock() - t2
    if len(events) < 3 * n:  # selected, started and completed of every token, and the deltas
        raise AssertionError(f"a trace of {len(events)} events for {n} tokens")
    ending = t2 - t1
    if result.finish_reason is not FinishReason.MAX_OUTPUT_TOKENS or result.stop is not None:
        raise AssertionError(f"benchmark run ended with {result.finish_reason} (stop {result.stop!r})")
    return elapsed / n * 1e6, result.output, ending / n * 1e6, reading / n * 1e6


def run_floor(table: list[bytes], ids: list[int], clock: Callable[[], float] = time.process_time) -> float:
    """µs per token of appending each token's bytes to a list."""
    t0 = clock()
    out: list[bytes] = []
    append = out.append
    for i in ids:
        append(table[i])
    return (clock() - t0) / len(ids) * 1e6


def _hf_pair(path: Path, stops: list[str]):
    """transformers' tokenizer, StopStringCriteria and a TextIteratorStreamer factory, or None."""
    try:
        from transformers import PreTrainedTokenizerFast, TextIteratorStreamer
        from transformers.generation.stopping_criteria import StopStringCriteria
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    return StopStringCriteria(hf, stops), lambda: TextIteratorStreamer(hf, skip_special_tokens=True)


def run_transformers(pair, prompt: list[int], ids: list[int],
                     clock: Callable[[], float] = time.process_time) -> tuple[float, bytes]:
    """µs per token of StopStringCriteria + TextIteratorStreamer.put, consumer thread draining."""
    criteria, make_streamer = pair
    full = torch.tensor([prompt + ids])
    singles = [torch.tensor([i]) for i in ids]  # built outside the timed loop
    m = len(prompt)
    streamer = make_streamer()
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(streamer), daemon=True)
    reader.start()
    t0 = clock()
    for t, single in enumerate(singles, start=m + 1):
        if criteria(full[:, :t], None).any():
            raise AssertionError("a benchmark stop string matched")
        streamer.put(single)
    streamer.end()
    reader.join()
    elapsed = clock() - t0
    return elapsed / len(ids) * 1e6, "".join(got).encode()


CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}

# Run in the baseline checkout's interpreter: one round of its own benchmark, µs per token of each
# of its contenders as JSON.
_BASELINE_RUN = """
import json, sys
sys.path.insert(0, "benchmarks")
import bench_framework
r = bench_framework.run(1, int(sys.argv[1]), sys.argv[2], sys.argv[3])
print(json.dumps({name: s["median"] for name, s in r["us_per_token"].items()}))
"""


def run_baseline(checkout: Path, n_tokens: int, clock: str, layout: str) -> dict[str, float]:
    """One round of `checkout`'s bench_framework (its .venv): µs per token of each contender."""
    return in_checkout(checkout, _BASELINE_RUN, str(n_tokens), clock, layout)


def run(rounds: int = 7, n_tokens: int = 2000, clock: str = "cpu", layout: str = "lines",
        baseline: Path | None = None) -> dict[str, Any]:
    """Figures of one run: µs per token (median, spread) of each contender and their ratios;
    with `baseline`, that checkout's figures taken round by round beside them.

    `clock` "cpu" (default) counts the process's CPU time, all threads: on a loaded machine it
    is far steadier than "wall", and it still charges transformers' consumer thread. `layout`:
    see LAYOUTS."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    tick = CLOCKS[clock]
    # One intra-op thread: the contenders' tensors are tiny, and an idle OpenMP worker spinning
    # after a transformers round would otherwise be charged to the next contender's CPU time.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(tick, rounds, n_tokens, clock, layout, baseline)
    finally:
        torch.set_num_threads(threads)


def _run(tick: Callable[[], float], rounds: int, n_tokens: int, clock: str, layout: str,
         baseline: Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        path = fixtures.byte_level_bpe(folder)
        tok = HFTokenizer(path)
        plan = tok.plan()
        table = [plan.rest.get(i, b"") for i in range(tok.vocab_size)]
        prompt = tok.encode(PROMPT)
        ids = output_ids(tok, n_tokens, layout)
        expected = tok.decode_bytes(ids)
        stops = stop_strings(expected.decode(), random.Random(4_6))
        pair = _hf_pair(path, stops)
        outputs: dict[str, bytes] = {}

        ending: list[float] = []
        reading: list[float] = []

        def ours() -> float:
            us, outputs["ours"], end_us, read_us = run_ours(tok, prompt, ids, stops, tick)
            ending.append(end_us)
            reading.append(read_us)
            return us

        def theirs() -> float:
            us, outputs["transformers"] = run_transformers(pair, prompt, ids, tick)
            return us

        contenders = {"floor": lambda: run_floor(table, ids, tick), "ours": ours}
        if pair is not None:
            contenders["transformers"] = theirs
        base_rounds: list[dict[str, float]] = []

        def base() -> float:
            base_rounds.append(run_baseline(baseline, n_tokens, clock, layout))
            return base_rounds[-1]["ours"]

        if baseline is not None:
            contenders["baseline ours"] = base
        ours()  # warm: automaton, compiled tables, caches
        ending.clear()
        reading.clear()
        us = interleaved(contenders, rounds)
        probe = RequestRun(Request(prompt, stop=stops), model=_StubModel(tok.vocab_size), tokenizer=tok).stopper
        holding = 0
        for piece in (plan.rest[i] for i in ids):
            probe.push(piece)
            holding += bool(probe.held)
        figures: dict[str, Any] = {
            "layout": layout,
            "tokens": len(ids),
            "output_bytes": len(expected),
            "stops": stops,
            "pushes_holding": holding,
            "rounds": rounds,
            "clock": clock,
            "us_per_token": us,
            "ours_end_us_per_token": stat(ending),
            "ours_trace_read_us_per_token": stat(reading),
            "ours_over_floor": ratio(us["ours"], us["floor"]),
            "ours_output_equals_batch_decode": outputs["ours"] == expected,
        }
        if baseline is not None:
            base_us = {name: stat([r[name] for r in base_rounds]) for name in base_rounds[0]}
            figures["baseline"] = {"checkout": str(baseline), "us_per_token": base_us,
                                   "baseline_over_ours": ratio(us["baseline ours"], us["ours"])}
            if "transformers" in base_us:
                figures["baseline"]["transformers_over_ours"] = ratio(base_us["transformers"], base_us["ours"])
        if "transformers" in us:
            figures["transformers_over_ours"] = ratio(us["transformers"], us["ours"])
            figures["transformers_output_equals_batch_decode"] = outputs["transformers"] == expected
        figures["targets"] = {
            "ours_under_5us": us["ours"]["median"] < 5.0,
            "transformers_at_least_50x": figures.get("transformers_over_ours", 0.0) >= 50,
            "transformers_at_least_100x": figures.get("transformers_over_ours", 0.0) >= 100,
        }
        return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="lines")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout whose figures are taken beside these")
    args = ap.parse_args()
    r = run(args.rounds, args.tokens, args.clock, args.layout, args.baseline)
    print(f"{r['tokens']} tokens ({r['output_bytes']} bytes) in {r['layout']}, {len(r['stops'])} stops "
          f"(bytes held after {r['pushes_holding']} tokens), {r['clock']} time, median of {r['rounds']} rounds")
    for name, s in r["us_per_token"].items():
        print(f"  {name:13s} {s['median']:9.3f} µs/token  (spread {s['spread_pct']:.0f}%)")
    end = r["ours_end_us_per_token"]
    read = r["ours_trace_read_us_per_token"]
    print(f"  (ours, once at the end: finish() and the Result {end['median']:.3f} µs/token, spread "
          f"{end['spread_pct']:.0f}%; reading the Result's trace, which builds its Events, "
          f"{read['median']:.3f} µs/token, spread {read['spread_pct']:.0f}%)")
    print(f"  ours / floor          = {r['ours_over_floor']:.1f}")
    if "transformers_over_ours" in r:
        print(f"  transformers / ours   = {r['transformers_over_ours']:.0f}  (targets >= 50 and >= 100, D67)")
    if "baseline" in r:
        b = r["baseline"]
        print(f"  baseline {b['checkout']}, in its own process each round: ours "
              f"{b['us_per_token']['ours']['median']:.3f} µs/token; baseline / ours = {b['baseline_over_ours']:.2f}"
              + (f"; its transformers / its ours = {b['transformers_over_ours']:.0f}" if "transformers_over_ours" in b else ""))
    print(f"  ours equals batch decode: {r['ours_output_equals_batch_decode']}; targets: {r['targets']}")


if __name__ == "__main__":
    main()
