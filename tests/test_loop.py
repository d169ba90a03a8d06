"""The reference loop of §4.3 on hand-computable fixtures: one test per way a request can end.

Tokens are forced by ScriptedModel over a ByteTableTokenizer; every trace is also checked against
every invariant of spec/invariants.toml (properties.check_trace).
"""

from __future__ import annotations

import io
import threading
import time

import pytest

from decodespec.properties import check_trace
from decodespec.runtime import ByteTableTokenizer, Fault, FaultPlan, Request, ScriptedModel, generate
from decodespec.runtime.events import EventKind, read_jsonl, write_jsonl
from decodespec.runtime.experiments import EXPERIMENTS

EOS = 2
TABLE = {
    1: b"> ", EOS: b"</s>", 10: b"ab", 11: b"c", 12: b"d", 13: b"e", 14: b"\xe4\xb8", 15: b"\xad",
    16: b"\xff", 17: b"c\xe4\xb8", 101: b"AB", 102: b"CD",
}


def tok() -> ByteTableTokenizer:
    return ByteTableTokenizer(TABLE, eos_id=EOS)


def run(script, *, faults=None, context_limit=4096, prompt=(1,), **req):
    model = ScriptedModel(list(script), vocab_size=128, context_limit=context_limit)
    res = generate(Request(list(prompt), **req), model=model, tokenizer=tok(), faults=faults)
    assert check_trace(res.events, tokenizer=tok()) == [], "a trace of the reference broke an invariant"
    return res


def kinds(res, kind):
    return [e for e in res.events if e.kind == kind]


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiments_of_section_4_11_hold(name):
    """§4.11 A and B: every claim of the experiment holds on the reference loop."""
    exp = EXPERIMENTS[name]()
    assert [c for c, ok in exp.claims if not ok] == []
    assert check_trace(exp.result.events) == []


def test_eos_ends_before_detokenization_and_is_never_shown():
    """§4.3/§4.12 row 1: EOS is checked before the detokenizer; its bytes never reach the client."""
    res = run([10, EOS, 11], max_output_tokens=8)
    assert (res.state.value, res.finish_reason) == ("FINISHED", "eos")
    assert res.output == b"ab"
    assert res.usage.selected_tokens == 2 and res.usage.processed_tokens == 1 and res.usage.returned_tokens == 1


def test_eos_on_last_allowed_token_reports_eos_not_length():
    """DECISIONS D4: EOS on the last allowed token is `eos`, never `max_output_tokens`."""
    res = run([10, EOS], max_output_tokens=2)
    assert res.finish_reason == "eos"


def test_stop_string_across_tokens_is_never_emitted():
    """§4.6: a stop spanning tokens is matched on bytes; none of its bytes are returned."""
    res = run([10, 11, 12], stop=["bcd"], max_output_tokens=8)
    assert (res.finish_reason, res.output, res.stop) == ("stop_sequence", b"a", "bcd")
    assert [e.data["token"] for e in kinds(res, EventKind.TOKEN_SELECTED)] == [10, 11, 12]


def test_stop_on_last_allowed_token_reports_stop_sequence():
    """DECISIONS D4: a stop completed by the last allowed token is `stop_sequence`."""
    res = run([10, 11], stop=["bc"], max_output_tokens=2)
    assert (res.finish_reason, res.output) == ("stop_sequence", b"a")


def test_stop_token_id_sequence_withholds_its_tokens():
    """§4.6 stop token sequences: matched on ids; the matched tokens' bytes are not returned."""
    res = run([10, 11, 12, 13], stop_token_ids=[[11, 12]], max_output_tokens=8)
    assert (res.finish_reason, res.output) == ("stop_sequence", b"ab")


def test_held_stop_prefix_is_flushed_at_length_limit():
    """§4.3 flush_safe_suffix: a held prefix that never completed a stop is returned at the end."""
    res = run([10, 11], stop=["cz"], max_output_tokens=2)
    assert (res.finish_reason, res.output) == ("max_output_tokens", b"abc")


