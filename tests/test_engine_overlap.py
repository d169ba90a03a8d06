"""The Engine's overlapped step (`Engine(overlap=True)`; spec/overlap.toml, DECISIONS D73, §4.3,
§4.9, §4.11): the forward of y_t runs on the forward thread while the driver detokenizes, matches
and streams y_t; a request found to end meanwhile has the step's result discarded. What a client
sees is what it sees without overlap, the traces pass every monitor, and cancels land while steps
run."""

from __future__ import annotations

import functools
import threading
import time

import attrs
import pytest
import test_engine
import torch
from _engine_kit import SlowModel, ascii_tokenizer, slow_model, tiny_model

from decodespec.properties import check_trace
from decodespec.runtime import Fault, FaultPlan, Request, generate
from decodespec.runtime.engine import Engine

MODEL = tiny_model()
TOK = ascii_tokenizer()


def _result(r):
    return (r.tokens, r.output, r.finish_reason, r.state.value, r.usage)


def test_overlap_changes_no_answer_and_every_trace_passes_the_monitors():
    """§4.3: z_{t+1} is taken only for a request that goes on; a stop, an EOS or the length found
    while the step runs discards it, so tokens, bytes, finish reason and usage (processed tokens
    too) equal the single-path loop's, greedy and sampled, with stops."""
    reqs = test_engine._requests(10) + test_engine._requests(4, stop=["00", "111", "3"], max_output_tokens=12)
    for i, r in enumerate(reqs):
        r["request_id"] = f"q{i}"
    ref = {r["request_id"]: generate(Request(**r), model=MODEL, tokenizer=TOK) for r in reqs}
    eng = Engine(MODEL, TOK, max_batch=5, overlap=True)
    runs = [eng.submit(Request(**r)) for r in reqs]
    eng.run_until_idle()
    for run in runs:
        assert _result(run.result()) == _result(ref[run.request.request_id]), run.request.request_id
        assert check_trace(run.trace.events, tokenizer=TOK) == [], run.request.request_id
    stats = eng.stats()
    assert stats.overlapped_steps_total > 0 and stats.cache_tokens_in_use == 0 and stats.live_requests == 0
    assert {r.result().finish_reason.value for r in runs} >= {"max_output_tokens", "stop_sequence"}


def test_an_injected_cancel_lands_while_the_step_runs_and_its_result_is_discarded():
    """§4.11 B: a cancel injected at decode.started(step=3) is observed before decode.completed(3):
    no token.selected(4), CANCELLED, nothing after the terminal, resources released once (the
    monitors), and the Engine counts it as a cancel observed while a step ran."""
    eng = Engine(MODEL, TOK, overlap=True)
    runs = [eng.submit(Request(prompt=f"cancel me {i}", max_output_tokens=10, request_id=f"c{i}"),
                       faults=FaultPlan([Fault("decode.started", 3, "cancel")])) for i in range(3)]
    eng.run_until_idle()
    for run in runs:
        assert run.state == "CANCELLED" and len(run.tokens) == 3
        kinds = [(ev.kind, ev.data.get("step")) for ev in run.trace.events]
        assert kinds.index(("cancel.observed", None)) < kinds.index(("decode.completed", 3))
        assert check_trace(run.trace.events, tokenizer=TOK) == []
    assert eng.stats().cancels_in_flight_total == 3


def test_cancels_from_another_thread_land_while_steps_run():
    """§4.9 with a model whose step takes 20 ms: cancels sent from a client thread at random
    moments are observed while a step runs (counted > 0); every run ends CANCELLED with a trace
    that passes every monitor, and nothing stays held."""
    model = slow_model(0.02)
    eng = Engine(model, TOK, overlap=True, max_batch=8)
    eng.start()
    try:
        runs = [eng.submit(Request(prompt=f"long {i}", max_output_tokens=100, request_id=f"t{i}", ignore_eos=True))
                for i in range(6)]
        for i, run in enumerate(runs):
            time.sleep(0.013 * (i + 1))
            eng.cancel(run.request.request_id)
        deadline = time.monotonic() + 30
        while not all(r.done for r in runs) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        eng.stop()
    assert all(r.state == "CANCELLED" for r in runs)
    for run in runs:
        assert check_trace(run.trace.events, tokenizer=TOK) == []
    stats = eng.stats()
    assert stats.cancels_in_flight_total > 0 and stats.cache_tokens_in_use == 0


def test_a_failed_send_while_the_step_runs_frees_the_cache_once_after_it():
    """§4.9, §4.10: a send that fails during y_t's host work ends the request FAILED at once, but
    its cache is freed only when the step that writes it completed, once (the ledger and the
    monitors), and the others go on."""
    eng = Engine(MODEL, TOK, overlap=True)
    bad = eng.submit(Request(prompt="send fails", max_output_tokens=8, request_id="bad"),
                     faults=FaultPlan([Fault("response.delta", 2, "transport_error")]))
    good = eng.submit(Request(prompt="goes on", max_output_tokens=8, request_id="good"))
    eng.run_until_idle()
    assert bad.state == "FAILED" and bad.reason.value == "transport_error" and bad.cache.freed
    assert good.state == "FINISHED"
    ref = generate(Request(prompt="goes on", max_output_tokens=8, request_id="good"), model=MODEL, tokenizer=TOK)
    assert _result(good.result()) == _result(ref)
    for run in (bad, good):
        assert check_trace(run.trace.events, tokenizer=TOK) == []


