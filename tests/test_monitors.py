"""Trace monitors (properties/monitors.py): every invariant of spec/invariants.toml catches a
hand-built trace that breaks it, and conforming traces (hand-built to the trace contract, and real
runs of generate()) give no violation at all."""

from __future__ import annotations

import pytest

from decodespec.properties import Violation, check_trace
from decodespec.properties.invariants import load_invariants
from decodespec.properties.monitors import skipped
from decodespec.runtime import ByteTableTokenizer, Request, ScriptedModel, generate
from decodespec.runtime.events import Event, Trace

TOK = ByteTableTokenizer({5: b"Q", 6: b": ", 101: b"AB", 102: b"CD", 103: b"E", 2: b""}, eos_id=2)
MODEL_RES = ("kv_cache", "batch_slot", "rng_state")
USAGE = dict(prompt_tokens=2, selected_tokens=2, processed_tokens=1, returned_tokens=2, returned_bytes=3,
             completion_tokens=2)


def lc(frm, to, event, reason=None):
    return ("lifecycle.transition", {"from": frm, "to": to, "event": event, "action": "a", "reason": reason})


def head(stop=("XYZ",), max_out=2):
    """Events 1-6 of the trace contract: created, stream resources, start, admission, prefill."""
    return [
        ("request.created", dict(prompt_tokens=2, stop=list(stop), stop_token_ids=[], max_output_tokens=max_out,
                                 context_limit=64, eos_id=2, policy="pause")),
        ("resource.acquired", {"resource": "trace_handle"}),
        ("resource.acquired", {"resource": "stream_buffer"}),
        ("response.start", {"model": "m"}),
        lc("CREATED", "QUEUED", "enqueue"),
        lc("QUEUED", "PREFILLING", "schedule"),
        *[("resource.acquired", {"resource": k}) for k in MODEL_RES],
        ("prefill.started", {"step": 0}),
        ("prefill.completed", {"step": 0, "cache_len": 2}),
        lc("PREFILLING", "DECODING", "prefill_done"),
    ]


def tail(kind="response.completed", to="FINISHED", frm="DRAINING", event="complete", seq=2, reason="max_output_tokens",
         usage=None):
    """Events 9-12: model resources released, terminal transition and event, stream resources."""
    return [
        *[("resource.released", {"resource": k}) for k in MODEL_RES],
        lc(frm, to, event),
        (kind, {"seq": seq, "finish_reason": reason, "usage": dict(usage or USAGE)}),
        ("resource.released", {"resource": "stream_buffer"}),
        ("resource.released", {"resource": "trace_handle"}),
        ("timings", {}),
    ]


def length_run():
    """101 -> "AB", 103 -> "E", max_output_tokens=2: ends FINISHED with max_output_tokens."""
    return head() + [
        ("token.selected", {"step": 1, "token": 101, "eos": False}),
        ("response.delta", {"seq": 0, "bytes": b"AB"}),
        ("decode.started", {"step": 1}),
        ("decode.completed", {"step": 1, "cache_len": 3}),
        ("token.selected", {"step": 2, "token": 103, "eos": False}),
        ("response.delta", {"seq": 1, "bytes": b"E"}),
        lc("DECODING", "DRAINING", "length", "max_output_tokens"),
    ] + tail()


def stop_run():
    """Experiment A (§4.11): 101 "AB", 102 "CD" with stop "BCD": only "A" is returned."""
    usage = dict(USAGE, returned_tokens=1, returned_bytes=1)
    return head(stop=("BCD",), max_out=8) + [
        ("token.selected", {"step": 1, "token": 101, "eos": False}),
        ("response.delta", {"seq": 0, "bytes": b"A"}),
        ("decode.started", {"step": 1}),
        ("decode.completed", {"step": 1, "cache_len": 3}),
        ("token.selected", {"step": 2, "token": 102, "eos": False}),
        ("stop.hit", {"stop": "BCD", "rule_version": 1, "kind": "string"}),
        lc("DECODING", "DRAINING", "stop_hit", "stop_sequence"),
    ] + tail(seq=1, reason="stop_sequence", usage=usage)


def cancel_run():
    """Experiment B (§4.11): a cancel lands while decode 2 is in flight; observed at the next step top."""
    usage = dict(USAGE, processed_tokens=2)
    return head(max_out=8) + [
        ("token.selected", {"step": 1, "token": 101, "eos": False}),
        ("response.delta", {"seq": 0, "bytes": b"AB"}),
        ("decode.started", {"step": 1}),
        ("decode.completed", {"step": 1, "cache_len": 3}),
        ("token.selected", {"step": 2, "token": 103, "eos": False}),
        ("response.delta", {"seq": 1, "bytes": b"E"}),
        ("decode.started", {"step": 2}),
        ("cancel.requested", {"source": "client"}),
        ("decode.completed", {"step": 2, "cache_len": 4}),
        ("cancel.observed", {"state": "DECODING"}),
        lc("DECODING", "CANCEL_REQUESTED", "cancel"),
    ] + tail("response.cancelled", "CANCELLED", "CANCEL_REQUESTED", "safe_point", reason="cancelled", usage=usage)


