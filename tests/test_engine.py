"""The batched Engine (runtime/engine.py): same semantics as generate(), batching of §4.4,
cancels and deadlines at safe points (§4.9), backpressure and preemption (§4.8), failures kept to
their own request (§4.10)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from _engine_kit import FakeClock, FlakyModel, ascii_tokenizer, tiny_model

from decodespec.properties import check_trace
from decodespec.runtime import Fault, FaultPlan, Request, generate
from decodespec.runtime.engine import (
    DuplicateRequest,
    Engine,
    EngineStopped,
    QueueFull,
    UnknownRequest,
)
from decodespec.runtime.events import EventKind
from decodespec.runtime.stream import OrderedStream

MODEL = tiny_model()
TOK = ascii_tokenizer()


def _requests(n: int, **kw) -> list[dict]:
    out = []
    for i in range(n):
        r = dict(prompt=f"prompt number {i}" + "x" * (i % 5), max_output_tokens=8 + i % 7, seed=100 + i,
                 temperature=0.8 if i % 2 else 0.0, request_id=f"r{i}")
        r.update(kw)
        out.append(r)
    return out


def _reference(reqs: list[dict]) -> dict:
    return {r["request_id"]: generate(Request(**r), model=MODEL, tokenizer=TOK) for r in reqs}


def _same(a, b) -> bool:
    return (a.tokens, a.output, a.finish_reason, a.state.value, a.usage) == (
        b.tokens, b.output, b.finish_reason, b.state.value, b.usage)


def _gauges_zero(eng: Engine) -> None:
    s = eng.stats()
    assert (s.queue_depth, s.active_slots, s.swapped, s.parked, s.cache_tokens_in_use, s.cache_bytes_in_use,
            s.swapped_bytes, s.live_requests) == (0, 0, 0, 0, 0, 0, 0, 0), s


def _no_violations(runs) -> None:
    for run in runs:
        assert check_trace(run.trace.events, tokenizer=TOK) == [], run.request.request_id





def test_engine_tokens_equal_generate_for_greedy_and_sampled():
    """§4.4: batching changes when a step runs, never what it selects: every request's tokens,
    bytes, finish reason and usage equal the single-path loop's for the same seed."""
    reqs = _requests(12)
    ref = _reference(reqs)
    eng = Engine(MODEL, TOK, max_batch=5)
    runs = [eng.submit(Request(**r)) for r in reqs]
    eng.run_until_idle()
    assert all(_same(run.result(), ref[run.request.request_id]) for run in runs)
    _no_violations(runs)
    _gauges_zero(eng)
    assert sum(eng.stats().requests_total.values()) == 12


def test_stop_strings_in_batch_match_single_path():
    """§4.6 inside a batch: a stop string ends its request with stop_sequence and is never sent,
    exactly as in generate(); the other sequences of the batch go on."""
    base = generate(Request("abc", max_output_tokens=20), model=MODEL, tokenizer=TOK).text
    stop = base[5:7]
    reqs = [dict(prompt="abc", max_output_tokens=20, stop=[stop], request_id="s0")] + _requests(4)
    ref = _reference(reqs)
    eng = Engine(MODEL, TOK)
    runs = [eng.submit(Request(**r)) for r in reqs]
    eng.run_until_idle()
    res = runs[0].result()
    assert res.finish_reason.value == "stop_sequence" and stop not in res.text
    assert all(_same(run.result(), ref[run.request.request_id]) for run in runs)


