"""Model-derived tests: each checker path becomes a concrete run of the runtime.

machine/paths.py gives one shortest model path per reachable table decision and fault point. A
path is turned into a `ConcreteRun`:

- data (§4.5, §4.6): the path's select and drain steps are abstracted to what the lifecycle and
  the stream see (EOS, an invalid token, a delta or not, a stop hit or not; at the drain: a
  decoding error, a tail delta, a hit, a flushed suffix); a token script over the fixed byte table
  `TABLE` with stop "QZ" is searched that the real detokenizer and stop matcher turn into exactly
  that. Bytes the model's detokenizer holds with valid text (released by finish()) are realised by
  tokens held by the token-id stop matcher (`stop_token_ids`), which the runtime releases at the
  drain through the same stop matcher (runtime/effects.py `RunEffects.drain`);
- environment (§4.7-§4.10): cancel, deadline, model error, decoding error and transport error
  become a FaultPlan at the trace point where the model's loop observes them; a cancel observed
  in QUEUED (no FaultPlan point lies between enqueue and the check) is requested by a trace
  listener; reads, disconnects and reconnects are done by this harness, which is the stream's only
  reader (`read_inline=False`), right after the delta (or start, or terminal) the path puts them
  after;
- request parameters: max_output_tokens, context limit, grammar and a content policy that fire the
  finish checks at the path's step (the policy refuses the n-th non-empty safe chunk, D11); the
  path's backpressure policy with a cap of one delta (`buffer`: a byte cap computed from the deltas'
  sizes, a replay counting as a read of every unread delta);
- driver: generate() (`read_inline=False`), except for a path whose cancel is observed while the
  producer is parked on its reader (an `observe` tag with `parked`): generate() never parks before a select, the
  batched Engine does (runtime/engine.py), so such a path runs on an Engine stepped on this thread
  until it parks; then the cancel is requested and the Engine steps on (`Driver.ENGINE`). The
  generate() paths are run on the Engine as well; those it does not realise the same way are named,
  with their reason, in `ENGINE_DIFFERENCES`.

Refinement (what "the trace refines the path" means here): the runtime trace is projected onto
table events per machine (lifecycle, stream, and each resource kind separately) exactly as the
`refinement` monitor replays it (properties/monitors.py), plus the stream's block, unblock and
replay steps, which the trace does not log: the harness observes them (the stream's state after a
delta, around each of its reads, and its replay calls). For every machine the projected sequence
of (state, event) must EQUAL the path's: no extra self-loops or ignore rows are tolerated (none is
needed: the loop fires the same ignore rows the model does). Order across machines is not compared
(the model and the runtime both interleave them by §4.3, but the resource releases and the
terminal event are one critical section in the runtime).

Steps of the model that neither driver takes are excluded from path search by `allow`, each with
its reason in `UNREALIZABLE` (a cancel observed twice, or after the finish reason is fixed: the
tables decide those for other engines); `MODEL_ONLY` names the decisions and fault points that are
reachable in the model only through such steps.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..machine import IllegalTransition, compiled
from ..machine.checker_model import Step
from ..machine.checker_state import RequestState
from ..machine.paths import ModelPath, PathSet, PathStep, covering_paths, machine_of
from ..runtime.detokenizer import DecodingError, IncrementalDetokenizer
from ..runtime.engine import Engine
from ..runtime.events import TERMINAL_KINDS, Event, EventKind
from ..runtime.faults import Fault, FaultPlan
from ..runtime.loop import generate
from ..runtime.models import ScriptedModel
from ..runtime.request import Request, token_checks
from ..runtime.stop import StopMatcher, TokenStopMatcher
from ..runtime.stream_events import StreamEventKind
from ..runtime.tokenizers import ByteTableTokenizer

K = EventKind
PROMPT = (1,)
EOS = 2
# One byte table for every derived run: plain text, prefixes of the stop "QZ", a character split
# across two tokens, and tokens held by the token-id stop matcher (sequences [n, 21]; 21 is never
# selected, so the held bytes are released at the drain).
TABLE = {
    1: b"> ", EOS: b"</s>", 10: b"x", 11: b"Q", 12: b"Z", 13: b"QZ", 14: b"xQ", 15: b"xQZ",
    16: b"\xc3", 17: b"\xa9", 20: b"QZ", 21: b"w", 22: b"x", 23: b"xQ", 24: b"Q", 25: b"xQZ",
}
# One byteless id per token finish check of the table (D4, D47: e.g. tool_call), never text.
TOKEN_CHECK_IDS = {check: 30 + i for i, check in enumerate(token_checks())}
TABLE.update({tid: b"" for tid in TOKEN_CHECK_IDS.values()})
_CHECK_OF_ID = {tid: check for check, tid in TOKEN_CHECK_IDS.items()}
STOP = ("QZ",)
STOP_IDS = ((20, 21), (22, 21), (23, 21), (24, 21), (25, 21))
ALPHABET = (10, 11, 12, 13, 14, 15, 16, 17, 20, 22, 23, 24, 25, EOS, *TOKEN_CHECK_IDS.values())
UNSELECTED = 10  # pads the script: ScriptedModel needs logits past the last selected token
NO_LIMIT = 8  # max_output_tokens when the path never ends by length (the model selects <= 2)
LARGE = 1 << 20
PAUSE_TIMEOUT_S = 5.0  # Engine: bounds a wait inside a paused send (none is expected)
COMPARED = ("lifecycle", "stream", "resources")


def tokenizer() -> ByteTableTokenizer:
    return ByteTableTokenizer(TABLE, eos_id=EOS)


# ---------------------------------------------------------------- what no driver does


def _busy_cancel_outside_kernel(comp: RequestState, step: Step) -> bool:
    return step.tag.kind == "observe_busy" and \
        step.m.life.states[comp.lifecycle] not in ("PREFILLING", "DECODING", "CANCEL_REQUESTED")


# name -> (predicate on a model step, reason). Each is a model step that neither driver of the
# reference runtime takes (generate() nor the Engine: both observe a cancel through
# RequestRun.check_point and at begin_prefill / begin_decode); the model keeps them because the tables decide them
# for other engines (the ignore rows of DECISIONS D2). The decisions reachable only through them
# are MODEL_ONLY.
UNREALIZABLE = {
    "repeated_cancel": (
        lambda comp, step: step.tag.kind == "repeat_cancel",
        "RequestRun fires `cancel` once (_observe_cancel, shared by generate() and the Engine); a "
        "second request only sets a flag that is already set (§4.9). The ignore row is there for "
        "engines that fire every cancel they receive",
    ),
    "cancel_observed_without_kernel": (
        _busy_cancel_outside_kernel,
        "generate() and the Engine observe a cancel only at check points in QUEUED/DECODING and while "
        "a kernel is in flight (§4.9 safe points); once the reason is fixed (DRAINING) or the request "
        "ended, nothing looks at the flag. The ignore rows (D2) are for engines that still do",
    ),
    "racing_release": (
        lambda comp, step: step.tag.kind == "racing_release",
        "RequestRun releases each kind once, under its lock, so neither driver releases a released "
        "kind; the ignore row is how the ledger records a racing second release instead of freeing "
        "twice (§4.12 row 4; tests/test_ledger.py and the double_release mutant)",
    ),
    "transport_while_cancel_pending": (
        lambda comp, step: step.tag.kind == "transport_while_cancel",
        "the reference fails a transport only inside a send or past a reader's timeout (DECODING, "
        "DRAINING), never while a cancel waits for its safe point; the ignore row (D2) is for "
        "engines whose connection can fail at any moment",
    ),
    "scheduler_preempts": (
        lambda comp, step: step.tag.kind in ("preempt", "resume"),
        "generate() never preempts, and the Engine preempts when its own schedule needs the place "
        "(§4.8), not at a point a derived run could name; tests/test_engine.py drives swap and "
        "recompute, and the multi-request checker explores every preemption the sequence table allows",
    ),
    "stop_in_drained_tail": (
        lambda comp, step: step.tag.kind == "drain" and step.tag.stop == "hit",
        "RequestRun's stop matcher sees every byte the moment it is detokenized (a partial stop-id "
        "match withholds bytes from the stream, not from the matcher: D3), and a per-token "
        "detokenizer drains nothing at finish() but an unfinished character, which fails (D12); so "
        "no stop can complete in a drained tail. The row is there for engines that hold decoded "
        "text back",
    ),
    "raises_on_the_flush": (
        lambda comp, step: step.tag.kind == "drain_raises",
        "a request's own code that raises while its tail is sent (a content policy judging the "
        "flushed bytes) is not a fault a FaultPlan names; tests/test_engine.py drives it with a "
        "raising policy, which ends that request alone FAILED with model_error (D20)",
    ),
}


_BUSY = "scheduler: cancel observed while the loop is busy"
# Targets the model reaches only through UNREALIZABLE steps: target -> the UNREALIZABLE entry.
# tests/test_model_derived.py asserts that this is exactly what path search leaves unreached.
MODEL_ONLY: dict[tuple[str, ...], str] = {
    **{("fault", "environment: the cancel is repeated", pt): "repeated_cancel"
       for pt in ("prefill_in_flight", "decode_in_flight", "safe_point", "closing", "done")},
    ("ignore", "lifecycle", "CANCEL_REQUESTED", "cancel"): "repeated_cancel",
    ("ignore", "lifecycle", "CANCELLED", "cancel"): "repeated_cancel",
    **{("fault", _BUSY, pt): "cancel_observed_without_kernel"
       for pt in ("sending", "draining_finish", "draining_stop_hit", "draining_flush", "draining_end",
                  "closing", "done")},
    ("ignore", "lifecycle", "DRAINING", "cancel"): "cancel_observed_without_kernel",
    ("ignore", "lifecycle", "FINISHED", "cancel"): "cancel_observed_without_kernel",
    ("ignore", "lifecycle", "FAILED", "cancel"): "cancel_observed_without_kernel",
    ("row", "lifecycle", "DRAINING", "stop_hit"): "stop_in_drained_tail",
    ("row", "lifecycle", "DRAINING", "model_error"): "raises_on_the_flush",
    ("fault", "environment: the request's own code raises on the flushed bytes", "draining_flush"):
        "raises_on_the_flush",
    ("ignore", "resources", "RELEASED", "release"): "racing_release",
    **{("fault", "environment: a racing release of the KV cache", pt): "racing_release" for pt in ("closing", "done")},
    ("ignore", "lifecycle", "CANCEL_REQUESTED", "transport_error"): "transport_while_cancel_pending",
    **{("fault", "transport: the connection fails while the cancel is pending", pt): "transport_while_cancel_pending"
       for pt in ("prefill_in_flight", "decode_in_flight", "safe_point")},
    **{("row", "sequence", state, event): "scheduler_preempts"
       for state, event in (("RESIDENT", "preempt"), ("PARKED", "preempt"), ("SWAPPED", "resume"), ("SWAPPED", "drop"))},
    **{("fault", label, "top_of_step"): "scheduler_preempts"
       for label in ("scheduler: preempted (cache swapped out, place given back)", "scheduler: resumed (cache restored, a place taken)")},
    **{("fault", label, "draining_stop_hit"): "stop_in_drained_tail"
       for label in ("reader: reads one delta", "transport: the client disconnects",
                     "transport: the client reconnects and replays from its last seq")},
}


def _acts_before_admission(path: ModelPath) -> bool:
    return any(s.tag.kind in HARNESS_ACTIONS and s.point == "created" for s in path.steps) and any(
        s.tag.kind == "refuse" or (s.tag.kind == "observe" and s.point == "created") for s in path.steps)


# name -> (predicate on a derived path, reason): paths generate() realises and the Engine, the
# second driver of RequestRun, does not (each a real difference of the batched driver).
ENGINE_DIFFERENCES = {
    "admission_inside_submit": (
        _acts_before_admission,
        "Engine.submit creates and admits (or refuses) the request in one call: no reader or "
        "transport step comes between response.start and an admission that ends the request",
    ),
    "draining_waits_for_its_reader": (
        lambda path: ("PAUSED", "complete") in path.fired("stream"),
        "the Engine calls finish() on a DRAINING run only once its reader has caught up "
        "(engine._settle, §4.8), even when nothing is left to send; so it never completes on a "
        "PAUSED stream, while generate() goes on and completes there (the terminal has its slot)",
    ),
}


def engine_differs(path: ModelPath) -> list[str]:
    """The ENGINE_DIFFERENCES that keep the Engine from realising `path` as generate() does."""
    return [name for name, (pred, _) in ENGINE_DIFFERENCES.items() if pred(path)]


def allow(comp: RequestState, step: Step) -> bool:
    """The model steps a concrete run (generate() or the Engine) can reproduce (see UNREALIZABLE)."""
    return not any(pred(comp, step) for pred, _ in UNREALIZABLE.values())


def derive_paths() -> PathSet:
    """The covering paths of the default one-request model, restricted to realizable steps."""
    return covering_paths(allow=allow)


# ---------------------------------------------------------------- data: tokens and stops


@attrs.frozen
class Select:
    """What the lifecycle and the stream see of one selected token (None: not observed)."""

    kind: str  # "eos", "invalid", "push" or a token finish check's event (TOKEN_CHECK_IDS)
    delta: bool | None = False
    hit: bool | None = False


@attrs.frozen
class Drain:
    """What they see of DRAINING's finish() (§4.3): a decoding error, or tail delta, hit, flush."""

    invalid: bool
    tail: bool | None = False
    hit: bool | None = False
    flush: bool | None = False


