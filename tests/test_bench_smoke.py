"""Smoke runs of the benchmarks: each `run()` at a tiny size, so CI keeps them working.

These are not measurements and assert no timing: only that every benchmark runs, returns
JSON-able figures, and that the correctness facts it reports hold (§4.5 streamed bytes equal the
batch decode, §4.9 cancels in flight end CANCELLED with a conforming trace, §4.4 KV bytes).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import attrs
import pytest
from click.testing import CliRunner

from decodespec.cli import main
from decodespec.cli_bench import BENCHMARKS, default_folder, load_benchmark, load_file, run_arguments
from decodespec.properties import fixtures
from decodespec.runtime.tokenizers import HFTokenizer

FOLDER = default_folder()
# Benchmarks whose quick run still takes tens of seconds on two loaded cores.
SLOW = {"engine", "server"}


def _quick(name: str) -> dict:
    module = load_benchmark(name, FOLDER)
    if module is None:
        pytest.skip(f"benchmarks/bench_{name}.py does not exist yet")
    return module.run(**run_arguments(module, None, quick=True))


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in BENCHMARKS]
)
def test_benchmark_runs_quick_and_returns_json_figures(name):
    """Every benchmark's run() works at its QUICK size and its figures serialise."""
    figures = _quick(name)
    assert isinstance(figures, dict) and figures
    json.dumps(figures, default=str)


def test_framework_bench_streams_exactly_the_batch_decode():
    """§4.5-§4.7: the per-token path measured is the real one: its streamed output equals the
    batch decode (as does transformers' streamer on the same ids), and no stop fired (§4.6)."""
    figures = _quick("framework")
    assert figures["ours_output_equals_batch_decode"] is True
    assert figures.get("transformers_output_equals_batch_decode", True) is True
    assert figures["pushes_holding"] > 0, "the stop strings must partially match sometimes"
    assert set(figures["us_per_token"]) >= {"floor", "ours"}


def test_the_instruction_counter_drives_every_request_through_the_whole_token_path(tmp_path):
    """count_framework's child (what valgrind counts) takes each request through the
    token path to its last id, and says how many ids a request has (the per-token divisor)."""
    done = subprocess.run([sys.executable, str(FOLDER / "count_framework.py"), "--child", "2", "--tokens", "60"],
                          capture_output=True, text=True, check=True)
    assert 50 <= int(done.stdout.split()[-1]) <= 60
    # what the child runs per request: every id selected and decoded, its bytes streamed
    bf = load_file(FOLDER / "bench_framework.py")
    tok = HFTokenizer(fixtures.byte_level_bpe(tmp_path))
    ids = bf.output_ids(tok, 60)
    stops = bf.stop_strings(tok.decode_bytes(ids).decode(), random.Random(4_6))
    run, cache, logits = bf.prefilled(tok, tok.encode(bf.PROMPT), len(ids), stops)
    bf.drive(run, ids, cache, logits)
    assert run.tokens == ids and run.decoded == len(ids) and run.state == "DECODING"
    assert bytes(run.output) + run.stopper.held + run.detok.pending == tok.decode_bytes(ids)


def test_gpu_check_small_runs_on_cpu_with_no_problems():
    """§4.9/§4.11 B and §4.4: --small on CPU; cancels in flight end CANCELLED (or lose the race to
    FINISHED) with conforming traces, with and without overlap; only with overlap is a cancel
    observed while a step runs; a token's KV bytes equal 2·L·H_kv·d_h·sizeof; every batch has
    its engine/bare ratios with and without overlap and its step time against the weights' read."""
    module = load_file(FOLDER / "gpu_check.py")
    figures = module.run(rounds=1, small=True, budget_s=1.0)
    assert figures["problems"] == []
    without, with_ = figures["cancels"]["without_overlap"], figures["cancels"]["with_overlap"]
    for c in (without, with_):
        assert c["cancels_observed"] >= c["injected"]
    assert without["observed_while_step_pending"] == 0 and without["engine_in_flight_cancels"] is None
    assert with_["engine_in_flight_cancels"] > 0
    assert figures["kv"]["equal"] is True
    for b in module.SIZES["small"].batches:
        assert figures["weights"]["batches"][b]["step_over_weight_read"] > 0
        assert {"engine_over_bare", "overlap_over_bare"} <= set(figures["engine_over_bare"][b])
    assert any(line.startswith("cancels") and "(must be > 0)" in line for line in module.table(figures))


def test_gpu_check_fails_when_overlap_observes_no_cancel_in_flight(monkeypatch):
    """§4.11 B: with overlap a cancel must be observed while a step runs; an engine whose count of
    such cancels stays 0 is a problem of the run (its exit status 1), not a figure."""
    module = load_file(FOLDER / "gpu_check.py")

    class NeverInFlight(module.Engine):
        def stats(self):
            return attrs.evolve(super().stats(), cancels_in_flight_total=0)

    monkeypatch.setattr(module, "Engine", NeverInFlight)
    size = attrs.evolve(module.SIZES["small"], cancel_steps=(1,), threaded=0)
    model = module.TinyLM(module.TinyLMConfig(vocab_size=module.VOCAB, **size.config))
    assert module.cancels(model, size, overlap=False, step_s=0.001)["problems"] == []
    assert module.cancels(model, size, overlap=True, step_s=0.001)["problems"] == [
        "overlap: the engine observed no cancel while a step was in flight"]


def test_cli_bench_writes_json_and_refuses_unknown_names(tmp_path):
    """`decodespec bench NAME --quick --json FILE` prints a table and writes the figures;
    an unknown name is a usage error naming the known ones."""
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", "stop", "--quick", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["stop"]["arguments"] == {"rounds": 1} and "us_per_token" in data["stop"]["figures"]
    bad = CliRunner().invoke(main, ["bench", "nope"])
    assert bad.exit_code == 2 and "known: framework" in bad.output