def test_batch_holds_different_cache_lengths_and_respects_max_batch():
    """§4.4: one decode_one advances sequences whose caches have different lengths; never more
    than max_batch sequences are resident."""
    eng = Engine(MODEL, TOK, max_batch=3)
    for r in _requests(7):
        eng.submit(Request(**r))
    seen_lengths = set()
    while not eng.idle:
        eng.step()
        s = eng.stats()
        assert s.active_slots <= 3
        seen_lengths.add(len({e.run.cache.length for e in eng._resident}))
    assert max(seen_lengths) > 1
    _gauges_zero(eng)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_preempted_runs_produce_the_uninterrupted_tokens(mode, temperature):
    """§4.8 last paragraph: under cache pressure the latest arrival is preempted (swap or
    recompute) and resumed with the same StepState and RNG cursor, so its tokens equal an
    uninterrupted run's with the same seed, greedy and sampled; preemption is not a lifecycle
    transition, only sequence.preempted / sequence.resumed in the trace."""
    reqs = _requests(8, temperature=temperature, max_output_tokens=24)
    ref = _reference(reqs)
    eng = Engine(MODEL, TOK, max_batch=8, cache_budget_tokens=120, preemption=mode)
    runs = [eng.submit(Request(**r)) for r in reqs]
    eng.run_until_idle()
    stats = eng.stats()
    assert stats.preemptions_total > 0 and stats.resumes_total == stats.preemptions_total
    preempted = [run for run in runs if any(e.kind == EventKind.PREEMPTED for e in run.trace.events)]
    assert preempted
    for run in runs:
        assert _same(run.result(), ref[run.request.request_id]), run.request.request_id
    for run in preempted:
        kinds = [e.kind for e in run.trace.events]
        i, j = kinds.index(EventKind.PREEMPTED), kinds.index(EventKind.RESUMED)
        assert i < j and EventKind.LIFECYCLE not in kinds[i:j]
    _no_violations(runs)
    _gauges_zero(eng)


def test_cancel_while_queued_never_prefills():
    """§4.9/§4.3: a cancel observed at the check point before prefill ends the request CANCELLED
    without touching the model; the others are not affected."""
    reqs = _requests(3)
    ref = _reference(reqs)
    eng = Engine(MODEL, TOK)
    runs = [eng.submit(Request(**r)) for r in reqs]
    assert eng.cancel("r1") is True
    eng.run_until_idle()
    res = runs[1].result()
    assert res.state.value == "CANCELLED" and res.finish_reason.value == "cancelled"
    assert not any(e.kind == EventKind.PREFILL_STARTED for e in res.events)
    assert _same(runs[0].result(), ref["r0"]) and _same(runs[2].result(), ref["r2"])
    assert eng.cancel("r1") is False  # already ended: a no-op
    with pytest.raises(UnknownRequest, match="nope"):
        eng.cancel("nope")


def test_cancel_while_decoding_takes_effect_at_the_next_safe_point():
    """§4.9: a cancel during decoding ends the run CANCELLED at its next step boundary; no token
    is selected after the cancel is observed, and the batch-mates finish normally."""
    reqs = _requests(3, max_output_tokens=30, temperature=0.0)
    ref = _reference(reqs)
    eng = Engine(MODEL, TOK)
    runs = [eng.submit(Request(**r)) for r in reqs]
    for _ in range(4):
        eng.step()
    selected_before = len(runs[2].tokens)
    eng.cancel("r2")
    eng.run_until_idle()
    res = runs[2].result()
    assert res.state.value == "CANCELLED" and len(res.tokens) == selected_before
    assert _same(runs[0].result(), ref["r0"]) and _same(runs[1].result(), ref["r1"])
    _no_violations(runs)


def test_deadline_is_deadline_exceeded_in_queue_and_while_decoding():
    """§4.9, DECISIONS D1: a deadline fires as deadline_exceeded (never cancelled), whether it
    passes while the request waits in the queue or while it decodes."""
    clock = FakeClock()
    eng = Engine(MODEL, TOK, max_batch=1, clock=clock)
    a = eng.submit(Request("long one", max_output_tokens=40, deadline_s=5.0, request_id="a"))
    b = eng.submit(Request("waits", max_output_tokens=40, deadline_s=1.0, request_id="b"))
    for _ in range(3):
        eng.step()
    clock.advance(2.0)  # b's deadline passes while it is still queued behind a
    eng.step()
    assert b.done and b.reason.value == "deadline_exceeded"
    assert not any(e.kind == EventKind.PREFILL_STARTED for e in b.trace.events)
    clock.advance(4.0)  # a's deadline passes while it decodes
    eng.run_until_idle()
    assert a.state == "FINISHED" and a.reason.value == "deadline_exceeded"
    assert 0 < len(a.tokens) < 40
    _no_violations([a, b])