def _simulate(tokens: Sequence[int], tok: ByteTableTokenizer) -> tuple[list[Select], Drain | None, list[bytes]]:
    """The runtime's data path for `tokens` (RequestRun.select, RunEffects.drain) without a loop."""
    detok = IncrementalDetokenizer(tok, prompt_ids=list(PROMPT))
    stopper = StopMatcher(list(STOP))
    ids = TokenStopMatcher(list(STOP_IDS))
    held: list[bytes] = []
    out: list[Select] = []
    deltas: list[bytes] = []
    for t in tokens:
        if t == EOS or t in _CHECK_OF_ID:
            out.append(Select("eos" if t == EOS else _CHECK_OF_ID[t]))
            break
        try:
            new = detok.push(t)
        except DecodingError:
            out.append(Select("invalid"))
            return out, None, deltas
        ids_hit = ids.push(t)
        held.append(new)
        keep = 0 if ids_hit else len(ids.held)
        new = b"".join(held[: len(held) - keep])
        del held[: len(held) - keep]
        if not new:
            out.append(Select("push", False, False))
            continue
        safe, hit = stopper.push(new)
        out.append(Select("push", bool(safe), hit is not None))
        if safe:
            deltas.append(safe)
        if hit is not None:
            return out, None, deltas
    try:
        tail = b"".join(held) + detok.finish()
    except DecodingError:
        return out, Drain(True), deltas
    safe, hit = stopper.push(tail) if tail else (b"", None)
    flush = b"" if hit is not None else stopper.flush()
    deltas += [d for d in (safe, flush) if d]
    return out, Drain(False, bool(safe), hit is not None, bool(flush)), deltas


