"""GPU check: cancels landing in flight, engine vs bare forward, KV bytes per token.

On a CUDA machine (under 5 minutes), three parts, one table:

(a) faults (§4.9, §4.11 B): requests on a TinyLM on the device get a cancel injected at
    `decode.started` of step k (while that step runs), and cancels from another thread at random
    moments. Each must end CANCELLED (or FINISHED when the cancel lost the race), select no token
    after the cancelled step, and pass every trace monitor (check_trace). On CUDA the step's
    completion is a CUDA event recorded after its kernels are launched: the table counts the
    cancels observed while that event was still pending on the device (`Event.query()` False),
    i.e. truly during the device step.
(b) engine vs bare (§4.4): tokens/s of `Engine.run_until_idle` (full semantics per token) against
    the bare loop `prefill_batch` + STEPS x (`decode_one` + argmax), batch 1 .. 256, using the
    functions of benchmarks/bench_engine.py when it is there (else the bare loop only).
(c) KV bytes (§4.4): bytes one processed token adds to a sequence's cache, read from the cache's
    real K/V tensors, against 2·L·H_kv·d_h·sizeof(dtype) from the config; plus, on CUDA, the
    allocator's growth per token.

`--small` (automatic without CUDA) runs the same on CPU with a small model in well under a
minute, so CI keeps it working. The tokenizer maps every id to one ASCII byte, so random weights
always yield valid text (a decoding failure would only measure the tokenizer).

Run: .venv/bin/python benchmarks/gpu_check.py [--small] [--rounds N]
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from typing import Any

import torch

from decodespec.properties import check_trace
from decodespec.runtime import ByteTableTokenizer, Fault, FaultPlan, Request, generate
from decodespec.runtime.events import EventKind
from decodespec.runtime.tinylm import TinyLM, TinyLMConfig

VOCAB = 256
# (config, batch sizes, cancel steps, threaded cancels)
SIZES: dict[str, tuple[dict[str, int], tuple[int, ...], tuple[int, ...], int]] = {
    "small": (dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, context_limit=256),
              (1, 8), (1, 3, 7), 8),
    "cuda": (dict(d_model=2048, n_layers=24, n_heads=16, n_kv_heads=4, d_ff=5632, context_limit=1024),
             (1, 8, 32, 64, 128, 256), (1, 3, 7, 15, 31), 32),
}


def ascii_tokenizer() -> ByteTableTokenizer:
    """Every id is one printable ASCII byte: any greedy output is valid UTF-8."""
    return ByteTableTokenizer({i: bytes([32 + i % 95]) for i in range(VOCAB)})


class _EventedModel:
    """The model, recording a CUDA event after each decode step's kernels are launched, so a cancel
    observation can ask whether that step was still running on the device."""

    def __init__(self, model: TinyLM) -> None:
        self._model = model
        self.last: torch.cuda.Event | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def decode_one(self, caches: Any, tokens: Any) -> torch.Tensor:
        out = self._model.decode_one(caches, tokens)
        if out.is_cuda:
            self.last = torch.cuda.Event()
            self.last.record()
        return out


def check_faults(model: TinyLM, steps: tuple[int, ...], threaded: int, seed: int = 0) -> dict[str, Any]:
    """Part (a): injected in-flight cancels and cancels from another thread."""
    tok, wrapped = ascii_tokenizer(), _EventedModel(model)
    problems: list[str] = []
    pending_at_observe = observed = 0

    def watch(run: Any) -> None:
        def on_event(ev: Any) -> None:
            nonlocal pending_at_observe, observed
            if ev.kind == EventKind.CANCEL_OBSERVED:
                observed += 1
                if wrapped.last is not None and not wrapped.last.query():
                    pending_at_observe += 1
        run.trace.subscribe(on_event)

    max_out = max(steps) + 4
    for k in steps:
        req = Request([1, 2, 3], max_output_tokens=max_out)
        res = generate(req, model=wrapped, tokenizer=tok, on_run=watch,
                       faults=FaultPlan([Fault("decode.started", k, "cancel")]))
        selected = [e.data["step"] for e in res.events if e.kind == EventKind.TOKEN_SELECTED]
        if res.state.value != "CANCELLED" or max(selected) != k:
            problems.append(f"cancel at decode.started {k}: {res.state.value}, selected up to {max(selected)}")
        problems += [f"step {k}: {v}" for v in check_trace(res.events)]
    rng = random.Random(seed)
    ended: dict[str, int] = {}
    for _ in range(threaded):
        runs: list[Any] = []
        delay = rng.uniform(0, 0.01)

        def on_run(run: Any, runs: list[Any] = runs, delay: float = delay) -> None:
            runs.append(run)
            watch(run)
            threading.Timer(delay, run.cancel).start()

        res = generate(Request([4, 5, 6], max_output_tokens=max_out), model=wrapped, tokenizer=tok, on_run=on_run)
        ended[res.state.value] = ended.get(res.state.value, 0) + 1
        if res.state.value not in ("CANCELLED", "FINISHED"):
            problems.append(f"threaded cancel ended {res.state.value}")
        problems += [f"threaded: {v}" for v in check_trace(res.events)]
    return {
        "injected_cancels": len(steps),
        "threaded_cancels": threaded,
        "threaded_outcomes": ended,
        "cancels_observed": observed,
        "observed_while_cuda_step_pending": pending_at_observe if model.device.type == "cuda" else None,
        "problems": problems,
        "ok": not problems,
    }


def engine_vs_bare(model: TinyLM, batches: tuple[int, ...], rounds: int) -> dict[str, Any]:
    """Part (b), through benchmarks/bench_engine.py's paired `compare` when present."""
    try:
        from bench_engine import compare
    except ImportError:
        return {"engine": "benchmarks/bench_engine.py not found: not measured"}
    tok = ascii_tokenizer()
    return {b: compare(model, tok, [[(7 * i + j) % VOCAB for j in range(8 + i % 8)] for i in range(b)], rounds)
            for b in batches}