def test_a_failing_kernel_fails_only_its_sequence():
    """§4.10: a decode kernel that raises for one sequence fails that request (model_error); the
    batch is retried per sequence, so the other requests' results equal the reference."""
    reqs = _requests(5)
    ref = _reference(reqs)
    bad_len = len(TOK.encode(reqs[2]["prompt"]))
    assert sum(len(TOK.encode(r["prompt"])) == bad_len for r in reqs) == 1
    model = FlakyModel(MODEL, bad_len)
    eng = Engine(model, TOK)
    runs = [eng.submit(Request(**r)) for r in reqs]
    eng.run_until_idle()
    assert model.batch_failures >= 1
    for run in runs:
        if run is runs[2]:
            assert run.state == "FAILED" and run.reason.value == "model_error" and "decode kernel fault" in run.error
        else:
            assert _same(run.result(), ref[run.request.request_id])
    _no_violations(runs)
    _gauges_zero(eng)


class _NanRowModel(FlakyModel):
    """Decode logits with NaN in the row of the sequence whose prompt has `bad_len` tokens."""

    def decode_one(self, caches, tokens):
        out = self.inner.decode_one(caches, tokens).clone()
        for b, c in enumerate(caches):
            if c.prompt_length == self.bad_len:
                out[b, 3] = float("nan")
        return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_fail_only_their_request_in_a_greedy_batch(temperature):
    """§4.10: a row of NaN logits is that request's model_error (bad logits), whether its row is
    chosen by the batch's one argmax or by its own sampler; the other rows' tokens are unchanged."""
    reqs = _requests(4, temperature=0.0)
    reqs[1]["temperature"] = temperature
    ref = _reference(reqs)
    bad_len = len(TOK.encode(reqs[1]["prompt"]))
    assert sum(len(TOK.encode(r["prompt"])) == bad_len for r in reqs) == 1
    eng = Engine(_NanRowModel(MODEL, bad_len), TOK)
    runs = [eng.submit(Request(**r)) for r in reqs]
    eng.run_until_idle()
    assert runs[1].state == "FAILED" and runs[1].reason.value == "model_error" and "NaN" in runs[1].error
    assert all(_same(r.result(), ref[r.request.request_id]) for r in runs if r is not runs[1])
    _no_violations(runs)
    _gauges_zero(eng)


def test_a_failing_prefill_fails_only_its_request():
    """§4.10: a batched prefill that raises is retried per prompt; only the culprit fails."""
    reqs = _requests(4)
    ref = _reference(reqs)
    bad_len = len(TOK.encode(reqs[1]["prompt"]))
    eng = Engine(FlakyModel(MODEL, bad_len, in_prefill=True), TOK)
    runs = [eng.submit(Request(**r)) for r in reqs]
    eng.run_until_idle()
    assert runs[1].state == "FAILED" and runs[1].reason.value == "model_error"
    assert all(_same(r.result(), ref[r.request.request_id]) for r in runs if r is not runs[1])
    _no_violations(runs)


def test_injected_faults_match_the_single_path_loop():
    """The FaultPlan points behave in the Engine as in generate(): model_error at decode.started,
    cancel at token.selected, decoding_error — each only in its own request."""
    plans = {
        "r0": [Fault("decode.started", 3, "model_error")],
        "r1": [Fault("token.selected", 2, "cancel")],
        "r2": [Fault("token.selected", 4, "decoding_error")],
        "r3": [Fault("prefill.started", 0, "model_error")],
    }
    reqs = _requests(5, max_output_tokens=12)
    ref = {r["request_id"]: generate(Request(**r), model=MODEL, tokenizer=TOK,
                                     faults=FaultPlan(plans.get(r["request_id"], []))) for r in reqs}
    eng = Engine(MODEL, TOK)
    runs = [eng.submit(Request(**r), faults=FaultPlan(plans.get(r["request_id"], []))) for r in reqs]
    eng.run_until_idle()
    for run in runs:
        got, want = run.result(), ref[run.request.request_id]
        assert (got.state.value, got.finish_reason, got.tokens, got.output) == (
            want.state.value, want.finish_reason, want.tokens, want.output), run.request.request_id
    assert [r.state for r in runs] == ["FAILED", "CANCELLED", "FAILED", "FAILED", "FINISHED"]
    _no_violations(runs)