def _matches(want: Select | Drain, got: Select | Drain) -> bool:
    if type(want) is not type(got):
        return False
    return all(w is None or w == g for w, g in zip(attrs.astuple(want), attrs.astuple(got)))


# ---------------------------------------------------------------- path -> concrete run


@attrs.frozen
class Plan:
    """The environment and request parameters a path asks for (before the tokens are chosen)."""

    selects: tuple[Select, ...]
    drain: Drain | None
    faults: tuple[Fault, ...]
    cancel_in_queue: bool
    max_output_tokens: int
    context_limit: int
    grammar_at: int | None
    interrupt_at: int | None
    reject: bool
    policy: str
    # harness actions on the stream: (deltas sent before, after the terminal?, action)
    actions: tuple[tuple[int, bool, str], ...]
    overflow_at: int | None  # index of the delta that overflows (buffer/fail policy)
    parked_cancel: bool  # a cancel requested while the producer waits for its reader (Engine)
    parked_actions: tuple[str, ...]  # harness actions the path takes after that cancel


def plan_of(path: ModelPath) -> Plan:
    """Walk the path's steps and record what each asks of the data, the faults and the request
    (by its tag's kind: STEP_RULES)."""
    walk = _Walk()
    for st in path.steps:
        if st.tag.kind in STEP_RULES:
            STEP_RULES[st.tag.kind](walk, st)
        elif st.tag.kind not in PASSIVE_STEPS:
            raise ValueError(f"a derived run has no rule for a {st.tag.kind} step (STEP_RULES, PASSIVE_STEPS)")
        if any(m == "stream" and e in ("complete", "cancel", "fail", "overflow") for m, _, e in st.fired):
            walk.terminal = True
    return Plan(tuple(walk.selects), walk.drain, tuple(walk.faults), walk.cancel_in_queue, walk.max_tokens,
                walk.context_limit, walk.grammar_at, walk.interrupt_at, walk.reject, path.policy,
                tuple(walk.actions), walk.overflow_at, walk.parked_cancel, tuple(walk.parked_actions))