class _FreedCacheWatch(SlowModel):
    """The tiny model, each step `delay_s` long; records every cache of its batch that was freed
    before the step wrote it (the step still writes there: §4.9's safe point was not waited for)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(tiny_model(), delay_s)
        self.freed_in_flight: list[int] = []

    def decode_one(self, caches, tokens):
        time.sleep(self.delay_s)  # the host work on y_t runs meanwhile
        freed = [id(c) for c in caches if c.freed]
        if freed:
            self.freed_in_flight += freed
            raise RuntimeError("a cache of the batch was freed while its step ran")
        return self.inner.decode_one(caches, tokens)


@pytest.mark.parametrize("held", [True, False], ids=["held", "seeded-free-at-once"])
def test_no_cache_is_freed_while_its_step_runs(held, monkeypatch):
    """§4.9, §4.10: requests whose sends fail during y_t's host work end FAILED there, but their
    caches are freed only once the step writing them completed. Seeded: with the held cache
    switched off the free lands while the step runs, and the watch sees it."""
    from decodespec.runtime import engine as engine_module

    if not held:
        monkeypatch.setattr(engine_module, "_hold", lambda e: None)
    model = _FreedCacheWatch(0.01)
    eng = Engine(model, TOK, overlap=True)
    runs = [eng.submit(Request(prompt=f"send fails {i}", max_output_tokens=8, request_id=f"f{i}"),
                       faults=FaultPlan([Fault("response.delta", 2, "transport_error")])) for i in range(3)]
    eng.run_until_idle()
    assert all(r.state == "FAILED" and r.cache.freed for r in runs)
    assert (model.freed_in_flight == []) is held, model.freed_in_flight


def test_overlap_must_be_a_bool():
    with pytest.raises(ValueError, match="overlap must be True or False"):
        Engine(MODEL, TOK, overlap=1)


# The Engine's own specification (tests/test_engine.py), run again with every Engine overlapping:
# each answer, trace, gauge and failure it checks holds with overlap on, for each of its parameters.
def _engine_cases() -> list:
    cases = []
    for name in sorted(n for n in dir(test_engine) if n.startswith("test_")):
        fn = getattr(test_engine, name)
        combos: list[dict] = [{}]
        for mark in getattr(fn, "pytestmark", []):
            if mark.name != "parametrize":
                continue
            names = [a.strip() for a in mark.args[0].split(",")] if isinstance(mark.args[0], str) else list(mark.args[0])
            values = [v if len(names) > 1 else (v,) for v in mark.args[1]]
            combos = [{**c, **dict(zip(names, v))} for c in combos for v in values]
        cases += [pytest.param(name, c, id=f"{name}-{'-'.join(map(str, c.values()))}" if c else name) for c in combos]
    return cases


@pytest.mark.parametrize(("name", "params"), _engine_cases())
def test_the_engine_tests_pass_with_overlap_on(name, params, monkeypatch, tmp_path):
    monkeypatch.setattr(test_engine, "Engine", functools.partial(Engine, overlap=True))
    fn = getattr(test_engine, name)
    wants = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    fixtures = {"monkeypatch": monkeypatch, "tmp_path": tmp_path}
    fn(**params, **{k: v for k, v in fixtures.items() if k in wants})


def test_threads_end_with_the_engine():
    """stop() ends the engine's own threads, its forward thread too (threads another test's engine
    left behind in this process are not this engine's)."""
    before = set(threading.enumerate())
    eng = Engine(MODEL, TOK, overlap=True)
    eng.start()
    run = eng.submit(Request(prompt="x", max_output_tokens=3, request_id="x"))
    deadline = time.monotonic() + 30
    while not run.done and time.monotonic() < deadline:
        time.sleep(0.01)
    own = [t for t in threading.enumerate() if t not in before and t.name.startswith("decodespec-")]
    assert {t.name.split("_")[0] for t in own} == {"decodespec-engine", "decodespec-forward"}
    eng.stop()
    assert not [t.name for t in own if t.is_alive()]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from decodespec.runtime.hfmodel import HFModel

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama-overlap")
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return HFModel(folder)


def test_runs_that_end_while_a_step_runs_keep_their_cache_until_it_completed(hf_model):
    """§4.9, §4.10 on a model whose step touches every resident sequence's cache (HFModel's resident
    batch writes the K/V it owes a cache when the cache leaves the batch, D50, D61): runs that end
    during the host work (their last token known, sampled, stopped) while the others' step runs
    are released only after it completed; every answer equals generate()'s, none fails."""
    from decodespec.runtime import ByteTableTokenizer

    model = SlowModel(hf_model, 0.005)  # the host work is done before the step touches the caches
    tok = ByteTableTokenizer({i: bytes([33 + i]) for i in range(64)})
    reqs = [Request(list(range(1 + i % 5, 4 + i)), max_output_tokens=2 + i % 6, request_id=f"h{i}",
                    temperature=0.7 if i % 4 == 3 else 0.0, seed=i) for i in range(24)]
    ref = {r.request_id: _result(generate(r, model=hf_model, tokenizer=tok)) for r in reqs}
    for _ in range(2):
        eng = Engine(model, tok, max_batch=6, overlap=True)
        runs = [eng.submit(attrs.evolve(r)) for r in reqs]
        eng.run_until_idle()
        assert {r.request.request_id: _result(r.result()) for r in runs} == ref
        for run in runs:
            assert check_trace(run.trace.events, tokenizer=tok) == []
