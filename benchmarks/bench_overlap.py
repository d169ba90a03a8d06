"""Engine tokens/s with and without overlapped steps, side by side on CPU (DECISIONS D73; §4.4).

For batch sizes 1, 8 and 32 the same B greedy requests (a TinyLM of the embedded one's shape widened
to `--d-model` (256: a step of a few ms at batch 1 on CPU), with the embedded tokenizer, EOS
switched off, STEPS output tokens each, a stop string that never matches so the stop matcher works
on every token) run through `Engine(overlap=False)` and `Engine(overlap=True)`: without overlap each
decode waits for the host work on its tokens (detokenize, stop match, stream, trace); with it the
decode of y_t runs on the forward thread while the driver does y_t's host work. One round runs both
at every batch size (which goes first alternates); a figure is tokens/s = B x STEPS over the wall
time of `run_until_idle()` (the prefill included), the median over the rounds with its spread
(benchmarks/common.stat). The step time of the bare forward is measured too (it must be >= 1 ms
for the comparison to mean anything). Both engines run their kernels on `--threads` intra-op
threads (default 1): with overlap the driver's host work takes a second core.

Run: .venv/bin/python benchmarks/bench_overlap.py [--rounds N] [--steps N] [--threads N]
Writes benchmarks/results/overlap_cpu.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from bench_engine import TEXTS, _NoEos
from common import stat

from decodespec.runtime import Request
from decodespec.runtime.engine import Engine
from decodespec.runtime.tinylm import ASSETS, TinyLM
from decodespec.runtime.tokenizers import HFTokenizer

BATCHES = (1, 8, 32)
STEPS = 64
QUICK = {"rounds": 1, "steps": 4, "d_model": 64}  # `decodespec bench --quick`: a smoke run, not a measurement
OUT = Path(__file__).resolve().parent / "results" / "overlap_cpu.json"


def engine_tokens_per_s(model: TinyLM, tok: Any, b: int, steps: int, overlap: bool, threads: int) -> float:
    """B greedy requests of `steps` tokens through one Engine; tokens/s over run_until_idle()."""
    eng = Engine(model, tok, max_batch=max(b, 1), overlap=overlap, threads=threads)
    for i in range(b):
        eng.submit(Request(prompt=f"{TEXTS[i % len(TEXTS)]} {i}", max_output_tokens=steps, temperature=0.0,
                           stop=["\x00never\x00"], request_id=f"b{b}-{i}"))
    gc.collect()
    t0 = time.perf_counter()
    eng.run_until_idle()
    seconds = time.perf_counter() - t0
    stats = eng.stats()
    eng.stop()
    if stats.decode_tokens_total < b * (steps - 1):
        raise RuntimeError(f"batch {b}: only {stats.decode_tokens_total} tokens decoded of {b * steps}")
    if overlap and stats.overlapped_steps_total == 0:
        raise RuntimeError("overlap=True ran no overlapped step")
    return b * steps / seconds


def bare_step_ms(model: TinyLM, b: int, n: int = 20) -> float:
    """The bare forward: one decode_one over B sequences, in ms (median of n)."""
    logits, caches = model.prefill_batch([[1, 2, 3, 4, 5, 6, 7, 8]] * b)
    toks = logits.argmax(dim=-1).tolist()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        logits = model.decode_one(caches, toks)
        times.append((time.perf_counter() - t0) * 1e3)
        toks = logits.argmax(dim=-1).tolist()
    return stat(times)["median"]


def run(rounds: int = 5, steps: int = STEPS, threads: int = 1, d_model: int = 256) -> dict[str, Any]:
    torch.set_num_threads(threads)
    shape = TinyLM.default().config
    model = TinyLM(attrs.evolve(shape, d_model=d_model, d_ff=3 * d_model), name=f"tinylm-d{d_model}")
    tok = _NoEos(HFTokenizer(ASSETS / "tokenizer.json"))
    samples: dict[tuple[int, bool], list[float]] = {(b, o): [] for b in BATCHES for o in (False, True)}
    for r in range(rounds):
        for b in BATCHES:
            for overlap in ((False, True) if r % 2 == 0 else (True, False)):
                samples[(b, overlap)].append(engine_tokens_per_s(model, tok, b, steps, overlap, threads))
    out: dict[str, Any] = {"steps": steps, "rounds": rounds, "threads": threads, "device": "cpu",
                           "machine": platform.machine(), "cpus": len(__import__("os").sched_getaffinity(0)),
                           "model": f"TinyLM, the embedded shape with d_model={d_model}", "batches": {}}
    for b in BATCHES:
        off, on = stat(samples[(b, False)]), stat(samples[(b, True)])
        out["batches"][str(b)] = {"bare_step_ms": bare_step_ms(model, b), "tokens_per_s_without": off,
                                  "tokens_per_s_with": on, "ratio_with_over_without": on["median"] / off["median"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=256)
    args = ap.parse_args()
    res = run(args.rounds, args.steps, args.threads, args.d_model)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(f"engine tokens/s with and without overlap, {res['model']}, {args.steps} tokens a request, "
          f"{args.threads} thread(s), median of {args.rounds} rounds ({res['cpus']} CPUs)")
    print(f"{'batch':>5} {'bare step ms':>12} {'without':>10} {'with':>10} {'with/without':>12} {'spread w/o, w':>15}")
    for b, row in res["batches"].items():
        off, on = row["tokens_per_s_without"], row["tokens_per_s_with"]
        print(f"{b:>5} {row['bare_step_ms']:>12.2f} {off['median']:>10.0f} {on['median']:>10.0f} "
              f"{row['ratio_with_over_without']:>12.2f} {off['spread_pct']:>6.0f}%, {on['spread_pct']:>4.0f}%")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
