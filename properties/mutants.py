"""Seeded runtime bugs: the seven failures of §4.12 plus two more, each a switchable mutation.

A Mutant patches the reference runtime only inside its `active()` context (tests and the mutant
matrix use it; nothing activates it in normal runs). `run_matrix()` runs every scenario under each
mutant, checks every trace with check_trace, and reports which invariants caught it: the test of
the matrix asserts that each mutant is caught by the invariant that names its failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import attrs

from ..runtime.backpressure import BufferCaps
from ..runtime.events import Event, EventKind
from ..runtime.faults import Fault, FaultPlan
from ..runtime.loop import generate
from ..runtime.models import ScriptedModel
from ..runtime.request import Request
from ..runtime.runner import RequestRun
from ..runtime.stop import StopKind, StopMatcher
from ..runtime.stream import OrderedStream
from ..runtime.stream_events import Deduper
from ..runtime.tokenizers import ByteTableTokenizer
from .monitors import check_trace

EOS = 2
TABLE = {1: b"> ", EOS: b"</s>", 10: b"ab", 11: b"c", 12: b"d", 13: b"e", 101: b"AB", 102: b"CD"}


def _tokenizer() -> ByteTableTokenizer:
    return ByteTableTokenizer(TABLE, eos_id=EOS)


def _gen(script: list[int], faults: Sequence[Fault] = (), read_inline: bool = True, **req: Any) -> list[Event]:
    model = ScriptedModel(script, vocab_size=128)
    res = generate(Request([1], **req), model=model, tokenizer=_tokenizer(), faults=FaultPlan(faults),
                   read_inline=read_inline)
    return list(res.events)


def _replay_client_view() -> list[Event]:
    """A client reads two deltas, drops, reconnects and merges the replay with what it had (§4.7 rule 4).

    Returns what the client shows, as delta events (a partial trace: the client's view only).
    """
    stream = OrderedStream("replay-client", policy="buffer")
    stream.start("scripted")
    for chunk in (b"ab", b"c", b"d", b"e"):
        stream.delta(chunk)
    stream.complete("max_output_tokens", {})
    live = [stream.get(timeout=0) for _ in range(3)]  # start, seq 0, seq 1
    replay = stream.replay(after_seq=0)  # the reconnect overlaps: it asks from before seq 1
    dedup = Deduper()
    shown = [ev for ev in live + replay if ev is not None and ev.kind == "delta" and dedup.accept_event(ev)]
    return [
        Event(EventKind.RESPONSE_DELTA, ev.request_id, i, 0.0, {"seq": ev.seq, "bytes": ev.data})
        for i, ev in enumerate(shown)
    ]


# Each scenario exercises one part of §4.3-§4.10; together they touch every mutated path.
SCENARIOS: dict[str, Callable[[], list[Event]]] = {
    "eos": lambda: _gen([10, EOS, 11], max_output_tokens=4),
    "cross_token_stop": lambda: _gen([101, 102, 13], stop=["BCD"], max_output_tokens=4),
    "length": lambda: _gen([10, 11, 12], max_output_tokens=3),
    "cancel_racing_completion": lambda: _gen(
        [10, 11, 12], [Fault("token.selected", 3, "cancel")], max_output_tokens=3
    ),
    "cancel_in_flight": lambda: _gen([10, 11, 12, 13], [Fault("decode.started", 2, "cancel")], max_output_tokens=4),
    "slow_reader_fail_policy": lambda: _gen(
        [10, 11, 12, 13], read_inline=False, policy="fail", max_buffer_events=2, max_output_tokens=4
    ),
    "disconnect": lambda: _gen([10, 11, 12, 13], [Fault("response.delta", 0, "disconnect")], max_output_tokens=4),
    "deadline": lambda: _gen([10, 11, 12, 13], [Fault("token.selected", 1, "deadline")], max_output_tokens=4),
    "replay_client_view": _replay_client_view,
}


@attrs.frozen
class Mutant:
    """A seeded bug: `patches()` yields while the runtime carries it."""

    name: str
    failure: str  # the row of §4.12 (or the section) it reproduces
    anchor: str
    catchers: tuple[str, ...]  # the invariants that name this failure (one must fire)
    patches: Callable[[], contextlib.AbstractContextManager[None]] = attrs.field(repr=False)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self.patches():
            yield


def _patch(target: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]):
    return mock.patch.object(target, name, make(getattr(target, name)))


@contextlib.contextmanager
def _eos_as_text() -> Iterator[None]:
    """§4.12 row 1: EOS goes to the ordinary detokenizer and is shown."""

    def init(orig):
        def wrapped(self, *a, **kw):
            orig(self, *a, **kw)
            self.eos_id, self.eos_ids = None, frozenset()

        return wrapped

    with _patch(RequestRun, "__init__", init):
        yield


class _OneTokenStopMatcher(StopMatcher):
    """§4.12 row 2: each push is matched on its own; nothing is held across tokens."""

    def push(self, data: bytes):
        for stop in self.stops:
            s = stop.encode() if isinstance(stop, str) else stop
            at = data.find(s)
            if at >= 0:
                self._one_hit = True
                return data[:at], _FakeHit(stop)
        return data, None

    @property
    def hit(self):
        return _FakeHit(self.stops[0]) if getattr(self, "_one_hit", False) else None

    def flush(self) -> bytes:
        return b""

    def discard_from_first_match(self) -> None:
        pass


@attrs.frozen
class _FakeHit:
    stop: str | bytes
    rule_version: int = 1
    index: int = 0
    start: int = 0
    end: int = 0
    kind: StopKind = StopKind.STRING


@contextlib.contextmanager
def _stop_one_token() -> Iterator[None]:
    with mock.patch("decodespec.runtime.runner.StopMatcher", _OneTokenStopMatcher):
        yield


@contextlib.contextmanager
def _written_before_decode() -> Iterator[None]:
    """§4.12 row 3: the selected token is marked written to the cache before decode_one runs."""

    def select(orig):
        def wrapped(self):
            go_on = orig(self)
            if go_on:
                self.trace.emit(EventKind.DECODE_COMPLETED, step=len(self.tokens), cache_len=self.cache.length + 1)
            return go_on

        return wrapped

    with _patch(RequestRun, "select", select):
        yield


@contextlib.contextmanager
def _racing_terminals() -> Iterator[None]:
    """§4.12 row 4: completion and a late cancel both write a terminal event."""

    def fire(orig):
        def wrapped(self, event, **kw):
            ended = self.done
            action = orig(self, event, **kw)
            if not ended and self.done and self._cancel_requested and self.state != "CANCELLED":
                self.trace.emit(EventKind.RESPONSE_CANCELLED, seq=self.stream.next_seq, finish_reason="cancelled",
                                usage=self.usage().as_dict())
            return action

        return wrapped

    with _patch(RequestRun, "fire", fire):
        yield


@contextlib.contextmanager
def _unbounded_buffer() -> Iterator[None]:
    """§4.12 row 5: the stream never enforces its cap."""
    with mock.patch.object(BufferCaps, "within_cap", lambda self, events, nbytes, size: True), \
         mock.patch.object(BufferCaps, "has_room", lambda self, events, nbytes, size: True):
        yield


@contextlib.contextmanager
def _disconnect_as_eos() -> Iterator[None]:
    """§4.12 row 6: a client disconnect is recorded as a model EOS (while the stream is
    disconnected: a reconnect would end the mutation)."""

    def check_point(orig):
        def wrapped(self):
            if not self.stream.connected and self.state == "DECODING":
                self.fire("eos")
                return False
            return orig(self)

        return wrapped

    with _patch(RequestRun, "check_point", check_point):
        yield


@contextlib.contextmanager
def _replay_without_dedup() -> Iterator[None]:
    """§4.12 row 7: a reconnect's replay is shown without (request_id, seq) dedup."""
    with mock.patch.object(Deduper, "accept", lambda self, rid, seq: True):
        yield


@contextlib.contextmanager
def _deadline_as_cancel() -> Iterator[None]:
    """§4.9: a deadline is reported as `cancelled`."""

    def check_point(orig):
        def wrapped(self):
            if self._deadline_forced and self.state == "DECODING":
                self.trace.emit(EventKind.DEADLINE_EXCEEDED)
                self.fire("cancel")
                return False
            return orig(self)

        return wrapped

    with _patch(RequestRun, "check_point", check_point):
        yield


@contextlib.contextmanager
def _double_release() -> Iterator[None]:
    """§4.10: the cache is released twice on the way out."""

    def fire(orig):
        def wrapped(self, event, **kw):
            ended = self.done
            action = orig(self, event, **kw)
            if not ended and self.done and self.ledger.state("kv_cache") != "UNACQUIRED":
                self.ledger.release("kv_cache")
            return action

        return wrapped

    with _patch(RequestRun, "fire", fire):
        yield


MUTANTS: tuple[Mutant, ...] = (
    Mutant("eos_shown_as_text", "EOS sent to the detokenizer and shown", "§4.12", ("eos_not_emitted",), _eos_as_text),
    Mutant("stop_one_token_only", "stop matcher looks at one token only", "§4.6",
           ("stop_bytes_never_emitted",), _stop_one_token),
    Mutant("written_before_decode", "token marked written to the cache before decode", "§4.2",
           ("decode_after_selected", "selected_minus_decoded_0_or_1"), _written_before_decode),
    Mutant("racing_terminals", "two terminal events race", "§4.1",
           ("single_terminal_event", "terminal_exclusive"), _racing_terminals),
    Mutant("unbounded_buffer", "backpressure buffer without a cap", "§4.8", ("stream_bounded",), _unbounded_buffer),
    Mutant("disconnect_as_eos", "a disconnect recorded as EOS", "§4.7", ("transport_not_eos",), _disconnect_as_eos),
    Mutant("replay_without_dedup", "reconnect replay without dedup", "§4.7",
           ("seq_strictly_increasing",), _replay_without_dedup),
    Mutant("deadline_as_cancelled", "a deadline reported as cancelled", "§4.9",
           ("deadline_not_cancelled",), _deadline_as_cancel),
    Mutant("double_release", "a resource released twice", "§4.10", ("release_exactly_once",), _double_release),
)


@attrs.frozen
class MatrixRow:
    mutant: Mutant
    caught_by: tuple[str, ...]  # every invariant that fired, sorted
    errors: tuple[str, ...]  # scenarios that crashed under the mutant (a crash is not a catch)

    @property
    def caught(self) -> bool:
        return any(name in self.caught_by for name in self.mutant.catchers)


# Scenarios whose events are a client's view of a stream, not a whole request trace: only the
# ordering invariants of §4.7 apply to them.
PARTIAL = {"replay_client_view": frozenset({"seq_strictly_increasing", "seq_contiguous"})}


def scenario_violations(name: str) -> set[str]:
    """The invariants scenario `name` violates on the runtime as it is now."""
    applies = PARTIAL.get(name)
    found = {v.invariant for v in check_trace(SCENARIOS[name](), complete=applies is None)}
    return found if applies is None else found & applies


def run_matrix(mutants: tuple[Mutant, ...] = MUTANTS) -> list[MatrixRow]:
    rows = []
    for m in mutants:
        fired: set[str] = set()
        errors: list[str] = []
        with m.active():
            for name in SCENARIOS:
                try:
                    fired.update(scenario_violations(name))
                except Exception as exc:  # recorded: a crash must not count as a catch
                    errors.append(f"{name}: {type(exc).__name__}: {exc}")
        rows.append(MatrixRow(m, tuple(sorted(fired)), tuple(errors)))
    return rows
