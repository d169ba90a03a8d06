"""Engine tokens/s against a bare loop of the same model forward (§4.4; DESIGN "Performance").

For batch sizes 1, 8, 32 and 64, the same B prompts produce the same number of tokens two ways:
- bare: `prefill_batch`, then STEPS x (`decode_one` over the batch + greedy argmax): no semantics;
- engine: B greedy Requests of STEPS + 1 output tokens through `Engine.run_until_idle()` (the full
  §4.3 semantics per token: lifecycle table, detokenizer, stop matcher, ordered stream, ledger,
  trace), which runs the same prefill and STEPS decode steps.
EOS is disabled (a tokenizer view without eos_id) so both produce exactly B x STEPS decoded tokens.
STEPS is 128 (`--steps`): at batch 32 each run then lasts about 0.7 s, long enough for a shared
machine's noise to average out within a round, and the figure is throughput, the per-request work
(set-up, drain, the terminal event) being still in it over 128 tokens instead of 64.
Several rounds: in each, bare and engine run back to back (which goes first alternates), and the
ratio engine/bare is taken within the round, so a slow stretch of the shared machine falls on both
sides of one ratio; the median of the rounds' ratios is the figure (target >= 0.9 at batch 32),
with its spread, beside the median tokens/s of each. Wall time is the figure; the same ratio of
CPU time (process_time) is printed beside it, as it is less disturbed by other processes.
A third figure needs no second run: inside each engine run the model's own calls are timed, and
forward time / engine time is the share of the engine's wall time that is the bare forward (what
the framework leaves to the model); it is far steadier than the paired ratio on a noisy machine.

Run: .venv/bin/python benchmarks/bench_engine.py [--rounds N] [--threads N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

from decodespec.runtime import Request
from decodespec.runtime.engine import Engine
from decodespec.runtime.tinylm import ASSETS, TinyLM
from decodespec.runtime.tokenizers import HFTokenizer

BATCHES = (1, 8, 32, 64)
STEPS = 128  # decode steps per run (--steps); see the module doc


class _NoEos:
    """The tokenizer with EOS switched off, so every run produces exactly its token budget."""

    eos_id = None

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


def bare(model: TinyLM, prompts: list[list[int]], steps: int = STEPS) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    logits, caches = model.prefill_batch(prompts)
    for _ in range(steps):
        logits = model.decode_one(caches, logits.argmax(dim=-1).tolist())
    _sync(model)
    return time.perf_counter() - t0, time.process_time() - c0


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


def engine(model: TinyLM, tok: Any, prompts: list[list[int]], timed: _Timed | None = None,
           steps: int = STEPS) -> tuple[float, float]:
    """Wall and CPU seconds of the engine run; `timed` (wrapping `model`) adds up its forward time."""
    eng = Engine(timed or model, tok, max_batch=len(prompts))
    t0, c0 = time.perf_counter(), time.process_time()
    runs = [eng.submit(Request(p, max_output_tokens=steps + 1, max_buffer_events=steps + 8)) for p in prompts]
    eng.run_until_idle()
    _sync(model)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    bad = [r.error or r.reason for r in runs if r.reason.value != "max_output_tokens" or r.decoded != steps]
    assert not bad, bad[:3]
    return dt, dc


def compare(model: TinyLM, tok: Any, prompts: list[list[int]], rounds: int, steps: int = STEPS) -> dict[str, float]:
    """bare against engine on `prompts`, paired round by round (module doc): tokens/s of each,
    the median per-round ratio with its min and max, the CPU-time ratio and the forward share."""
    b = len(prompts)
    bare(model, prompts, steps), engine(model, tok, prompts, steps=steps)  # warm-up
    t_bare, t_eng, shares = [], [], []
    timed = _Timed(model)
    for i in range(rounds):  # paired: both see the same stretch of machine load
        timed.seconds = 0.0
        timers = (("bare", lambda: bare(model, prompts, steps)),
                  ("engine", lambda: engine(model, tok, prompts, timed, steps)))
        got = {}
        for name, timer in timers if i % 2 == 0 else timers[::-1]:
            gc.collect()  # each starts from a clean heap: neither pays for the other's garbage
            got[name] = timer()
        t_bare.append(got["bare"])
        t_eng.append(got["engine"])
        shares.append(timed.seconds / got["engine"][0])
    ratios = [tb / te for (tb, _), (te, _) in zip(t_bare, t_eng)]
    cpu_ratios = [cb / ce for (_, cb), (_, ce) in zip(t_bare, t_eng)]
    mb, me = statistics.median(t for t, _ in t_bare), statistics.median(t for t, _ in t_eng)
    return {"bare_tok_s": b * steps / mb, "engine_tok_s": b * steps / me,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "cpu_ratio": statistics.median(cpu_ratios), "forward_share": statistics.median(shares),
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
    print(f"{'batch':>6} {'bare tok/s':>12} {'engine tok/s':>13} {'ratio':>7} {'(min-max)':>11} {'cpu ratio':>10} "
          f"{'forward share':>14} {'(min-max)':>11}")
    for b, r in res["batches"].items():
        spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        share = f"{r['forward_share_min']:.3f}-{r['forward_share_max']:.3f}"
        print(f"{b:>6} {r['bare_tok_s']:>12.0f} {r['engine_tok_s']:>13.0f} {r['ratio']:>7.2f} {spread:>11} "
              f"{r['cpu_ratio']:>10.2f} {r['forward_share']:>14.3f} {share:>11}")


if __name__ == "__main__":
    main()
