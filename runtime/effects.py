"""What a fired lifecycle row does to its run (§4.3, §4.7, §4.10): emitting, releasing, finishing.

A run's state (runner.RequestRun: the machines it holds and their states) fires its lifecycle
table; the row's effects (lifecycle.toml [actions]) run here, each implemented once (`LIFECYCLE`,
machine/actions.py, checked both ways against the table), over the run's `RunEffects`: the sends
of a delta, the echoed prompt and the drained tail, the stop hit's record, the terminal event and
the releases that end a request (transition_and_emit_terminal, §4.3).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..machine.actions import ActionError, Executor
from ..spec import FinishReason
from ..spec.derived import DriverStates
from .backpressure import OVERFLOW_ERROR, BackpressurePolicy, StreamOverflow
from .detokenizer import DecodingError, IncrementalDetokenizer
from .events import EventKind, Trace
from .faults import FaultHooks
from .ledger import ResourceLedger
from .request import Request
from .result import Usage
from .stop import StopHit, StopMatcher
from .stream import OrderedStream
from .utf8_guard import Utf8Guard

if TYPE_CHECKING:
    import torch

# After these reasons the detokenizer tail lies past the end of the output: it is discarded,
# finish() is not called (§4.3, DECISIONS D11). Every other reason drains with finish().
_DISCARD_TAIL = frozenset({FinishReason.STOP_SEQUENCE, FinishReason.CONTENT_INTERRUPTED})
# The OrderedStream call of each terminal stream event; the table says which terminal lifecycle
# state sends which (lifecycle.toml terminal_events, transition_and_emit_terminal of §4.3).
STREAM_SEND: dict[str, Callable[[OrderedStream, FinishReason, dict, str], int]] = {
    "complete": lambda s, reason, usage, err: s.complete(reason, usage),
    "cancel": lambda s, reason, usage, err: s.cancel(usage),
    "fail": lambda s, reason, usage, err: s.fail(reason, usage, err),
}


class Run(Protocol):
    """What the effects read and change of the run they act for (runner.RequestRun): its
    machines, what it has counted, and its `fire`."""

    request: Request
    trace: Trace
    stream: OrderedStream
    ledger: ResourceLedger
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    guard: Utf8Guard | None
    faults: FaultHooks
    cache: Any
    logits: torch.Tensor | None
    output: bytearray
    unsent: bytes  # released by the stop matcher, withheld by a partial stop-id match
    stop_hit: StopHit | None
    stop_kept: bool  # include_stop_str_in_output (D33)
    reason: FinishReason | None
    error: str
    put_delta: Callable[[bytes], int | None]  # the stream's delta, or deliver to an inline reader

    @property
    def state(self) -> str:
        """The lifecycle state's name."""

    @property
    def final_reason(self) -> FinishReason:
        """The reason a terminal row fixed."""

    @property
    def terminal_send(self) -> Mapping[str, Callable[[OrderedStream, FinishReason, dict, str], int]]:
        """The stream call of each terminal state."""

    def fire(self, event: str, **data: Any) -> str | None:
        """Fire a lifecycle event (its row's effects run here)."""

    def usage(self) -> Usage:
        """The usage counts so far (D7)."""

    def end_hold(self) -> None:
        """Close the stop matcher's holding interval."""

    def timings(self) -> dict[str, float]:
        """The TIMINGS fields."""

    def count_tail(self, n: int) -> None:
        """Count the detokenizer's tail of `n` bytes."""