def test_length_limit_is_exact():
    """§4.3: exactly max_output_tokens tokens are selected."""
    res = run([10, 11, 12, 13], max_output_tokens=3)
    assert res.finish_reason == "max_output_tokens" and res.usage.selected_tokens == 3


def test_context_limit_stops_when_no_position_is_left():
    """DECISIONS D10: cache length + 1 >= context limit after a selection ends the request."""
    res = run([10, 11, 12, 13], context_limit=4, max_output_tokens=10)
    assert (res.finish_reason, res.usage.selected_tokens) == ("context_limit", 3)


def test_prompt_that_fills_the_context_is_refused_at_admission():
    """DECISIONS D9: CREATED -> FAILED with context_limit; no model resource is acquired."""
    res = run([10], context_limit=4, prompt=(1, 1, 1, 1))
    assert (res.state.value, res.finish_reason) == ("FAILED", "context_limit")
    assert not [e for e in kinds(res, EventKind.RESOURCE_ACQUIRED) if e.data["resource"] == "kv_cache"]


def test_grammar_acceptance_completes():
    """§4.6 grammar acceptance: the request ends with grammar_complete once the output matches."""
    res = run([10, 11, 12], grammar=r"abc", max_output_tokens=8)
    assert (res.finish_reason, res.output) == ("grammar_complete", b"abc")


def test_grammar_waits_while_a_longer_match_is_still_possible():
    """D14: "ab" matches ab(cd)? but "abcd" still could: the run goes on and completes
    at "abcd", where nothing longer can match; the grammar sees this token's bytes."""
    res = run([10, 11, 12, 13], grammar=r"ab(cd)?", max_output_tokens=8)
    assert (res.finish_reason, res.output, res.usage.selected_tokens) == ("grammar_complete", b"abcd", 3)
    res = run([10, 10, 11], grammar=r"(ab)+", max_output_tokens=3)  # never complete: more "ab" may come
    assert res.finish_reason == "max_output_tokens"


def test_content_interruption_is_not_disguised_as_eos():
    """§4.10, DECISIONS D11: a policy interruption ends FINISHED/content_interrupted; the chunk is not sent."""
    res = run([10, 11, 12], content_policy=lambda sent, chunk: b"c" in chunk, max_output_tokens=8)
    assert (res.state.value, res.finish_reason, res.output) == ("FINISHED", "content_interrupted", b"ab")


def test_deadline_in_queue_is_deadline_exceeded_never_cancelled():
    """§4.9, DECISIONS D1: a deadline observed before prefill ends deadline_exceeded; nothing is selected."""
    res = run([10, 11], deadline_s=0)
    assert (res.state.value, res.finish_reason) == ("FINISHED", "deadline_exceeded")
    assert not kinds(res, EventKind.TOKEN_SELECTED) and not kinds(res, EventKind.RESPONSE_CANCELLED)


def test_deadline_during_decoding_is_observed_at_the_next_step():
    """§4.9: a deadline passing after step 2 is observed at the top of step 3."""
    res = run([10, 11, 12, 13], faults=FaultPlan([Fault("token.selected", 2, "deadline")]), max_output_tokens=8)
    assert (res.finish_reason, res.output, res.usage.selected_tokens) == ("deadline_exceeded", b"abc", 2)


def test_cancel_before_admission_ends_cancelled_at_once():
    """DECISIONS D2: a cancel in CREATED takes effect at once."""
    model = ScriptedModel([10], vocab_size=128)
    res = generate(Request([1]), model=model, tokenizer=tok(), on_run=lambda r: r.cancel())
    assert (res.state.value, res.finish_reason) == ("CANCELLED", "cancelled")
    assert check_trace(res.events) == []