def eos_run():
    """101 "AB", then EOS: reason eos, the EOS token shows nothing."""
    usage = dict(USAGE, returned_tokens=1, returned_bytes=2)
    return head(max_out=8) + [
        ("token.selected", {"step": 1, "token": 101, "eos": False}),
        ("response.delta", {"seq": 0, "bytes": b"AB"}),
        ("decode.started", {"step": 1}),
        ("decode.completed", {"step": 1, "cache_len": 3}),
        ("token.selected", {"step": 2, "token": 2, "eos": True}),
        lc("DECODING", "DRAINING", "eos", "eos"),
    ] + tail(seq=1, reason="eos", usage=usage)


def got(reader, first, last, count, terminal=False, closed=False):
    """One stream.delivered entry: `count` events handed to `reader`, seq `first`..`last` (D5)."""
    return ("stream.delivered", {"reader": reader, "first": first, "seq": last, "count": count, "terminal": terminal,
                                 "closed": closed})


def opened(reader, first, after=None, resume=False):
    return ("stream.reader_opened", {"reader": reader, "after": after, "resume": resume, "first": first})


def readers_run():
    """length_run read over HTTP: the live reader, then a resume after seq 0 while it is still open
    (D5: each has its own cursor; both get the rest and the terminal), a resume past the end (the
    terminal again) and one that leaves after one event (closed)."""
    return length_run() + [
        opened(0, None), got(0, None, 2, 4, True),
        opened(1, 1, after=0, resume=True), got(1, 1, 2, 2, True),
        opened(2, 2, after=9, resume=True), got(2, 2, 2, 1, True),  # past the end: the terminal again
        opened(3, 1, after=0, resume=True), got(3, 1, 1, 1, closed=True),
    ]


def build(rows) -> list[Event]:
    tr = Trace("r1", clock=lambda: 0.0)
    for kind, data in rows:
        tr.emit(kind, **data)
    return tr.events


def where(rows, kind, n=0, **match):
    """Position of the n-th row of `kind` whose data has the given items."""
    hits = [i for i, (k, d) in enumerate(rows) if k == kind and all(d.get(a) == b for a, b in match.items())]
    return hits[n]


def edit(rows, kind, n=0, match=None, **changes):
    i = where(rows, kind, n, **(match or {}))
    rows[i] = (rows[i][0], {**rows[i][1], **changes})
    return rows


def rekind(rows, kind, new_kind, **changes):
    i = where(rows, kind)
    rows[i] = (new_kind, {**rows[i][1], **changes})
    return rows


def move(rows, i, j):
    rows.insert(j, rows.pop(i))
    return rows


def drop(rows, kind, n=0, **match):
    rows.pop(where(rows, kind, n, **match))
    return rows


def insert_before(rows, kind, row, n=0, **match):
    rows.insert(where(rows, kind, n, **match), row)
    return rows


