"""One request's execution state across the loop of §4.3, shared by generate() and the Engine.

The lifecycle's control state is the run's compiled lifecycle table (a `Lifecycle`: the table
the caller gives, else the spec directory's): every transition is a `fire` of its event, and
firing a row runs its action: the action's effects (lifecycle.toml [actions]),
each implemented once below (`LIFECYCLE`, machine/actions.py) and checked both ways against the
table, e.g. `fail` is release_model, fix_reason, emit_terminal (§4.3, §4.10).
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
from ..machine.actions import ActionError, Executor, Plan, run_phases
from ..spec import FinishReason, Spec, Table, default_spec, load_spec
from ..spec.derived import DriverStates, driver_states, terminal_stream_event
from .alignment import ScoreLog
from .backpressure import OVERFLOW_ERROR, BackpressurePolicy, StreamOverflow
from .detokenizer import DecodingError, IncrementalDetokenizer
from .errors import ModelError, RequestError
from .events import EventKind, Trace
from .faults import FaultAction, FaultPlan
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
_PAUSE = BackpressurePolicy.PAUSE
_DECODE_STARTED = EventKind.DECODE_STARTED.value
_DECODE_COMPLETED = EventKind.DECODE_COMPLETED.value
# After these reasons the detokenizer tail lies past the end of the output: it is discarded,
# finish() is not called (§4.3, DECISIONS D11). Every other reason drains with finish().
_DISCARD_TAIL = frozenset({FinishReason.STOP_SEQUENCE, FinishReason.CONTENT_INTERRUPTED})
# The OrderedStream call of each terminal stream event; the table says which terminal lifecycle
# state sends which (lifecycle.toml terminal_events, transition_and_emit_terminal of §4.3).
_STREAM_SEND: dict[str, Callable[[OrderedStream, FinishReason, dict, str], int]] = {
    "complete": lambda s, reason, usage, err: s.complete(reason, usage),
    "cancel": lambda s, reason, usage, err: s.cancel(usage),
    "fail": lambda s, reason, usage, err: s.fail(reason, usage, err),
}


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
        if hit is not None and self._stop_kept:
            safe += hit.own_bytes
    # finish_checks (§4.3): the table's finish checks in its order (runtime/finish.py, D4): the event of the
    # first that holds fires after the emit
    event = self._winner(self, eos, safe, hit, t, checked)
    # emit (§4.7): a chunk the content policy refused is never sent (D11); nothing to check: straight to the
    # stream
    if safe and event != _CONTENT_INTERRUPT:
        if self._plain_send:
            try:
                self._put_delta(safe)
            except StreamOverflow as exc:
                return self._send_failed(exc.seq, str(exc))
            self.output += safe
        elif not self._send(safe):
            return False
    # decode (§4.4): the output ends at a match whichever check fixes the reason; after an interruption
    # nothing is kept
    if hit is not None and event != _CONTENT_INTERRUPT:
        self._record_hit(hit)
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
        if hit is not None and self._stop_kept:
            safe += hit.own_bytes
    # emit (§4.7): a chunk the content policy refused is never sent (D11); nothing to check: straight to the
    # stream
    if safe and event != _CONTENT_INTERRUPT:
        if self._plain_send:
            try:
                self._put_delta(safe)
            except StreamOverflow as exc:
                return self._send_failed(exc.seq, str(exc))
            self.output += safe
        elif not self._send(safe):
            return False
    # finish_checks (§4.3): the table's finish checks in its order (runtime/finish.py, D4): the event of the
    # first that holds fires after the emit
    event = self._winner(self, eos, safe, hit, t, checked)
    # decode (§4.4): the output ends at a match whichever check fixes the reason; after an interruption
    # nothing is kept
    if hit is not None and event != _CONTENT_INTERRUPT:
        self._record_hit(hit)
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
    """The StepState of §4.2 plus lifecycle, stream, ledger and trace of one request."""

    # Slots: the per-token path reads a dozen of these per token, right after a model step has
    # pushed them out of the CPU caches; a slot is one fixed offset, a dict entry a probe.
    __slots__ = (
        "cache", "clock", "deadline_at", "decoded", "detok", "echo_len", "eos_id", "eos_ids", "error", "faults",
        "finish_ids", "guard", "ledger", "_echo", "_guarded", "_stop_kept",
        "life", "logits", "model", "output", "prompt_ids", "reason", "request", "sampler", "scores", "spec",
        "stop_hit", "stopper", "stream", "token_stopper", "tokenizer", "tokens", "trace",
        "_byte_marks", "_cancel_claimed", "_cancel_fired", "_cancel_lock", "_cancel_requested",
        "_created", "_deadline_forced", "_decode_s", "_deferred", "_detok_push", "_detok_total", "_done_quiet",
        "_faulty", "_held_since", "_inline", "_kernel_fault", "_lc", "_listeners", "_lock", "_may_overflow",
        "_not_text", "_overflow", "_plain_send", "_poisoned", "_put_delta", "_select_quiet", "_stop_push", "_t",
        "_t0", "_undecodable", "_unsent", "_winner",
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
        lc = self._lc = lifecycle_of(lifecycle or spec["lifecycle"])
        # read per token: a slot each, where the Lifecycle's attribute would be two lookups
        self._select_quiet, self._done_quiet = lc.select_quiet, lc.decode_done_quiet
        self.request = request
        self.model = model
        self.tokenizer = tokenizer
        self.faults = faults or FaultPlan()
        self.clock = clock
        rid = request.request_id
        self.trace = Trace(rid, clock)
        self.life = lc.machine.new()
        self.ledger = ResourceLedger(rid, trace=self.trace, table=spec["resources"])
        self.stream = OrderedStream(
            rid,
            policy=request.policy,
            max_events=request.max_buffer_events,
            max_bytes=request.max_buffer_bytes,
            pause_timeout_s=pause_timeout_s,
            usage_provider=lambda: self.usage().as_dict(),
            trace=self.trace,
            table=spec["stream"],
        )
        self.prompt_ids: list[int] = (
            tokenizer.encode(request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
        )
        try:  # a prompt id the tokenizer cannot decode is bad input: nothing starts (D9)
            tokenizer.decode_bytes(self.prompt_ids)
        except TokenizerError as exc:
            raise RequestError("prompt", str(exc)) from None
        self.eos_id: int | None = tokenizer.eos_id
        # Every id that ends the output (a checkpoint may list several, as Llama 3's does, §4.6).
        self.eos_ids: frozenset[int] = getattr(tokenizer, "eos_ids", None) or frozenset(
            () if self.eos_id is None else (self.eos_id,))
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=self.prompt_ids,
                                            skip_special=request.skip_special_tokens, table=spec["detokenizer"])
        # echo: the prompt's bytes, by the batch decode's rules (D12), are the output's first delta;
        # a prompt that ends inside a character is completed by the output's first bytes (D33).
        self._echo = (tokenizer.decode_bytes(self.prompt_ids, skip_special=request.skip_special_tokens)
                      if request.echo else None)
        self.echo_len = len(self._echo) if self._echo else 0
        self._stop_kept = request.include_stop_str_in_output  # a stop string's own bytes end the output
        self.guard: Utf8Guard | None = None
        if request.utf8_guard:
            plan = tokenizer.plan(skip_special=request.skip_special_tokens)
            if plan is None:
                raise RequestError("utf8_guard", "needs a tokenizer whose decoder has a per-token byte table "
                                                 f"({type(tokenizer).__name__}'s has none)")
            # Every byteless end (EOS, a token check's ids) waits for the character to finish (D22).
            ends = self.eos_ids.union(*(ids for _, ids in request.finish_tokens))
            self.guard = guard_for(plan, model.vocab_size, frozenset(ends))
        self.stopper = StopMatcher(request.stop, table=spec["stop_matcher"])
        self.token_stopper = (TokenStopMatcher(request.stop_token_ids, table=spec["stop_matcher"])
                              if request.stop_token_ids else None)
        self._unsent = b""  # bytes the stop matcher released that a partial stop-id match withholds
        # Ids the model may score but the tokenizer cannot decode are never chosen (D20); the
        # guard already refuses them.
        self._undecodable = None if self.guard is not None else undecodable_mask(
            tokenizer, model.vocab_size, getattr(model, "device", "cpu"))
        self.tokens: list[int] = []
        # Each selected token's (log-probability, top alternatives) when the request asks (D59).
        self.scores: ScoreLog | None = None if request.logprobs is None else ScoreLog(request.logprobs)
        self.sampler = Sampler(
            SamplingParams(
                temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, seed=request.seed,
                min_p=request.min_p, presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
                logit_bias=request.logit_bias, min_tokens=request.min_tokens, score=request.score,
                # the stop tokens min_tokens holds back (D31): EOS and every one-id stop sequence
                min_tokens_ids=tuple(sorted({*self.eos_ids, *(s[0] for s in request.stop_token_ids if len(s) == 1)}
                                            & set(range(model.vocab_size)))),
            ),
            model.vocab_size,
            getattr(model, "device", "cpu"),
            history=self.tokens, prompt=self.prompt_ids,
        )
        self.cache: Any = None
        self.logits: torch.Tensor | None = None
        self.decoded = 0
        self.output = bytearray()
        self._byte_marks: list[int] = []  # output bytes through each token, held ones included (usage D7)
        self._detok_total = 0
        self.reason: FinishReason | None = None
        self.error = ""
        self.stop_hit: Any = None
        self._cancel_requested = False  # set by any thread, observed by the driver (§4.9)
        self._cancel_claimed = False  # the one cancel() that logs the request has begun
        self._cancel_lock = threading.Lock()
        self._cancel_fired = False
        self._deadline_forced = False
        self._kernel_fault = False
        self._poisoned: set[int] = set()
        self._lock = threading.Lock()
        self._overflow = False  # the terminal event is the stream's overflow (D6)
        self._created = clock()
        self._t = {"queue": 0.0, "prefill": 0.0, "stop_buffer": 0.0}
        self._decode_s = 0.0  # the per-token sum of decode time, kept out of `_t` (a float add on the per-token path)
        self._held_since: float | None = None
        self.deadline_at = self._created + request.deadline_s if request.deadline_s is not None else None
        self._listeners: list[Callable[[Any], None]] = []
        self._inline = False
        self._put_delta = self.stream.delta  # deliver() once the driver reads inline
        self._faulty = bool(self.faults.faults)
        self._deferred: list[tuple[FaultAction, int]] | None = []
        if self._faulty:
            self.trace.subscribe(self._inject)
        # Bound once: the per-token path calls these for every token.
        self._detok_push: Callable[[int], bytes] = self.detok.push
        self._stop_push = self.stopper.push
        self._may_overflow = self.stream.policy is not _PAUSE  # pause waits instead (§4.8)
        self._plain_send = self._plain()
        self._winner = lc.winner
        self._guarded = request_guard(lc.table.finish_checks, lc.table.finish_guards, request)
        # event -> the ids of its token finish check, none where the request names none
        self.finish_ids = {**lc.token_checks, **dict(request.finish_tokens)}
        self._not_text = frozenset().union(*self.finish_ids.values())  # like EOS, never detokenized
        self.trace.emit(
            EventKind.REQUEST_CREATED,
            prompt_tokens=len(self.prompt_ids),
            prompt_ids=self.prompt_ids,
            stop=list(request.stop),
            stop_token_ids=[list(s) for s in request.stop_token_ids],
            max_output_tokens=request.max_output_tokens,
            context_limit=model.context_limit,
            eos_id=self.eos_id,
            eos_ids=sorted(self.eos_ids),
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            seed=self.sampler.seed,
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
            echo_bytes=self.echo_len,
        )
        self.ledger.acquire("trace_handle")
        self.ledger.acquire("stream_buffer")
        self.stream.start(model_name or getattr(model, "name", type(model).__name__))
        # Faults that arrived at request.created (a client that left at once, say) land now that
        # the request exists: the stream table accepts nothing before response.start.
        deferred, self._deferred = self._deferred, None
        for action, step in deferred:
            _FAULTS[action](self, step)

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
        return self._lc.driver_states

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
        return self.life.state is self._lc.decoding

    def fire(self, event: str, **data: Any) -> str | None:
        """Fire a lifecycle event and run its row's action through the one phase loop
        (machine.actions.run_phases): the `before` effects, the change, the `with` effects, the
        trace entry (§4.12), the `after` effects. A row that ends the request runs in one critical
        section (transition_and_emit_terminal, §4.3)."""
        key = (self.life.state._value_, event)
        plan = self._lc.plans.get(key)
        if plan is not None and (plan.before or plan.after):
            with self._lock:
                return self._run(plan, key, data)
        return self._run(plan, key, data)

    def _run(self, plan: Plan | None, key: tuple[str, str], data: dict) -> str | None:
        reason = self._lc.reasons.get(key)

        def entry(fired: tuple[str | None, Any]) -> None:
            action, after = fired
            if after._value_ != key[0] or reason is not None:  # a self-loop that fixes a reason shows too
                self.trace.emit(
                    EventKind.LIFECYCLE, **{"from": key[0]}, to=after._value_, event=key[1],
                    action=action, reason=reason.value if reason else None, **data,
                )
            elif key in self._lc.ignored:
                self.trace.emit(EventKind.LIFECYCLE_IGNORED, state=key[0], event=key[1], action=action)

        # a refused pair: the fire raises the table's IllegalTransition; nothing changed
        return run_phases(plan, (self, key, reason), self.life.fire, (key[1],), entry=entry)[0]

    # ---- requests from other threads ------------------------------------------------------

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

    def take_kernel_fault(self) -> bool:
        """True (once) when a model_error fault was injected into the kernel now in flight."""
        fault, self._kernel_fault = self._kernel_fault, False
        return fault

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
            self._send_echo()

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
        begin a stop-id sequence are withheld from sending (`_unsent`). On a hit the text up to
        the cut is final: the earlier cut wins, a string match on a tie."""
        token_hit = token_stopper.push(token)
        unsent = self._unsent + safe if self._unsent else safe
        sent = len(self.output) - self.echo_len
        if token_hit is not None:
            marks, n = self._byte_marks, len(token_hit.stop)
            cut = marks[-n - 1] if len(marks) > n else 0  # where the stop ids' bytes begin
            if hit is None or hit.start > cut:  # the token-id stop cuts first: it wins
                self._unsent = b""
                kept = unsent + self.stopper.held
                return kept[: _char_start(kept, cut - sent)], token_hit
        if hit is not None:  # a string stop: everything before it is final
            self._unsent = b""
            return unsent, hit
        k = len(token_stopper.held)
        if not k:
            self._unsent = b""
            return unsent, None
        marks = self._byte_marks
        cap = marks[-k - 1] if len(marks) > k else 0  # the held tokens' bytes begin here
        n = _char_start(unsent, max(0, cap - sent))
        self._unsent = unsent[n:]
        return unsent[:n], None

    def consumed_text(self, safe: bytes) -> str:
        """The text the decoder consumed with `safe`, the bytes this token would send: sent, sent
        now, withheld by the stop-id and stop matchers (D14, D23), the echoed prompt left out (D33)."""
        return (self.output[self.echo_len:] + safe + self._unsent + self.stopper.held).decode("utf-8", "replace")

    def _record_hit(self, hit: Any) -> None:
        """stop.hit with the match's index and span (D3); the output ends at its start."""
        self.stop_hit = hit
        self.trace.emit(EventKind.STOP_HIT, stop=hit.stop, rule_version=hit.rule_version, kind=hit.kind.value,
                        index=hit.index, start=hit.start, end=hit.end)

    def _send(self, data: bytes) -> bool:
        """stream.emit_delta_if_nonempty (§4.3); a failed send ends the request (§4.10).

        Where the pause policy waits for the reader (§4.8), the stream counts the time itself
        (`paused_s`, the `send_s` of TIMINGS); the inline reader's `deliver` never waits.
        """
        if not data:
            return True
        stream = self.stream
        if self._faulty:  # no scan of the plan on the per-token path when there are no faults
            seq = stream.next_seq
            if FaultAction.TRANSPORT_ERROR in self.faults.at("response.delta", seq):
                self.trace.emit(EventKind.FAULT_INJECTED, point="response.delta", step=seq, action="transport_error")
                return self._send_failed(seq, "injected send failure")
        if self._may_overflow and not stream.fits(len(data)):
            return self._send_failed(stream.next_seq, OVERFLOW_ERROR, overflow=True)
        try:
            self._put_delta(data)
        except StreamOverflow as exc:  # a paused send waited past the stream's pause timeout (D5)
            return self._send_failed(exc.seq, str(exc))
        self.output += data
        if self._listeners:
            for fn in self._listeners:
                fn(data)
        return True

    def _send_failed(self, seq: int, why: str, overflow: bool = False) -> bool:
        self.error = f"transport_error: {why}"
        self.trace.emit(EventKind.TRANSPORT, what="send_failed", seq=seq)
        self._overflow = overflow
        self.fire("transport_error")
        return False

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
        ending = self._lc.endings.get(self.state)
        if ending is not None:  # a terminal state has nothing left to do
            ending(self)

    def _cancel_at_safe_point(self) -> None:
        """discard_non_safe_stop_buffer (§4.3): held bytes are not safe and are never sent."""
        self._unsent = b""
        self.fire("safe_point")

    def _send_echo(self) -> bool:
        """The echoed prompt as the output's first delta, once (D33); False when its send failed."""
        echo, self._echo = self._echo, None
        return echo is None or self._send(echo)

    def _drain(self) -> None:
        if not self._send_echo():  # ended before its prefill (a deadline in the queue): the output
            return  # still opens with the prompt's bytes (D33)
        if self.reason in _DISCARD_TAIL or self.stop_hit is not None:  # the output ended at a cut
            self.detok.discard_pending_after_stop()
            if self.stopper.hit is not None:
                self.stopper.discard_from_first_match()
            self._unsent = b""
            self.fire("complete")
            return
        if self.guard is not None and self.detok.pending:
            # An end the sampler did not choose (a deadline, a grammar) cut a character short:
            # the guarded run drops the unfinished character instead of failing (D16).
            self.trace.emit(EventKind.DETOK_DROPPED, bytes=len(self.detok.pending))
            self.detok.discard_pending_after_stop()
            tail = b""
        else:
            try:
                tail = self.detok.finish()
            except DecodingError as exc:
                self.error = f"decoding_error: {exc}"
                self.fire("decode_error")
                return
        self._detok_total += len(tail)
        if self._byte_marks:
            self._byte_marks[-1] = self._detok_total
        unsent, self._unsent = self._unsent, b""  # already through the stop matcher: final now
        if not self._drained(unsent):
            return
        safe, hit = self.stopper.push(tail) if tail else (b"", None)
        if hit is not None and self._stop_kept:
            safe += hit.own_bytes
        if not self._drained(safe):
            return
        if hit is not None:
            self._record_hit(hit)
            self.fire("stop_hit")
            self.stopper.discard_from_first_match()
        elif not self._drained(self.stopper.flush()):
            return
        self.fire("complete")

    def _drained(self, data: bytes) -> bool:
        """Send a drained chunk; the content policy judges it first, as every chunk (D11, D23): a
        refused chunk is not sent, nor anything after it, and the request ends content_interrupted.
        False when the drain ends here."""
        policy = self.request.content_policy
        if data and policy is not None and policy(bytes(self.output), data):
            self.fire("content_interrupt")
            self.fire("complete")
            return False
        return self._send(data)

    def _freer(self, kind: str) -> Callable[[], None] | None:
        if kind != "kv_cache":
            return None

        def free() -> None:
            if self.cache is not None:
                self.cache.free()

        return free

    # ---- results -----------------------------------------------------------------------------

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
        self._listeners.append(fn)
        self._plain_send = self._plain()

    @property
    def inline_reader(self) -> bool:
        """True when the driver reads its own stream as it goes (generate() does)."""
        return self._inline

    @inline_reader.setter
    def inline_reader(self, value: bool) -> None:
        self._inline = bool(value)
        self._put_delta = self.stream.deliver if self._inline else self.stream.delta

    def _plain(self) -> bool:
        """Would `_send` only pass the delta on? No content policy, no fault plan to consult, no
        listener and the pause policy (whose stream never overflows, §4.8): select then hands it
        to the stream itself."""
        return (
            self.request.content_policy is None and not self._faulty and not self._may_overflow
            and not self._listeners
        )

    # ---- fault injection (§4.9, §4.10) -------------------------------------------------------

    def _poisoned_push(self, token: int) -> bytes:
        """The detokenizer's push where a decoding_error fault was injected for some step."""
        step = len(self.tokens)
        if step in self._poisoned:
            raise DecodingError(f"injected decoding error at step {step}")
        return self.detok.push(token)

    def _inject(self, ev: Any) -> None:
        data = ev.data
        step = data.get("seq") if ev.kind == EventKind.RESPONSE_DELTA else data.get("step", 0)
        if step is None:
            return
        for action in self.faults.at(str(ev.kind), step):
            self.trace.emit(EventKind.FAULT_INJECTED, point=str(ev.kind), step=step, action=action.value)
            if self._deferred is not None:  # still being built: delivered once the stream has started
                self._deferred.append((action, step))
            else:
                _FAULTS[action](self, step)