def test_cancel_during_prefill_discards_the_prefill():
    """§4.9: a cancel while prefill is in flight: it completes, nothing is selected, CANCELLED."""
    res = run([10, 11], faults=FaultPlan([Fault("prefill.started", 0, "cancel")]))
    assert res.state.value == "CANCELLED" and not kinds(res, EventKind.TOKEN_SELECTED)


def test_cancel_from_another_thread_is_observed_at_a_safe_point():
    """§4.9: a cancel requested by another thread mid-run ends CANCELLED with a stable prefix."""
    gate = threading.Event()
    model = ScriptedModel([10, 11, 12, 13, 10, 11, 12, 13], vocab_size=128)
    runs = []

    def on_delta(_b):
        if len(runs[0].output) >= 3 and not gate.is_set():
            gate.set()
            threading.Thread(target=runs[0].cancel).start()

    res = generate(Request([1], max_output_tokens=8), model=model, tokenizer=tok(), on_run=runs.append, on_delta=on_delta)
    assert res.state.value in ("CANCELLED", "FINISHED")  # the cancel may lose to the length limit
    assert check_trace(res.events) == []
    assert res.output.startswith(b"abc")


def test_model_error_fails_and_releases_once():
    """§4.10: a model error is FAILED/model_error; cache and slot are released exactly once."""
    res = run([10, 11, 12], faults=FaultPlan([Fault("decode.started", 2, "model_error")]), max_output_tokens=8)
    assert (res.state.value, res.finish_reason, res.output) == ("FAILED", "model_error", b"abc")
    released = [e.data["resource"] for e in kinds(res, EventKind.RESOURCE_RELEASED)]
    assert sorted(released) == sorted(["kv_cache", "batch_slot", "rng_state", "stream_buffer", "trace_handle"])


def test_model_error_in_prefill_fails():
    """§4.1: PREFILLING -> FAILED on a model error."""
    res = run([10], faults=FaultPlan([Fault("prefill.started", 0, "model_error")]))
    assert (res.state.value, res.finish_reason) == ("FAILED", "model_error")


def test_invalid_tail_at_finish_is_a_decoding_error():
    """§4.3: finish() on an incomplete UTF-8 tail raises; the request FAILS (DECISIONS D12)."""
    res = run([10, 14], max_output_tokens=2)
    assert (res.state.value, res.finish_reason, res.output) == ("FAILED", "model_error", b"ab")
    assert res.error.startswith("decoding_error")


def test_no_decoding_error_after_a_stop_hit():
    """§4.3: after a stop hit finish() is not called; the incomplete tail past the stop is discarded."""
    res = run([10, 17], stop=["c"], max_output_tokens=4)
    assert (res.state.value, res.finish_reason, res.output) == ("FINISHED", "stop_sequence", b"ab")


def test_split_character_is_held_and_then_emitted_whole():
    """§4.5: a character split over two tokens is sent once complete, never as U+FFFD."""
    res = run([14, 15], max_output_tokens=2)
    assert res.output == "中".encode() and res.finish_reason == "max_output_tokens"
    assert [e.data["bytes"] for e in kinds(res, EventKind.RESPONSE_DELTA)] == ["中".encode()]


def test_invalid_byte_mid_stream_fails():
    """DECISIONS D12: bytes no continuation can make valid fail the request at that push."""
    res = run([10, 16, 11], max_output_tokens=4)
    assert (res.state.value, res.finish_reason, res.output) == ("FAILED", "model_error", b"ab")


def test_transport_error_is_not_eos():
    """§4.7 rule 5, §4.10: a failed send ends FAILED/transport_error, never eos."""
    res = run([10, 11, 12], faults=FaultPlan([Fault("response.delta", 1, "transport_error")]), max_output_tokens=3)
    assert (res.state.value, res.finish_reason, res.output) == ("FAILED", "transport_error", b"ab")