# Each entry: invariant -> (the trace that breaks it, whether a tokenizer is passed).
BROKEN = {
    "terminal_exclusive": lambda: rekind(length_run(), "response.completed", "response.failed",
                                         finish_reason="model_error"),
    "terminal_irreversible": lambda: length_run() + [lc("FINISHED", "CANCEL_REQUESTED", "cancel")],
    "refinement": lambda: insert_before(length_run(), "lifecycle.transition",
                                        ("token.selected", {"step": 1, "token": 101, "eos": False}),
                                        event="schedule"),
    "start_first": lambda: drop(length_run(), "response.start"),
    "no_delta_after_terminal": lambda: length_run() + [("response.delta", {"seq": 3, "bytes": b"Z"})],
    "single_terminal_event": lambda: drop(length_run(), "response.completed"),
    "terminal_after_all_deltas": lambda: edit(length_run(), "response.completed", seq=7),
    "terminal_with_transition": lambda: insert_before(length_run(), "response.completed", ("decode.started", {"step": 9})),
    "seq_strictly_increasing": lambda: edit(length_run(), "response.delta", 1, seq=0),
    "seq_contiguous": lambda: edit(edit(length_run(), "response.delta", 1, seq=2), "response.completed", seq=3),
    "reader_delivery_complete": lambda: edit(readers_run(), "stream.delivered", count=1, match={"reader": 1}),
    "delta_nonempty": lambda: insert_before(length_run(), "decode.started", ("response.delta", {"seq": 1, "bytes": b""})),
    "stream_bounded": lambda: edit(edit(length_run(), "request.created", max_events=1), "response.delta", unread_events=2),
    "release_exactly_once": lambda: insert_before(length_run(), "lifecycle.transition",
                                                  ("resource.released", {"resource": "kv_cache"}), event="complete"),
    "no_leak": lambda: drop(length_run(), "resource.released", resource="rng_state"),
    "model_released_before_terminal": lambda: move(length_run(), where(length_run(), "resource.released",
                                                                       resource="kv_cache"), -3),
    "stop_bytes_never_emitted": lambda: edit(length_run(), "request.created", stop=["BE"]),
    "nothing_after_stop_hit": lambda: insert_before(length_run(), "response.delta",
                                                    ("stop.hit", {"stop": "XYZ", "rule_version": 1, "kind": "string"}), 1),
    "stop_prefix_held": lambda: edit(length_run(), "request.created", stop=["BX"]),
    "stop_earliest_wins": lambda: edit(stop_run(), "request.created", stop=["BCD", "AB"]),
    "finish_reason_precedence": lambda: edit(
        edit(stop_run(), "lifecycle.transition", match={"event": "stop_hit"}, event="length", reason="max_output_tokens"),
        "response.completed", finish_reason="max_output_tokens"),
    "stop_reason_requires_hit": lambda: edit(drop(stop_run(), "stop.hit"), "request.created", stop=[]),
    "eos_not_emitted": lambda: insert_before(eos_run(), "lifecycle.transition",
                                             ("response.delta", {"seq": 1, "bytes": b"</s>"}), event="eos"),
    # D31: the EOS on token 2 ends the run although min_tokens 2 turns that check off
    "eos_guards_respected": lambda: edit(eos_run(), "request.created", min_tokens=2),
    "selected_minus_decoded_0_or_1": lambda: drop(drop(length_run(), "decode.started"), "decode.completed"),
    "decode_after_selected": lambda: insert_before(length_run(), "token.selected", ("decode.started", {"step": 2}), 1),
    "steps_consecutive": lambda: edit(length_run(), "token.selected", 1, step=3),
    "no_select_after_cancel_observed": lambda: insert_before(cancel_run(), "resource.released",
                                                             ("token.selected", {"step": 3, "token": 103, "eos": False})),
    "no_kernel_in_flight_at_cancelled": lambda: drop(cancel_run(), "decode.completed", 1),
    "cancel_observed_after_requested": lambda: drop(cancel_run(), "cancel.requested"),
    "cancelled_only_if_requested": lambda: drop(cancel_run(), "cancel.requested"),
    # the observed cancel ends FAILED; a token after DRAINING; a failed send as a model error
    "observed_cancel_ends_cancelled": lambda: edit(cancel_run(), "lifecycle.transition", match={"event": "safe_point"},
                                                   to="FAILED", event="model_error", reason="model_error"),
    "no_select_while_draining": lambda: insert_before(length_run(), "resource.released",
                                                      ("token.selected", {"step": 3, "token": 103, "eos": False})),
    "transport_failure_reported_as_such": lambda: edit(length_run(), "lifecycle.transition", match={"event": "length"},
                                                       to="FAILED", event="transport_error", reason="model_error"),
    "deadline_not_cancelled": lambda: insert_before(cancel_run(), "cancel.observed", ("deadline.exceeded", {})),
    "transport_not_eos": lambda: insert_before(
        edit(edit(length_run(), "lifecycle.transition", match={"event": "length"}, event="eos", reason="eos"),
             "response.completed", finish_reason="eos"),
        "lifecycle.transition", ("transport", {"what": "disconnect"}), 4),
    "finish_reason_matches_state": lambda: edit(length_run(), "response.completed", finish_reason="transport_error"),
    "length_respected": lambda: edit(length_run(), "request.created", max_output_tokens=1),
    "usage_consistent": lambda: edit(length_run(), "response.completed", usage=dict(USAGE, processed_tokens=2)),
    "detok_concat_equals_batch": lambda: edit(length_run(), "response.delta", 1, bytes=b"X"),
    # D59: "E" goes out in the first delta, before token 103 that spells it is selected.
    "stream_tokens_aligned": lambda: drop(edit(length_run(), "response.delta", 0, bytes=b"ABE"), "response.delta", 1),
}