class RunEffects:
    """What a fired row of one run's lifecycle does, and the sends on the way there (§4.3, §4.7,
    §4.10): a delta (emit_delta_if_nonempty), the echoed prompt (D33), the tail a draining run
    sends, the terminal event and the releases."""

    __slots__ = ("run", "listeners", "_echo", "_may_overflow", "_overflow")

    def __init__(self, run: Run, echo: bytes | None) -> None:
        self.run = run
        self.listeners: list[Callable[[bytes], None]] = []  # on_delta's: each sees every delta sent
        self._echo = echo  # the prompt's bytes, sent once as the output's first delta (D33)
        self._may_overflow = run.stream.policy is not BackpressurePolicy.PAUSE  # pause waits instead (§4.8)
        self._overflow = False  # the terminal event is the stream's overflow (D6)

    def plain(self) -> bool:
        """Would `send` only pass the delta on? No content policy, no fault to inject, no listener
        and the pause policy (whose stream never overflows, §4.8): the step then hands the delta
        to the stream itself."""
        run = self.run
        return (run.request.content_policy is None and not run.faults.active and not self._may_overflow
                and not self.listeners)

    def send(self, data: bytes) -> bool:
        """stream.emit_delta_if_nonempty (§4.3); a failed send ends the request (§4.10).

        Where the pause policy waits for the reader (§4.8), the stream counts the time itself
        (`paused_s`, the `send_s` of TIMINGS); the inline reader's `deliver` never waits.
        """
        if not data:
            return True
        run = self.run
        stream = run.stream
        if run.faults.active and run.faults.send_fails(stream.next_seq):
            return self.send_failed(stream.next_seq, "injected send failure")
        if self._may_overflow and not stream.fits(len(data)):
            return self.send_failed(stream.next_seq, OVERFLOW_ERROR, overflow=True)
        try:
            run.put_delta(data)
        except StreamOverflow as exc:  # a paused send waited past the stream's pause timeout (D5)
            return self.send_failed(exc.seq, str(exc))
        run.output += data
        for fn in self.listeners:
            fn(data)
        return True

    def send_failed(self, seq: int, why: str, overflow: bool = False) -> bool:
        """The send of delta `seq` failed (`why`): FAILED with transport_error (§4.10); False."""
        run = self.run
        run.error = f"transport_error: {why}"
        run.trace.emit(EventKind.TRANSPORT, what="send_failed", seq=seq)
        self._overflow = overflow
        run.fire("transport_error")
        return False

    def send_echo(self) -> bool:
        """The echoed prompt as the output's first delta, once (D33); False when its send failed."""
        echo, self._echo = self._echo, None
        return echo is None or self.send(echo)

    def record_hit(self, hit: StopHit) -> None:
        """stop.hit with the match's index and span (D3); the output ends at its start."""
        self.run.stop_hit = hit
        self.run.trace.emit(EventKind.STOP_HIT, stop=hit.stop, rule_version=hit.rule_version, kind=hit.kind.value,
                            index=hit.index, start=hit.start, end=hit.end)

    def safe_point(self) -> None:
        """discard_non_safe_stop_buffer (§4.3): held bytes are not safe and are never sent."""
        self.run.unsent = b""
        self.run.fire("safe_point")

    def drain(self) -> None:
        """DRAINING (§4.3, after the loop): the echo if still unsent, then the detokenizer's tail
        through the stop matcher, then the one terminal; an output that ended at a cut drops it."""
        run = self.run
        if not self.send_echo():  # ended before its prefill (a deadline in the queue): the output
            return  # still opens with the prompt's bytes (D33)
        detok, stopper = run.detok, run.stopper
        if run.reason in _DISCARD_TAIL or run.stop_hit is not None:  # the output ended at a cut
            detok.discard_pending_after_stop()
            if stopper.hit is not None:
                stopper.discard_from_first_match()
            run.unsent = b""
            run.fire("complete")
            return
        tail = self._tail()
        if tail is None:
            return
        unsent, run.unsent = run.unsent, b""  # already through the stop matcher: final now
        if not self._drained(unsent):
            return
        safe, hit = stopper.push(tail) if tail else (b"", None)
        if hit is not None and run.stop_kept:
            safe += hit.own_bytes
        if not self._drained(safe):
            return
        if hit is not None:
            self.record_hit(hit)
            run.fire("stop_hit")
            stopper.discard_from_first_match()
        elif not self._drained(stopper.flush()):
            return
        run.fire("complete")

    def _tail(self) -> bytes | None:
        """The detokenizer's tail, counted in the byte marks (D7); None when it failed (the run
        then ended with decoding_error)."""
        run = self.run
        detok = run.detok
        if run.guard is not None and detok.pending:
            # An end the sampler did not choose (a deadline, a grammar) cut a character short:
            # the guarded run drops the unfinished character instead of failing (D16).
            run.trace.emit(EventKind.DETOK_DROPPED, bytes=len(detok.pending))
            detok.discard_pending_after_stop()
            tail = b""
        else:
            try:
                tail = detok.finish()
            except DecodingError as exc:
                run.error = f"decoding_error: {exc}"
                run.fire("decode_error")
                return None
        run.count_tail(len(tail))
        return tail

    def _drained(self, data: bytes) -> bool:
        """Send a drained chunk; the content policy judges it first, as every chunk (D11, D23): a
        refused chunk is not sent, nor anything after it, and the request ends content_interrupted.
        False when the drain ends here."""
        run = self.run
        policy = run.request.content_policy
        if data and policy is not None and policy(bytes(run.output), data):
            run.fire("content_interrupt")
            run.fire("complete")
            return False
        return self.send(data)

    def free_of(self, kind: str) -> Callable[[], None] | None:
        """What releasing a model resource of `kind` frees: the run's KV cache for kv_cache (§4.10)."""
        if kind != "kv_cache":
            return None

        def free() -> None:
            if self.run.cache is not None:
                self.run.cache.free()

        return free


