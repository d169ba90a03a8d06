"""The trace (runtime/events.py; §4.12): raw entries recorded without a lock on
the hot path, Events built when read, indices equal to positions even across threads."""

from __future__ import annotations

import gc
import io
import threading

from decodespec.runtime.events import Event, EventKind, Trace, read_jsonl, write_jsonl


def test_events_carry_index_time_and_fields_in_emit_order():
    """§4.12: each event has its request id, its position as index, the clock's time and its fields;
    emit returns that time."""
    ticks = iter([1.0, 2.0, 3.0])
    tr = Trace("r1", clock=lambda: next(ticks))
    assert tr.emit(EventKind.TOKEN_SELECTED, step=1, token=5, eos=False) == 1.0
    tr.emit(EventKind.DECODE_STARTED, step=1)
    assert len(tr) == 2
    tr.emit(EventKind.DECODE_COMPLETED, step=1, cache_len=4)
    assert tr.events == [
        Event(EventKind.TOKEN_SELECTED, "r1", 0, 1.0, {"step": 1, "token": 5, "eos": False}),
        Event(EventKind.DECODE_STARTED, "r1", 1, 2.0, {"step": 1}),
        Event(EventKind.DECODE_COMPLETED, "r1", 2, 3.0, {"step": 1, "cache_len": 4}),
    ]
    assert list(tr) == tr.events


def test_events_is_a_copy_that_reading_does_not_change():
    """Reading `events` twice gives equal lists; changing one does not change the trace."""
    tr = Trace("r1")
    tr.emit(EventKind.PREFILL_STARTED, step=0)
    first = tr.events
    first.clear()
    tr.emit(EventKind.PREFILL_COMPLETED, step=0, cache_len=3)
    assert [e.index for e in tr.events] == [0, 1] and tr.events == tr.events


def test_concurrent_emits_get_distinct_indices_equal_to_positions():
    """A cancel logged from another thread never shares an index with the loop's own events:
    every index is the event's position, 0..n-1, and listeners see the same indices."""
    tr = Trace("r1")
    heard: list[tuple[int, int]] = []
    lock = threading.Lock()

    def listen(ev: Event) -> None:
        with lock:
            heard.append((ev.index, ev.data["n"]))

    tr.subscribe(listen)
    per_thread, threads = 2000, 4
    start = threading.Barrier(threads)

    def work(k: int) -> None:
        start.wait()
        for i in range(per_thread):
            tr.emit(EventKind.TRANSPORT, n=k * per_thread + i)

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    events = tr.events
    assert [e.index for e in events] == list(range(per_thread * threads))
    assert sorted(e.data["n"] for e in events) == list(range(per_thread * threads))
    assert sorted(heard) == sorted((e.index, e.data["n"]) for e in events)


def test_a_listener_may_emit_and_its_event_follows():
    """The fault injector emits from inside a listener; its event takes the next index."""
    tr = Trace("r1")

    def inject(ev: Event) -> None:
        if ev.kind == EventKind.TOKEN_SELECTED:
            tr.emit(EventKind.FAULT_INJECTED, point=str(ev.kind), step=ev.data["step"], action="cancel")

    tr.subscribe(inject)
    tr.emit(EventKind.TOKEN_SELECTED, step=1, token=2, eos=False)
    assert [(e.index, e.kind) for e in tr.events] == [(0, EventKind.TOKEN_SELECTED), (1, EventKind.FAULT_INJECTED)]


def test_jsonl_round_trip_keeps_every_field():
    """Traces serialise to JSON Lines and read back equal, bytes included."""
    tr = Trace("r1", clock=lambda: 0.5)
    tr.emit(EventKind.RESPONSE_DELTA, seq=0, bytes=b"\xe4\xb8\xad", unread_events=1, unread_bytes=3)
    tr.emit(EventKind.LIFECYCLE, **{"from": "DECODING"}, to="DRAINING", event="eos", action=None, reason="eos")
    fh = io.StringIO()
    write_jsonl(tr.events, fh)
    fh.seek(0)
    back = read_jsonl(fh)
    assert [(e.kind, e.index, e.t, dict(e.data)) for e in back] == [
        (str(e.kind), e.index, e.t, dict(e.data)) for e in tr.events
    ]


def test_a_per_token_entry_put_as_values_reads_as_the_same_event_as_emit():
    """The per-token kinds are put as flat tuples of values (no mapping on the hot path); read
    back, each is the Event `emit` with the same fields gives, listeners included."""
    seen: list[Event] = []
    fast, slow = Trace("r", clock=lambda: 7.0), Trace("r", clock=lambda: 7.0)
    fast.subscribe(seen.append)
    rows = [
        (EventKind.TOKEN_SELECTED, (3, 41, False), {"step": 3, "token": 41, "eos": False}),
        (EventKind.RESPONSE_DELTA, (0, b"hi", 1, 2), {"seq": 0, "bytes": b"hi", "unread_events": 1, "unread_bytes": 2}),
        (EventKind.DECODE_STARTED, (3,), {"step": 3}),
        (EventKind.DECODE_COMPLETED, (3, 9), {"step": 3, "cache_len": 9}),
    ]
    for kind, values, fields in rows:
        fast.put((kind.value, fast.clock(), *values))  # the plain string, as the hot path puts it
        slow.emit(kind, **fields)
    assert fast.events == slow.events == seen
    assert all(type(e.kind) is EventKind for e in fast.events + seen)
    assert [e.to_json() for e in fast.events] == [e.to_json() for e in slow.events]


def test_put_notifies_only_once_someone_subscribed():
    """With no listener `put` is the list's own append; subscribing makes later puts notify."""
    tr = Trace("r")
    tr.put((EventKind.DECODE_STARTED.value, 1.0, 1))
    seen: list[Event] = []
    tr.subscribe(seen.append)
    tr.put((EventKind.DECODE_COMPLETED.value, 2.0, 1, 5))
    assert [(e.index, e.kind, dict(e.data)) for e in seen] == [(1, EventKind.DECODE_COMPLETED, {"step": 1, "cache_len": 5})]


def test_per_token_entries_leave_the_garbage_collector_at_its_first_pass():
    """A per-token entry is one flat tuple of atomic values (its kind as a plain string),
    so one collection stops tracking it and a long trace adds nothing to later full collections."""
    from decodespec.runtime import ByteTableTokenizer, Request, ScriptedModel, generate

    tok = ByteTableTokenizer({1: b"> ", 2: b"</s>", 10: b"ab", 11: b"c"}, eos_id=2)
    model = ScriptedModel([10, 11, 10, 11, 2], vocab_size=16)
    result = generate(Request([1]), model=model, tokenizer=tok)
    gc.collect()
    raw = result.trace._raw
    per_token = [entry for entry in raw if type(entry[2]) is not dict]
    assert {entry[0] for entry in per_token} == {"token.selected", "decode.started", "decode.completed", "response.delta"}
    assert not any(gc.is_tracked(entry) for entry in per_token)