def test_slow_reader_is_parked_without_blocking_the_batch():
    """§4.8, DECISIONS D6 (pause): a request whose reader does not read is parked at its cap —
    the others finish — and resumes, gap-free and identical to the reference, once it is read."""
    slow = dict(prompt="slow reader", max_output_tokens=30, max_buffer_events=3, request_id="slow")
    reqs = [slow] + _requests(3)
    ref = _reference(reqs)
    eng = Engine(MODEL, TOK)
    runs = [eng.submit(Request(**r)) for r in reqs]
    eng.run_until_idle()
    assert all(r.done for r in runs[1:]) and not runs[0].done
    assert eng.stats().parked == 1
    assert runs[0].stream.unread[0] == 3
    got = []
    while not runs[0].done or runs[0].stream.unread[0]:
        while (ev := runs[0].stream.get(timeout=0)) is not None:
            got.append(ev)
        eng.step()
    got += list(runs[0].stream)
    assert _same(runs[0].result(), ref["slow"])
    assert b"".join(ev.data for ev in got if ev.kind == "delta") == ref["slow"].output
    _gauges_zero(eng)


def test_detached_paused_request_fails_with_transport_error_after_the_timeout():
    """DECISIONS D5: a disconnect is recorded, not a cancel and never EOS; a paused request whose
    reader is gone fails with transport_error once detach_timeout_s has passed."""
    clock = FakeClock()
    eng = Engine(MODEL, TOK, detach_timeout_s=5.0, clock=clock)
    run = eng.submit(Request("gone", max_output_tokens=30, max_buffer_events=2))
    other = eng.submit(Request("other", max_output_tokens=10))
    run.disconnect()
    eng.run_until_idle()
    assert other.done and not run.done
    clock.advance(4.0)
    eng.step()
    assert not run.done
    clock.advance(1.5)
    eng.step()
    assert run.state == "FAILED" and run.reason.value == "transport_error"
    kinds = [e.data.get("what") for e in run.trace.events if e.kind == EventKind.TRANSPORT]
    assert kinds == ["disconnect", "detach_timeout"]
    _no_violations([run, other])
    _gauges_zero(eng)


def test_silent_connected_readers_cannot_hold_every_slot():
    """§4.8: two clients take both slots and stop reading (still connected): their runs
    park, the longest wait shows in the stats, and after stall_timeout_s they fail with
    transport_error, freeing the slots, so the queued third request is answered."""
    clock = FakeClock()
    eng = Engine(MODEL, TOK, max_batch=2, stall_timeout_s=5.0, clock=clock)
    silent = [eng.submit(Request(f"silent {i}", max_output_tokens=40, max_buffer_events=2)) for i in range(2)]
    waiting = eng.submit(Request("waiting", max_output_tokens=5))
    eng.run_until_idle()
    assert not waiting.done and all(r.stream.connected and not r.done for r in silent)
    clock.advance(3.0)
    assert eng.stats().parked == 2 and eng.stats().parked_longest_s >= 3.0
    eng.step()
    assert not any(r.done for r in silent)
    clock.advance(2.5)
    eng.run_until_idle()
    for r in silent:
        assert r.state == "FAILED" and r.reason.value == "transport_error" and "not reading" in r.error
        assert [e.data.get("what") for e in r.trace.events if e.kind == EventKind.TRANSPORT] == ["stall_timeout"]
    assert waiting.state == "FINISHED"
    _no_violations([*silent, waiting])
    _gauges_zero(eng)


def test_a_stall_bound_of_none_waits_for_the_reader():
    clock = FakeClock()
    eng = Engine(MODEL, TOK, stall_timeout_s=None, clock=clock)
    run = eng.submit(Request("patient", max_output_tokens=20, max_buffer_events=2))
    eng.run_until_idle()
    clock.advance(10_000)
    eng.step()
    assert not run.done
    for _ in range(1000):  # the reader comes back: it reads what is there, the engine goes on
        while run.stream.get(timeout=0) is not None:
            pass
        eng.step()
        if run.done:
            break
    assert run.state == "FINISHED"