def test_every_trace_invariant_has_a_violating_trace_here():
    """Each trace invariant of spec/invariants.toml (§4.1-§4.12) is exercised by one BROKEN entry."""
    declared = {n for n, inv in load_invariants().items() if inv.on_traces}
    assert declared == set(BROKEN)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_monitor_catches_its_violation(name):
    """The hand-built trace that breaks `name` is reported under that name, with its anchor."""
    found = check_trace(build(BROKEN[name]()), tokenizer=TOK)
    named = [v for v in found if v.invariant == name]
    assert named, f"{name} not caught; got {[str(v) for v in found]}"
    assert named[0].anchor == load_invariants()[name].anchor
    assert named[0].request_id == "r1"


@pytest.mark.parametrize("rows", [length_run, stop_run, cancel_run, eos_run, readers_run])
def test_contract_traces_conform(rows):
    """Traces written to the trace contract (§4.3 loop; §4.11 experiments A and B) have no violation."""
    assert check_trace(build(rows()), tokenizer=TOK) == []


@pytest.mark.parametrize(
    "tokens, kwargs",
    [
        ([101, 102, 103], dict(stop=["BCD"])),
        ([101, 103, 2], {}),
        ([101, 103, 103, 103], dict(max_output_tokens=2)),
        # "B" may begin "BCDX" until "C" (or the token-id stop [102]) completes with token 102: the
        # output ends there, the open match can never win, and "B" goes out with that token (§4.6, D3)
        ([101, 102, 103], dict(stop=["C", "BCDX"])),
        ([101, 102, 103], dict(stop=["BCDX"], stop_token_ids=[[102]])),
    ],
)
def test_reference_runs_conform(tokens, kwargs):
    """Real runs of generate() (§4.3) pass every monitor, the tokenizer one included (§4.5)."""
    r = generate(Request([5, 6], **kwargs), model=ScriptedModel(tokens, vocab_size=200), tokenizer=TOK)
    assert check_trace(r.events, tokenizer=TOK) == []


def test_a_prefix_sent_before_a_stop_completes_is_caught_though_one_completes_later():
    """§4.6: a stop completed later rules the open match out only from then on; "B", which may begin
    "BCDX", sent with token 101, before "C" completes with 102, is a violation at that delta."""
    early = edit(edit(stop_run(), "request.created", stop=["C", "BCDX"]), "response.delta", bytes=b"AB")
    rows = build(early)
    found = [v for v in check_trace(rows, tokenizer=TOK) if v.invariant == "stop_prefix_held"]
    assert [v.index for v in found] == [where(early, "response.delta")]


def test_violation_names_index_and_end_of_trace():
    """A missing obligation is reported at the end of the trace (index None), others at the event (§4.10)."""
    leak = check_trace(build(BROKEN["no_leak"]()))
    assert any(v.invariant == "no_leak" and v.index is None for v in leak)
    late = build(BROKEN["no_delta_after_terminal"]())
    v = next(v for v in check_trace(late) if v.invariant == "no_delta_after_terminal")
    assert v.index == late[-1].index and isinstance(v, Violation)
    assert "no_delta_after_terminal (§4.7)" in str(v)


def test_prefix_mode_skips_end_of_trace_obligations():
    """complete=False checks a running request: no terminal yet and resources held are fine (§4.7, §4.10)."""
    rows = length_run()
    prefix = build(rows[: where(rows, "decode.completed") + 1])
    assert check_trace(prefix, complete=False) == []
    assert {v.invariant for v in check_trace(prefix)} >= {"single_terminal_event", "no_leak"}


def test_tokenizer_invariant_is_skipped_without_a_tokenizer():
    """detok_concat_equals_batch (§4.5), stop_prefix_held (§4.6) and stream_tokens_aligned (§4.7)
    need a tokenizer; without one they are skipped, not passed."""
    assert sorted(skipped()) == ["detok_concat_equals_batch", "stop_prefix_held", "stream_tokens_aligned"]
    assert skipped(tokenizer=TOK) == []
    assert check_trace(build(BROKEN["detok_concat_equals_batch"]())) == []


def test_requests_are_checked_separately():
    """Interleaved events of two requests are grouped by request_id before checking (§4.4)."""
    a, b = build(length_run()), build(length_run())
    b = [Event(e.kind, "r2", e.index, e.t, e.data) for e in b]
    mixed = [e for pair in zip(a, b) for e in pair]
    assert check_trace(mixed) == []


def test_check_trace_refuses_non_events():
    """A clear TypeError names what was passed instead of an Event."""
    with pytest.raises(TypeError, match="Event"):
        check_trace([("response.start", {})])