@attrs.define
class _Walk:
    """A Plan as plan_of builds it, step by step; `t` counts the selected tokens, `seq` the deltas
    sent, `terminal` whether the stream has ended."""

    selects: list[Select] = attrs.Factory(list)
    drain: Drain | None = None
    faults: list[Fault] = attrs.Factory(list)
    actions: list[tuple[int, bool, str]] = attrs.Factory(list)
    parked_actions: list[str] = attrs.Factory(list)
    t: int = 0
    seq: int = 0
    terminal: bool = False
    cancel_in_queue: bool = False
    reject: bool = False
    parked_cancel: bool = False
    max_tokens: int = NO_LIMIT
    context_limit: int = 4096
    grammar_at: int | None = None
    interrupt_at: int | None = None
    overflow_at: int | None = None

    def deltas(self) -> int:
        """The non-empty chunks selected so far (the content policy sees each one, D11)."""
        return sum(1 for s in self.selects if s.delta)


# A select's tag token -> what the lifecycle and the stream see of it (a token check's event: itself).
_SELECTS: dict[str, Callable[[Any], Select]] = {
    "eos": lambda tag: Select("eos"),
    "invalid": lambda tag: Select("invalid"),
    "hold": lambda tag: Select("push", False, False),
    "push": lambda tag: Select("push", bool(tag.safe), tag.stop == "hit"),
}


def _select(walk: _Walk, st: PathStep) -> None:
    tag = st.tag
    walk.t += 1
    if tag.token in _SELECTS:
        walk.selects.append(_SELECTS[tag.token](tag))
    elif tag.token in TOKEN_CHECK_IDS:
        walk.selects.append(Select(tag.token))
    else:
        raise ValueError(f"a derived run has no token for a {tag.token} select (TOKEN_CHECK_IDS)")
    if tag.token == "invalid":
        walk.faults.append(Fault("token.selected", walk.t, "decoding_error"))
    if tag.token == "push" and tag.interrupt:  # the policy sees every non-empty chunk (D11)
        walk.interrupt_at = walk.deltas()


# What finish() finds at the drain (§4.3): nothing, a decoding error, else a tail delta.
_DRAINS = {"nothing": Drain(False, False, False, None), "invalid": Drain(True)}


def _drain(walk: _Walk, st: PathStep) -> None:
    tag = st.tag
    walk.drain = _DRAINS[tag.what] if tag.what in _DRAINS else \
        Drain(False, bool(tag.safe), None if tag.stop != "hit" else True, None)


