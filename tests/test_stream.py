"""OrderedStream and Deduper: ordered deltas, one terminal, replay, bounded buffer (§4.7, §4.8)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from decodespec.machine import IllegalTransition
from decodespec.runtime.backpressure import OVERFLOW_ERROR, BackpressurePolicy, StreamOverflow
from decodespec.runtime.events import EventKind, Trace
from decodespec.runtime.stream import OrderedStream
from decodespec.runtime.stream_events import Deduper, StreamEvent
from decodespec.runtime.wakes import batched_wakes
from decodespec.spec import FinishReason, load_spec

WAIT = 5.0  # seconds: upper bound for any thread handshake, so a broken stream fails, never hangs


def started(**kw) -> OrderedStream:
    s = OrderedStream("r1", **kw)
    s.start("tiny")
    return s


def wait_until(pred, timeout: float = WAIT) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.001)
    return pred()


def drain(s: OrderedStream) -> list[StreamEvent]:
    out = []
    while (ev := s.get(timeout=0)) is not None:
        out.append(ev)
    return out


# ---- §4.7: numbering, terminal, trace ---------------------------------------------------------


def test_policies_are_the_table_params():
    """§4.8: the three policies come from spec/stream.toml."""
    assert [p.value for p in BackpressurePolicy] == load_spec("stream").params["policies"]


def test_seq_contiguous_from_zero_and_terminal_takes_the_next():
    """§4.7 rules 1 and 3: deltas are 0..N-1 and completed(seq=N) comes after all of them."""
    s = started()
    assert s.next_seq == 0
    assert [s.delta(b"a"), s.delta(b"bc"), s.delta(b"d")] == [0, 1, 2]
    assert s.next_seq == 3
    assert s.complete("eos", {"selected_tokens": 3}) == 3
    evs = list(s)
    assert [e.kind for e in evs] == ["start", "delta", "delta", "delta", "completed"]
    assert [e.seq for e in evs] == [None, 0, 1, 2, 3]
    assert b"".join(e.data for e in evs) == b"abcd"
    assert evs[-1].finish_reason is FinishReason.EOS and evs[-1].usage == {"selected_tokens": 3}
    assert s.closed and s.state == "COMPLETED" and s.get(timeout=0) is None


def test_terminal_seq_is_zero_without_deltas():
    """§4.7: with no delta the terminal event is seq 0 (DECISIONS D13)."""
    s = started()
    assert s.cancel({"selected_tokens": 0}) == 0
    assert [(e.kind, e.seq, e.finish_reason) for e in s] == [
        ("start", None, None),
        ("cancelled", 0, FinishReason.CANCELLED),
    ]


def test_trace_records_start_deltas_and_terminal():
    """§4.7 and the trace contract: response.start, response.delta(seq, bytes) with the buffer
    occupancy after it (§4.8, for the stream_bounded monitor), one terminal."""
    trace = Trace("r1")
    s = started(trace=trace)
    s.delta(b"hi")
    s.fail("model_error", {"n": 1}, error="decoding_error: bad tail")
    assert [(e.kind, dict(e.data)) for e in trace] == [
        (EventKind.RESPONSE_START, {"model": "tiny"}),
        (EventKind.RESPONSE_DELTA, {"seq": 0, "bytes": b"hi", "unread_events": 1, "unread_bytes": 2}),
        (
            EventKind.RESPONSE_FAILED,
            {"seq": 1, "finish_reason": "model_error", "usage": {"n": 1}, "error": "decoding_error: bad tail"},
        ),
    ]


def test_empty_delta_sends_nothing():
    """§4.7 (emit_delta_if_nonempty): an empty delta takes no seq and sends no event."""
    trace = Trace("r1")
    s = started(trace=trace)
    assert s.delta(b"") is None
    assert s.delta(b"x") == 0
    assert [e.kind for e in drain(s)] == ["start", "delta"]
    assert len(trace) == 2


def test_delta_keeps_a_private_copy_of_mutable_bytes():
    """§4.7 rule 2: what was sent is what is read and replayed, even if the caller reuses its buffer."""
    s = started()
    buf = bytearray(b"abc")
    s.delta(buf)
    buf[:] = b"xyz"
    assert drain(s)[-1].data == b"abc" and s.replay(-1)[0].data == b"abc"


@pytest.mark.parametrize("end", ["complete", "cancel", "fail"])
def test_nothing_but_reads_after_the_terminal(end):
    """§4.7 rule 3: after the one terminal event every send is rejected and the state is kept;
    replay, disconnect and reconnect stay allowed."""
    s = started()
    s.delta(b"a")
    {"complete": lambda: s.complete("stop_sequence"), "cancel": s.cancel,
     "fail": lambda: s.fail("transport_error", error="x")}[end]()
    state, n = s.state, len(s.events)
    for send in (lambda: s.delta(b"b"), lambda: s.delta(b""), lambda: s.complete("eos"), s.cancel,
                 lambda: s.fail("model_error"), s.start):
        with pytest.raises(IllegalTransition):
            send()
        assert s.state == state and len(s.events) == n
    s.disconnect()
    s.reconnect()
    assert [e.seq for e in s.replay(-1)] == [0, 1]


def test_nothing_before_start():
    """§4.7: response.start precedes everything; sends and replays before it are rejected."""
    s = OrderedStream("r1")
    for call in (lambda: s.delta(b"a"), lambda: s.delta(b""), s.cancel, lambda: s.replay(None)):
        with pytest.raises(IllegalTransition):
            call()
    assert s.state == "NEW" and s.get(timeout=0) is None


@pytest.mark.parametrize(
    "call, exc, text",
    [
        (lambda s: s.delta("text"), TypeError, "must be bytes"),
        (lambda s: s.complete("done"), ValueError, "unknown finish_reason 'done'"),
        (lambda s: s.complete("cancelled"), ValueError, "through cancel"),
        (lambda s: s.fail(FinishReason.CANCELLED), ValueError, "through cancel"),
        (lambda s: s.replay("3"), TypeError, "after_seq"),
    ],
)
def test_bad_input_is_a_clear_error(call, exc, text):
    """§4.7/§4.10: wrong types and reasons outside the ten are refused with a precise message."""
    s = started()
    with pytest.raises(exc, match=text):
        call(s)
    assert s.state == "OPEN" and len(s.events) == 1


@pytest.mark.parametrize(
    "kw, exc, text",
    [
        ({"policy": "drop"}, ValueError, "unknown backpressure policy 'drop'"),
        ({"max_events": 0}, ValueError, "max_events must be at least 1"),
        ({"max_bytes": 1.5}, TypeError, "max_bytes must be an int"),
        ({"pause_timeout_s": -1}, ValueError, "pause_timeout_s"),
    ],
)
def test_bad_configuration_is_refused(kw, exc, text):
    """§4.8: a policy outside the three or a non-positive cap is refused at construction."""
    with pytest.raises(exc, match=text):
        OrderedStream("r1", **kw)


# ---- §4.7 rules 4 and 5: replay, dedup, disconnect ---------------------------------------------


def test_replay_returns_exactly_the_missed_events_and_counts_them_read():
    """§4.7 rule 4: replay(k) gives every retained event with seq > k, terminal included; the live
    reader then continues after them."""
    s = started()
    for b in (b"a", b"b", b"c"):
        s.delta(b)
    assert [e.seq for e in drain(s)] == [None, 0, 1, 2]  # all read, still retained
    s.delta(b"d")
    s.complete("eos")
    assert [(e.seq, e.data) for e in s.replay(1)] == [(2, b"c"), (3, b"d"), (4, b"")]
    assert [e.kind for e in s.replay(None)][0] == "start" and len(s.replay(None)) == 6
    assert s.replay(4) == [] and s.get(timeout=0) is None
    assert s.unread == (0, 0)


def test_deduper_merges_a_replay_with_a_live_read():
    """§4.7 rule 4: a client merging a replay with what it already showed keeps each seq once."""
    s = started()
    shown = Deduper()
    out = bytearray()
    for b in (b"he", b"ll", b"o"):
        s.delta(b)
    for ev in drain(s)[:3]:  # start, 0, 1 shown before the connection dropped
        if shown.accept_event(ev):
            out += ev.data
    s.disconnect()
    s.delta(b"!")
    s.complete("eos")
    s.reconnect()
    for ev in s.replay(-1):  # the client asks from the start of the deltas: 0 and 1 are duplicates
        if shown.accept_event(ev):
            out += ev.data
    assert bytes(out) == b"hello!"
    assert not shown.accept("r1", 0) and shown.accept("r2", 0)


def test_disconnect_is_a_transport_fact_not_an_end():
    """§4.7 rule 5 (DECISIONS D5): a disconnect is traced, is not EOS and does not end the stream."""
    trace = Trace("r1")
    s = started(trace=trace)
    s.disconnect()
    assert not s.connected and s.state == "OPEN" and not s.closed
    assert s.delta(b"x") == 0
    s.reconnect()
    assert s.connected
    kinds = [(e.kind, dict(e.data)) for e in trace if e.kind == EventKind.TRANSPORT]
    assert kinds == [(EventKind.TRANSPORT, {"what": "disconnect"}), (EventKind.TRANSPORT, {"what": "reconnect"})]


# ---- §4.8: the three policies ------------------------------------------------------------------


def test_pause_blocks_the_producer_thread_until_the_reader_drains():
    """§4.8 policy 1: at the cap the producer waits (state PAUSED) and resumes when the reader reads;
    unread deltas never exceed the cap and every byte arrives in order."""
    s = started(policy="pause", max_events=2)
    sent: list[int] = []
    done = threading.Event()

    def produce() -> None:
        for i in range(8):
            sent.append(s.delta(bytes([65 + i])))
        s.complete("max_output_tokens")
        done.set()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    assert wait_until(s.would_block)
    time.sleep(0.02)  # give a broken stream time to let the producer run past the cap
    assert sent == [0, 1] and producer.is_alive() and not done.is_set()
    assert s.unread == (2, 2) and not s.writable
    got = []
    while True:
        ev = s.get(timeout=WAIT)
        assert ev is not None, "reader starved"
        assert s.unread[0] <= 2
        got.append(ev)
        if ev.terminal:
            break
    assert done.wait(WAIT)
    assert b"".join(e.data for e in got) == b"ABCDEFGH"
    assert [e.seq for e in got[1:]] == list(range(9)) and sent == list(range(8))


def test_paused_s_counts_only_the_time_the_producer_waited_for_its_reader():
    """§4.8: `paused_s` (TIMINGS' send_s) is the time a pause-policy producer spent waiting; a
    send that fits waits for nothing and adds nothing."""
    s = started(policy="pause", max_events=2)
    s.delta(b"A")
    assert s.paused_s == 0.0
    producer = threading.Thread(target=lambda: s.delta(b"B") and s.delta(b"C"), daemon=True)
    producer.start()
    assert wait_until(s.would_block)
    time.sleep(0.1)  # the producer stays paused until the reader reads
    while s.get(timeout=0) is not None:
        pass
    producer.join(WAIT)
    assert not producer.is_alive()
    assert 0.09 <= s.paused_s < WAIT


def test_pause_byte_cap_holds_unread_bytes_under_max_bytes():
    """§4.8: under pause, a delta that would pass max_bytes waits, so unread bytes stay within it."""
    s = started(policy="pause", max_bytes=4, pause_timeout_s=0)
    s.delta(b"abc")
    assert s.writable and s.unread == (1, 3)
    with pytest.raises(StreamOverflow):  # 3 + 2 > 4 and nobody reads within 0 s
        s.delta(b"de")
    assert s.unread[1] <= 4 and s.state == "FAILED"


def test_pause_accepts_a_lone_oversized_delta():
    """§4.8: a delta larger than max_bytes goes out when nothing is unread (waiting cannot help)."""
    s = started(policy="pause", max_bytes=2)
    assert s.delta(b"abcdef") == 0
    assert s.would_block()
    assert drain(s)[-1].data == b"abcdef" and s.writable


def test_pause_timeout_fails_with_transport_error():
    """§4.8 policy 3 / DECISIONS D5: a producer parked past pause_timeout_s fails the stream with
    transport_error and gets StreamOverflow; the parked delta is not claimed as sent."""
    s = started(policy="pause", max_events=1, pause_timeout_s=0.05)
    s.delta(b"a")
    t0 = time.monotonic()
    with pytest.raises(StreamOverflow) as info:
        s.delta(b"b")
    assert time.monotonic() - t0 >= 0.04
    assert info.value.finish_reason is FinishReason.TRANSPORT_ERROR and info.value.seq == 1
    evs = drain(s)
    assert [e.kind for e in evs] == ["start", "delta", "failed"]
    assert evs[-1].finish_reason is FinishReason.TRANSPORT_ERROR and "stalled" in evs[-1].error


def test_terminal_fits_past_the_cap_while_paused():
    """§4.8 (DECISIONS D6): the terminal event has a reserved slot, so a full paused stream ends."""
    s = started(policy="pause", max_events=1)
    s.delta(b"a")
    assert s.would_block()
    assert s.complete("eos") == 1
    assert [e.kind for e in drain(s)] == ["start", "delta", "completed"]


def test_cancel_from_another_thread_wakes_a_paused_producer():
    """§4.9/§4.8: a cancel while the producer waits ends the stream; the producer's delta is then
    rejected by the table (nothing after the terminal event)."""
    s = started(policy="pause", max_events=1)
    s.delta(b"a")
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            s.delta(b"b")
        except IllegalTransition as exc:
            errors.append(exc)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    time.sleep(0.02)
    assert producer.is_alive()
    s.cancel()
    producer.join(WAIT)
    assert not producer.is_alive() and len(errors) == 1
    assert [e.kind for e in drain(s)] == ["start", "delta", "cancelled"]


@pytest.mark.parametrize(
    "policy, kw, chunks",
    [
        ("buffer", {"max_bytes": 5}, [b"ab", b"cd", b"e", b"f"]),
        ("fail", {"max_events": 3}, [b"a", b"b", b"c", b"d"]),
    ],
)
def test_overflow_fails_with_transport_error_and_drops_nothing(policy, kw, chunks):
    """§4.8 policies 2 and 3 (DECISIONS D6): past the cap the producer never waits, the stream ends
    failed(transport_error, "stream buffer overflow"), StreamOverflow is raised, and every delta
    accepted before it is still delivered: nothing is dropped, no completion is claimed."""
    trace = Trace("r1")
    s = started(policy=policy, trace=trace, usage_provider=lambda: {"selected_tokens": 9}, **kw)
    for c in chunks[:-1]:
        s.delta(c)
    with pytest.raises(StreamOverflow) as info:
        s.delta(chunks[-1])
    assert info.value.finish_reason is FinishReason.TRANSPORT_ERROR and info.value.seq == 3
    evs = drain(s)
    assert b"".join(e.data for e in evs) == b"".join(chunks[:-1])
    last = evs[-1]
    assert (last.kind, last.seq, last.finish_reason, last.error) == (
        "failed", 3, FinishReason.TRANSPORT_ERROR, OVERFLOW_ERROR)
    assert last.usage == {"selected_tokens": 9}
    assert sum(e.kind in ("completed", "cancelled", "failed") for e in evs) == 1
    assert trace.events[-1].kind == EventKind.RESPONSE_FAILED
    with pytest.raises(IllegalTransition):
        s.complete("eos")


@pytest.mark.parametrize(
    "policy, kw, chunks, fits",
    [
        ("buffer", {"max_bytes": 4}, [b"abc"], {1: True, 2: False}),
        ("fail", {"max_events": 2}, [b"a", b"b"], {1: False}),
        ("pause", {"max_events": 1}, [b"a"], {1: True, 100: True}),
    ],
)
def test_fits_predicts_an_overflow_without_changing_anything(policy, kw, chunks, fits):
    """§4.8 (DECISIONS D6): `fits(n)` says whether a delta of n bytes would be taken (pause always
    takes, it waits instead), so a producer can end its own lifecycle first; asking changes nothing."""
    s = started(policy=policy, **kw)
    for c in chunks:
        s.delta(c)
    before = (s.state, s.unread, len(s.events))
    assert {n: s.fits(n) for n in fits} == fits
    assert (s.state, s.unread, len(s.events)) == before


@pytest.mark.parametrize("policy", ["buffer", "fail"])
def test_slow_reader_never_blocks_buffer_or_fail(policy):
    """§4.8: buffer and fail never make the producer wait: a reader that reads nothing meets an
    overflow, never a hang, and unread memory stays within the caps until then."""
    s = started(policy=policy, max_events=16, max_bytes=64)
    with pytest.raises(StreamOverflow):
        for _ in range(1000):
            s.delta(b"abcd")
            events, nbytes = s.unread
            assert s.writable and (nbytes <= 64 if policy == "buffer" else events <= 16)


# ---- threads and asyncio -----------------------------------------------------------------------


def _readers_woken_per_loop_call(streams: list[OrderedStream], produce) -> tuple[list[bytes], list[int]]:
    """Asyncio readers of `streams`, each waiting, while `produce` runs on a thread; the events
    each reader got, and how many readers each of the loop's cross-thread calls woke."""
    calls: list[int] = []

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counted(callback, arg, *rest):
            calls.append(len(arg) if isinstance(arg, list) else 1)
            return plain(callback, arg, *rest)

        loop.call_soon_threadsafe = counted
        for st_ in streams:
            assert (await st_.aget()).kind == "start"

        async def read(st_: OrderedStream) -> bytes:
            return b"".join([ev.data or b"" async for ev in st_])

        readers = [asyncio.create_task(read(st_)) for st_ in streams]
        await asyncio.sleep(0.02)  # every reader is waiting
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        got = await asyncio.gather(*readers)
        producer.join(WAIT)
        return got

    return asyncio.run(asyncio.wait_for(main(), WAIT)), calls


def test_a_batch_of_writes_wakes_each_event_loop_once():
    """§4.7, D57: deltas written to many streams inside one `batched_wakes()` (the Engine's step)
    wake their waiting asyncio readers with one call into the loop, not one per delta; every
    byte still arrives in order."""
    streams = [started(max_events=64) for _ in range(8)]

    def produce() -> None:
        for token in range(3):
            with batched_wakes():
                for i, st_ in enumerate(streams):
                    st_.delta(bytes([65 + i, 48 + token]))
            time.sleep(0.01)
        with batched_wakes():
            for st_ in streams:
                st_.complete("eos")

    got, calls = _readers_woken_per_loop_call(streams, produce)
    assert got == [bytes([65 + i, 48, 65 + i, 49, 65 + i, 50]) for i in range(8)]
    assert calls and max(calls) == 8 and len(calls) <= 4  # a step's readers in one call (4 steps)


def test_a_paused_producer_inside_a_batch_wakes_its_reader_before_it_waits():
    """§4.8, D57: a producer that must wait for its reader (pause policy, buffer full) inside an
    open batch sends the batch's wake-ups first: the reader drains and the producer goes on (a
    deferred wake-up would leave both waiting)."""
    s = started(policy="pause", max_events=2, pause_timeout_s=WAIT)

    def produce() -> None:
        with batched_wakes():
            for i in range(10):
                s.delta(bytes([48 + i]))
            s.complete("eos")

    got, _ = _readers_woken_per_loop_call([s], produce)
    assert got == [b"0123456789"]


@pytest.mark.parametrize("max_events, deltas", [(256, 40), (8, 40)])
def test_a_whole_answer_reader_is_woken_at_the_end_or_at_half_a_cap_never_per_delta(max_events, deltas):
    """§4.7, §4.8, D61: a reader of the whole answer (`abatch`, a response that is not streamed) is
    woken when the stream ends, or when the unread deltas reach half a cap, so a pause-policy
    producer goes on without waiting for it; it gets every byte in order, in a few batches."""
    s = started(policy="pause", max_events=max_events, pause_timeout_s=WAIT)
    calls: list[int] = []

    async def main() -> list[list[StreamEvent]]:
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counted(callback, *args):
            calls.append(1)
            return plain(callback, *args)

        loop.call_soon_threadsafe = counted
        reader = s.reader()

        def produce() -> None:
            for i in range(deltas):
                s.delta(bytes([48 + i % 10]))
            s.complete("eos")

        async def read() -> list[list[StreamEvent]]:
            batches = []
            while got := await reader.abatch():
                batches.append(got)
            return batches

        task = asyncio.create_task(read())
        await asyncio.sleep(0.02)  # the reader waits
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        batches = await task
        producer.join(WAIT)
        return batches

    batches = asyncio.run(asyncio.wait_for(main(), WAIT))
    events = [ev for batch in batches for ev in batch]
    assert [ev.kind for ev in events] == ["start"] + ["delta"] * deltas + ["completed"]
    assert b"".join(ev.data for ev in events if ev.kind == "delta") == bytes(48 + i % 10 for i in range(deltas))
    if max_events > deltas:  # a cap past the whole answer: the producer never waited
        assert s.paused_s == 0.0
    assert len(calls) <= (1 if max_events > deltas else deltas // (max_events // 2) + 2)


def test_threaded_producer_and_reader_see_every_byte_in_order():
    """§4.7 rule 2: with a producer thread and a reader thread, order is by seq and nothing is lost."""
    s = started(policy="pause", max_events=3, max_bytes=16)
    payload = [bytes([i % 251]) * (1 + i % 5) for i in range(500)]

    def produce() -> None:
        for p in payload:
            s.delta(p)
        s.complete("eos")

    got: list[StreamEvent] = []
    reader = threading.Thread(target=lambda: got.extend(s), daemon=True)
    producer = threading.Thread(target=produce, daemon=True)
    reader.start()
    producer.start()
    producer.join(WAIT)
    reader.join(WAIT)
    assert not producer.is_alive() and not reader.is_alive()
    assert [e.seq for e in got] == [None, *range(501)]
    assert b"".join(e.data for e in got) == b"".join(payload)


def test_asyncio_reader_gets_everything_without_blocking_the_loop():
    """§4.7: an asyncio reader awaits events from a producer thread; the loop stays free meanwhile
    and a cancelled aget() loses no event."""
    s = started(policy="pause", max_events=2)

    async def main() -> tuple[list[StreamEvent], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        tick = asyncio.create_task(ticker())
        early = asyncio.create_task(s.aget())
        assert (await early).kind == "start"
        lost = asyncio.create_task(s.aget())
        await asyncio.sleep(0.01)
        lost.cancel()  # cancelled while waiting: must not swallow the first delta

        def produce() -> None:
            time.sleep(0.05)
            for i in range(20):
                s.delta(str(i).encode())
            s.complete("eos")

        threading.Thread(target=produce, daemon=True).start()
        got = [ev async for ev in s]
        tick.cancel()
        return got, ticks

    got, ticks = asyncio.run(asyncio.wait_for(main(), WAIT))
    assert [e.seq for e in got] == list(range(21))
    assert b"".join(e.data for e in got) == b"".join(str(i).encode() for i in range(20))
    assert ticks >= 10  # the loop ran while the reader waited for the producer


# ---- Hypothesis: random single-threaded interleavings -------------------------------------------


class StreamMachine(RuleBasedStateMachine):
    """§4.7/§4.8: random producer and reader steps against a model of the protocol and the caps."""

    @initialize(
        policy=st.sampled_from(list(BackpressurePolicy)),
        max_events=st.integers(1, 4),
        max_bytes=st.integers(1, 8),
    )
    def setup(self, policy, max_events, max_bytes):
        self.s = OrderedStream("r1", policy=policy, max_events=max_events, max_bytes=max_bytes,
                               pause_timeout_s=0)
        self.policy, self.max_events, self.max_bytes = policy, max_events, max_bytes
        self.started = False
        self.log: list[tuple[str, int | None, bytes]] = []  # model of the retained log
        self.cursor = 0
        self.accepted = bytearray()
        self.largest = 0

    def unread_deltas(self) -> list[bytes]:
        return [d for k, _, d in self.log[self.cursor:] if k == "delta"]

    def ended(self) -> bool:
        return any(k not in ("start", "delta") for k, _, _ in self.log)

    def next_seq(self) -> int:
        return sum(k != "start" for k, _, _ in self.log)

    @rule(model=st.text(max_size=3))
    def start(self, model):
        if self.started:
            with pytest.raises(IllegalTransition):
                self.s.start(model)
        else:
            self.s.start(model)
            self.started = True
            self.log.append(("start", None, b""))

    @rule(data=st.binary(max_size=6))
    def delta(self, data):
        if not self.started or self.ended():
            with pytest.raises(IllegalTransition):
                self.s.delta(data)
            return
        if not data:
            assert self.s.delta(data) is None
            return
        unread = self.unread_deltas()
        n, nbytes = len(unread), sum(map(len, unread))
        if self.policy == "pause":
            room = n < self.max_events and (n == 0 or nbytes + len(data) <= self.max_bytes)
        elif self.policy == "buffer":
            room = nbytes + len(data) <= self.max_bytes
        else:
            room = n < self.max_events
        assert self.s.fits(len(data)) == (room or self.policy == "pause")
        seq = self.next_seq()
        if room:
            assert self.s.delta(data) == seq
            self.log.append(("delta", seq, data))
            self.accepted += data
            self.largest = max(self.largest, len(data))
        else:
            with pytest.raises(StreamOverflow):
                self.s.delta(data)
            self.log.append(("failed", seq, b""))

    @rule(end=st.sampled_from(["complete", "cancel", "fail"]))
    def finish(self, end):
        call = {"complete": lambda: self.s.complete("eos"), "cancel": self.s.cancel,
                "fail": lambda: self.s.fail("model_error", error="boom")}[end]
        if not self.started or self.ended():
            with pytest.raises(IllegalTransition):
                call()
            return
        seq = self.next_seq()
        assert call() == seq
        self.log.append(({"complete": "completed", "cancel": "cancelled", "fail": "failed"}[end], seq, b""))

    @rule()
    def read(self):
        ev = self.s.get(timeout=0)
        if self.cursor < len(self.log):
            kind, seq, data = self.log[self.cursor]
            assert ev is not None and (ev.kind, ev.seq, ev.data) == (kind, seq, data)
            self.cursor += 1
        else:
            assert ev is None

    @rule(after=st.one_of(st.none(), st.integers(-1, 8)))
    def replay(self, after):
        if not self.started:
            with pytest.raises(IllegalTransition):
                self.s.replay(after)
            return
        got = [(e.kind, e.seq, e.data) for e in self.s.replay(after)]
        want = [x for x in self.log if after is None or (x[1] is not None and x[1] > after)]
        assert got == want
        self.cursor = len(self.log)

    @invariant()
    def seq_contiguous_and_one_terminal_last(self):
        evs = self.s.events if self.started else []
        seqs = [e.seq for e in evs[1:]]
        assert seqs == list(range(len(seqs)))
        terminals = [i for i, e in enumerate(evs) if e.terminal]
        assert terminals in ([], [len(evs) - 1])
        assert self.s.closed == bool(terminals)

    @invariant()
    def no_silent_drop(self):
        if self.started:
            assert b"".join(e.data for e in self.s.events) == bytes(self.accepted)

    @invariant()
    def buffer_bounded(self):
        n, nbytes = self.s.unread
        assert (n, nbytes) == (len(self.unread_deltas()), sum(map(len, self.unread_deltas())))
        if self.policy in ("pause", "fail"):
            assert n <= self.max_events
        if self.policy == "buffer":
            assert nbytes <= self.max_bytes
        if self.policy == "pause":
            assert nbytes <= max(self.max_bytes, self.largest)


TestStreamMachine = StreamMachine.TestCase
TestStreamMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


# ---- the inline reader's deliver() (the per-token hot path) -------------------------------------


def _inline_by_delta(s: OrderedStream, chunks: list[bytes]) -> list:
    seqs = []
    for c in chunks:
        seqs.append(s.delta(c))
        drain(s)
    return seqs


@pytest.mark.parametrize(
    "kw",
    [
        {"policy": "pause"},
        {"policy": "pause", "max_events": 1},  # delta() blocks after each delta: deliver falls back
        {"policy": "pause", "max_bytes": 3},  # a delta of 3+ bytes leaves no room: falls back too
        {"policy": "buffer", "max_bytes": 4},
        {"policy": "fail", "max_events": 1},
    ],
)
def test_deliver_is_delta_then_reading_everything(kw):
    """§4.7/§4.8: deliver() (generate() reads its own stream) leaves the same trace, seqs, replay
    log, stream state and unread counts as delta() followed by draining reads."""
    chunks = [b"a", b"bc", b"", b"def", b"g"]
    (ta, tb) = Trace("r1"), Trace("r1")
    a, b = started(trace=ta, **kw), started(trace=tb, **kw)
    want = _inline_by_delta(a, chunks)
    got = [b.deliver(c) for c in chunks]
    assert got == want == [0, 1, None, 2, 3]
    a.complete("stop_sequence"), b.complete("stop_sequence")
    assert [(e.kind, dict(e.data)) for e in tb] == [(e.kind, dict(e.data)) for e in ta]
    assert b.replay() == a.replay() and b.state == a.state and b.unread == a.unread == (0, 0)


def test_deliver_overflowing_a_buffer_fails_like_delta():
    """§4.8, D6: a delta past the buffer cap fails the stream with transport_error on either path."""
    s = started(policy="buffer", max_bytes=2)
    with pytest.raises(StreamOverflow):
        s.deliver(b"abc")
    assert s.closed and drain(s)[-1].finish_reason is FinishReason.TRANSPORT_ERROR


def test_deliver_takes_earlier_unread_events_with_it():
    """Whatever was unread (start, deltas sent with delta()) counts as read after deliver()."""
    s = started(policy="pause", max_events=4)
    s.delta(b"x")
    assert s.deliver(b"y") == 1
    assert s.unread == (0, 0) and s.get(timeout=0) is None
    assert [ev.data for ev in s.replay(-1)] == [b"x", b"y"]


def test_would_wait_tells_the_producer_when_a_pause_send_would_block():
    """§4.8 pause: would_wait(headroom) is True once unread bytes plus the headroom pass the cap or
    the stream is paused; buffer and fail never wait."""
    s = started(policy="pause", max_events=2, max_bytes=10)
    assert not s.would_wait(100)  # nothing unread: a lone delta never waits
    s.delta(b"abcd")
    assert not s.would_wait(6) and s.would_wait(7)
    s.delta(b"e")  # the event cap: the stream pauses
    assert s.would_block() and s.would_wait(0)
    drain(s)
    assert not s.would_wait(6)
    assert not started(policy="buffer", max_bytes=1).would_wait(100)