def _swap_delivered(reader, *entries):
    """readers_run with `reader`'s delivered entries replaced by `entries`."""
    def change(rows):
        i = where(rows, "stream.delivered", reader=reader)
        rows = [r for r in rows if not (r[0] == "stream.delivered" and r[1]["reader"] == reader)]
        return rows[:i] + list(entries) + rows[i:]
    return change


def _handed_before_logged(rows):
    """readers_run whose first reader opens and is handed response.start and seq 0 before the
    stream logs seq 0 (a reader ahead of the log), then the rest as before."""
    rows = _swap_delivered(0, got(0, None, 0, 2), got(0, 1, 2, 2, True))(rows)
    early = rows.pop(where(rows, "stream.delivered", reader=0))
    opening = rows.pop(where(rows, "stream.reader_opened", reader=0))
    i = where(rows, "response.delta", seq=0)
    return rows[:i] + [opening, early] + rows[i:]


# Every way one reader's delivery can be wrong, written by hand.
@pytest.mark.parametrize(("change", "says"), [
    (_swap_delivered(1, got(1, 2, 2, 1, True)), "seq=2 where seq=1 was due (a gap)"),  # skips seq 1
    (_swap_delivered(1, got(1, 1, 2, 1, True)), "1 events for seq=1..2 (a gap)"),  # loses one inside
    (_swap_delivered(1, got(1, 0, 2, 3, True)), "seq=0 where seq=1 was due (a duplicate)"),  # replays seq 0
    (_swap_delivered(1, got(1, 1, 2, 3, True)), "(a duplicate)"),  # one event twice inside the run
    (_swap_delivered(1, got(1, 1, 1, 1), got(1, 1, 2, 2, True)), "(a duplicate)"),  # a run repeats the last
    (_swap_delivered(0, got(0, 0, 2, 3, True)), "seq=0 where seq=None was due (a gap)"),  # misses response.start
    (lambda rows: edit(edit(rows, "stream.reader_opened", first=0, match={"reader": 0}), "stream.delivered",
                       first=0, count=3, match={"reader": 0}), "the first, started at seq=0"),  # nor seq 0 (claimed)
    (_swap_delivered(0, got(0, None, 2, 4, True), got(0, 3, 3, 1)), "after its terminal event"),
    (_swap_delivered(3, got(3, 1, 1, 1, closed=True), got(3, 2, 2, 1, True)), "after its close"),
    (_swap_delivered(1, got(1, 1, 1, 1, True)), "terminal with seq=1"),
    (_swap_delivered(1, got(1, 1, 5, 5, True)), "seq=5, which the stream never logged"),
    (lambda rows: rows + [got(7, 0, 0, 1)], "never opened"),
    (_handed_before_logged, "reader 0 was handed seq=0 before the stream logged it"),
    (_swap_delivered(1, got(1, 1, 1, 1)), "reader 1 neither got the terminal event nor closed"),  # just stops
    (lambda rows: rows + [opened(4, 1, after=0, resume=True)], "reader 4 neither got"),  # opened, never fed
])
def test_reader_delivery_monitor_names_each_kind_of_wrong_delivery(change, says):
    """§4.7 per reader: a skipped or lost event, a duplicate, a live reader that misses
    response.start or seq 0, anything after the terminal or after the reader left, a wrong terminal, an
    event never logged or handed out before it was logged, a reader never opened, a delivery that
    stops without terminal or close."""
    found = [str(v) for v in check_trace(build(change(readers_run())), tokenizer=TOK)
             if v.invariant == "reader_delivery_complete"]
    assert found and says in found[0], found


@pytest.mark.parametrize(("policy", "events", "nbytes", "flagged"), [
    ("buffer", 9, 3, False),  # buffer bounds bytes only: many small unread deltas are fine (D6)
    ("buffer", 1, 99, True),
    ("fail", 1, 99, False),  # fail bounds events only
    ("fail", 9, 3, True),
    ("pause", 9, 3, True),  # pause bounds both
    ("pause", 2, 99, True),
    ("pause", 1, 99, False),  # a lone delta larger than max_bytes waits alone
])
def test_stream_bounded_applies_the_caps_of_the_policy(policy, events, nbytes, flagged):
    """D6 per policy: buffer bounds the unread bytes only, fail the unread events only, pause both
    (a lone delta larger than max_bytes waits alone); a run within its policy's caps is not flagged."""
    rows = edit(edit(length_run(), "request.created", policy=policy, max_events=4, max_bytes=10),
                "response.delta", unread_events=events, unread_bytes=nbytes)
    found = [v for v in check_trace(build(rows), tokenizer=TOK) if v.invariant == "stream_bounded"]
    assert bool(found) is flagged, found