def _flush(walk: _Walk, st: PathStep) -> None:
    assert walk.drain is not None
    drain = walk.drain = attrs.evolve(walk.drain, hit=False if walk.drain.hit is None else walk.drain.hit,
                                      flush=("stop_matcher", "HOLDING", "flush") in set(st.fired))
    if st.tag.interrupt:  # the policy refuses the flushed chunk: its call after every other (D23)
        walk.interrupt_at = walk.deltas() + bool(drain.tail) + 1


# A finish check's event -> the request parameter that fires it at this token (and its offset).
_CHECKS = {"length": ("max_tokens", 0), "context_full": ("context_limit", len(PROMPT)), "grammar_done": ("grammar_at", 0)}


def _check(walk: _Walk, st: PathStep) -> None:
    if st.tag.event in _CHECKS:
        field, offset = _CHECKS[st.tag.event]
        setattr(walk, field, walk.t + offset)


def _observe(walk: _Walk, st: PathStep) -> None:
    """A cancel or deadline seen at a check point: requested while parked (Engine), as a fault at
    creation, in the queue (a cancel by trace listener), or after the prefill or a decode."""
    tag, pt = st.tag, st.point
    if tag.parked:
        walk.parked_cancel = True
    elif pt == "created":
        walk.faults.append(Fault("request.created", 0, "cancel"))
    elif pt == "queued" and tag.what == "cancel":
        walk.cancel_in_queue = True
    elif pt == "queued":
        walk.faults.append(Fault("request.created", 0, "deadline"))
    elif tag.what is None:
        raise ValueError(f"the observed row at {pt!r} names no fault action (its tag has no `what`)")
    else:
        walk.faults.append(Fault("prefill.completed", 0, tag.what) if walk.t == 0
                           else Fault("decode.completed", walk.t, tag.what))


def _observe_busy(walk: _Walk, st: PathStep) -> None:
    walk.faults.append(Fault("prefill.started", 0, "cancel") if st.point == "prefill_in_flight"
                       else Fault("decode.started", walk.t, "cancel"))


def _model_error(walk: _Walk, st: PathStep) -> None:
    walk.faults.append(Fault("prefill.started", 0, "model_error") if st.tag.what == "prefill"
                       else Fault("decode.started", walk.t, "model_error"))


def _send_fails(walk: _Walk, st: PathStep) -> None:
    walk.faults.append(Fault("response.delta", walk.seq, "transport_error"))
    _unobserved_after_send(walk.selects, walk.drain)


def _overflow(walk: _Walk, st: PathStep) -> None:
    walk.overflow_at = walk.seq
    _unobserved_after_send(walk.selects, walk.drain)


def _refuse(walk: _Walk, st: PathStep) -> None:
    walk.reject = True


def _delta(walk: _Walk, st: PathStep) -> None:
    walk.seq += 1


def _harness(walk: _Walk, st: PathStep) -> None:
    if walk.parked_cancel and not walk.terminal:
        walk.parked_actions.append(st.tag.kind)  # done once the Engine has parked the run
    else:
        walk.actions.append((walk.seq, walk.terminal, st.tag.kind))


# The model steps this harness performs itself, by tag kind (the stream's reader and transport).
HARNESS_ACTIONS = ("read", "disconnect", "reconnect")
# What each kind of model step asks of a derived run (plan_of).
STEP_RULES: dict[str, Callable[[_Walk, PathStep], None]] = {
    "select": _select, "drain": _drain, "flush": _flush, "refuse": _refuse, "check": _check, "observe": _observe,
    "observe_busy": _observe_busy, "model_error": _model_error, "send_fails": _send_fails, "overflow": _overflow,
    "delta": _delta, **dict.fromkeys(HARNESS_ACTIONS, _harness),
}
# The kinds of model step that ask nothing of the data, the faults or the request: the runtime
# takes them itself (admission, scheduling, kernels, the terminal, parking), or they are never on a
# derived path (UNREALIZABLE).
PASSIVE_STEPS = frozenset({
    "start", "admit", "schedule", "kernel_done", "decode", "safe_point", "drain_hit", "drain_raises", "complete",
    "close", "request", "repeat_cancel", "transport_while_cancel", "racing_release", "park", "unpark", "preempt",
    "resume", "park_again", "unpark_idle",
})


def _unobserved_after_send(selects: list[Select], drain: Drain | None) -> None:
    """A failed send ends the run before its stop hit (or the flush) is looked at."""
    if drain is not None and drain.hit is None:
        return  # the tail's own send failed: hit and flush stay unobserved
    if selects and drain is None and selects[-1].kind == "push":
        selects[-1] = attrs.evolve(selects[-1], hit=None)


class NoConcreteData(LookupError):
    """No token script over TABLE gives the path's data outcomes (a gap in the fixture table)."""