def kv_bytes(model: TinyLM) -> dict[str, Any]:
    """Part (c): bytes per processed token, measured on the cache's tensors, against the formula."""
    c = model.config
    itemsize = model.embed.weight.element_size()
    formula = 2 * c.n_layers * c.n_kv_heads * c.head_dim * itemsize
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if cuda else 0
    _, cache = model.prefill(list(range(1, 65)))
    tensors = cache.k, cache.v
    per_token = sum(t[0].numel() * t.element_size() for t in tensors)  # one time slot, all layers
    out: dict[str, Any] = {
        "formula_bytes": formula,
        "measured_bytes": per_token,
        "equal": per_token == formula,
        "capacity_over_length": cache.capacity / cache.length,
    }
    if cuda:
        torch.cuda.synchronize()
        out["allocator_bytes_per_capacity_token"] = (torch.cuda.memory_allocated() - before) / cache.capacity
    cache.free()
    return out


def run(rounds: int = 3, small: bool | None = None) -> dict[str, Any]:
    """All three parts; `small` None means: small unless CUDA is available."""
    if small is None:
        small = not torch.cuda.is_available()
    device = "cpu" if small else "cuda"
    cfg, batches, steps, threaded = SIZES["small" if small else "cuda"]
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=VOCAB, **cfg), device=device).eval()
    t0 = time.perf_counter()
    with torch.inference_mode():
        figures = {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "size": "small" if small else "cuda",
            "params": sum(p.numel() for p in model.parameters()),
            "faults": check_faults(model, steps, threaded),
            "engine_vs_bare": engine_vs_bare(model, batches, rounds),
            "kv": kv_bytes(model),
        }
    figures["seconds"] = time.perf_counter() - t0
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="CPU, small model (automatic without CUDA)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    r = run(args.rounds, True if args.small else None)
    f, kv = r["faults"], r["kv"]
    print(f"gpu_check on {r['device']} ({r['size']}, {r['params']:,} params), {r['seconds']:.1f} s")
    print(f"{'part':<10} {'figure':<34} {'value':>14}")
    rows = [
        ("faults", "injected in-flight cancels", f["injected_cancels"]),
        ("faults", "threaded cancels (outcomes)", f"{f['threaded_cancels']} {f['threaded_outcomes']}"),
        ("faults", "observed while CUDA step pending", f["observed_while_cuda_step_pending"]),
        ("faults", "problems", len(f["problems"])),
    ]
    eng = r["engine_vs_bare"]
    if "engine" in eng:
        rows.append(("engine", "engine vs bare", eng["engine"]))
    for b, row in eng.items() if "engine" not in eng else ():
        rows.append(("engine", f"batch {b}: engine / bare tok/s",
                     f"{row['engine_tok_s']:.0f}/{row['bare_tok_s']:.0f} = {row['ratio']:.2f}"))
        rows.append(("engine", f"batch {b}: forward share of engine time", f"{row['forward_share']:.3f}"))
    rows += [
        ("kv", "bytes/token measured vs 2·L·H_kv·d_h·s", f"{kv['measured_bytes']} vs {kv['formula_bytes']}"),
        ("kv", "capacity / length", f"{kv['capacity_over_length']:.2f}"),
    ]
    if "allocator_bytes_per_capacity_token" in kv:
        rows.append(("kv", "allocator bytes per capacity token", f"{kv['allocator_bytes_per_capacity_token']:.0f}"))
    for part, name, value in rows:
        print(f"{part:<10} {name:<34} {value!s:>14}")
    for p in f["problems"]:
        print(f"  problem: {p}")


if __name__ == "__main__":
    main()
