"""GPU check: the forward against the weights' read time, engine over bare with and without
overlapped steps, cancels landing while a step is pending, KV bytes per token.

Four parts, one table, on a TinyLM with random weights in `--dtype` (runtime/dtypes.py):

(a) weights (§4.4): the device's copy bandwidth, measured with one large tensor copied on the
    device (bytes read + bytes written over the time; CUDA events on CUDA, perf_counter on CPU),
    gives the time to read the parameters once. Against it, the bare forward: one `decode_one` over
    B sequences (after `prefill_batch`), its median time per step and per token. The ratio step
    time / weight read time is 1 where a step is bound by reading the weights; more is time the
    model code spends elsewhere (kernel launches, the padded KV it rebuilds each step).
(b) engine over bare (§4.4, D73): the bare loop `prefill_batch` + STEPS x (`decode_one` + argmax)
    against `Engine.step()` with `overlap=False` and with `overlap=True` (the full §4.3 semantics
    per token), the three in lockstep (benchmarks/bench_engine.py), at each batch size: the median
    over rounds of engine tok/s over bare tok/s.
(c) cancels in flight (§4.9, §4.11 B): one Engine, without and then with overlap, runs a batch of
    greedy requests; some get a cancel injected at `decode.started` of step k, the others a cancel
    from another thread at a random moment of the run. Each must end CANCELLED (or FINISHED when
    the cancel lost the race), an injected one select no token after step k, and every trace pass
    every monitor (check_trace). Counted: the cancels observed (CANCEL_OBSERVED) while the model's
    decode step was pending (its `decode_one` not returned, or on CUDA the kernels it launched not
    finished: a CUDA event recorded after them, queried), and with overlap the engine's own count
    of cancels observed while a step was in flight. Without overlap every step completes before
    the host does the token's work, so both are 0; with overlap the engine's count must be > 0,
    and on CUDA the pending count too: a 0 there is a problem, and the run fails.
(d) KV bytes (§4.4): bytes one token adds to a sequence's cache, read from its K/V tensors, against
    2·L·H_kv·d_h·sizeof(dtype); on CUDA, the allocator's growth per token of capacity too.

Bounded time: (a) times BARE_STEPS steps per batch; (c) runs a fixed batch of about 40 tokens
each; (b) shares `--budget-s` between the batch sizes: the decode steps of a round are chosen from
(a)'s step time so that a warm-up and `--rounds` rounds of the three sides fit each batch's share,
and no round starts once the share is spent. The default (CUDA: a 1.1 B-parameter model, batches
1 to 256, a budget of 90 s) ends in under 3 minutes, model set-up included; `--small` (automatic
without CUDA: a 3 M-parameter model on one CPU thread, batches 1 and 8, 10 s) in well under a
minute on the CPU, so CI keeps it working. The tokenizer maps every id to one ASCII byte, so
random weights always yield valid text (a decoding failure would only measure the tokenizer).

Run: .venv/bin/python benchmarks/gpu_check.py [--small] [--rounds N] [--budget-s S] [--dtype D]
Writes benchmarks/results/gpu_check_<device>_<dtype>.json; exits 1 when a problem was found.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from bench_engine import bare, engine, lockstep

from decodespec.properties import check_trace
from decodespec.runtime import ByteTableTokenizer, Fault, FaultPlan, Request
from decodespec.runtime.dtypes import DEFAULT_DTYPE, DTYPES, torch_dtype
from decodespec.runtime.engine import Engine
from decodespec.runtime.events import EventKind
from decodespec.runtime.runner import RequestRun
from decodespec.runtime.tinylm import TinyLM, TinyLMConfig

VOCAB = 256
BARE_STEPS = 12  # decode steps timed per batch in part (a)
OUT = Path(__file__).resolve().parent / "results"


@attrs.frozen
class Size:
    """One run's sizes: the model, the batches, the cancels of part (c), part (b)'s budget."""

    config: dict[str, int]
    batches: tuple[int, ...]
    cancel_steps: tuple[int, ...]  # part (c): a cancel injected at decode.started of each
    threaded: int  # part (c): requests cancelled from another thread
    max_steps: int  # part (b): decode steps of a round at most
    budget_s: float  # part (b): seconds for all batches
    copy_mib: int  # part (a): the tensor copied to measure the bandwidth


SIZES = {
    "small": Size(dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768, context_limit=256),
                  (1, 8), (1, 3, 7), 8, 32, 10.0, 128),
    "cuda": Size(dict(d_model=2048, n_layers=24, n_heads=16, n_kv_heads=4, d_ff=5632, context_limit=1024),
                 (1, 8, 32, 64, 128, 256), (1, 3, 7, 15, 31), 16, 128, 90.0, 2048),
}


def ascii_tokenizer() -> ByteTableTokenizer:
    """Every id is one printable ASCII byte: any greedy output is valid UTF-8 (and no EOS)."""
    return ByteTableTokenizer({i: bytes([32 + i % 95]) for i in range(VOCAB)})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _prompts(b: int) -> list[list[int]]:
    return [[(7 * i + j) % VOCAB for j in range(8 + i % 8)] for i in range(b)]


# ---- (a) the bare forward against the time to read the weights -----------------------------

def copy_bandwidth(device: torch.device, mib: int, copies: int = 5) -> float:
    """Bytes per second of one large tensor copy on `device` (read + write), the best of `copies`."""
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: pages touched, kernels loaded
    best = float("inf")
    for _ in range(copies):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * n / best


def bare_step_s(model: TinyLM, b: int, steps: int = BARE_STEPS) -> float:
    """Median seconds of one bare decode step (decode_one + argmax) over B sequences."""
    logits, caches = model.prefill_batch(_prompts(b))
    times = []
    for _ in range(steps):
        _sync(model.device)
        t0 = time.perf_counter()
        logits = model.decode_one(caches, logits.argmax(dim=-1).tolist())
        _sync(model.device)
        times.append(time.perf_counter() - t0)
    for c in caches:
        c.free()
    return statistics.median(times[1:])  # the first step pays for first-use set-up


def weights(model: TinyLM, batches: tuple[int, ...], copy_mib: int) -> dict[str, Any]:
    """Part (a): parameter bytes / copy bandwidth, against the bare step time at each batch."""
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(model.device, copy_mib)
    read_s = param_bytes / bandwidth
    rows = {}
    for b in batches:
        step = bare_step_s(model, b)
        rows[b] = {"step_ms": step * 1e3, "token_ms": step / b * 1e3, "step_over_weight_read": step / read_s}
    return {"param_bytes": param_bytes, "copy_bytes_per_s": bandwidth, "weight_read_ms": read_s * 1e3,
            "batches": rows}


# ---- (b) engine over bare, without and with overlap ------------------------------------------

def engine_over_bare(model: TinyLM, batches: tuple[int, ...], step_s: dict[int, float], rounds: int,
                     size: Size) -> dict[int, Any]:
    """Part (b): bare, engine and engine with overlap in lockstep; the steps of a round chosen so
    that a warm-up and `rounds` rounds fit each batch's share of the budget (module doc)."""
    tok, share = ascii_tokenizer(), size.budget_s / len(batches)
    out: dict[int, Any] = {}
    for b in batches:
        # three sides; the engine's own work and the prefill counted as twice the bare step
        steps = max(8, min(size.max_steps, int(share / (rounds + 1) / (6 * step_s[b]))))
        prompts = _prompts(b)
        deadline = time.perf_counter() + share
        ratios: dict[str, list[float]] = {"engine": [], "overlap": []}
        lockstep(_sides(model, tok, prompts, 4))  # warm-up
        while len(ratios["engine"]) < rounds and (not ratios["engine"] or time.perf_counter() < deadline):
            spent = lockstep(_sides(model, tok, prompts, steps))
            for side, values in ratios.items():
                values.append(spent["bare"] / spent[side])
        out[b] = {"steps": steps, "rounds": len(ratios["engine"]),
                  **{f"{side}_over_bare": statistics.median(v) for side, v in ratios.items()},
                  **{f"{side}_over_bare_min": min(v) for side, v in ratios.items()},
                  **{f"{side}_over_bare_max": max(v) for side, v in ratios.items()}}
    return out