def choose_tokens(plan: Plan, tok: ByteTableTokenizer) -> tuple[list[int], list[bytes]]:
    """The first script over ALPHABET whose simulated outcomes match the plan (and its byte cap)."""
    n = len(plan.selects)
    for script in itertools.product(ALPHABET, repeat=n):
        if plan.selects and plan.selects[-1].kind == "invalid":
            if script[-1] != UNSELECTED:
                continue  # the decoding error is injected; the token itself is plain text
            got, drain, deltas = _simulate(script[:-1], tok)
            got = [*got, Select("invalid")]
        else:
            got, drain, deltas = _simulate(script, tok)
        if len(got) != n or not all(_matches(w, g) for w, g in zip(plan.selects, got)):
            continue
        if plan.drain is not None and (drain is None or not _matches(plan.drain, drain)):
            continue
        if plan.policy == "buffer" and _byte_cap(plan, deltas) is None:
            continue
        return list(script), deltas
    raise NoConcreteData(f"no script of {n} tokens over the fixture table gives {plan.selects} / {plan.drain}")


def _byte_cap(plan: Plan, deltas: list[bytes]) -> int | None:
    """`buffer` policy: a max_bytes under which exactly the plan's overflow happens, or None."""
    reads = [a for a in plan.actions if a[2] in ("read", "reconnect") and not a[1]]
    unread: list[int] = []
    fit_need, over_limit = 1, None
    for k, d in enumerate(deltas):
        for a in reads:
            if a[0] == k:  # a read takes the oldest delta; a replay counts every unread one as read
                del unread[: 1 if a[2] == "read" else len(unread)]
        need = sum(unread) + len(d)
        if k == plan.overflow_at:
            over_limit = need - 1
            break
        fit_need = max(fit_need, need)
        unread.append(len(d))
    if over_limit is None:
        return fit_need
    return fit_need if fit_need <= over_limit else None


class Driver(enum.StrEnum):
    """Which driver of RequestRun realises a path: the single-path loop or the batched Engine."""

    GENERATE = "generate"
    ENGINE = "engine"


@attrs.frozen
class ConcreteRun:
    """A path made concrete: everything its driver needs, replayable (tests/regressions).

    `cancel_when_parked` (Engine only): the cancel is requested once the Engine has parked the run
    on its reader (a step that moves nothing), after `parked_actions` (the reads and transport
    steps the path takes after the cancel; the stream order is what is compared), then the Engine
    steps on (§4.8, §4.9).
    """

    path: ModelPath
    script: tuple[int, ...]
    request: Mapping[str, Any]
    context_limit: int
    faults: tuple[Fault, ...]
    cancel_in_queue: bool
    actions: tuple[tuple[int, bool, str], ...]
    grammar_at: int | None
    interrupt_at: int | None
    driver: Driver = attrs.field(default=Driver.GENERATE, converter=Driver)
    cancel_when_parked: bool = False
    parked_actions: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        if (self.cancel_when_parked or self.parked_actions) and self.driver is not Driver.ENGINE:
            raise ValueError("cancel_when_parked and parked_actions need the engine driver: "
                             "generate() never parks before a select")

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path.to_json(), "script": list(self.script), "request": dict(self.request),
            "context_limit": self.context_limit,
            "faults": [{"point": f.point, "step": f.step, "action": f.action.value} for f in self.faults],
            "cancel_in_queue": self.cancel_in_queue, "actions": [list(a) for a in self.actions],
            "grammar_at": self.grammar_at, "interrupt_at": self.interrupt_at,
            "driver": self.driver.value, "cancel_when_parked": self.cancel_when_parked,
            "parked_actions": list(self.parked_actions),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ConcreteRun:
        return cls(
            path=ModelPath.from_json(obj["path"]), script=tuple(obj["script"]), request=dict(obj["request"]),
            context_limit=obj["context_limit"], faults=tuple(Fault(**f) for f in obj["faults"]),
            cancel_in_queue=obj["cancel_in_queue"], actions=tuple(tuple(a) for a in obj["actions"]),
            grammar_at=obj["grammar_at"], interrupt_at=obj["interrupt_at"],
            driver=obj.get("driver", Driver.GENERATE), cancel_when_parked=obj.get("cancel_when_parked", False),
            parked_actions=tuple(obj.get("parked_actions", ())),
        )


def concretize(path: ModelPath, tok: ByteTableTokenizer | None = None) -> ConcreteRun:
    """Choose the tokens, request parameters and faults that reproduce `path` (module doc)."""
    plan = plan_of(path)
    tok = tok or tokenizer()
    script, deltas = choose_tokens(plan, tok)
    request: dict[str, Any] = {
        "stop": list(STOP), "stop_token_ids": [list(s) for s in STOP_IDS],
        "finish_tokens": {check: [tid] for check, tid in TOKEN_CHECK_IDS.items()},
        "max_output_tokens": plan.max_output_tokens, "policy": plan.policy,
        "max_buffer_events": 1 if plan.policy != "buffer" else LARGE,
        "max_buffer_bytes": _byte_cap(plan, deltas) if plan.policy == "buffer" else LARGE,
    }
    context_limit = len(PROMPT) if plan.reject else plan.context_limit
    driver = Driver.ENGINE if plan.parked_cancel else Driver.GENERATE
    return ConcreteRun(path, tuple(script), request, context_limit, plan.faults, plan.cancel_in_queue,
                       plan.actions, plan.grammar_at, plan.interrupt_at, driver, plan.parked_cancel,
                       plan.parked_actions)


