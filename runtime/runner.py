"""One request's execution state across the loop of §4.3, shared by generate() and the Engine.

A RequestRun is the request's state: the machines it holds and their states, and the step over
them. The lifecycle's control state is the run's compiled lifecycle table (a `Lifecycle`: the table
the caller gives, else the spec directory's): every transition is a `fire` of its event, and
firing a row runs its action's effects (lifecycle.toml [actions]) on the run's `RunEffects`
(runtime/effects.py: emitting, releasing, finishing), e.g. `fail` is release_model, fix_reason,
emit_terminal (§4.3, §4.10). Injected faults land through the run's `FaultHooks` (runtime/faults.py).
The drivers (runtime/loop.py for one request, runtime/engine.py for a batch) call the phase methods
in §4.3's order: admit, check_point, begin_prefill/end_prefill, select, begin_decode/end_decode,
finish. Every lifecycle event is fired from the driver's thread; other threads only *request* a
cancel (a flag observed at the safe points, §4.9).
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from ..machine import CompiledMachine, compiled_of, per_table
from ..machine.actions import Plan, run_phases
from ..spec import FinishReason, Spec, Table, default_spec, load_spec
from ..spec.derived import DriverStates, driver_states, terminal_stream_event
from .alignment import ScoreLog
from .backpressure import StreamOverflow
from .detokenizer import DecodingError, IncrementalDetokenizer
from .effects import LIFECYCLE, STREAM_SEND, RunEffects, endings
from .errors import ModelError, RequestError
from .events import EventKind, Trace
from .faults import FaultHooks, FaultPlan
from .finish import Composed, finish_checks, request_guard
from .ledger import ResourceLedger
from .request import Request
from .result import Result, Usage
from .sampling import Sampler, SamplingParams
from .stop import StopHit, StopMatcher, TokenStopMatcher
from .stream import OrderedStream
from .tokenizers import TokenizerError
from .utf8_guard import Utf8Guard, guard_for

_CONTENT_INTERRUPT = "content_interrupt"
_TOKEN_SELECTED = EventKind.TOKEN_SELECTED.value  # per-token entries carry the plain string (events.py)
_DECODE_STARTED = EventKind.DECODE_STARTED.value
_DECODE_COMPLETED = EventKind.DECODE_COMPLETED.value


# ---- the step of §4.3 in the order of the lifecycle table's [[step]] (DECISIONS D53) ----------
# RequestRun.check_point runs check_cancel_or_deadline, RequestRun.select every other phase; the
# functions of each order the loader accepts are below, written from runtime/stepgen.py.
# ---- written by `decodespec codegen` from runtime/stepgen.py: edit the phases there, not below ----

def _check_point_0(self: RequestRun) -> bool:
    """check_cancel_or_deadline (§4.3): True when the run may go on selecting. Its phases:
    observe_cancel, observe_deadline."""
    # observe_cancel (§4.9): a cancel requested by now is observed: nothing more is selected
    if self._cancel_requested:
        self._observe_cancel()
        return False
    # observe_deadline (§4.9): a deadline passed by now (or an injected one) ends the run
    if self._deadline_forced or (self.deadline_at is not None and self.clock() >= self.deadline_at):
        self.trace.emit(EventKind.DEADLINE_EXCEEDED)
        self.fire("deadline")
        return False
    return True


def _check_point_1(self: RequestRun) -> bool:
    """check_cancel_or_deadline (§4.3): True when the run may go on selecting. Its phases:
    observe_deadline, observe_cancel."""
    # observe_deadline (§4.9): a deadline passed by now (or an injected one) ends the run
    if self._deadline_forced or (self.deadline_at is not None and self.clock() >= self.deadline_at):
        self.trace.emit(EventKind.DEADLINE_EXCEEDED)
        self.fire("deadline")
        return False
    # observe_cancel (§4.9): a cancel requested by now is observed: nothing more is selected
    if self._cancel_requested:
        self._observe_cancel()
        return False
    return True


def _select_0(self: RequestRun, token: int | None = None) -> bool:
    """Choose y_t (or take `token`, chosen by the caller from this run's logits) and run every other
    phase of the step on it: True when y_t must be decoded next. Its phases: choose, consume,
    push_bytes, stop, finish_checks, emit, decode."""
    new = safe = b""
    hit: StopHit | None = None
    event: str | None = None
    # choose (§4.3): y_t: only tokens that keep the output valid UTF-8 (D16; greedy with a stop refuses only
    # the tokens that fail at once, D22); never an id the tokenizer cannot decode (D20). `token` given:
    # chosen by the caller from this run's logits (the Engine's one argmax over a greedy batch)
    guard = self.guard
    if guard is not None:
        remaining = Utf8Guard.UNBOUNDED if self.sampler.greedy and (
            self.request.stop or self.token_stopper is not None) else min(
            self.request.max_output_tokens - len(self.tokens), self.model.context_limit - self.cache.length) - 1
        logits = guard.restrict(self.step_logits, self.detok.held, remaining)
        if token is None or logits[token] == float("-inf"):
            token = self.sampler.choose(logits)
    elif self._undecodable is not None:
        if token is None or self._undecodable[token]:
            token = self.sampler.choose(self.step_logits.masked_fill(self._undecodable, float("-inf")))
    elif token is None:
        token = self.sampler.choose(self.step_logits)
    if self.scores is not None:
        self.scores.record(self.step_logits, token)
    # consume (§4.2): y_t recorded and fired as `select`; a guard that turns the check of a not-text token
    # off makes it a token like any other (D31)
    tokens = self.tokens
    tokens.append(token)
    t = len(tokens)
    if self.life.state not in self._select_quiet:
        self.fire("select")
    eos = token in self.eos_ids
    special = eos or token in self._not_text
    checked: int | None = token
    if special and self._guarded is not None and self._guarded(self, token, t):
        eos = special = False
        checked = None
    trace = self.trace
    trace.put((_TOKEN_SELECTED, trace.clock(), t, token, eos))
    # push_bytes (§4.5): EOS and a token check's ids are not text: no bytes (D4); usage counts a token's
    # bytes, held ones included, and a split character for each of its tokens (D7)
    marks = self._byte_marks
    if special:
        marks.append(marks[-1] if marks else 0)
    else:
        try:
            new = self._detok_push(token)
        except DecodingError as exc:
            self.error = f"decoding_error: {exc}"
            marks.append(marks[-1] if marks else 0)
            self.fire("decode_error")
            return False
        total = self._detok_total = self._detok_total + len(new)
        marks.append(total + self.detok.held_bytes)
    # stop (§4.6): the clock is read only when holding starts or ends; include_stop_str_in_output: the match
    # ends the output (D33)
    if not special:
        if new:
            safe, hit = self._stop_push(new)
            if self.stopper.held:
                if self._held_since is None:
                    self._held_since = self.clock()
            elif self._held_since is not None:
                self._t["stop_buffer"] += self.clock() - self._held_since
                self._held_since = None
        token_stopper = self.token_stopper
        if token_stopper is not None:
            safe, hit = self._token_stop(token_stopper, token, safe, hit)
        if hit is not None and self.stop_kept:
            safe += hit.own_bytes
    # finish_checks (§4.3): the table's finish checks in its order (runtime/finish.py, D4): the event of the
    # first that holds fires after the emit
    event = self._winner(self, eos, safe, hit, t, checked)
    # emit (§4.7): a chunk the content policy refused is never sent (D11); nothing to check: straight to the
    # stream
    if safe and event != _CONTENT_INTERRUPT:
        if self._plain_send:
            try:
                self.put_delta(safe)
            except StreamOverflow as exc:
                return self.effects.send_failed(exc.seq, str(exc))
            self.output += safe
        elif not self.effects.send(safe):
            return False
    # decode (§4.4): the output ends at a match whichever check fixes the reason; after an interruption
    # nothing is kept
    if hit is not None and event != _CONTENT_INTERRUPT:
        self.effects.record_hit(hit)
    if event is None:
        return True
    self.fire(event)
    return False


def _select_1(self: RequestRun, token: int | None = None) -> bool:
    """Choose y_t (or take `token`, chosen by the caller from this run's logits) and run every other
    phase of the step on it: True when y_t must be decoded next. Its phases: choose, consume,
    push_bytes, stop, emit, finish_checks, decode."""
    new = safe = b""
    hit: StopHit | None = None
    event: str | None = None
    # choose (§4.3): y_t: only tokens that keep the output valid UTF-8 (D16; greedy with a stop refuses only
    # the tokens that fail at once, D22); never an id the tokenizer cannot decode (D20). `token` given:
    # chosen by the caller from this run's logits (the Engine's one argmax over a greedy batch)
    guard = self.guard
    if guard is not None:
        remaining = Utf8Guard.UNBOUNDED if self.sampler.greedy and (
            self.request.stop or self.token_stopper is not None) else min(
            self.request.max_output_tokens - len(self.tokens), self.model.context_limit - self.cache.length) - 1
        logits = guard.restrict(self.step_logits, self.detok.held, remaining)
        if token is None or logits[token] == float("-inf"):
            token = self.sampler.choose(logits)
    elif self._undecodable is not None:
        if token is None or self._undecodable[token]:
            token = self.sampler.choose(self.step_logits.masked_fill(self._undecodable, float("-inf")))
    elif token is None:
        token = self.sampler.choose(self.step_logits)
    if self.scores is not None:
        self.scores.record(self.step_logits, token)
    # consume (§4.2): y_t recorded and fired as `select`; a guard that turns the check of a not-text token
    # off makes it a token like any other (D31)
    tokens = self.tokens
    tokens.append(token)
    t = len(tokens)
    if self.life.state not in self._select_quiet:
        self.fire("select")
    eos = token in self.eos_ids
    special = eos or token in self._not_text
    checked: int | None = token
    if special and self._guarded is not None and self._guarded(self, token, t):
        eos = special = False
        checked = None
    trace = self.trace
    trace.put((_TOKEN_SELECTED, trace.clock(), t, token, eos))
    # push_bytes (§4.5): EOS and a token check's ids are not text: no bytes (D4); usage counts a token's
    # bytes, held ones included, and a split character for each of its tokens (D7)
    marks = self._byte_marks
    if special:
        marks.append(marks[-1] if marks else 0)
    else:
        try:
            new = self._detok_push(token)
        except DecodingError as exc:
            self.error = f"decoding_error: {exc}"
            marks.append(marks[-1] if marks else 0)
            self.fire("decode_error")
            return False
        total = self._detok_total = self._detok_total + len(new)
        marks.append(total + self.detok.held_bytes)
    # stop (§4.6): the clock is read only when holding starts or ends; include_stop_str_in_output: the match
    # ends the output (D33)
    if not special:
        if new:
            safe, hit = self._stop_push(new)
            if self.stopper.held:
                if self._held_since is None:
                    self._held_since = self.clock()
            elif self._held_since is not None:
                self._t["stop_buffer"] += self.clock() - self._held_since
                self._held_since = None
        token_stopper = self.token_stopper
        if token_stopper is not None:
            safe, hit = self._token_stop(token_stopper, token, safe, hit)
        if hit is not None and self.stop_kept:
            safe += hit.own_bytes
    # emit (§4.7): a chunk the content policy refused is never sent (D11); nothing to check: straight to the
    # stream
    if safe and event != _CONTENT_INTERRUPT:
        if self._plain_send:
            try:
                self.put_delta(safe)
            except StreamOverflow as exc:
                return self.effects.send_failed(exc.seq, str(exc))
            self.output += safe
        elif not self.effects.send(safe):
            return False
    # finish_checks (§4.3): the table's finish checks in its order (runtime/finish.py, D4): the event of the
    # first that holds fires after the emit
    event = self._winner(self, eos, safe, hit, t, checked)
    # decode (§4.4): the output ends at a match whichever check fixes the reason; after an interruption
    # nothing is kept
    if hit is not None and event != _CONTENT_INTERRUPT:
        self.effects.record_hit(hit)
    if event is None:
        return True
    self.fire(event)
    return False


# Each order of the step's phases and its (check_point, select).
_STEPS: dict[tuple[str, ...], tuple[Callable[[RequestRun], bool], Callable[..., bool]]] = {
    ("observe_cancel", "observe_deadline", "choose", "consume", "push_bytes", "stop", "finish_checks", "emit",
     "decode"): (_check_point_0, _select_0),
    ("observe_cancel", "observe_deadline", "choose", "consume", "push_bytes", "stop", "emit", "finish_checks",
     "decode"): (_check_point_0, _select_1),
    ("observe_deadline", "observe_cancel", "choose", "consume", "push_bytes", "stop", "finish_checks", "emit",
     "decode"): (_check_point_1, _select_0),
    ("observe_deadline", "observe_cancel", "choose", "consume", "push_bytes", "stop", "emit", "finish_checks",
     "decode"): (_check_point_1, _select_1),
}


def _shipped_finish_checks(run: RequestRun, eos: bool, safe: bytes, hit: StopHit | None, t: int,
                           token: int | None) -> str | None:
    """The event of the first of the shipped lifecycle table's finish checks that holds, or None:
    runtime/finish.py's conditions inline, in the table's order: eos, tool_call, content_interrupt,
    stop_hit, length, context_full, grammar_done."""
    # eos (§4.6)
    if eos:
        return "eos"
    # tool_call (§4.3)
    if token in run.finish_ids["tool_call"]:
        return "tool_call"
    # content_interrupt (§4.10)
    if (run.request.content_policy is not None
            and safe != b""
            and run.request.content_policy(bytes(run.output), safe)):
        return "content_interrupt"
    # stop_hit (§4.6)
    if hit is not None:
        return "stop_hit"
    # length (§4.3)
    if t >= run.request.max_output_tokens:
        return "length"
    # context_full (§4.3)
    if run.cache.length + 1 >= run.model.context_limit:
        return "context_full"
    # grammar_done (§4.6)
    if run.request.grammar is not None and run.request.grammar.complete(run.consumed_text(safe)):
        return "grammar_done"
    return None


# The shipped table's finish checks as (event, token check?), in the order _shipped_finish_checks
# runs them.
_SHIPPED_CHECKS = (
    ("eos", False), ("tool_call", True), ("content_interrupt", False), ("stop_hit", False), ("length", False),
    ("context_full", False), ("grammar_done", False),
)


# ---- end of the code `decodespec codegen` writes ----


def _step_of(table: Table) -> tuple[Callable[[RequestRun], bool], Callable[..., bool]]:
    """(check_point, select) of `table`'s [[step]] order: the pair written above for it."""
    order = tuple(p.phase for p in table.step)
    if not order:
        raise RuntimeError(f"{table.source}: declares no [[step]]; the runtime runs the loop's step from it")
    step = _STEPS.get(order)
    if step is None:
        raise RuntimeError(f"{table.source}: no step runs the phases in the order {order}; after a change to "
                           "STEP_NEEDS or runtime/stepgen.PHASES run `decodespec codegen`")
    return step


def _winner_of(table: Table) -> Callable[..., str | None]:
    """`table`'s finish checks as one function: the one written above where its list is the shipped
    one, else its checks one by one (finish.Composed)."""
    checks = finish_checks(table.finish_checks)  # every listed check has its function, and each its entry
    if tuple((c.event, c.tokens) for c in table.finish_checks) == _SHIPPED_CHECKS:
        return _shipped_finish_checks
    return Composed(checks)


_CHECK_POINT, _SELECT = _step_of(load_spec("lifecycle"))  # RequestRun's; another table's: Lifecycle.run_type


class RequestRun:
    """One request's state (§4.2's StepState): the machines it holds (lifecycle, stream, ledger,
    detokenizer, stop matchers, sampler, trace) and their states, and the step of §4.3 over them.
    What a fired row does is its `effects` (effects.RunEffects); where faults land, its `faults`
    (faults.FaultHooks)."""

    # Slots: the per-token path reads a dozen of these per token, right after a model step has
    # pushed them out of the CPU caches; a slot is one fixed offset, a dict entry a probe.
    __slots__ = (
        "cache", "clock", "deadline_at", "decoded", "detok", "echo_len", "effects", "eos_id", "eos_ids", "error",
        "faults", "finish_ids", "guard", "ledger", "life", "lifecycle", "logits", "model", "output", "prompt_ids",
        "put_delta", "reason", "request", "sampler", "scores", "spec", "stop_hit", "stop_kept", "stopper", "stream",
        "token_stopper", "tokenizer", "tokens", "trace", "unsent",
        "_byte_marks", "_cancel_claimed", "_cancel_fired", "_cancel_lock", "_cancel_requested", "_created",
        "_deadline_forced", "_decode_s", "_detok_push", "_detok_total", "_done_quiet", "_guarded", "_held_since",
        "_inline", "_lock", "_not_text", "_plain_send", "_select_quiet", "_stop_push", "_t", "_t0", "_undecodable",
        "_winner",
    )

    def __new__(cls, *args: Any, spec: Spec | None = None, lifecycle: Table | None = None, **kwargs: Any) -> RequestRun:
        """A run of a lifecycle table (default: the spec's, else the spec directory's) whose [[step]]
        order is another than the class's is an instance of the subclass that runs that order
        (Lifecycle.run_type)."""
        table = lifecycle or (spec["lifecycle"] if spec is not None else None)
        return object.__new__(cls if table is None else lifecycle_of(table).run_type(cls))

    def __init__(
        self,
        request: Request,
        *,
        model: Any,
        tokenizer: Any,
        faults: FaultPlan | None = None,
        model_name: str = "",
        clock: Callable[[], float] = time.monotonic,
        pause_timeout_s: float | None = None,
        spec: Spec | None = None,
        lifecycle: Table | None = None,
    ) -> None:
        # the tables this run follows (§4.1-§4.8): `spec`'s, else the spec directory's; `lifecycle`
        # in place of the spec's lifecycle table
        spec = self.spec = spec or default_spec()
        lc = self.lifecycle = lifecycle_of(lifecycle or spec["lifecycle"])
        # read per token: a slot each, where the Lifecycle's attribute would be two lookups
        self._select_quiet, self._done_quiet = lc.select_quiet, lc.decode_done_quiet
        self.request, self.model, self.tokenizer, self.clock = request, model, tokenizer, clock
        rid = request.request_id
        self.trace = Trace(rid, clock)
        self.life = lc.machine.new()
        self.ledger = ResourceLedger(rid, trace=self.trace, table=spec["resources"])
        self.stream = OrderedStream(
            rid, policy=request.policy, max_events=request.max_buffer_events, max_bytes=request.max_buffer_bytes,
            pause_timeout_s=pause_timeout_s, usage_provider=lambda: self.usage().as_dict(), trace=self.trace,
            table=spec["stream"],
        )
        self.prompt_ids = _prompt_ids(request, tokenizer)
        self.eos_id: int | None = tokenizer.eos_id
        # Every id that ends the output (a checkpoint may list several, as Llama 3's does, §4.6).
        self.eos_ids: frozenset[int] = getattr(tokenizer, "eos_ids", None) or frozenset(
            () if self.eos_id is None else (self.eos_id,))
        self._hold_machines(request, model, tokenizer, spec)
        self._start_counts(request)
        self.faults = FaultHooks(faults or FaultPlan(), self, self.trace)
        # echo: the prompt's bytes, by the batch decode's rules (D12), are the output's first delta;
        # a prompt that ends inside a character is completed by the output's first bytes (D33).
        echo = (tokenizer.decode_bytes(self.prompt_ids, skip_special=request.skip_special_tokens)
                if request.echo else None)
        self.echo_len = len(echo) if echo else 0
        self.effects = RunEffects(self, echo)
        self._inline = False
        self.put_delta: Callable[[bytes], int | None] = self.stream.delta  # deliver() once the driver reads inline
        self._plain_send = self.effects.plain()
        self._winner = lc.winner
        self._guarded = request_guard(lc.table.finish_checks, lc.table.finish_guards, request)
        # event -> the ids of its token finish check, none where the request names none
        self.finish_ids = {**lc.token_checks, **dict(request.finish_tokens)}
        self._not_text = frozenset().union(*self.finish_ids.values())  # like EOS, never detokenized
        self.trace.emit(EventKind.REQUEST_CREATED, **_created_fields(self))
        self.ledger.acquire("trace_handle")
        self.ledger.acquire("stream_buffer")
        self.stream.start(model_name or getattr(model, "name", type(model).__name__))
        self.faults.start()  # what fired at request.created lands now that the stream has started

    def _hold_machines(self, request: Request, model: Any, tokenizer: Any, spec: Spec) -> None:
        """The machines a step runs a token through (§4.3-§4.6): detokenizer, UTF-8 guard, stop
        matchers, the mask of ids the tokenizer cannot decode, sampler; each bound method the
        per-token path calls, bound once."""
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=self.prompt_ids,
                                            skip_special=request.skip_special_tokens, table=spec["detokenizer"])
        self.guard = _guard(request, tokenizer, model.vocab_size, self.eos_ids)
        self.stopper = StopMatcher(request.stop, table=spec["stop_matcher"])
        self.token_stopper = (TokenStopMatcher(request.stop_token_ids, table=spec["stop_matcher"])
                              if request.stop_token_ids else None)
        self.stop_kept = request.include_stop_str_in_output  # a stop string's own bytes end the output
        # Ids the model may score but the tokenizer cannot decode are never chosen (D20); the
        # guard already refuses them.
        self._undecodable = None if self.guard is not None else undecodable_mask(
            tokenizer, model.vocab_size, getattr(model, "device", "cpu"))
        self.tokens: list[int] = []
        self.sampler = _sampler(request, model, self.eos_ids, self.tokens, self.prompt_ids)
        self._detok_push: Callable[[int], bytes] = self.detok.push
        self._stop_push = self.stopper.push

    def _start_counts(self, request: Request) -> None:
        """What the run counts and flags as it goes, at their start: output, byte marks (D7),
        scores (D59), reason and error, the cancel's progress (§4.9), timings (§4.12)."""
        self.cache: Any = None
        self.logits: torch.Tensor | None = None
        self.decoded = 0
        self.output = bytearray()
        self._byte_marks: list[int] = []  # output bytes through each token, held ones included (usage D7)
        self._detok_total = 0
        self.unsent = b""  # bytes the stop matcher released that a partial stop-id match withholds
        # Each selected token's (log-probability, top alternatives) when the request asks (D59).
        self.scores: ScoreLog | None = None if request.logprobs is None else ScoreLog(request.logprobs)
        self.reason: FinishReason | None = None
        self.error = ""
        self.stop_hit: StopHit | None = None
        self._cancel_requested = False  # set by any thread, observed by the driver (§4.9)
        self._cancel_claimed = False  # the one cancel() that logs the request has begun
        self._cancel_lock = threading.Lock()
        self._cancel_fired = False
        self._deadline_forced = False
        self._lock = threading.Lock()
        self._created = self.clock()
        self._t = {"queue": 0.0, "prefill": 0.0, "stop_buffer": 0.0}
        self._decode_s = 0.0  # the per-token sum of decode time, kept out of `_t` (a float add on the per-token path)
        self._held_since: float | None = None
        self.deadline_at = self._created + request.deadline_s if request.deadline_s is not None else None

    # ---- the lifecycle table -------------------------------------------------------------

    @property
    def state(self) -> str:
        return self.life.state.value

    @property
    def done(self) -> bool:
        return self.life.terminal

    @property
    def driver_states(self) -> DriverStates:
        """The states of this run's lifecycle table the drivers branch on (spec.derived.driver_states)."""
        return self.lifecycle.driver_states

    @property
    def terminal_send(self) -> Mapping[str, Callable[[OrderedStream, FinishReason, dict, str], int]]:
        """The stream call of each terminal state of this run's lifecycle table (emit_terminal)."""
        return self.lifecycle.terminal_send

    @property
    def final_reason(self) -> FinishReason:
        """The finish reason the lifecycle table fixed (fix_reason, §4.3, §4.10): every row into a
        terminal state fixes one, so a terminal run has it; asking before is an error."""
        reason = self.reason
        if reason is None:
            raise RuntimeError(f"request {self.request.request_id}: no finish reason fixed yet (state {self.state})")
        return reason

    @property
    def step_logits(self) -> torch.Tensor:
        """The logits this step chooses from: set by the prefill and each decode, present while
        the run selects (DECODING, §4.3); a discarded result (discard_result, §4.9) leaves none."""
        logits = self.logits
        if logits is None:
            raise RuntimeError(f"request {self.request.request_id}: no logits to choose from in {self.state}")
        return logits

    @property
    def decoding(self) -> bool:
        """In DECODING: the loop of §4.3 goes on selecting (the drivers ask once per token)."""
        return self.life.state is self.lifecycle.decoding

    def fire(self, event: str, **data: Any) -> str | None:
        """Fire a lifecycle event and run its row's action on the run's effects through the one
        phase loop (machine.actions.run_phases): the `before` effects, the change, the `with`
        effects, the trace entry (§4.12), the `after` effects. A row that ends the request runs in
        one critical section (transition_and_emit_terminal, §4.3)."""
        key = (self.life.state._value_, event)
        plan = self.lifecycle.plans.get(key)
        if plan is not None and (plan.before or plan.after):
            with self._lock:
                return self._run(plan, key, data)
        return self._run(plan, key, data)

    def _run(self, plan: Plan | None, key: tuple[str, str], data: dict) -> str | None:
        reason = self.lifecycle.reasons.get(key)

        def entry(fired: tuple[str | None, Any]) -> None:
            action, after = fired
            if after._value_ != key[0] or reason is not None:  # a self-loop that fixes a reason shows too
                self.trace.emit(
                    EventKind.LIFECYCLE, **{"from": key[0]}, to=after._value_, event=key[1],
                    action=action, reason=reason.value if reason else None, **data,
                )
            elif key in self.lifecycle.ignored:
                self.trace.emit(EventKind.LIFECYCLE_IGNORED, state=key[0], event=key[1], action=action)

        # a refused pair: the fire raises the table's IllegalTransition; nothing changed
        return run_phases(plan, (self.effects, key, reason), self.life.fire, (key[1],), entry=entry)[0]

    # ---- requests from other threads, and injected faults (faults.FaultTarget) ---------------

    def cancel(self, source: str = "client") -> None:
        """Request a cancel (§4.9 moment 1); the driver observes it at its next safe point."""
        with self._cancel_lock:  # one caller logs the request, however many threads cancel
            if self._cancel_claimed:
                return
            self._cancel_claimed = True
        # The request is in the trace before the driver can see the flag, so no observation of
        # it can precede it (cancel_observed_after_requested, also across threads).
        self.trace.emit(EventKind.CANCEL_REQUESTED, source=source)
        self._cancel_requested = True

    def disconnect(self) -> None:
        """The client went away: a transport fact, never EOS, not a cancel (DECISIONS D5)."""
        self.stream.disconnect()

    def force_deadline(self) -> None:
        """The deadline counts as passed at the next check point (an injected deadline, §4.9)."""
        self._deadline_forced = True

    def check_decoding(self) -> None:
        """Every later push asks the fault hooks first (an injected decoding_error, §4.10); a run
        with none pays nothing for the check."""
        self._detok_push = self._checked_push

    def _checked_push(self, token: int) -> bytes:
        """The detokenizer's push, failing where a decoding_error fault was injected for the step."""
        step = len(self.tokens)
        if self.faults.decoding_fails(step):
            raise DecodingError(f"injected decoding error at step {step}")
        return self.detok.push(token)

    def take_kernel_fault(self) -> bool:
        """True (once) when a model_error fault was injected into the kernel now in flight."""
        return self.faults.take_kernel_fault()

    # ---- §4.3, phase by phase ---------------------------------------------------------------

    # One step of the loop in the table's order: check_cancel_or_deadline, then select y_t and
    # run every other phase on it (the functions above the class, written from runtime/stepgen.py).
    check_point = _CHECK_POINT
    select = _SELECT

    def admit(self) -> bool:
        """CREATED -> QUEUED, or a refusal (D9) or an early cancel (D2). True when queued."""
        if self._cancel_requested:
            self.fire("cancel")
            return False
        if len(self.prompt_ids) >= self.model.context_limit:
            self.error = f"prompt of {len(self.prompt_ids)} tokens leaves no room in a context of {self.model.context_limit}"
            self.fire("reject")
            return False
        self.fire("enqueue")
        return True

    def _observe_cancel(self) -> None:
        """§4.9 moment 2: fire `cancel` once; the table decides what it means in this state."""
        if not self._cancel_fired:
            self._cancel_fired = True
            self.fire("cancel")

    def transport_failed(self, error: str, what: str = "detach_timeout") -> None:
        """The return channel gave up (a parked reader past its timeout: `detach_timeout` when it is
        gone, DECISIONS D5, `stall_timeout` when connected but not reading): FAILED with
        transport_error. Valid in DECODING and DRAINING."""
        self.error = f"transport_error: {error}"
        self.trace.emit(EventKind.TRANSPORT, what=what)
        self.fire("transport_error")

    def begin_prefill(self) -> None:
        self._t["queue"] = self.clock() - self._created
        self.fire("schedule")  # start_prefill: the model resources are acquired (acquire_model)
        self._t0 = self.clock()
        self.trace.emit(EventKind.PREFILL_STARTED, step=0, prompt_tokens=len(self.prompt_ids))
        if self._cancel_requested:  # in flight from here on: a cancel that arrived is observed
            self._observe_cancel()

    def end_prefill(self, logits: torch.Tensor, cache: Any) -> None:
        self._t["prefill"] = self.clock() - self._t0
        self.cache = cache
        self.logits = logits
        self.trace.emit(EventKind.PREFILL_COMPLETED, step=0, cache_len=cache.length)
        self.fire("prefill_done")  # after a cancel, the ignore row's discard_result drops it (§4.9)
        if self.decoding:  # once: a recomputed prefill does not echo again
            self.effects.send_echo()

    def kernel_failed(self, exc: BaseException) -> None:
        """A prefill or decode kernel raised: FAILED with model_error (or ignored after a cancel)."""
        self.error = f"model_error: {exc}"
        self.fire("model_error")  # after a cancel an ignore row: the cancel came first and wins (D2)

    def crashed(self, exc: Exception, where: str) -> None:
        """An exception escaped this request's own step (`where`: its sampler on bad logits, its
        tokenizer, its content policy or grammar): the request ends FAILED with model_error and an
        error naming the cause; the driver goes on with the others (§4.10, DECISIONS D20). After a
        cancel the cancel wins (D2)."""
        self.kernel_failed(ModelError(f"{where} raised {type(exc).__name__}: {exc}"))

    def _token_stop(self, token_stopper: TokenStopMatcher, token: int, safe: bytes,
                    hit: StopHit | None) -> tuple[bytes, StopHit | None]:
        """Merge the token-id stops (`token_stopper`, the run's) into the string matcher's verdict
        (§4.6, D3). The string matcher sees every byte at once; the bytes of tokens that may still
        begin a stop-id sequence are withheld from sending (`unsent`). On a hit the text up to
        the cut is final: the earlier cut wins, a string match on a tie."""
        token_hit = token_stopper.push(token)
        unsent = self.unsent + safe if self.unsent else safe
        sent = len(self.output) - self.echo_len
        if token_hit is not None:
            marks, n = self._byte_marks, len(token_hit.stop)
            cut = marks[-n - 1] if len(marks) > n else 0  # where the stop ids' bytes begin
            if hit is None or hit.start > cut:  # the token-id stop cuts first: it wins
                self.unsent = b""
                kept = unsent + self.stopper.held
                return kept[: _char_start(kept, cut - sent)], token_hit
        if hit is not None:  # a string stop: everything before it is final
            self.unsent = b""
            return unsent, hit
        k = len(token_stopper.held)
        if not k:
            self.unsent = b""
            return unsent, None
        marks = self._byte_marks
        cap = marks[-k - 1] if len(marks) > k else 0  # the held tokens' bytes begin here
        n = _char_start(unsent, max(0, cap - sent))
        self.unsent = unsent[n:]
        return unsent[:n], None

    def consumed_text(self, safe: bytes) -> str:
        """The text the decoder consumed with `safe`, the bytes this token would send: sent, sent
        now, withheld by the stop-id and stop matchers (D14, D23), the echoed prompt left out (D33)."""
        return (self.output[self.echo_len:] + safe + self.unsent + self.stopper.held).decode("utf-8", "replace")

    def begin_decode(self) -> None:
        """decode.started; the kernel counts as in flight from here, so a cancel that arrived by
        now is observed at once (§4.9, §4.11 B), as in begin_prefill."""
        trace = self.trace
        self._t0 = t = trace.clock()
        trace.put((_DECODE_STARTED, t, len(self.tokens)))
        if self._cancel_requested:
            self._observe_cancel()

    def end_decode(self, logits: torch.Tensor) -> None:
        self.decoded += 1
        trace = self.trace
        t = trace.clock()
        trace.put((_DECODE_COMPLETED, t, len(self.tokens), self.cache.length))
        self._decode_s += t - self._t0
        if self.life.state in self._done_quiet:
            self.logits = logits
            return
        self.logits = logits
        self.fire("decode_done")  # after a cancel, the ignore row's discard_result drops it (§4.9)

    def finish(self) -> Result:
        """After the loop: `end()`, then the Result (generate()'s return value)."""
        self.end()
        return self.result()

    def end(self) -> None:
        """After the loop: the safe point of a cancel, or DRAINING and the one terminal (§4.3).
        The Engine calls this; its clients build a Result only when they ask for one."""
        ending = self.lifecycle.endings.get(self.state)
        if ending is not None:  # a terminal state has nothing left to do
            ending(self.effects)

    def count_tail(self, n: int) -> None:
        """The detokenizer's tail of `n` bytes is the last token's (usage, D7)."""
        self._detok_total += n
        if self._byte_marks:
            self._byte_marks[-1] = self._detok_total

    # ---- results -----------------------------------------------------------------------------

    def end_hold(self) -> None:
        """Close the stop matcher's holding interval, if one is open (its time is stop_buffer's)."""
        if self._held_since is not None:
            self._t["stop_buffer"] += self.clock() - self._held_since
            self._held_since = None

    def timings(self) -> dict[str, float]:
        """The TIMINGS fields (§4.12): seconds queued, in the prefill, holding stop bytes, in
        decode steps, and waiting for the reader to send."""
        return {**{f"{k}_s": v for k, v in self._t.items()}, "decode_s": self._decode_s,
                "send_s": self.stream.paused_s}

    def usage(self) -> Usage:
        """DECISIONS D7: a token is returned when one of its bytes reached the client (the echoed
        prompt is no token's: D33). An echo the request ended before sending (a cancel before the
        prefill, a failed first send) returned nothing, and no byte after it."""
        returned = max(0, len(self.output) - self.echo_len)
        start, count = 0, 0
        for end in self._byte_marks:
            if end > start and start < returned:
                count += 1
            start = end
        return Usage(
            prompt_tokens=len(self.prompt_ids),
            selected_tokens=len(self.tokens),
            processed_tokens=self.decoded,
            returned_tokens=count,
            returned_bytes=returned,
        )

    def result(self) -> Result:
        hit = self.stop_hit
        return Result(
            request_id=self.request.request_id,
            state=self.life.state,
            finish_reason=self.final_reason,
            output=bytes(self.output),
            usage=self.usage(),
            trace=self.trace,
            trace_length=len(self.trace),
            tokens=tuple(self.tokens),
            error=self.error or None,
            stop=None if hit is None else hit.stop,
        )

    @property
    def byte_marks(self) -> list[int]:
        """The detokenizer's output bytes through each selected token, held ones included (append-only;
        D7 counts returned tokens by them, D59 reports each token with the chunk that sends its first byte)."""
        return self._byte_marks

    def on_delta(self, fn: Callable[[bytes], None]) -> None:
        """Call `fn(bytes)` for every delta as it is sent (the CLI streams with it)."""
        self.effects.listeners.append(fn)
        self._plain_send = self.effects.plain()

    @property
    def inline_reader(self) -> bool:
        """True when the driver reads its own stream as it goes (generate() does)."""
        return self._inline

    @inline_reader.setter
    def inline_reader(self, value: bool) -> None:
        self._inline = bool(value)
        self.put_delta = self.stream.deliver if self._inline else self.stream.delta


def _prompt_ids(request: Request, tokenizer: Any) -> list[int]:
    """The request's prompt as ids; one the tokenizer cannot decode is bad input: nothing starts (D9)."""
    ids = tokenizer.encode(request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
    try:
        tokenizer.decode_bytes(ids)
    except TokenizerError as exc:
        raise RequestError("prompt", str(exc)) from None
    return ids


def _guard(request: Request, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> Utf8Guard | None:
    """The request's UTF-8 guard (D16), None when it asks for none; it needs the tokenizer's
    per-token byte table. Every byteless end (EOS, a token check's ids) waits for the character
    to finish (D22)."""
    if not request.utf8_guard:
        return None
    plan = tokenizer.plan(skip_special=request.skip_special_tokens)
    if plan is None:
        raise RequestError("utf8_guard", "needs a tokenizer whose decoder has a per-token byte table "
                                         f"({type(tokenizer).__name__}'s has none)")
    return guard_for(plan, vocab_size, frozenset(eos_ids.union(*(ids for _, ids in request.finish_tokens))))


def _sampler(request: Request, model: Any, eos_ids: frozenset[int], history: list[int], prompt: list[int]) -> Sampler:
    """The request's sampler over the model's vocabulary (§4.3), reading the run's `history` of tokens."""
    params = SamplingParams(
        temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, seed=request.seed,
        min_p=request.min_p, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
        logit_bias=request.logit_bias, min_tokens=request.min_tokens, score=request.score,
        # the stop tokens min_tokens holds back (D31): EOS and every one-id stop sequence
        min_tokens_ids=tuple(sorted({*eos_ids, *(s[0] for s in request.stop_token_ids if len(s) == 1)}
                                    & set(range(model.vocab_size)))),
    )
    return Sampler(params, model.vocab_size, getattr(model, "device", "cpu"), history=history, prompt=prompt)


def _created_fields(run: RequestRun) -> dict[str, Any]:
    """The fields of the request.created event (§4.12): what the run was asked for, as it runs it."""
    request = run.request
    return dict(
        prompt_tokens=len(run.prompt_ids),
        prompt_ids=run.prompt_ids,
        stop=list(request.stop),
        stop_token_ids=[list(s) for s in request.stop_token_ids],
        max_output_tokens=request.max_output_tokens,
        context_limit=run.model.context_limit,
        eos_id=run.eos_id,
        eos_ids=sorted(run.eos_ids),
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=run.sampler.seed,
        deadline_s=request.deadline_s,
        policy=request.policy,
        utf8_guard=request.utf8_guard,
        max_events=request.max_buffer_events,
        max_bytes=request.max_buffer_bytes,
        finish_tokens={event: sorted(ids) for event, ids in request.finish_tokens},
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        echo_bytes=run.echo_len,
    )


def _quiet(table: Table, machine: CompiledMachine, reasons: Mapping[tuple[str, str], FinishReason], event: str,
           action: str) -> frozenset[enum.Enum]:
    """The states where `table` makes the per-token `event` a self-loop with `action`, an action
    with no effects (lifecycle.toml [actions]; the caller records the token itself): select and
    end_decode skip the fire there and fire, running the row's effects, elsewhere."""
    if table.actions.get(action):
        return frozenset()
    return frozenset(s for s in machine.self_loops(event, action) if (s.value, event) not in reasons)


@attrs.frozen(eq=False)
class Lifecycle:
    """A lifecycle table as RequestRun runs it (§4.1, §4.3): its compiled machine, each pair's plan
    (the row's effects), finish reason and whether it is ignored, the states where the per-token
    events change nothing, its step (check_point, select) for its [[step]] order, its finish checks
    as one function, the events of its token checks and the stream call of each terminal state."""

    table: Table
    machine: CompiledMachine
    plans: Mapping[tuple[str, str], Plan]
    reasons: Mapping[tuple[str, str], FinishReason]
    ignored: frozenset[tuple[str, str]]
    decoding: enum.Enum
    select_quiet: frozenset[enum.Enum]  # select's action: token.selected in the trace
    decode_done_quiet: frozenset[enum.Enum]  # decode_done's: decode.completed in the trace
    step: tuple[Callable[[RequestRun], bool], Callable[..., bool]]
    winner: Callable[..., str | None]
    token_checks: Mapping[str, frozenset[int]]  # event -> no ids: a request names its own
    terminal_send: Mapping[str, Callable[[OrderedStream, FinishReason, dict, str], int]]
    driver_states: DriverStates  # the states the drivers branch on (spec.derived.driver_states)
    # what end() does, by the state the loop ended in (effects.endings)
    endings: Mapping[str, Callable[[RunEffects], None]] = attrs.field(
        default=attrs.Factory(lambda lc: endings(lc.driver_states), takes_self=True))

    @classmethod
    def of(cls, table: Table) -> Lifecycle:
        machine = compiled_of(table)
        reasons = {k: FinishReason(d.reason) for k, d in table.decisions.items() if d.reason}
        where = driver_states(table)
        (decoding,) = where.selecting
        return cls(
            table, machine, LIFECYCLE.plans(table), reasons,
            frozenset(k for k, d in table.decisions.items() if d.kind == "ignore"), table.State[decoding],
            _quiet(table, machine, reasons, "select", "record_selected"),
            _quiet(table, machine, reasons, "decode_done", "record_decoded"),
            _step_of(table), _winner_of(table), {c.event: frozenset() for c in table.finish_checks if c.tokens},
            {state: STREAM_SEND[event] for state, event in terminal_stream_event(life=table).items()},
            where,
        )

    def run_type(self, base: type[RequestRun]) -> type[RequestRun]:
        """`base`, or the subclass of it whose check_point and select run this table's step order."""
        if (base.check_point, base.select) == self.step:
            return base
        key = (id(self), base)
        kind = _RUN_TYPES.get(key)
        if kind is None:
            check_point, select = self.step
            kind = _RUN_TYPES[key] = type(base.__name__, (base,), {
                "__slots__": (), "__module__": base.__module__, "check_point": check_point, "select": select,
                "__doc__": f"{base.__name__} of {self.table.source}, whose [[step]] order is another."})
        return kind


_RUN_TYPES: dict[tuple[int, type[RequestRun]], type[RequestRun]] = {}
lifecycle_of = per_table(Lifecycle.of)  # the Lifecycle of a table, built once per table


def _char_start(data: bytes, n: int) -> int:
    """The largest i <= n where data[:i] ends between two UTF-8 characters: a stop-id cut (or the
    bytes a partial stop-id match withholds) never splits a character; the character whose bytes
    the stop ids complete goes with them (DECISIONS D24)."""
    while 0 < n < len(data) and 0x80 <= data[n] < 0xC0:
        n -= 1
    return n


# (id(tokenizer), vocab_size, device) -> (a weak reference to the tokenizer, its mask)
_UNDECODABLE: dict[tuple[int, int, str], tuple[Any, torch.Tensor | None]] = {}


def undecodable_mask(tokenizer: Any, vocab_size: int, device: Any = "cpu") -> torch.Tensor | None:
    """The model ids below `vocab_size` that `tokenizer` refuses to decode (a model vocabulary
    padded past the tokenizer's, common in checkpoints; ids missing from a byte table), as a
    [vocab_size] bool mask on `device`, or None when every id decodes (§4.5, DECISIONS D20).
    Built once per tokenizer, O(vocabulary) dictionary lookups."""
    key = (id(tokenizer), vocab_size, str(device))
    kept = _UNDECODABLE.get(key)
    if kept is not None and kept[0]() is tokenizer:
        return kept[1]
    limit = min(getattr(tokenizer, "vocab_size", vocab_size), vocab_size)
    bad = list(range(limit, vocab_size))
    plan = tokenizer.plan() if callable(getattr(tokenizer, "plan", None)) else None
    if plan is not None:
        known = plan.rest.keys() | plan.skipped
        for tid in range(limit):
            if tid not in known:
                try:
                    tokenizer.decode_bytes([tid])
                except TokenizerError:
                    bad.append(tid)
    mask = None
    if bad:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[bad] = True
        mask = mask.to(device)
    with contextlib.suppress(TypeError):  # a tokenizer that takes no weak reference: computed again next time
        _UNDECODABLE[key] = (weakref.ref(tokenizer, lambda _ref: _UNDECODABLE.pop(key, None)), mask)
    return mask


def run_kernel(run: RequestRun, fn: Callable[[], Any], begin: Callable[[], None], pool: Any) -> Any:
    """Run a model kernel so that a cancel can arrive while it is in flight (§4.9, §4.11 B).

    The kernel runs on `pool`'s worker; its completion is gated until `begin()` has run: it
    records *.started (delivering injected faults) and observes a cancel that arrived by then.
    On a CUDA device the step ends when the device says so: the worker records a CUDA event after
    the launch and waits on it, so the safe point is the kernel's real completion, not the return
    of an asynchronous launch. Raises ModelError when the kernel failed or a model_error fault
    was injected.
    """
    gate = threading.Event()
    on_cuda = torch.device(getattr(run.model, "device", "cpu")).type == "cuda"

    def gated() -> Any:
        out = fn()
        if on_cuda:
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        gate.wait()
        if run.take_kernel_fault():
            raise ModelError("injected model error")
        return out

    fut = pool.submit(gated)
    try:
        begin()
    finally:
        gate.set()
    try:
        return fut.result()
    except ModelError:
        raise
    except Exception as exc:  # the model raised: a model error of this request (§4.10)
        raise ModelError(f"{type(exc).__name__}: {exc}") from exc