def test_disconnect_does_not_end_the_request():
    """DECISIONS D5: a disconnect is recorded as a transport fact and the request runs on."""
    res = run([10, 11, 12], faults=FaultPlan([Fault("response.delta", 0, "disconnect")]), max_output_tokens=3)
    assert res.finish_reason == "max_output_tokens" and res.output == b"abcd"
    assert [e.data["what"] for e in kinds(res, EventKind.TRANSPORT)] == ["disconnect"]


def test_usage_distinguishes_selected_processed_returned():
    """§4.10, DECISIONS D7/D8: at a stop, the stop token is selected, not processed, not returned."""
    res = run([101, 102, 103], stop=["BCD"], max_output_tokens=8)
    u = res.usage
    assert (u.selected_tokens, u.processed_tokens, u.returned_tokens, u.returned_bytes) == (2, 1, 1, 1)
    assert u.completion_tokens == 2


def test_terminal_event_carries_the_next_seq_and_usage():
    """§4.7: completed(sequence_no=N) follows deltas 0..N-1 and carries the usage."""
    res = run([10, 11, 12], max_output_tokens=3)
    seqs = [e.data["seq"] for e in kinds(res, EventKind.RESPONSE_DELTA)]
    (term,) = kinds(res, EventKind.RESPONSE_COMPLETED)
    assert seqs == list(range(len(seqs))) and term.data["seq"] == len(seqs)
    assert term.data["usage"]["selected_tokens"] == 3


def test_trace_round_trips_through_json_lines():
    """§4.12: the trace serialises to JSON Lines and back without loss of the checked fields."""
    res = run([10, 14, 15], max_output_tokens=3)
    buf = io.StringIO()
    write_jsonl(res.events, buf)
    buf.seek(0)
    back = read_jsonl(buf)
    assert [(e.kind, e.index) for e in back] == [(str(e.kind), e.index) for e in res.events]
    assert check_trace(back) == []


def test_result_trace_ends_with_the_request_even_if_the_run_logs_more_later():
    """§4.12: a Result's events are the trace as it stood when the request ended (built when
    read): a cancel requested after the end is in the run's trace, not in the Result."""
    seen = []
    res = generate(Request([1], max_output_tokens=2), model=ScriptedModel([10, 11], vocab_size=128),
                   tokenizer=tok(), on_run=seen.append)
    before = res.events
    seen[0].cancel("late")
    assert len(seen[0].trace) == len(before) + 1 and res.events == before
    assert before[-1].kind == EventKind.TIMINGS and check_trace(before, tokenizer=tok()) == []


@pytest.mark.parametrize("policy", ["pause", "buffer", "fail"])
@pytest.mark.parametrize("read_inline", [True, False])
def test_every_send_path_streams_the_same_deltas_and_output(policy, read_inline):
    """§4.7: whether select hands a delta to the stream itself, read inline or not, or
    goes through the checks of `_send` (a listener, another policy), the deltas, the listener's
    view and the output are the same."""
    script = [10, 14, 15, 11, 17, 15, 12]
    seen: list[bytes] = []
    quiet = run(script, max_output_tokens=7, policy=policy)
    heard = generate(Request([1], max_output_tokens=7, policy=policy),
                     model=ScriptedModel(script, vocab_size=128), tokenizer=tok(), on_delta=seen.append,
                     read_inline=read_inline)
    assert check_trace(heard.events, tokenizer=tok()) == []
    deltas = [e.data["bytes"] for e in kinds(quiet, EventKind.RESPONSE_DELTA)]
    assert deltas == [e.data["bytes"] for e in kinds(heard, EventKind.RESPONSE_DELTA)] == seen
    assert quiet.output == heard.output == b"".join(deltas) == "ab中cc中d".encode()