def test_buffer_policy_overflow_fails_only_that_request():
    """§4.8, DECISIONS D6 (buffer): past max_bytes the request fails with transport_error;
    nothing is dropped silently and the batch-mates are untouched."""
    reqs = _requests(3)
    ref = _reference(reqs)
    eng = Engine(MODEL, TOK)
    over = eng.submit(Request("flood", max_output_tokens=40, policy="buffer", max_buffer_bytes=5))
    runs = [eng.submit(Request(**r)) for r in reqs]
    eng.run_until_idle()
    assert over.state == "FAILED" and over.reason.value == "transport_error"
    assert all(_same(r.result(), ref[r.request.request_id]) for r in runs)


def test_a_reader_making_room_after_an_overflow_cannot_let_the_refused_delta_through(monkeypatch):
    """§4.8, DECISIONS D6, found by the soak: the producer asks `fits`, is refused, and fails its
    lifecycle; a reader that drains the buffer in that instant must not turn the refused delta into
    a sent one. The transition to FAILED stays next to response.failed and the usage counts exactly
    the bytes the trace shows sent."""
    eng = Engine(MODEL, TOK)
    run = eng.submit(Request("flood", max_output_tokens=40, policy="buffer", max_buffer_bytes=5))
    fits = OrderedStream.fits

    def fits_then_a_reader_drains(stream: OrderedStream, size: int) -> bool:
        verdict = fits(stream, size)
        if not verdict:  # the reader's turn comes between the verdict and the producer's failure
            while stream.get(timeout=0) is not None:
                pass
        return verdict

    monkeypatch.setattr(OrderedStream, "fits", fits_then_a_reader_drains)
    eng.run_until_idle()
    assert run.state == "FAILED" and run.reason.value == "transport_error"
    assert check_trace(run.trace.events, tokenizer=TOK) == []
    sent = sum(len(e.data["bytes"]) for e in run.trace.events if e.kind == EventKind.RESPONSE_DELTA)
    assert run.result().usage.returned_bytes == sent == len(run.result().output)


def test_full_queue_refuses_without_starting_anything():
    """Admission: a full queue raises QueueFull (the server's 429) and creates no request."""
    eng = Engine(MODEL, TOK, max_queue=2)
    eng.submit(Request("a", request_id="q1"))
    eng.submit(Request("b", request_id="q2"))
    with pytest.raises(QueueFull, match="max_queue=2"):
        eng.submit(Request("c", request_id="q3"))
    with pytest.raises(UnknownRequest):
        eng.get("q3")
    with pytest.raises(DuplicateRequest, match="q1"):
        eng.submit(Request("a", request_id="q1"))
    assert eng.stats().queue_depth == 2
    eng.run_until_idle()
    _gauges_zero(eng)


def test_prompt_over_context_is_refused_at_admission():
    """DECISIONS D9: a prompt that leaves no room for an output token is refused at submit:
    FAILED with context_limit, nothing queued."""
    eng = Engine(MODEL, TOK)
    run = eng.submit(Request([1] * MODEL.context_limit))
    assert run.state == "FAILED" and run.reason.value == "context_limit"
    assert eng.stats().queue_depth == 0 and eng.get(run.request.request_id) is run