def _sides(model: TinyLM, tok: Any, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    return {"bare": bare(model, prompts, steps), "engine": engine(model, tok, prompts, steps),
            "overlap": engine(model, tok, prompts, steps, overlap=True)}


# ---- (c) cancels observed while a step is pending ---------------------------------------------

class _Watched:
    """The model, telling whether its decode step is pending: its `decode_one` call has not
    returned (with overlap it runs on the engine's forward thread), or on CUDA the kernels it
    launched have not finished (a CUDA event recorded after them, queried)."""

    def __init__(self, model: TinyLM) -> None:
        self._model = model
        self._running = False
        self._done: torch.cuda.Event | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def decode_one(self, caches: Any, tokens: Any) -> torch.Tensor:
        self._running = True
        try:
            out = self._model.decode_one(caches, tokens)
            if out.is_cuda:
                done = torch.cuda.Event()
                done.record()
                self._done = done
            return out
        finally:
            self._running = False

    def pending(self) -> bool:
        done = self._done
        return self._running or (done is not None and not done.query())


def cancels(model: TinyLM, size: Size, overlap: bool, step_s: float, seed: int = 0) -> dict[str, Any]:
    """Part (c) with or without overlap: injected and threaded cancels in one batch (module doc)."""
    watched, tok, rng = _Watched(model), ascii_tokenizer(), random.Random(seed)
    max_out = max(size.cancel_steps) + 8
    eng = Engine(watched, tok, max_batch=len(size.cancel_steps) + size.threaded, overlap=overlap)
    counts = {"observed": 0, "pending": 0}

    def on_event(ev: Any) -> None:
        if ev.kind == EventKind.CANCEL_OBSERVED:
            counts["observed"] += 1
            counts["pending"] += watched.pending()

    def submit(name: str, faults: FaultPlan | None = None) -> RequestRun:
        run = eng.submit(Request([1, 2, 3], max_output_tokens=max_out, request_id=name), faults)
        run.trace.subscribe(on_event)
        return run

    injected = {k: submit(f"inject-{k}", FaultPlan([Fault("decode.started", k, "cancel")]))
                for k in size.cancel_steps}
    threaded = [submit(f"thread-{i}") for i in range(size.threaded)]
    timers = [threading.Timer(rng.uniform(0, max_out * step_s), eng.cancel, (run.request.request_id,))
              for run in threaded]
    for t in timers:
        t.start()
    eng.run_until_idle()
    for t in timers:
        t.join()
    in_flight = eng.stats().cancels_in_flight_total
    eng.stop()
    problems = _injected_problems(injected) + _threaded_problems(threaded)
    if overlap and in_flight == 0:
        problems.append("overlap: the engine observed no cancel while a step was in flight")
    if overlap and model.device.type == "cuda" and counts["pending"] == 0:
        problems.append("overlap: no cancel was observed while a CUDA step was pending")
    return {"injected": len(injected), "threaded": len(threaded),
            "threaded_outcomes": _outcomes(threaded), "cancels_observed": counts["observed"],
            "observed_while_step_pending": counts["pending"],
            "engine_in_flight_cancels": in_flight if overlap else None, "problems": problems}


def _injected_problems(runs: dict[int, RequestRun]) -> list[str]:
    """Each injected cancel ends CANCELLED with no token selected after its step, and a clean trace."""
    problems = []
    for k, run in runs.items():
        res = run.result()
        last = max((e.data["step"] for e in res.events if e.kind == EventKind.TOKEN_SELECTED), default=None)
        if res.state.value != "CANCELLED" or last != k:
            problems.append(f"cancel at decode.started {k}: {res.state.value}, selected up to step {last}")
        problems += [f"cancel at {k}: {v}" for v in check_trace(res.events)]
    return problems


def _threaded_problems(runs: list[RequestRun]) -> list[str]:
    """Each threaded cancel ends CANCELLED or FINISHED (it lost the race), with a clean trace."""
    problems = []
    for run in runs:
        res = run.result()
        if res.state.value not in ("CANCELLED", "FINISHED"):
            problems.append(f"{res.request_id}: ended {res.state.value}")
        problems += [f"{res.request_id}: {v}" for v in check_trace(res.events)]
    return problems


def _outcomes(runs: list[RequestRun]) -> dict[str, int]:
    ended: dict[str, int] = {}
    for run in runs:
        ended[run.state] = ended.get(run.state, 0) + 1
    return ended


# ---- (d) KV bytes per token ---------------------------------------------------------------------

def kv_bytes(model: TinyLM) -> dict[str, Any]:
    """Part (d): bytes per processed token, measured on the cache's tensors, against the formula."""
    c = model.config
    formula = 2 * c.n_layers * c.n_kv_heads * c.head_dim * model.embed.weight.element_size()
    cuda = model.device.type == "cuda"
    _sync(model.device)
    before = torch.cuda.memory_allocated() if cuda else 0
    _, cache = model.prefill(list(range(1, 65)))
    per_token = sum(t[0].numel() * t.element_size() for t in (cache.k, cache.v))  # one time slot, all layers
    out: dict[str, Any] = {"formula_bytes": formula, "measured_bytes": per_token, "equal": per_token == formula,
                           "capacity_over_length": cache.capacity / cache.length}
    if cuda:
        _sync(model.device)
        out["allocator_bytes_per_capacity_token"] = (torch.cuda.memory_allocated() - before) / cache.capacity
    cache.free()
    return out


# ---- the run and its table --------------------------------------------------------------------

def run(rounds: int = 2, small: bool | None = None, dtype: str = DEFAULT_DTYPE,
        budget_s: float | None = None) -> dict[str, Any]:
    """All four parts; `small` None means: small unless CUDA is available; `budget_s` None: the size's."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if small is None:
        small = not torch.cuda.is_available()
    name = "small" if small else "cuda"
    size = SIZES[name]
    if budget_s is not None:
        size = attrs.evolve(size, budget_s=budget_s)
    device = "cpu" if small else "cuda"
    threads = torch.get_num_threads()
    if small:  # one intra-op thread: on a shared CPU a team of threads waits for its slowest
        torch.set_num_threads(1)
    try:
        return _run(size, name, device, rounds, dtype)
    finally:
        torch.set_num_threads(threads)


def _run(size: Size, name: str, device: str, rounds: int, dtype: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=VOCAB, **size.config), device=device).to(dtype=torch_dtype(dtype)).eval()
    with torch.inference_mode():
        part_a = weights(model, size.batches, size.copy_mib)
        step_s = {b: row["step_ms"] / 1e3 for b, row in part_a["batches"].items()}
        figures = {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "size": name, "dtype": dtype, "budget_s": size.budget_s,
            "params": sum(p.numel() for p in model.parameters()),
            "weights": part_a,
            "engine_over_bare": engine_over_bare(model, size.batches, step_s, rounds, size),
            "cancels": {mode: cancels(model, size, overlap, step_s[size.batches[0]])
                        for mode, overlap in (("without_overlap", False), ("with_overlap", True))},
            "kv": kv_bytes(model),
        }
    figures["problems"] = [f"{mode}: {p}" for mode, c in figures["cancels"].items() for p in c["problems"]]
    figures["seconds"] = time.perf_counter() - t0
    return figures


def table(r: dict[str, Any]) -> list[str]:
    """The figures as printed lines: one row a figure, the parts in order."""
    w, kv = r["weights"], r["kv"]
    read = (f"{w['param_bytes'] / 2**20:.0f} MiB / {w['copy_bytes_per_s'] / 1e9:.1f} GB/s "
            f"= {w['weight_read_ms']:.3f} ms")
    rows = [("weights", "parameter bytes / copy bandwidth", read)]
    for b, row in w["batches"].items():
        rows.append(("weights", f"batch {b}: bare step (token) ms",
                     f"{row['step_ms']:.3f} ({row['token_ms']:.3f}) = {row['step_over_weight_read']:.1f}x read"))
    for b, row in r["engine_over_bare"].items():
        rows.append(("engine", f"batch {b}: engine/bare w/o, with overlap",
                     f"{row['engine_over_bare']:.2f}, {row['overlap_over_bare']:.2f} "
                     f"({row['rounds']}x{row['steps']} steps)"))
    for mode, c in r["cancels"].items():
        must = " (must be > 0)" if mode == "with_overlap" else ""
        rows += [
            ("cancels", f"{mode}: injected, threaded (ended)",
             f"{c['injected']}, {c['threaded']} {c['threaded_outcomes']}"),
            ("cancels", f"{mode}: observed, while step pending",
             f"{c['cancels_observed']}, {c['observed_while_step_pending']}"),
        ]
        if c["engine_in_flight_cancels"] is not None:
            rows.append(("cancels", f"{mode}: engine's in-flight count{must}", c["engine_in_flight_cancels"]))
    rows += [("kv", "bytes/token measured vs 2·L·H_kv·d_h·s", f"{kv['measured_bytes']} vs {kv['formula_bytes']}"),
             ("kv", "capacity / length", f"{kv['capacity_over_length']:.2f}")]
    if "allocator_bytes_per_capacity_token" in kv:
        rows.append(("kv", "allocator bytes per capacity token", f"{kv['allocator_bytes_per_capacity_token']:.0f}"))
    head = (f"gpu_check on {r['device']} ({r['size']}, {r['dtype']}, {r['params']:,} params), "
            f"{r['seconds']:.1f} s, {len(r['problems'])} problem(s)")
    return [head, f"{'part':<8} {'figure':<54} value"] + [f"{p:<8} {n:<54} {v}" for p, n, v in rows] + [
        f"  problem: {p}" for p in r["problems"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="CPU, small model (automatic without CUDA)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of part (b) per batch, within the budget")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for part (b), all batches")
    ap.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    args = ap.parse_args()
    r = run(args.rounds, True if args.small else None, args.dtype, args.budget_s)
    lines = table(r)
    print("\n".join(lines))
    path = OUT / f"gpu_check_{'cpu' if r['device'] == 'cpu' else 'cuda'}_{r['dtype']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"figures": r, "table": lines}, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    sys.exit(1 if r["problems"] else 0)


if __name__ == "__main__":
    main()