def _fault_model_error(run: RequestRun, step: int) -> None:
    run._kernel_fault = True


def _fault_decoding_error(run: RequestRun, step: int) -> None:
    run._poisoned.add(step)
    run._detok_push = run._poisoned_push  # only a run with an injected fault pays for the check


def _fault_deadline(run: RequestRun, step: int) -> None:
    run._deadline_forced = True


_FAULTS: dict[FaultAction, Callable[[RequestRun, int], None]] = {
    FaultAction.CANCEL: lambda run, step: run.cancel(source="fault"),
    FaultAction.DEADLINE: _fault_deadline,
    FaultAction.MODEL_ERROR: _fault_model_error,
    FaultAction.DECODING_ERROR: _fault_decoding_error,
    FaultAction.TRANSPORT_ERROR: lambda run, step: None,  # checked before the send itself (_send)
    FaultAction.DISCONNECT: lambda run, step: run.disconnect(),
}


# ---- the runtime's implementation of every lifecycle effect (machine/actions.py) -------------
# Each runs as (run, (state, event), the row's reason); `fire` runs them by phase.
LIFECYCLE = Executor("lifecycle", "the runtime (runner.RequestRun)")


@LIFECYCLE.effect("release_model")
def _release_model(run: RequestRun, key: tuple[str, str], reason: FinishReason | None) -> None:
    for kind in run.ledger.model_kinds:
        if run.ledger.state(kind) == "HELD":
            run.ledger.release(kind)


