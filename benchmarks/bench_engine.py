"""Engine tokens/s against a bare loop of the same model forward (§4.4; docs/performance.md).

For batch sizes 1, 8, 32 and 64, the same B prompts produce the same number of tokens two ways:
- bare: `prefill_batch`, then STEPS x (`decode_one` over the batch + greedy argmax): no semantics;
- engine: B greedy Requests of STEPS + 1 output tokens through `Engine.run_until_idle()` (the full
  §4.3 semantics per token: lifecycle table, detokenizer, stop matcher, ordered stream, ledger,
  trace), which runs the same prefill and STEPS decode steps.
EOS is disabled (a tokenizer view without eos_id) so both produce exactly B x STEPS decoded tokens.
STEPS is 128 (`--steps`), so the figure is throughput with the per-request work (set-up, drain,
the terminal event) spread over 128 tokens, not 64.
The two run in lockstep: one bare forward, one `Engine.step()`, and so on (which goes first
alternates), each side timing only its own steps. The shared machine's slow stretches last far
longer than a step (5-10 ms here), so they fall on both sides alike; run one after the other, a
round's ratio swung by +-20 % with them. Each round gives the ratio engine/bare tokens per second;
the median over the rounds is the figure (target >= 0.9 at batch 32), with its spread.
A second figure needs no second run: inside each engine run the model's own calls are timed, and
forward time / engine time is the share of the engine's wall time that is the bare forward (what
the framework leaves to the model).

Run: .venv/bin/python benchmarks/bench_engine.py [--rounds N] [--threads N] [--device cpu|cuda] [--steps N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from decodespec.runtime import Request
from decodespec.runtime.engine import Engine
from decodespec.runtime.tinylm import ASSETS, TinyLM
from decodespec.runtime.tokenizers import HFTokenizer

BATCHES = (1, 8, 32, 64)
STEPS = 128  # decode steps per run (--steps); see the module doc
QUICK = {"rounds": 1, "steps": 8}  # `decodespec bench --quick`: a smoke run in seconds, not a measurement


class _NoEos:
    """The tokenizer with EOS switched off, so every run produces exactly its token budget."""

    eos_id = None
    eos_ids: frozenset[int] = frozenset()

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


TEXTS = ("Once upon a time", "The quick brown fox", "In the beginning there was", "She said that the",
         "A long time ago, in a small town,", "Tomorrow we will", "The answer is", "Here is a short story about")


def _prompts(tok: Any, b: int) -> list[list[int]]:
    return [tok.encode(f"{TEXTS[i % len(TEXTS)]} {i}") for i in range(b)]


def _sync(model: TinyLM) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def bare(model: TinyLM, prompts: list[list[int]], steps: int = STEPS) -> Iterator[None]:
    """The bare loop, one forward per step: `prefill_batch`, then `steps` x (`decode_one` + argmax)."""
    logits, caches = model.prefill_batch(prompts)
    _sync(model)
    yield
    for _ in range(steps):
        logits = model.decode_one(caches, logits.argmax(dim=-1).tolist())
        _sync(model)
        yield


class _Timed:
    """The model with its forward calls timed (prefill, prefill_batch, decode_one)."""

    def __init__(self, model: TinyLM) -> None:
        self._model, self.seconds = model, 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if name not in ("prefill", "prefill_batch", "decode_one"):
            return attr

        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = attr(*args)
                _sync(self._model)
                return out
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def engine(model: Any, tok: Any, prompts: list[list[int]], steps: int = STEPS, overlap: bool = False) -> Iterator[None]:
    """The engine (with overlapped steps, D73, when `overlap`), one `Engine.step()` per step, from
    the submits to the last terminal event."""
    eng = Engine(model, tok, max_batch=len(prompts), overlap=overlap)
    runs = [eng.submit(Request(p, max_output_tokens=steps + 1, max_buffer_events=steps + 8)) for p in prompts]
    while eng.step() and not eng.idle:
        yield
    eng.stop()
    bad = [r.error or r.reason for r in runs if r.reason.value != "max_output_tokens" or r.decoded != steps]
    assert not bad, bad[:3]


def lockstep(sides: dict[str, Iterator[None]]) -> dict[str, float]:
    """Advance the sides one step each in turn (which goes first alternates) until all are done;
    returns each side's own wall seconds. A slow stretch of a shared machine lasts far longer
    than a step, so it falls on both sides alike."""
    spent = dict.fromkeys(sides, 0.0)
    live = dict(sides)
    turn = 0
    while live:
        for name in list(live) if turn % 2 == 0 else list(live)[::-1]:
            t0 = time.perf_counter()
            try:
                next(live[name])
            except StopIteration:
                del live[name]
            spent[name] += time.perf_counter() - t0
        turn += 1
    return spent


def compare(model: TinyLM, tok: Any, prompts: list[list[int]], rounds: int, steps: int = STEPS) -> dict[str, float]:
    """bare against engine on `prompts` in lockstep (module doc), `rounds` times: tokens/s of
    each, the median per-round ratio with its min and max, and the forward share."""
    b = len(prompts)
    lockstep({"bare": bare(model, prompts, steps), "engine": engine(model, tok, prompts, steps)})  # warm-up
    timed = _Timed(model)
    t_bare, t_eng, shares = [], [], []
    for _ in range(rounds):
        timed.seconds = 0.0
        gc.collect()  # each round starts from a clean heap
        spent = lockstep({"bare": bare(model, prompts, steps), "engine": engine(timed, tok, prompts, steps)})
        t_bare.append(spent["bare"])
        t_eng.append(spent["engine"])
        shares.append(timed.seconds / spent["engine"])
    ratios = [tb / te for tb, te in zip(t_bare, t_eng)]
    return {"bare_tok_s": b * steps / statistics.median(t_bare), "engine_tok_s": b * steps / statistics.median(t_eng),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "forward_share": statistics.median(shares),
            "forward_share_min": min(shares), "forward_share_max": max(shares)}


def run(rounds: int = 5, device: str = "cpu", steps: int = STEPS) -> dict[str, Any]:
    model = TinyLM.default(device=device)
    tok = _NoEos(HFTokenizer(ASSETS / "tokenizer.json"))
    out: dict[str, Any] = {"steps": steps, "device": device, "threads": torch.get_num_threads(), "batches": {}}
    for b in BATCHES:
        out["batches"][b] = compare(model, tok, _prompts(tok, b), rounds, steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"decode steps per run (default {STEPS})")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args.rounds, args.device, args.steps)
    print(f"engine vs bare forward, {res['steps']} decode steps, device {res['device']}, "
          f"{res['threads']} threads, median of {args.rounds} paired rounds")
    print(f"{'batch':>6} {'bare tok/s':>12} {'engine tok/s':>13} {'ratio':>7} {'(min-max)':>11} "
          f"{'forward share':>14} {'(min-max)':>11}")
    for b, r in res["batches"].items():
        spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        share = f"{r['forward_share_min']:.3f}-{r['forward_share_max']:.3f}"
        print(f"{b:>6} {r['bare_tok_s']:>12.0f} {r['engine_tok_s']:>13.0f} {r['ratio']:>7.2f} {spread:>11} "
              f"{r['forward_share']:>14.3f} {share:>11}")


if __name__ == "__main__":
    main()