def test_timings_send_s_is_the_time_the_producer_waited_for_its_reader():
    """§4.8: TIMINGS' send_s is the stream's paused_s, the time a pause-policy producer spent
    waiting for a reader that started late; nothing else is counted in it. The reader starts 0.1 s
    after the producer has paused (on a loaded machine a fixed delay from the start could pass
    before the producer filled its one-event buffer, and it never waited)."""
    runs = []

    def late_reader(run) -> None:
        runs.append(run)

        def read() -> None:
            deadline = time.monotonic() + 30
            while run.stream.state.name != "PAUSED" and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.1)
            for _ in run.stream:
                pass

        threading.Thread(target=read, daemon=True).start()

    res = generate(Request([1], max_output_tokens=6, policy="pause", max_buffer_events=1),
                   model=ScriptedModel([10, 11, 12, 13, 10, 11], vocab_size=128), tokenizer=tok(),
                   on_run=late_reader, read_inline=False)
    assert res.finish_reason.value == "max_output_tokens" and res.output == b"abcdeabc"
    send_s = kinds(res, EventKind.TIMINGS)[0].data["send_s"]
    assert send_s == runs[0].stream.paused_s and 0.09 <= send_s < 5


def test_a_cancel_is_in_the_trace_before_the_driver_can_observe_it():
    """§4.9 (cancel_observed_after_requested across threads): while cancel() is still logging
    cancel.requested, a safe point on the driver does not see the cancel yet; once it has
    returned, the next safe point does: the flag is set only once the entry is logged."""
    from decodespec.runtime.runner import RequestRun

    run = RequestRun(Request([1], max_output_tokens=4), model=ScriptedModel([10] * 4, vocab_size=128),
                     tokenizer=tok())
    assert run.admit() and run.check_point()
    seen_during: list[bool] = []
    run.trace.subscribe(lambda ev: seen_during.append(run.check_point())
                        if ev.kind == EventKind.CANCEL_REQUESTED else None)
    run.cancel("client")
    assert seen_during == [True]  # the driver, had it looked then, would have gone on
    assert run.check_point() is False
    run.cancel("again")  # a second cancel logs nothing
    assert run.finish().finish_reason == "cancelled"
    kinds_ = [e.kind for e in run.trace.events]
    assert kinds_.count(EventKind.CANCEL_REQUESTED) == 1
    assert kinds_.index(EventKind.CANCEL_REQUESTED) < kinds_.index(EventKind.RESPONSE_CANCELLED)


def test_prompt_id_outside_the_tokenizer_is_refused_before_anything_starts():
    """DECISIONS D9: bad input is an error naming the field; no trace, no resource, no stream."""
    from decodespec.runtime.errors import RequestError

    with pytest.raises(RequestError, match=r"^prompt: .*999"):
        generate(Request([999]), model=ScriptedModel([10], vocab_size=1000), tokenizer=tok())


@pytest.mark.parametrize(("action", "state"), [("cancel", "CANCELLED"), ("deadline", "FINISHED"),
                                               ("disconnect", "FINISHED")])
def test_an_asynchronous_fault_at_request_created_lands_once_the_request_exists(action, state):
    """§4.9, D5: a cancel, deadline or disconnect injected at request.created is
    delivered once the stream has started (the stream table accepts nothing before
    response.start); it never raises IllegalTransition out of generate()."""
    res = run([10, 11, 12], faults=FaultPlan([Fault("request.created", 0, action)]), max_output_tokens=3)
    assert res.state.value == state


def test_a_character_split_across_tokens_counts_each_token_as_returned():
    """D7: returned_tokens counts tokens at least one of whose bytes reached the client;
    both halves of 中 (e4 b8 | ad) did, though the first emitted nothing on its own."""
    res = run([14, 15, EOS], max_output_tokens=8)
    assert res.output == "中".encode() and res.usage.returned_tokens == 2 and res.usage.returned_bytes == 3
    res = run([10, 14, 15, 11], max_output_tokens=4)
    assert res.output == b"ab\xe4\xb8\xadc" and res.usage.returned_tokens == 4