def test_background_thread_and_stop_cancels_the_rest():
    """start()/stop(): requests complete on the engine thread; stop() ends every remaining
    request cancelled (§4.9) and refuses new ones; the gauges return to zero."""
    eng = Engine(MODEL, TOK, poll_s=0.001)
    eng.start()
    done = eng.submit(Request("quick", max_output_tokens=5))
    assert [ev.kind for ev in done.stream][-1] == "completed"
    parked = eng.submit(Request("parked", max_output_tokens=60, max_buffer_events=2))
    deadline = time.monotonic() + 10
    while parked.stream.unread[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    eng.stop()
    assert parked.state == "CANCELLED" and parked.reason.value == "cancelled"
    with pytest.raises(EngineStopped):
        eng.submit(Request("late"))
    _no_violations([done, parked])
    _gauges_zero(eng)


def test_cancel_from_another_thread_while_running():
    """§4.9 moment 1 from any thread: cancel() only sets a flag; the engine thread observes it."""
    eng = Engine(MODEL, TOK, poll_s=0.001)
    eng.start()
    try:
        run = eng.submit(Request("cancel me", max_output_tokens=100, max_buffer_events=1))
        seen = threading.Event()
        run.stream.get(timeout=5)  # start
        threading.Thread(target=lambda: (eng.cancel(run.request.request_id), seen.set())).start()
        assert seen.wait(5)
        events = list(run.stream)
        assert events[-1].kind == "cancelled"
    finally:
        eng.stop()
    assert run.state == "CANCELLED"


@pytest.mark.parametrize("threads", [1, 2])
def test_the_engine_thread_runs_its_kernels_on_the_threads_it_was_given(threads):
    """D60: the model's kernels run on the engine thread with `threads` intra-op threads, whatever
    the thread that started it has (here the other count); None takes the starter's count."""
    import torch

    seen: list[int] = []

    class Counting(FlakyModel):
        def decode_one(self, caches, tokens):
            seen.append(torch.get_num_threads())
            return super().decode_one(caches, tokens)

    before = torch.get_num_threads()
    torch.set_num_threads(3 - threads)
    try:
        for given, expected in ((threads, threads), (None, 3 - threads)):
            seen.clear()
            eng = Engine(Counting(MODEL, bad_len=-1), TOK, poll_s=0.001, threads=given)
            eng.start()
            try:
                run = eng.submit(Request("count", max_output_tokens=3))
                assert [ev.kind for ev in run.stream][-1] == "completed"
            finally:
                eng.stop()
            assert seen and set(seen) == {expected}
        assert torch.get_num_threads() == 3 - threads  # the starter's own count is left alone
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="pinning a team of two needs two CPUs and sched_setaffinity")
def test_the_engine_threads_team_runs_one_thread_a_cpu_when_pinned():
    """D62: with pin_threads, the engine thread and its one OpenMP worker each run on a CPU of
    their own (the first two this process may use), decoding as before; unpinned, nothing is."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    for pin in (True, False):
        eng = Engine(FlakyModel(MODEL, bad_len=-1), TOK, poll_s=0.001, threads=2, pin_threads=pin)
        before = {t.native_id for t in threading.enumerate()}
        eng.start()
        try:
            run = eng.submit(Request("count", max_output_tokens=3))
            assert [ev.kind for ev in run.stream][-1] == "completed"
            engine_tid = eng._thread.native_id
            assert eng.pinned == (tuple(cpus) if pin else ())
            if pin:
                assert os.sched_getaffinity(engine_tid) == {cpus[0]}
                # its worker: the one thread of this process that is not a Python thread and is on cpus[1]
                workers = [int(t) for t in os.listdir("/proc/self/task")
                           if int(t) not in before | {engine_tid} and os.sched_getaffinity(int(t)) == {cpus[1]}]
                assert len(workers) == 1
            else:
                assert os.sched_getaffinity(engine_tid) == os.sched_getaffinity(0)
        finally:
            eng.stop()


def test_constructor_rejects_bad_settings():
    """Bad engine settings are named in the error."""
    with pytest.raises(ValueError, match="max_batch"):
        Engine(MODEL, TOK, max_batch=0)
    with pytest.raises(ValueError, match="threads"):
        Engine(MODEL, TOK, threads=0)
    with pytest.raises(ValueError, match="preemption"):
        Engine(MODEL, TOK, preemption="drop")
    with pytest.raises(ValueError, match="cache_budget_tokens"):
        Engine(MODEL, TOK, cache_budget_tokens=-1)
    with pytest.raises(TypeError, match="Request"):
        Engine(MODEL, TOK).submit({"prompt": "x"})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_swap_restores_the_cache_bit_for_bit_in_every_dtype(dtype):
    """§4.8: snapshot() to host memory and restore() give back the very bits."""
    import torch

    model = tiny_model().to(getattr(torch, dtype))
    _, cache = model.prefill(list(range(3, 20)))
    for t in (5, 6, 7):
        model.decode_one([cache], [t])
    k0, v0 = (x.clone() for x in cache.keys_values())
    snap = cache.snapshot()
    cache.free()
    cache.restore(snap)
    k1, v1 = cache.keys_values()
    assert k1.dtype == getattr(torch, dtype) and torch.equal(k0, k1) and torch.equal(v0, v1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preemption", [None, "swap", "recompute"])
def test_a_batch_invariant_engine_equals_generate_bit_for_bit(dtype, preemption):
    """§4.4, §4.8: with batch_invariant every kernel call holds one sequence and
    recompute replays the decodes, so batching and preemption change no token, in fp32 and bf16
    (where batched kernels round differently: the Engine's docstring states what holds without)."""
    import torch

    from decodespec.runtime.tinylm import ASSETS, TinyLM
    from decodespec.runtime.tokenizers import HFTokenizer

    tok = HFTokenizer(ASSETS / "tokenizer.json")
    model = TinyLM.default().to(getattr(torch, dtype))
    reqs = [Request(f"Story {i}: once", max_output_tokens=16, request_id=f"s{i}") for i in range(12)]
    ref = {r.request_id: generate(r, model=model, tokenizer=tok).tokens for r in reqs}
    budget = {} if preemption is None else {"cache_budget_tokens": 120, "preemption": preemption}
    eng = Engine(model, tok, max_batch=6, batch_invariant=True, **budget)
    runs = [eng.submit(r) for r in reqs]
    eng.run_until_idle()
    assert {r.request.request_id: r.result().tokens for r in runs} == ref
    if preemption is not None:
        assert eng.stats().preemptions_total > 0
    for run in runs:
        assert check_trace(run.trace.events, tokenizer=tok) == []


def test_the_engine_moves_sequences_only_along_the_sequence_table(monkeypatch):
    """§4.4, §4.8: queued, resident, parked, swapped and done are the states of
    spec/sequence.toml; with preemption and slow readers every entry ends DONE, and a second drop
    (the abort/finish race that double-frees elsewhere) is an IllegalTransition that changes nothing."""
    from decodespec.machine import IllegalTransition
    from decodespec.runtime import engine as engine_mod

    dropped = []
    original = engine_mod.Engine._drop

    def spy(self, e):
        original(self, e)
        dropped.append(e)

    monkeypatch.setattr(engine_mod.Engine, "_drop", spy)
    eng = Engine(MODEL, TOK, max_batch=4, cache_budget_tokens=60, preemption="swap")
    runs = [eng.submit(Request(**r)) for r in _requests(10)]
    eng.run_until_idle()
    assert eng.stats().preemptions_total > 0
    assert len(dropped) == len(runs) and {e.seq.state.value for e in dropped} == {"DONE"}
    before = eng.stats().requests_total
    with pytest.raises(IllegalTransition, match="sequence: event 'drop' is not allowed in state DONE"):
        eng._drop(dropped[0])
    assert eng.stats().requests_total == before
    _no_violations(runs)
    _gauges_zero(eng)


def test_a_swapped_run_that_must_drain_waits_for_a_free_place():
    """§4.4, §4.8 (spec/sequence.toml: `resume` takes a place): a swapped-out run whose deadline
    passes while its reader is behind needs no cache, but it still may not join a full batch; it
    stays swapped until a place is free, and the batch never exceeds max_batch. (White-box: the
    scheduler's preemption and the other run's admission are forced at the moment the race needs.)"""
    eng = Engine(MODEL, TOK, max_batch=1, preemption="swap")
    y = eng.submit(Request("abc", max_output_tokens=8, policy="pause", max_buffer_events=1))
    for _ in range(50):
        eng.step()
        if eng.stats().parked:
            break
    assert eng.stats().parked == 1
    ey = eng._live[y.request.request_id]
    eng._preempt(ey)
    x = eng.submit(Request("xyz", max_output_tokens=8))
    ex = eng._live[x.request.request_id]
    with eng._lock:
        eng._queue.remove(ex)
    eng._prefill([ex])
    y._deadline_forced = True  # the deadline passes while y is swapped out
    eng._waiting_safe_points()
    assert (len(eng._resident), eng._swapped_out(ey), y.state) == (1, True, "DRAINING")
    for _ in range(2000):  # y's reader never reads: x finishes, then y resumes into the free place
        if x.done:
            break
        eng.step()
    eng._admit()
    assert x.done and not eng._swapped_out(ey) and len(eng._resident) <= eng.max_batch