def endings(where: DriverStates) -> Mapping[str, Callable[[RunEffects], None]]:
    """What is left to do after the loop, by the state the loop ended in (§4.3, after `while true`):
    a cancel observed reaches its safe point; a draining run sends its tail and finishes."""
    return {**dict.fromkeys(where.cancel_observed, RunEffects.safe_point),
            **dict.fromkeys(where.draining, RunEffects.drain)}


# ---- the runtime's implementation of every lifecycle effect (machine/actions.py) -------------
# Each runs as (the run's effects, (state, event), the row's reason); RequestRun.fire runs them by phase.
LIFECYCLE = Executor("lifecycle", "the runtime (effects.RunEffects)")


@LIFECYCLE.effect("release_model")
def _release_model(fx: RunEffects, key: tuple[str, str], reason: FinishReason | None) -> None:
    ledger = fx.run.ledger
    for kind in ledger.model_kinds:
        if ledger.state(kind) == "HELD":
            ledger.release(kind)


@LIFECYCLE.effect("fix_reason")
def _fix_reason(fx: RunEffects, key: tuple[str, str], reason: FinishReason | None) -> None:
    fx.run.reason = reason


@LIFECYCLE.effect("observe_cancel")
def _cancel_observed(fx: RunEffects, key: tuple[str, str], reason: FinishReason | None) -> None:
    fx.run.trace.emit(EventKind.CANCEL_OBSERVED, state=key[0])


@LIFECYCLE.effect("emit_terminal")
def _emit_terminal(fx: RunEffects, key: tuple[str, str], reason: FinishReason | None) -> None:
    """The terminal state's stream event (an overflow's own, D6), then the stream resources (§4.10)."""
    run = fx.run
    run.end_hold()
    if fx._overflow:
        run.stream.overflow()
    if not run.stream.closed:
        send = run.terminal_send.get(run.state)
        if send is None:
            raise ActionError(f"lifecycle row {key}: emit_terminal in {run.state}, which is not a terminal state")
        send(run.stream, run.final_reason, run.usage().as_dict(), run.error)
    for kind in run.ledger.stream_kinds:
        run.ledger.release(kind)
    run.trace.emit(EventKind.TIMINGS, **run.timings())


@LIFECYCLE.effect("acquire_model")
def _acquire_model(fx: RunEffects, key: tuple[str, str], reason: FinishReason | None) -> None:
    for kind in fx.run.ledger.model_kinds:
        fx.run.ledger.acquire(kind, fx.free_of(kind))


@LIFECYCLE.effect("discard_result")
def _discard_result(fx: RunEffects, key: tuple[str, str], reason: FinishReason | None) -> None:
    fx.run.logits = None