# ---------------------------------------------------------------- running and projecting


class _CompleteAtCall:
    """A grammar whose output is complete at its n-th check (the path's grammar_done step)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def complete(self, text: str) -> bool:
        self.calls += 1
        return self.calls == self.n


class _InterruptAtCall:
    """A content policy that interrupts the n-th non-empty chunk (DECISIONS D11)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, so_far: bytes, chunk: bytes) -> bool:
        self.calls += 1
        return self.calls == self.n


class _Harness:
    """The stream's reader and transport (read_inline=False): performs the path's reads,
    disconnects and reconnects, and logs the stream steps the trace does not (block, unblock,
    replay) at their trace position."""

    def __init__(self, run: ConcreteRun) -> None:
        self.actions = list(run.actions)
        self.cancel_in_queue = run.cancel_in_queue
        self.rt: Any = None
        self.extra: list[tuple[int, str]] = []  # (trace position, stream event)
        self.sent = 0
        self.read_seq = -1

    def on_run(self, rt: Any) -> None:
        self.rt = rt
        if self.cancel_in_queue:
            rt.trace.subscribe(self._cancel_when_queued)
        self._act(0, False)

    def _cancel_when_queued(self, ev: Event) -> None:
        if ev.kind == K.LIFECYCLE and ev.data.get("to") == "QUEUED":
            self.rt.cancel(source="model-derived")

    def on_delta(self, data: bytes) -> None:
        self.sent += 1
        if str(self.rt.stream.state) == "PAUSED":
            self._log("block")
        self._act(self.sent, False)

    def after(self) -> None:
        self._act(self.sent, True)

    def _log(self, event: str) -> None:
        self.extra.append((len(self.rt.trace.events), event))

    def _act(self, sent: int, after_terminal: bool) -> None:
        due = []
        while self.actions and self.actions[0][:2] == (sent, after_terminal):
            due.append(self.actions.pop(0)[2])
        self.perform(due)

    def perform(self, actions: Iterable[str]) -> None:
        """Do each harness action (read, disconnect, reconnect) now, logging the untraced steps."""
        stream = self.rt.stream
        for what in actions:
            before = str(stream.state)
            if what == "read":
                while (ev := stream.get(timeout=0)) is not None and ev.kind is not StreamEventKind.DELTA:
                    pass
                if ev is not None:
                    self.read_seq = ev.seq
            elif what == "disconnect":
                stream.disconnect()
            else:
                stream.reconnect()
                seqs = [ev.seq for ev in stream.replay(self.read_seq) if ev.kind is StreamEventKind.DELTA]
                self.read_seq = max(seqs, default=self.read_seq)  # the replay counts as read
                self._log("replay")
            if before == "PAUSED" and str(stream.state) == "OPEN":
                self._log("unblock")


def execute(run: ConcreteRun, tok: ByteTableTokenizer | None = None) -> tuple[list[Event], list[tuple[int, str]]]:
    """Run `run` on its driver; the full trace and the harness-observed stream steps."""
    tok = tok or tokenizer()
    h = _Harness(run)
    req = dict(run.request)
    req["stop_token_ids"] = [tuple(s) for s in req["stop_token_ids"]]
    if run.grammar_at is not None:
        req["grammar"] = _CompleteAtCall(run.grammar_at)
    if run.interrupt_at is not None:
        req["content_policy"] = _InterruptAtCall(run.interrupt_at)
    model = ScriptedModel([*run.script, UNSELECTED, UNSELECTED], vocab_size=max(TABLE) + 1,
                          context_limit=run.context_limit)
    request, faults = Request(list(PROMPT), **req), FaultPlan(run.faults)
    if run.driver is Driver.ENGINE:
        _on_engine(run, h, request, faults, model, tok)
    else:
        generate(request, model=model, tokenizer=tok, faults=faults,
                 on_run=h.on_run, on_delta=h.on_delta, read_inline=False)
    h.after()
    return list(h.rt.trace.events), h.extra


class EngineStalled(AssertionError):
    """The Engine run did not reach the state its path asks for (parked, or ended)."""