@LIFECYCLE.effect("fix_reason")
def _fix_reason(run: RequestRun, key: tuple[str, str], reason: FinishReason | None) -> None:
    run.reason = reason


@LIFECYCLE.effect("observe_cancel")
def _cancel_observed(run: RequestRun, key: tuple[str, str], reason: FinishReason | None) -> None:
    run.trace.emit(EventKind.CANCEL_OBSERVED, state=key[0])


@LIFECYCLE.effect("emit_terminal")
def _emit_terminal(run: RequestRun, key: tuple[str, str], reason: FinishReason | None) -> None:
    """The terminal state's stream event (an overflow's own, D6), then the stream resources (§4.10)."""
    if run._held_since is not None:
        run._t["stop_buffer"] += run.clock() - run._held_since
        run._held_since = None
    if run._overflow:
        run.stream.overflow()
    if not run.stream.closed:
        send = run._lc.terminal_send.get(run.state)
        if send is None:
            raise ActionError(f"lifecycle row {key}: emit_terminal in {run.state}, which is not a terminal state")
        send(run.stream, run.final_reason, run.usage().as_dict(), run.error)
    for kind in run.ledger.stream_kinds:
        run.ledger.release(kind)
    run.trace.emit(EventKind.TIMINGS, **{f"{k}_s": v for k, v in run._t.items()}, decode_s=run._decode_s,
                   send_s=run.stream.paused_s)


@LIFECYCLE.effect("acquire_model")
def _acquire_model(run: RequestRun, key: tuple[str, str], reason: FinishReason | None) -> None:
    for kind in run.ledger.model_kinds:
        run.ledger.acquire(kind, run._freer(kind))


@LIFECYCLE.effect("discard_result")
def _discard_result(run: RequestRun, key: tuple[str, str], reason: FinishReason | None) -> None:
    run.logits = None




def _endings(where: DriverStates) -> Mapping[str, Callable[[RequestRun], None]]:
    """What is left to do after the loop, by the state the loop ended in (§4.3, after `while true`):
    a cancel observed reaches its safe point; a draining run sends its tail and finishes."""
    return {**dict.fromkeys(where.cancel_observed, RequestRun._cancel_at_safe_point),
                   **dict.fromkeys(where.draining, RequestRun._drain)}


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
    # what end() does, by the state the loop ended in (_endings)
    endings: Mapping[str, Callable[[RequestRun], None]] = attrs.field(
        default=attrs.Factory(lambda lc: _endings(lc.driver_states), takes_self=True))

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
            {state: _STREAM_SEND[event] for state, event in terminal_stream_event(life=table).items()},
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