def _on_engine(run: ConcreteRun, h: _Harness, request: Request, faults: FaultPlan, model: Any,
               tok: ByteTableTokenizer) -> None:
    """The Engine drives the run (runtime/engine.py): stepped on this thread until idle or until
    nothing moves (the run is parked on its reader, §4.8); a parked cancel is requested then."""
    eng = Engine(model, tok, max_batch=1, detach_timeout_s=PAUSE_TIMEOUT_S)
    rt = eng.submit(request, faults=faults)  # admitted (CREATED -> QUEUED) inside submit
    rt.on_delta(h.on_delta)
    h.on_run(rt)
    if h.cancel_in_queue:
        eng.cancel(request.request_id, source="model-derived")
    eng.run_until_idle()
    if run.cancel_when_parked:
        if rt.done or not rt.stream.would_block():
            raise EngineStalled(f"expected the Engine to park the run on its reader; it is {rt.state}, "
                                f"stream {rt.stream.state.value}")
        h.perform(run.parked_actions)
        eng.cancel(request.request_id, source="model-derived")
        eng.run_until_idle()
    if not rt.done:
        raise EngineStalled(f"the Engine left the run in {rt.state} (stream {rt.stream.state.value})")


def project(events: Sequence[Event], extra: Iterable[tuple[int, str]] = ()) -> dict[str, list[tuple[str, str]]]:
    """Per machine (lifecycle, stream, resources[kind]) the (state, event) steps of a trace.

    The mapping is the `refinement` monitor's: lifecycle.transition / lifecycle.ignored give their
    event; token.selected is `select`; decode.completed is `decode_done` when the lifecycle is in
    DECODING (elsewhere its ignore row is logged); stop.hit in DRAINING is the self-loop
    `stop_hit`; response.* and transport disconnect/reconnect are stream events (a failed event
    whose error names the overflow is `overflow`); resource.* are the resources events of their
    kind. `extra`: stream events the harness observed, each before the trace event at its position.
    """
    life = compiled("lifecycle").new()
    steppers: dict[str, Any] = {"lifecycle": life}
    out: dict[str, list[tuple[str, str]]] = {}
    pending = sorted(extra, key=lambda x: x[0])

    def add(machine: str, event: str) -> None:
        st = steppers.get(machine)
        if st is None:
            st = steppers[machine] = compiled(machine_of(machine)).new()
        state = str(st.state)
        out.setdefault(machine, []).append((state, event))
        with contextlib.suppress(IllegalTransition):  # recorded as is: the comparison with the path shows it
            st.fire(event)

    for e in events:
        while pending and pending[0][0] <= e.index:
            add("stream", pending.pop(0)[1])
        k, d = e.kind, e.data
        if k in (K.LIFECYCLE, K.LIFECYCLE_IGNORED):
            add("lifecycle", d["event"])
        elif k == K.TOKEN_SELECTED:
            add("lifecycle", "select")
        elif k == K.DECODE_COMPLETED and str(life.state) == "DECODING":
            add("lifecycle", "decode_done")
        elif k == K.STOP_HIT and str(life.state) == "DRAINING":
            add("lifecycle", "stop_hit")
        elif k == K.RESPONSE_START:
            add("stream", "start")
        elif k == K.RESPONSE_DELTA:
            add("stream", "delta")
        elif k in TERMINAL_KINDS:
            ev = {K.RESPONSE_COMPLETED: "complete", K.RESPONSE_CANCELLED: "cancel"}.get(K(k))
            add("stream", ev or ("overflow" if "overflow" in str(d.get("error", "")) else "fail"))
        elif k == K.TRANSPORT and d.get("what") in ("disconnect", "reconnect"):
            add("stream", d["what"])
        elif k in (K.RESOURCE_ACQUIRED, K.RESOURCE_RELEASED):
            add(f"resources[{d['resource']}]", "acquire" if k == K.RESOURCE_ACQUIRED else "release")
    for _, event in pending:
        add("stream", event)
    return out


def expected(path: ModelPath) -> dict[str, list[tuple[str, str]]]:
    """The path's own per-machine steps, for the machines the runtime is compared on."""
    return {m: path.fired(m) for m in path.machines() if machine_of(m) in COMPARED}


def mismatches(path: ModelPath, got: Mapping[str, list[tuple[str, str]]]) -> dict[str, tuple[list, list]]:
    """Machines whose projected steps differ from the path: name -> (path's, runtime's)."""
    want = expected(path)
    return {m: (want.get(m, []), list(got.get(m, []))) for m in sorted(set(want) | set(got))
            if want.get(m, []) != list(got.get(m, []))}


def covered(got: Mapping[str, list[tuple[str, str]]]) -> set[tuple[str, str, str]]:
    """(table, state, event) of every step in a projection (resources of all kinds together)."""
    return {(machine_of(m), s, e) for m, steps in got.items() for s, e in steps}


# ---------------------------------------------------------------- regression cases


def load_regressions(folder: str | Path) -> list[tuple[str, ConcreteRun]]:
    """Every regression case (JSON: a replayable path and its concrete run) in `folder`."""
    out = []
    for p in sorted(Path(folder).glob("*.json")):
        out.append((p.stem, ConcreteRun.from_json(json.loads(p.read_text()))))
    return out


def save_regression(folder: str | Path, name: str, run: ConcreteRun) -> Path:
    """Keep a counterexample found later as a regression case."""
    p = Path(folder) / f"{name}.json"
    p.write_text(json.dumps(run.to_json(), indent=1) + "\n")
    return p
