"""The abstract model the checker explores: one request of the §4.3 loop driven through the tables.

A request is a record of small ints (machine/checker_state.RequestState): the loop's program counter
(a value of PC: which line of generate() it is at), the state index of each control machine
(lifecycle, stream, the five resources, stop matcher, detokenizer, sequence) and bounded data
(tokens selected and decoded, deltas sent, finish reason, cancel/deadline progress, kernel in
flight, backpressure policy, unread deltas, reader connection). A step under construction (`Step`)
changes a list of its fields through their indices `F`. `Model.expand(comp)` lists every successor: the loop's next step (with its
data-dependent choices: EOS or not, what the detokenizer and the stop matcher make of the bytes,
which finish check fires, whether the content policy refuses a chunk) and the environment's
injections (cancel, deadline, model error, decoding error, transport error, a slow or disconnected
reader, a reconnect).

Where spec/DECISIONS.md and the reference runtime fix a point, the model does what the runtime
does: the content policy judges a token's safe chunk before it is queued, so the interrupting chunk
is never sent (D11, the emit phase of runner.py's step); a reconnect's replay counts every retained
delta as read, so it drains the unread buffer and resumes a paused producer (OrderedStream.replay);
a cancel that arrives while a pause-policy producer waits for its reader is observed at the check
point at the top of the step (the Engine parks such a run before its select, `PARKED_CANCEL`),
never inside a paused send (generate() waits there in OrderedStream.delta and looks at nothing).

Every control step fires the table event the runtime would fire (runtime/runner.py does the same
in the same order), so the tables decide: a table change changes the explored behaviour. A step
that the table refuses ends that branch with a `refinement` violation. Edge checks (a transition
that breaks an invariant) and witnesses (sometimes-properties) are attached to each local step;
state checks are evaluated once per distinct request tuple (machine/checker_invariants.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from ..spec import DecisionKind, FinishReason, Spec, Table, load_spec
from ..spec.derived import (
    detokenizer_states,
    driver_states,
    final_reasons,
    model_resources_of,
    resource_states,
    sequence_states,
    stop_states,
    stream_end_of,
    stream_states,
    terminal_stream_event,
)
from ..spec.vocabulary import STEP_NEEDS
from .actions import Executor, run_phases
from .checker_state import (
    CANCEL,
    DEADLINE,
    EOS,
    FIELD_OF,
    KERNEL,
    PC,
    PC_NAMES,
    READER,
    RES_FIELD,
    RESOURCE_KINDS,
    Cancel,
    Deadline,
    F,
    Judged,
    Kernel,
    Reader,
    RequestState,
)

MACHINES = ("lifecycle", "stream", "resources", "stop_matcher", "detokenizer", "sequence")
REASONS = (None, *FinishReason)  # index 0: no reason fixed yet

# A pause-policy producer whose reader is behind waits for it at the top of a step (the Engine
# parks it there, runtime/engine.py); a cancel requested meanwhile is observed at this check point.
PARKED_CANCEL = "loop: cancel observed at a check point while the producer is parked on its reader"

# What the stop matcher makes of a push's bytes, and whether safe bytes remain (all of them, or
# only plain text when ModelConfig.byte_choices is off).
_STOP_OUTCOMES = {True: (("clear", True), ("hold", True), ("hold", False), ("hit", True), ("hit", False)),
                  False: (("clear", True),)}

# The loop's label of a finish check that wins at PC.finish_checks.
_CHECK_LABELS = {"stop_hit": "loop: stop hit: finish reason stop_sequence, tails discarded",
                 "length": "loop: max_output_tokens reached"}


# What the environment may inject (ModelConfig.faults): a cancel (and its repetition), a deadline,
# a model error in a kernel, a failed send, the reader's disconnect and reconnect. (The reader's
# reads are not a fault: a paused producer needs them to go on.)
FAULTS = ("cancel", "deadline", "model_error", "transport_error", "disconnect")
# The most requests one search explores at once (machine/checker.check, `decodespec check --requests`).
MAX_REQUESTS = 3

# The model's one implementation of each guard of the lifecycle table's [finish_guards] (D31):
# does the guard hold for the t-th token of a request whose guard field is `field` (RequestState.guard's name)?
# A min_tokens request asks for MIN_TOKENS tokens, so its first token cannot end it by EOS.
MIN_TOKENS = 1
FINISH_GUARDS = {
    "ignore_eos": lambda field, t: field == "ignore_eos",
    "min_tokens": lambda field, t: field == "min_tokens" and t <= MIN_TOKENS,
}


@attrs.frozen
class ModelConfig:
    """Bounds of the explored model (small: max_output_tokens <= 3 for the default runs)."""

    max_output_tokens: int = 2
    policies: tuple[str, ...] = ("pause", "buffer")
    buffer_cap: int = 1
    finish_conditions: bool = True  # context_full, grammar_done, content_interrupt as choices
    preemptions: int = 1  # how often the scheduler may preempt one request (§4.8 swap/recompute)
    byte_choices: bool = True  # every detokenizer/stop-matcher outcome of a token, else plain text
    faults: tuple[str, ...] = FAULTS  # the environment's injections (see FAULTS)
    # requests that set a finish guard's field (FINISH_GUARDS), beside the plain ones (first policy only)
    guards: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.max_output_tokens <= 8:
            raise ValueError(f"max_output_tokens must be 1..8 for model checking, got {self.max_output_tokens}")
        known = set(load_spec("stream").params["policies"])
        if not self.policies or not set(self.policies) <= known:
            raise ValueError(f"policies must be a non-empty subset of {sorted(known)}, got {self.policies}")
        if self.buffer_cap < 1:
            raise ValueError(f"buffer_cap must be >= 1, got {self.buffer_cap}")
        if not 0 <= self.preemptions <= 3:
            raise ValueError(f"preemptions must be 0..3, got {self.preemptions}")
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
        unknown = sorted(set(self.guards) - set(FINISH_GUARDS))
        if unknown:
            raise ValueError(f"unknown guard(s) {unknown}; known: {', '.join(FINISH_GUARDS)}")


class Machine:
    """Integer dispatch of one table: `step[state][event] -> (target, is_row, reason index, plan)`;
    the plan runs the row's action, effect by effect, through the model's executor (actions.py)."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.name = table.name
        self.states = table.states
        self.index = {s: i for i, s in enumerate(table.states)}
        self.terminal = tuple(s in table.terminal for s in table.states)
        plans = EXECUTORS[table.name].plans(table)
        self.step: tuple[dict[str, tuple], ...] = tuple(
            {
                e: (self.index[d.target], d.kind is DecisionKind.ROW,
                    REASONS.index(FinishReason(d.reason)) if d.reason else 0, plans[(s, e)])
                for e in table.events
                if (d := table.decision(s, e)).kind is not DecisionKind.REJECT
            }
            for s in table.states
        )

    def i(self, state: str) -> int:
        return self.index[state]

    def ids(self, states: Iterable[str]) -> frozenset[int]:
        """The indices of `states`."""
        return frozenset(self.index[s] for s in states)

    def targets(self, event: str) -> frozenset[int]:
        """The states a row of `event` leads to."""
        return frozenset(step[event][0] for step in self.step if event in step and step[event][1])


@attrs.frozen
class Tag:
    """What a model step is, as data: machine/paths.py and properties/
    model_derived.py read the tag; the label is for people.

    `kind`: start, admit, refuse, schedule, kernel_done, model_error, select, check, decode,
    delta, send_fails, overflow, safe_point, drain, drain_hit, flush, complete, close, observe (a
    cancel or deadline seen at a check point or before admission), observe_busy, request (a cancel
    or deadline asked for), repeat_cancel, transport_while_cancel, racing_release, read,
    disconnect, reconnect, park, unpark, preempt, resume, park_again, unpark_idle.
    `token` (select): eos, a token check's event, invalid, hold or push; `stop`: the stop matcher's
    outcome; `safe`: safe bytes non-empty; `event`: the finish check that wins; `what`: the kernel
    (prefill, decode), what is observed or requested (cancel, deadline), or what finish() finds
    (nothing, invalid, tail); `interrupt`: the content policy refuses the chunk; `parked`: observed
    while parked on the reader; `fault`: an environment fact, a fault point of paths.py.
    """

    kind: str
    token: str | None = None
    stop: str | None = None
    safe: bool | None = None
    event: str | None = None
    what: str | None = None
    interrupt: bool = False
    parked: bool = False
    fault: bool = False


# The invariants a model step reports as it happens (Step.violate), and where. The rest of the
# checker's side: the state checks (machine/checker_invariants.py) and the search (checker.py).
STEP_CHECKS = {
    "refinement": "Step.fire: the loop fires an event the table refuses",
    "terminal_irreversible": "Step.fire: a row leaves a terminal state",
    "observed_cancel_ends_cancelled": "Step.lc: a terminal transition out of CANCEL_REQUESTED other than CANCELLED",
    "transport_failure_reported_as_such": "Step.lc: a transport error ends the request with another reason",
    "no_select_after_cancel_observed": "Step.lc: a selection in CANCEL_REQUESTED",
    "no_select_while_draining": "Step.lc: a selection in DRAINING",
    "nothing_after_stop_hit": "Step.lc and Model._send: a selection or a delta after the stop hit",
    "release_exactly_once": "the free effect: a resource freed twice",
    "refused_chunk_never_sent": "Model._interrupt: a step order that sends the chunk the content policy refuses",
    "no_delta_after_terminal": "Model._send: a delta sent after the terminal event",
}


class Step:
    """One local transition under construction: the fields it changes and the events it fires."""

    __slots__ = ("m", "f", "fired", "bad", "pool", "needs_slot", "label", "tag", "dead", "overflow",
                 "passed", "released", "held_out", "raised")

    def __init__(self, model: Model, comp: RequestState, label: str, tag: Tag) -> None:
        self.m = model
        self.f = list(comp)  # the request's fields, changed in place by index (F.pc, F.lifecycle, ...)
        self.fired: list[tuple[str, str, str]] = []
        self.bad: list[tuple[str, str]] = []  # (invariant, message): what this step breaks
        self.pool = 0
        self.needs_slot = False
        self.label = label
        self.tag = tag
        self.dead = False
        self.overflow = False  # the terminal event is the stream's overflow (D6)
        # What the detokenizer's and the stop matcher's effects did with this step's bytes.
        self.passed = self.released = self.held_out = self.raised = False

    def fire(self, machine: str, event: str, field: int | None = None) -> int | None:
        """Fire `event` on `machine` (resources: at `field`); None when the table refuses it."""
        if self.dead:
            return None
        mach = self.m.machines[machine]
        field = FIELD_OF[machine] if field is None else field
        s = self.f[field]
        name = machine if machine != "resources" else f"resources[{RESOURCE_KINDS[field - F.trace_handle]}]"
        entry = mach.step[s].get(event)
        if entry is None:  # the refinement record: the one phase loop's `refused` hook
            return run_phases(None, (), int, refused=lambda: self._refused(name, mach.states[s], event))
        target, is_row, reason, plan = entry
        if mach.terminal[s] and target != s:
            self.violate("terminal_irreversible", f"{name} left terminal state {mach.states[s]} on '{event}'")
        return run_phases(plan, (self, field, target, reason), self._enter, (name, mach.states[s], event, field, target))

    def violate(self, name: str, message: str) -> None:
        """Report that this step breaks invariant `name` (one of STEP_CHECKS)."""
        if name not in STEP_CHECKS:
            raise KeyError(f"a model step reports '{name}', which STEP_CHECKS does not list")
        self.bad.append((name, message))

    def post(self) -> RequestState:
        """The request after this step."""
        return RequestState._make(self.f)

    def _enter(self, name: str, state: str, event: str, field: int, target: int) -> int:
        """The state change of a fired step: recorded as fired, the machine's field set."""
        self.fired.append((name, state, event))
        self.f[field] = target
        return target

    def _refused(self, name: str, state: str, event: str) -> None:
        self.fired.append((name, state, event))
        self.violate("refinement", f"{name}: the loop fires '{event}' in {state} and the table refuses it")
        self.dead = True

    # ---- helpers the loop steps share -----------------------------------------------------

    def lc(self, event: str, *, overflow: bool = False) -> str | None:
        """Fire a lifecycle event as runner.fire does: the row's action runs its effects (release
        the model resources before the change, emit the terminal event after it, §4.3)."""
        if event == "select":
            self._select_checks()
        self.overflow = overflow
        before = self.f[F.lifecycle]
        target = self.fire("lifecycle", event)
        if target is None:
            return None
        life = self.m.life
        if life.terminal[target] and not life.terminal[before]:
            if before in self.m.cancel_observed and target not in self.m.cancelled:
                self.violate("observed_cancel_ends_cancelled", f"a cancel was observed, then '{event}' ends "
                             f"{life.states[target]}")
            if event == "transport_error" and REASONS[self.f[F.reason]] != FinishReason.TRANSPORT_ERROR:
                self.violate("transport_failure_reported_as_such", f"a transport error ends {life.states[target]} "
                             f"with reason {REASONS[self.f[F.reason]]}")
        return life.states[target]

    def _select_checks(self) -> None:
        f, m = self.f, self.m
        life = f[F.lifecycle]
        if life in m.cancel_observed:
            self.violate("no_select_after_cancel_observed", "a token is selected after the cancel was observed")
        elif life in m.draining:
            self.violate("no_select_while_draining", f"a token is selected in {m.life.states[life]}")
        if REASONS[f[F.reason]] == FinishReason.STOP_SEQUENCE or f[F.stop_matcher] in m.stop_hit:
            self.violate("nothing_after_stop_hit", "a token is selected after the stop hit")

    def release(self, kind: str) -> None:
        field = RES_FIELD[kind]
        if self.f[field] in self.m.held:
            self.fire("resources", "release", field)

    def acquire(self, kind: str) -> None:
        self.fire("resources", "acquire", RES_FIELD[kind])

    def send(self, ret: int) -> None:
        """emit_delta_if_nonempty: hand the safe bytes to the stream, then continue at `ret`."""
        self.f[F.pc] = PC.sending
        self.f[F.ret] = ret

    def out(self, nonempty: bool, ret: int, gone: bool | None = None) -> None:
        """The step's bytes leave if the effects passed them on (`gone`; default: the detokenizer
        passed them and the stop matcher released them); bytes that neither went out nor were
        dropped by a row are lost (RequestState.lost)."""
        if gone is None:
            gone = self.passed and self.released
        if not nonempty:
            self.f[F.pc] = ret
        elif gone:
            self.send(ret)
        else:
            self.f[F.lost] = 1
            self.f[F.pc] = ret

    def push(self, detok: str, stop: str | None) -> None:
        """One push through the detokenizer and (its bytes) the stop matcher."""
        self.passed = self.released = False
        self.fire("detokenizer", detok)
        if stop is not None:
            self.fire("stop_matcher", stop)

    def discard_match(self) -> None:
        """After a hit: the stop matcher's discard row; a row that lets the held match out sends it."""
        self.held_out = False
        self.fire("stop_matcher", "discard")
        if self.held_out:
            self.send(self.f[F.pc])

    def after_lifecycle(self, state: str | None, *, default: int) -> None:
        """Where the loop goes once the table has answered (the runtime reads its state)."""
        if state is None:
            return  # refused: the branch is dead
        m = self.m
        i = m.life.index[state]
        if m.life.terminal[i]:
            return  # terminal: terminal_event set PC.closing
        if i in m.cancel_observed:
            self.f[F.pc] = PC.safe_point if self.f[F.kernel] == KERNEL.none else self.f[F.pc]
        elif i in m.draining and default in (PC.top_of_step, PC.finish_checks):
            self.f[F.pc] = PC.draining_finish
        else:
            self.f[F.pc] = default


# ---- the model's implementation of every effect (machine/actions.py) --------------------------
# Each runs on the Step under construction as (step, field, target state index, reason index).

LIFECYCLE = Executor("lifecycle", "the checker model")
STREAM = Executor("stream", "the checker model")
RESOURCES = Executor("resources", "the checker model")
STOP = Executor("stop_matcher", "the checker model")
DETOK = Executor("detokenizer", "the checker model")
SEQUENCE = Executor("sequence", "the checker model")
EXECUTORS = {x.table: x for x in (LIFECYCLE, STREAM, RESOURCES, STOP, DETOK, SEQUENCE)}


@LIFECYCLE.effect("release_model")
def _release_model(s: Step, field: int, target: int, reason: int) -> None:
    for kind in s.m.model_kinds:
        s.release(kind)


@LIFECYCLE.effect("fix_reason")
def _fix_reason(s: Step, field: int, target: int, reason: int) -> None:
    s.f[F.reason] = reason


@LIFECYCLE.effect("emit_terminal")
def _emit_terminal(s: Step, field: int, target: int, reason: int) -> None:
    state = s.m.life.states[target]
    s.fire("stream", "overflow" if s.overflow else s.m.stream_event_of.get(state, "fail"))
    s.f[F.pc] = PC.closing


@LIFECYCLE.effect("acquire_model")
def _acquire_model(s: Step, field: int, target: int, reason: int) -> None:
    for kind in s.m.model_kinds:
        s.acquire(kind)
    s.f[F.kernel] = KERNEL.prefill


LIFECYCLE.abstracts("observe_cancel", "the loop's cancel progress (RequestState.cancel) is the observation; "
                    "its trace entry is checked by cancel_observed_after_requested")
LIFECYCLE.abstracts("discard_result", "the model holds no logits; no_select_after_cancel_observed checks "
                    "that no token comes from a discarded result")


@STREAM.effect("queue_delta")
def _queue_delta(s: Step, field: int, target: int, reason: int) -> None:
    s.f[F.seq] += 1
    s.f[F.unread] += 1


@STREAM.effect("queue_terminal")
def _queue_terminal(s: Step, field: int, target: int, reason: int) -> None:
    s.f[F.terminals] += 1


@STREAM.effect("replay")
def _replay(s: Step, field: int, target: int, reason: int) -> None:
    s.f[F.unread] = 0


@STREAM.effect("detach")
def _detach(s: Step, field: int, target: int, reason: int) -> None:
    s.f[F.reader] = READER.disconnected


@STREAM.effect("attach")
def _attach(s: Step, field: int, target: int, reason: int) -> None:
    s.f[F.reader] = READER.reconnected


STREAM.abstracts("open", "response.start: the stream's OPEN state is the fact")
STREAM.abstracts("pause", "the PAUSED state is the fact: the loop does not send from it")
STREAM.abstracts("resume", "the OPEN state is the fact: the loop sends again")


@RESOURCES.effect("free")
def _free(s: Step, field: int, target: int, reason: int) -> None:
    bit = 1 << (field - F.trace_handle)
    if s.f[F.freed] & bit:
        s.violate("release_exactly_once", f"{RESOURCE_KINDS[field - F.trace_handle]} freed twice")
    s.f[F.freed] |= bit


@STOP.effect("release_safe")
def _release_safe(s: Step, field: int, target: int, reason: int) -> None:
    s.released = True


@STOP.effect("release_held")
def _release_held(s: Step, field: int, target: int, reason: int) -> None:
    s.held_out = True


STOP.abstracts("hold_suffix", "the model keeps no bytes: HOLDING says a suffix is held")
STOP.abstracts("cut_at_match", "the model keeps no bytes: HIT says the match is held back")
STOP.abstracts("drop_held", "dropping is sending nothing: DISCARDED says the held bytes are gone, and the model "
              "sends only what a row releases")


@DETOK.effect("pass_complete")
@DETOK.effect("pass_tail")
def _pass_bytes(s: Step, field: int, target: int, reason: int) -> None:
    s.passed = True


@DETOK.effect("raise_error")
def _raise_error(s: Step, field: int, target: int, reason: int) -> None:
    s.raised = True


@SEQUENCE.effect("take_place")
def _take_place(s: Step, field: int, target: int, reason: int) -> None:
    s.pool -= 1  # the product search lets this step run only while a place is free
    s.needs_slot = True


@SEQUENCE.effect("give_place")
def _give_place(s: Step, field: int, target: int, reason: int) -> None:
    s.pool += 1


SEQUENCE.abstracts("snapshot_cache", "the model keeps no cache contents: that a resumed sequence decodes "
                   "the same tokens is an Engine test (tests/test_engine.py, swap and recompute)")
SEQUENCE.abstracts("restore_cache", "the model keeps no cache contents: RESIDENT is the fact, and that the restored "
                   "cache decodes the same tokens is an Engine test (tests/test_engine.py)")
SEQUENCE.abstracts("hold_reader", "PARKED is the fact: the loop selects nothing from it")
SEQUENCE.abstracts("release_reader", "RESIDENT is the fact: the loop selects again")
SEQUENCE.abstracts("forget", "DONE is the fact: the request has nothing left to run")


DETOK.abstracts("hold_partial", "the model keeps no bytes: PENDING says a partial character is held")
DETOK.abstracts("drop_pending", "dropping is passing nothing on: DISCARDED says the pending bytes are gone")


class Model:
    """The local (one-request) transition relation over request tuples, for a set of tables."""

    def __init__(self, tables: Spec | Mapping[str, Table] | None = None, config: ModelConfig | None = None) -> None:
        tables = {n: tables[n] for n in MACHINES} if isinstance(tables, Spec) else dict(tables or {})
        unknown = set(tables) - set(MACHINES)
        if unknown:
            raise ValueError(f"unknown machine(s) {sorted(unknown)}; the checker uses {MACHINES}")
        self.tables = {name: tables.get(name) or load_spec(name) for name in MACHINES}
        self.machines = {name: Machine(t) for name, t in self.tables.items()}
        self.life = self.machines["lifecycle"]
        self.stream = self.machines["stream"]
        self.res = self.machines["resources"]
        self.stop = self.machines["stop_matcher"]
        self.detok = self.machines["detokenizer"]
        self.seq = self.machines["sequence"]
        self.config = config or ModelConfig()
        self._places = _places(self.seq)  # per sequence state: does it hold a batch place?
        # guards: per sequence state, the allowed events that would take a second place or give
        # back one it does not hold (what the Engine must be refused, as a second acquire is)
        self.place_guards = tuple(
            tuple((e, "takes a second place" if self._places[i] else "gives back a place it does not hold")
                  for e, (_, _, _, plan) in self.seq.step[i].items()
                  if (plan.has("take_place") and self._places[i]) or (plan.has("give_place") and not self._places[i]))
            for i in range(len(self.seq.states)))
        self._policy_names = self.config.policies
        # Derived from these tables (spec/derived.py), not the shipped ones: a changed table is
        # checked against its own terminal events and final reasons.
        life, stream = self.tables["lifecycle"], self.tables["stream"]
        self.stream_event_of = terminal_stream_event(life, stream)
        self.stream_end_of = stream_end_of(life, stream)
        self.model_kinds = model_resources_of(self.tables["resources"])  # released before the terminal event (§4.10)
        self.reasons_of_state = final_reasons(life)
        self._find_state_sets()
        # The lifecycle table's finish checks, in its order (D4): the loop below runs this list.
        self.finish_order = tuple(c.event for c in self.life.table.finish_checks)
        self.token_checks = tuple(c.event for c in self.life.table.finish_checks if c.tokens)
        # The guards the table gives each check (D31), each run through FINISH_GUARDS, checked both ways.
        declared = self.life.table.finish_guards
        undone, unused = [g for g in declared if g not in FINISH_GUARDS], [g for g in FINISH_GUARDS if g not in declared]
        if undone or unused:
            raise ValueError(f"lifecycle finish guards and the checker model's FINISH_GUARDS differ: declared without an "
                             f"implementation {undone}, implemented but not declared {unused}")
        self.unless = {c.event: c.unless for c in self.life.table.finish_checks}
        # The order of the loop's step (the table's [[step]], D53): which observation comes first at
        # a check point, and whether a token's bytes are emitted before the finish checks judge them.
        order = tuple(p.phase for p in self.life.table.step)
        if sorted(order) != sorted(STEP_NEEDS):
            raise ValueError(f"{self.life.table.source}: [[step]] lists {list(order)}; the checker model runs "
                             f"every phase of {list(STEP_NEEDS)} once")
        self.observe_order = tuple(p for p in order if p in _OBSERVERS)
        self.emit_first = order.index("emit") < order.index("finish_checks")

    def _find_state_sets(self) -> None:
        """The states the runtime branches on, as spec/derived.py finds them in these tables (state
        indices; the shipped names in the comments), not refused where a set is empty or wide: the
        checker judges a table the runtime would refuse. A lifecycle terminal state is named by its
        stream event (lifecycle.toml `terminal_events`)."""
        t = self.tables
        drivers = driver_states(t["lifecycle"], refuse=False)
        self.cancel_observed = self.life.ids(drivers.cancel_observed)  # CANCEL_REQUESTED
        self.draining = self.life.ids(drivers.draining)  # DRAINING
        self.finished, self.cancelled = (self.life.ids(s for s, e in self.stream_event_of.items() if e == event)
                                         for event in ("complete", "cancel"))  # FINISHED, CANCELLED
        where = stream_states(t["stream"], refuse=False)
        self.sending, self.paused = self.stream.ids(where.sending), self.stream.ids(where.paused)  # OPEN, PAUSED
        self.stream_new = self.stream.i(t["stream"].initial)  # NEW: not started
        self.held = self.res.ids(resource_states(t["resources"], refuse=False).held)  # HELD
        seq = sequence_states(t["sequence"], refuse=False)
        self.parked, self.swapped = self.seq.ids(seq.parked), self.seq.ids(seq.swapped)  # PARKED, SWAPPED
        self.matched = self.stop.ids(stop_states(t["stop_matcher"], refuse=False).matched)  # HIT
        self.discarded = self.stop.targets("discard")  # DISCARDED: where a match goes
        self.stop_hit = self.matched | self.discarded  # a stop string has matched
        self.holding = self.stop.targets("hold")  # HOLDING: a suffix that may begin a stop string
        self.pending = self.detok.ids(detokenizer_states(t["detokenizer"], refuse=False).pending)  # PENDING

    def initial(self) -> list[RequestState]:
        """One initial request per backpressure policy."""
        base = RequestState(*(0,) * len(F))._replace(
            pc=PC.new, lifecycle=self.life.i(self.life.table.initial), stream=self.stream.i(self.stream.table.initial),
            stop_matcher=self.stop.i(self.stop.table.initial), detokenizer=self.detok.i(self.detok.table.initial),
            sequence=self.seq.i(self.seq.table.initial), **dict.fromkeys(RESOURCE_KINDS, self.res.i(self.res.table.initial)))
        # plain requests first (machine/paths.py starts there); a guard changes what a token ends,
        # not how the stream holds it: one policy for those
        return ([base._replace(policy=p) for p in range(len(self._policy_names))]
                + [base._replace(guard=g) for g in range(1, len(self.config.guards) + 1)])

    def guard_field(self, c: RequestState | Judged) -> str | None:
        """The guard field the request sets (RequestState.guard), if any."""
        return self.config.guards[c.guard - 1] if c.guard else None

    def guarded(self, check: str, c: RequestState, t: int) -> bool:
        """Does a guard the table lists for `check` turn it off for the t-th token (D31)?"""
        field = self.guard_field(c)
        return field is not None and any(FINISH_GUARDS[g](field, t) for g in self.unless.get(check, ()))

    # What the product search asks of a request it keeps (a plain tuple of RequestState's fields).

    def done(self, comp: Sequence[int]) -> bool:
        return comp[F.pc] == PC.done

    def holds_slot(self, comp: Sequence[int]) -> bool:
        """Its sequence holds one of the batch's places (derived from the sequence table)."""
        return self._places[comp[F.sequence]]

    def waits_for_slot(self, comp: Sequence[int]) -> bool:
        """At the queue, nothing pending to observe: only a free slot lets it go on (§4.1 QUEUED)."""
        return comp[F.pc] == PC.queued and comp[F.cancel] != CANCEL.requested and comp[F.deadline] != DEADLINE.passed

    def used_slot(self, comp: Sequence[int]) -> bool:
        return self.res.terminal[comp[F.batch_slot]] and not self._places[comp[F.sequence]]

    # ---- the transition relation -----------------------------------------------------------

    def expand(self, comp: Sequence[int]) -> list[Step]:
        """Every successor step of one request (a RequestState or a plain tuple of its fields):
        the loop's choices and the environment's."""
        c = RequestState._make(comp)
        out: list[Step] = []
        self._loop(c, out)
        self._environment(c, out)
        return [s for s in out if s.fired or s.f != list(c)]

    def _new(self, comp, out, label, tag: Tag) -> Step:
        s = Step(self, comp, label, tag)
        out.append(s)
        return s

    def _loop(self, c: RequestState, out: list[Step]) -> None:
        pc = c.pc
        if pc == PC.new:
            s = self._new(c, out, "loop: request created, stream resources acquired, response.start", Tag("start"))
            s.acquire("trace_handle")
            s.acquire("stream_buffer")
            s.fire("stream", "start")
            s.f[F.pc] = PC.created
        elif pc == PC.created:
            if c.cancel == CANCEL.requested:
                s = self._new(c, out, "loop: cancel observed before admission", Tag("observe", what="cancel", fault=True))
                s.f[F.cancel] = CANCEL.observed
                s.after_lifecycle(s.lc("cancel"), default=PC.safe_point)
                return
            s = self._new(c, out, "loop: admitted (enqueue)", Tag("admit"))
            s.after_lifecycle(s.lc("enqueue"), default=PC.queued)
            s = self._new(c, out, "loop: admission refused (prompt fills the context)", Tag("refuse"))
            s.lc("reject")
        elif pc in (PC.queued, PC.top_of_step):
            self._check_point(c, out, pc)
        elif pc == PC.prefill_in_flight:
            self._kernel_end(c, out, "prefill_done", "prefill")
        elif pc == PC.decode_in_flight:
            self._kernel_end(c, out, "decode_done", "decode")
        elif pc == PC.finish_checks:
            self._finish_checks(c, out)
        elif pc == PC.sending:
            self._send(c, out)
        elif pc == PC.safe_point:
            s = self._new(c, out, "loop: safe point: tails discarded, model resources released, CANCELLED", Tag("safe_point"))
            if not self.detok.terminal[c.detokenizer]:
                s.fire("detokenizer", "discard")
            s.lc("safe_point")
        elif pc == PC.draining_finish:
            self._drain(c, out)
        elif pc == PC.draining_stop_hit:
            s = self._new(c, out, "loop: stop hit in the drained tail", Tag("drain_hit"))
            s.after_lifecycle(s.lc("stop_hit"), default=PC.draining_end)
            s.discard_match()
        elif pc == PC.draining_flush:
            s = self._new(c, out, "loop: flush the held suffix", Tag("flush"))
            held = c.stop_matcher in self.holding
            s.fire("stop_matcher", "flush")
            s.out(held, PC.draining_end, s.held_out)
            if held and self.config.finish_conditions:  # the policy refuses the flushed bytes (D23)
                s = self._new(c, out, "loop: flush the held suffix, the content policy refuses it (not sent, D23)",
                              Tag("flush", interrupt=True, fault=True))
                s.fire("stop_matcher", "flush")
                s.after_lifecycle(s.lc("content_interrupt"), default=PC.draining_end)
            if "model_error" in self.config.faults:  # a content policy that raises on the flush (D20)
                s = self._new(c, out, "environment: the request's own code raises on the flushed bytes",
                              Tag("drain_raises", fault=True))
                s.lc("model_error")
        elif pc == PC.interrupt_after_emit:
            self._interrupted(self._new(c, out, "loop: the content policy refuses the chunk already emitted",
                                        Tag("check", event="content_interrupt", interrupt=True, fault=True)))
        elif pc == PC.draining_end:
            s = self._new(c, out, "loop: model resources released, FINISHED with the terminal event", Tag("complete"))
            s.lc("complete")
        elif pc == PC.closing:
            s = self._new(c, out, "loop: stream resources released after the terminal event, the Engine drops it", Tag("close"))
            s.release("stream_buffer")
            s.release("trace_handle")
            s.fire("sequence", "drop")
            s.f[F.pc] = PC.done

    def _check_point(self, c, out, pc) -> None:
        """check_cancel_or_deadline (QUEUED) and the top of a decode step (§4.3, §4.9): the observe
        phases in the table's [[step]] order; the first with something to observe is the step."""
        if any(_OBSERVERS[phase](self, c, out, pc) for phase in self.observe_order):
            return
        if pc == PC.queued:
            s = self._new(c, out, "loop: scheduled: prefill starts (slot, cache, RNG acquired)", Tag("schedule"))
            s.fire("sequence", "admit")
            s.after_lifecycle(s.lc("schedule"), default=PC.prefill_in_flight)
        else:
            self._schedule(c, out)

    def _observe_cancel(self, c, out, pc) -> bool:
        if c.cancel != CANCEL.requested:
            return False
        parked = pc == PC.top_of_step and c.sequence in self.parked
        s = self._new(c, out, PARKED_CANCEL if parked else "loop: cancel observed at a check point", Tag("observe", what="cancel", parked=parked, fault=True))
        s.f[F.cancel] = CANCEL.observed
        s.after_lifecycle(s.lc("cancel"), default=PC.safe_point)
        return True

    def _observe_deadline(self, c, out, pc) -> bool:
        if c.deadline != DEADLINE.passed:
            return False
        s = self._new(c, out, "loop: deadline observed at a check point", Tag("observe", what="deadline", fault=True))
        s.f[F.deadline] = DEADLINE.observed
        s.after_lifecycle(s.lc("deadline"), default=PC.draining_finish)
        return True

    def _schedule(self, c, out) -> None:
        """Between two steps the Engine decides where the sequence is (§4.4, §4.8): a resident one
        selects (or, behind its reader, is parked), a parked one waits for its reader, a swapped
        one is resumed when a place is free; any resident or parked one may be preempted."""
        swapped = c.sequence in self.swapped  # else resident or parked: in the batch
        if not swapped and c.preempted < self.config.preemptions:
            s = self._new(c, out, "scheduler: preempted (cache swapped out, place given back)", Tag("preempt", fault=True))
            s.fire("sequence", "preempt")
            s.f[F.preempted] += 1
        paused = c.stream in self.paused
        if swapped:
            s = self._new(c, out, "scheduler: resumed (cache restored, a place taken)", Tag("resume", fault=True))
            s.fire("sequence", "resume")
        elif c.sequence in self.parked:
            if not paused:
                s = self._new(c, out, "scheduler: unparked (its reader caught up)", Tag("unpark", fault=True))
                s.fire("sequence", "unpark")
        else:
            if paused:
                s = self._new(c, out, "scheduler: parked (its reader is behind)", Tag("park", fault=True))
                s.fire("sequence", "park")
            self._select(c, out)

    def _winners(self, forced: Mapping[str, bool], free: frozenset[str], skip: frozenset[str] = frozenset()) -> list:
        """The events that can win the finish checks (D4), in the table's order: a check whose
        fact the state forces ends the list, one the environment chooses (`free`) may win and
        the list goes on; None stands for "no check holds" (decoding goes on)."""
        out: list[str | None] = []
        for event in self.finish_order:
            if event in skip:
                continue
            if forced.get(event):
                out.append(event)
                return out
            if event in free:
                out.append(event)
        out.append(None)
        return out

    def _free(self, nonempty: bool) -> frozenset[str]:
        """The finish checks whose outcome the environment picks (content policy, context, grammar)."""
        if not self.config.finish_conditions:
            return frozenset()
        return frozenset({"context_full", "grammar_done"} | ({"content_interrupt"} if nonempty else set()))

    def _select(self, c, out) -> None:
        """choose y_t; an EOS is not detokenized, any other token goes through the detokenizer
        and the stop matcher; then the table's finish checks (§4.3, §4.5, §4.6, D4): the content
        policy, where it wins, refuses the chunk before it is sent (D11)."""
        limit = c.selected + 1 >= self.config.max_output_tokens
        if self.guarded("eos", c, c.selected + 1):
            # A guard turns the EOS check off: EOS is a skipped special token (no bytes; kept as
            # text without skip_special_tokens, which the plain tokens below stand for), decoded
            # like any other, and the other checks decide (D31).
            detok = "hold" if c.detokenizer in self.pending else "emit"
            s = self._push(c, out, f"loop: select EOS, its check turned off by {self.guard_field(c)}: a token with "
                                   "no bytes", Tag("select", token="guarded_eos"), detok, None, PC.finish_checks)
            if s is not None:
                s.f[F.eos] = EOS.decoded
                s.out(False, PC.finish_checks)
        else:
            for event in self._winners({"eos": True, "length": limit}, self._free(False)):
                s = self._new(c, out, "loop: select EOS" if event == "eos" else f"loop: select EOS, {event} checked first", Tag("select", token="eos", event=event))
                s.f[F.selected] += 1
                s.after_lifecycle(s.lc("select"), default=PC.top_of_step)
                s.f[F.eos] = EOS.ended
                s.after_lifecycle(s.lc(event), default=PC.draining_finish)
        for check in self.token_checks:  # a token that fires a token check is not text either (D4)
            for event in self._winners({check: True, "length": limit}, self._free(False), frozenset({"eos"})):
                s = self._new(c, out, f"loop: select a {check} token" + ("" if event == check else f", {event} checked first"), Tag("select", token=check, event=event))
                s.f[F.selected] += 1
                s.after_lifecycle(s.lc("select"), default=PC.top_of_step)
                s.after_lifecycle(s.lc(event), default=PC.draining_finish)
        if self.config.byte_choices:
            s = self._push(c, out, "loop: select a token: detokenizer invalid", Tag("select", token="invalid"), "invalid", None)
            if s is not None:
                self._invalid(s, PC.finish_checks)
        outcomes = ([("loop: select a token: detokenizer hold", "hold", None, False)] if self.config.byte_choices else []) + [
            (f"loop: select a token: detokenizer emit, stop matcher {stop}, safe bytes "
             + ("non-empty" if nonempty else "empty"), "emit", stop, nonempty)
            for stop, nonempty in _STOP_OUTCOMES[self.config.byte_choices]]
        for label, push, stop, nonempty in outcomes:
            winners = self._winners({"stop_hit": stop == "hit", "length": limit}, self._free(nonempty), frozenset({"eos"}))
            if any(w != "content_interrupt" for w in winners):  # the chunk is sent, PC.finish_checks decides
                tag = Tag("select", token="hold") if push == "hold" else Tag("select", token="push", stop=stop, safe=nonempty)
                s = self._push(c, out, label, tag, push, stop, PC.finish_checks)
                if s is not None:
                    s.out(nonempty, PC.finish_checks)
            if "content_interrupt" in winners:
                self._interrupt(c, out, label, stop, nonempty)

    def _push(self, c, out, label: str, tag: Tag, push: str, stop: str | None, pc: int | None = None) -> Step | None:
        """A step that selects a token and pushes it through the detokenizer (and the stop
        matcher); it continues at `pc`. None when the table refused the selection."""
        s = self._new(c, out, label, tag)
        s.f[F.selected] += 1
        if s.lc("select") is None:
            return None
        s.push(push, stop)
        if pc is not None:
            s.f[F.pc] = pc
        return s

    def _interrupt(self, c, out, label: str, stop: str | None, nonempty: bool) -> None:
        """The content policy sees the safe chunk before it is sent and refuses it (D11): the
        chunk is never sent, pending bytes (and a matched stop) are discarded, FINISHED follows."""
        s = self._push(c, out, f"{label}, content policy interrupts (chunk not sent, D11)",
                       Tag("select", token="push", stop=stop, safe=nonempty, interrupt=True, fault=True), "emit", stop)
        if s is None:
            return
        if self.emit_first:
            # A [[step]] that emits before the finish checks (D53): the chunk goes out, then the
            # policy refuses it (PC.interrupt_after_emit).
            if nonempty and s.passed and s.released:
                s.violate("refused_chunk_never_sent", "the chunk the content policy refuses is sent before "
                          "the finish checks judge it")
            s.out(nonempty, PC.interrupt_after_emit)
            return
        self._interrupted(s)

    def _interrupted(self, s: Step) -> None:
        """content_interrupt fires: pending bytes (and a matched stop) are discarded, FINISHED follows."""
        s.after_lifecycle(s.lc("content_interrupt"), default=PC.draining_end)
        if not self.detok.terminal[s.f[F.detokenizer]]:
            s.fire("detokenizer", "discard")
        if s.f[F.stop_matcher] in self.matched:
            s.discard_match()

    def _finish_checks(self, c, out) -> None:
        """After the token's delta: the rest of the table's finish checks (D4; EOS and the content
        policy were decided at the select). A stop that matched cuts the output whichever check
        wins the reason: the tails are discarded."""
        hit = c.stop_matcher in self.matched
        forced = {"stop_hit": hit, "length": c.selected >= self.config.max_output_tokens}
        free = self._free(False)
        for event in self._winners(forced, free, frozenset({"eos", "content_interrupt"})):
            if event is None:
                s = self._new(c, out, "loop: no finish condition: decode starts", Tag("decode"))
                s.f[F.kernel] = KERNEL.decode
                s.f[F.pc] = PC.decode_in_flight
                continue
            s = self._new(c, out, _CHECK_LABELS.get(event, f"loop: {event}"), Tag("check", event=event))
            if not hit:
                s.after_lifecycle(s.lc(event), default=PC.draining_finish)
                continue
            s.after_lifecycle(s.lc(event), default=PC.draining_end)
            s.discard_match()
            if not self.detok.terminal[s.f[F.detokenizer]]:
                s.fire("detokenizer", "discard")

    def _kernel_end(self, c, out, done_event: str, what: str) -> None:
        s = self._new(c, out, f"device: {what} kernel completes", Tag("kernel_done", what=what))
        s.f[F.kernel] = KERNEL.none
        if what == "decode":
            s.f[F.decoded] += 1
        s.after_lifecycle(s.lc(done_event), default=PC.top_of_step)
        if "model_error" not in self.config.faults:
            return
        s = self._new(c, out, f"environment: model error in the {what} kernel", Tag("model_error", what=what, fault=True))
        s.f[F.kernel] = KERNEL.none
        s.after_lifecycle(s.lc("model_error"), default=PC.top_of_step)

    def _send(self, c, out) -> None:
        """A delta waits to be queued on the stream: transport failure, backpressure, or sent (§4.8)."""
        if "transport_error" in self.config.faults:
            s = self._new(c, out, "environment: the send fails (transport error)", Tag("send_fails", fault=True))
            s.lc("transport_error")
        if c.stream in self.paused:
            return  # the producer waits for the reader (pause policy)
        if c.unread < self.config.buffer_cap or c.stream not in self.sending:
            s = self._new(c, out, "loop: delta queued on the stream", Tag("delta"))
            if c.terminals or self.stream.terminal[c.stream]:
                s.violate("no_delta_after_terminal", "a delta is sent after the terminal event")
            if REASONS[c.reason] == FinishReason.STOP_SEQUENCE or c.stop_matcher in self.discarded:
                s.violate("nothing_after_stop_hit", "a delta is sent after the stop hit")
            if s.fire("stream", "delta") is not None:  # the row's effect queues it (seq, unread)
                s.f[F.pc] = c.ret
                if s.f[F.unread] >= self.config.buffer_cap and self._policy_names[c.policy] == "pause":
                    s.fire("stream", "block")  # the buffer is at its cap: the producer pauses (§4.8)
        else:
            s = self._new(c, out, "loop: buffer full: overflow, FAILED with transport_error (D6)", Tag("overflow"))
            s.lc("transport_error", overflow=True)

    def _drain(self, c, out) -> None:
        """DRAINING: text.finish(), its bytes through the stop matcher, else flush (§4.3)."""
        if c.detokenizer not in self.pending:
            s = self._new(c, out, "loop: finish(): nothing pending", Tag("drain", what="nothing"))
            if not self.detok.terminal[c.detokenizer]:
                s.fire("detokenizer", "finish")
            s.f[F.pc] = PC.draining_flush
            return
        s = self._new(c, out, "loop: finish(): the tail is not valid text (decoding error)", Tag("drain", what="invalid"))
        s.push("finish_invalid", None)
        self._invalid(s, PC.draining_flush)
        for stop, nonempty in _STOP_OUTCOMES[True]:
            s = self._new(c, out, f"loop: finish(): tail, stop matcher {stop}, safe bytes {'non-empty' if nonempty else 'empty'}", Tag("drain", what="tail", stop=stop, safe=nonempty))
            s.push("finish", stop)
            s.out(nonempty, PC.draining_stop_hit if stop == "hit" else PC.draining_flush)

    def _invalid(self, s: Step, ret: int) -> None:
        """Bytes that can never be text: the detokenizer's row raises and the request FAILS; a row
        that does not raise lets the run go on at `ret` with those bytes lost."""
        if s.raised:
            s.lc("decode_error")
        elif not s.dead:
            s.f[F.lost] = 1
            s.f[F.pc] = ret

    def _environment(self, c, out) -> None:
        """Injections possible at any point: cancel, deadline, reader progress, disconnect (§4.7-§4.9),
        and the events the tables ignore, offered wherever they can arrive (a cancel after the end,
        a failing connection while a cancel is pending, a racing release, a scheduler parking a
        parked sequence or unparking a resident one): each is checked and counted as fired; one
        that changes nothing is no edge of the search (machine/checker.py)."""
        life = c.lifecycle
        life_terminal = self.life.terminal[life]
        faults = self.config.faults
        if c.cancel == CANCEL.none and "cancel" in faults:
            s = self._new(c, out, "environment: cancel requested", Tag("request", what="cancel"))
            s.f[F.cancel] = CANCEL.requested
        elif c.cancel == CANCEL.requested and c.pc not in (PC.created, PC.queued, PC.top_of_step) and (
            c.kernel or life in self.draining or life_terminal
        ):
            s = self._new(c, out, "scheduler: cancel observed while the loop is busy", Tag("observe_busy", what="cancel", fault=True))
            s.f[F.cancel] = CANCEL.observed
            s.after_lifecycle(s.lc("cancel"), default=c.pc)
        elif c.cancel == CANCEL.observed and (life in self.cancel_observed or life_terminal):
            s = self._new(c, out, "environment: the cancel is repeated", Tag("repeat_cancel", fault=True))
            if not life_terminal:  # after the end the ignore row changes nothing: no new state
                s.f[F.cancel] = CANCEL.repeated
            s.lc("cancel")
        if life in self.cancel_observed and "transport_error" in faults:
            s = self._new(c, out, "transport: the connection fails while the cancel is pending", Tag("transport_while_cancel", fault=True))
            s.lc("transport_error")
        if life_terminal and self.res.terminal[c.kv_cache]:
            s = self._new(c, out, "environment: a racing release of the KV cache", Tag("racing_release", fault=True))
            s.fire("resources", "release", F.kv_cache)
        if c.pc == PC.top_of_step and not life_terminal:
            parked = c.sequence in self.parked
            if parked and c.stream in self.paused:
                s = self._new(c, out, "scheduler: parks its parked sequence again", Tag("park_again", fault=True))
                s.fire("sequence", "park")
            elif not parked and c.sequence not in self.swapped and c.stream in self.sending:  # resident
                s = self._new(c, out, "scheduler: unparks a sequence that is not parked", Tag("unpark_idle", fault=True))
                s.fire("sequence", "unpark")
        if c.deadline == DEADLINE.none and not life_terminal and "deadline" in faults:
            s = self._new(c, out, "environment: deadline passes", Tag("request", what="deadline"))
            s.f[F.deadline] = DEADLINE.passed
        paused = c.stream in self.paused
        if c.unread and c.reader != READER.disconnected:
            s = self._new(c, out, "reader: reads one delta", Tag("read", fault=True))
            s.f[F.unread] -= 1
            if paused:
                s.fire("stream", "unblock")
        if c.reader == READER.connected and c.stream != self.stream_new and "disconnect" in faults:
            s = self._new(c, out, "transport: the client disconnects", Tag("disconnect", fault=True))
            s.fire("stream", "disconnect")  # its row's effect: the reader is gone (RequestState.reader)
        elif c.reader == READER.disconnected:
            s = self._new(c, out, "transport: the client reconnects and replays from its last seq", Tag("reconnect", fault=True))
            s.fire("stream", "reconnect")
            s.fire("stream", "replay")  # the replayed deltas count as read (OrderedStream.replay)
            if paused:
                s.fire("stream", "unblock")

    # ---- what is checked ---------------------------------------------------------------------

    def describe(self, comp: Sequence[int]) -> dict[str, object]:
        """One request as named values: every machine's state, where the loop is, and the data
        (the state of a TLC trace)."""
        c = RequestState._make(comp)
        return {
            "pc": PC_NAMES[c.pc],
            "lifecycle": self.life.states[c.lifecycle],
            "stream": self.stream.states[c.stream],
            "stop_matcher": self.stop.states[c.stop_matcher],
            "detokenizer": self.detok.states[c.detokenizer],
            **{f"resources[{kind}]": self.res.states[c[field]] for kind, field in RES_FIELD.items()},
            "selected": c.selected, "decoded": c.decoded, "seq": c.seq, "unread": c.unread,
            "reason": None if REASONS[c.reason] is None else REASONS[c.reason].value,
            "cancel": Cancel._fields[c.cancel],
            "deadline": Deadline._fields[c.deadline],
            "kernel": Kernel._fields[c.kernel],
            "policy": self._policy_names[c.policy],
            "reader": Reader._fields[c.reader],
            "sequence": self.seq.states[c.sequence], "preempted": c.preempted,
            "freed": [kind for kind, field in RES_FIELD.items() if c.freed >> (field - F.trace_handle) & 1],
            "lost_bytes": bool(c.lost),
            "guard": self.guard_field(c),
        }

    def witnesses(self, pre: Sequence[int], step: Step) -> list[str]:
        """The sometimes-properties (WITNESSES) that a local step from `pre` demonstrates: those
        its fired steps (or its change of lifecycle state) trigger whose predicate holds."""
        triggers: dict[tuple[str, str, str] | None, None] = dict.fromkeys(step.fired)  # in the order fired, once each
        if pre[F.lifecycle] != step.f[F.lifecycle]:
            triggers[None] = None
        candidates = [(name, pred) for t in triggers for name, pred in _TRIGGERED.get(t, ())]
        if not candidates:
            return []
        a, b = RequestState._make(pre), step.post()
        return [name for name, pred in candidates if pred(self, a, b)]


# The model's one implementation of each observe phase of the [[step]] (D53).
_OBSERVERS = {"observe_cancel": Model._observe_cancel, "observe_deadline": Model._observe_deadline}


def _places(seq: Machine) -> tuple[bool, ...]:
    """Per state of the sequence table: does a sequence there hold a batch place? The places its
    rows' effects take and give back, counted along the table from the initial state (first
    count found; a table whose counts disagree is caught by the product's slot accounting)."""
    actions = seq.table.actions
    take = {(d.state, d.event): sum(int(x == "take_place") - int(x == "give_place")
                                    for x in (actions.get(d.action, ()) if d.action else ()))
            for d in seq.table.rows}
    held = {seq.table.initial: 0}
    todo = [seq.table.initial]
    while todo:
        st = todo.pop()
        for d in seq.table.rows:
            if d.state == st and d.target not in held:
                held[d.target] = held[st] + take[(d.state, d.event)]
                todo.append(d.target)
    return tuple(held.get(st, 0) > 0 for st in seq.states)


def _ends(m: Model, post, state: str, *reasons: FinishReason) -> bool:
    return m.life.states[post.lifecycle] == state and (not reasons or REASONS[post.reason] in reasons)


def _always(m: Model, a, b) -> bool:
    return True


# name -> (anchor, trigger step or None, predicate(model, pre, post)). A trigger is a table step
# the local step must fire; None means the step must change the lifecycle state.
WITNESSES = {
    "cancel_wins_over_completion": ("§4.9", None, lambda m, a, b: _ends(m, b, "CANCELLED") and a.selected >= 1),
    "late_cancel_ignored_in_draining": ("§4.9", ("lifecycle", "DRAINING", "cancel"), _always),
    "completion_wins_over_late_cancel": ("§4.9", None, lambda m, a, b: _ends(m, b, "FINISHED") and b.cancel >= CANCEL.observed),
    "stop_at_last_allowed_token": (
        "§4.3", ("lifecycle", "DECODING", "stop_hit"), lambda m, a, b: a.selected == m.config.max_output_tokens),
    "deadline_ends_deadline_exceeded": (
        "§4.9", None, lambda m, a, b: _ends(m, b, "FINISHED", FinishReason.DEADLINE_EXCEEDED)),
    "deadline_while_queued": ("§4.9", ("lifecycle", "QUEUED", "deadline"), _always),
    "stop_spans_two_tokens": ("§4.6", ("stop_matcher", "HOLDING", "hit"), _always),
    "stop_in_drained_tail": ("§4.3", ("lifecycle", "DRAINING", "stop_hit"), _always),
    "decoding_error_at_finish_fails": (
        "§4.3", ("detokenizer", "PENDING", "finish_invalid"), lambda m, a, b: _ends(m, b, "FAILED")),
    "transport_error_fails": ("§4.10", None, lambda m, a, b: _ends(m, b, "FAILED", FinishReason.TRANSPORT_ERROR)),
    "model_error_fails": ("§4.1", None, lambda m, a, b: _ends(m, b, "FAILED", FinishReason.MODEL_ERROR)),
    "slow_reader_pauses_and_resumes": ("§4.8", ("stream", "PAUSED", "unblock"), _always),
    "buffer_overflow_fails": ("§4.8", ("stream", "OPEN", "overflow"), _always),
    "reconnect_then_finish": ("§4.7", None, lambda m, a, b: _ends(m, b, "FINISHED") and b.reader == READER.reconnected),
    "cancel_during_prefill_discarded": ("§4.9", ("lifecycle", "CANCEL_REQUESTED", "prefill_done"), _always),
    "cancel_during_decode_discarded": ("§4.11", ("lifecycle", "CANCEL_REQUESTED", "decode_done"), _always),
    "eos_on_first_token": ("§4.12", ("lifecycle", "DECODING", "eos"), lambda m, a, b: b.selected == 1 and not b.guard),
    # D31: an EOS whose check a guard turns off is decoded, and the request ends another way
    "guarded_eos_then_length": (
        "§4.3", ("lifecycle", "DECODING", "length"), lambda m, a, b: m.guard_field(b) == "min_tokens" and b.eos == EOS.decoded),
    "ignored_eos_decoded": (
        "§4.6", ("lifecycle", "DECODING", "decode_done"), lambda m, a, b: m.guard_field(b) == "ignore_eos" and b.eos == EOS.decoded),
    "admission_refused": ("§4.1", ("lifecycle", "CREATED", "reject"), _always),
    # D11: the policy sees the chunk before the send and before the length check
    "content_interrupt_on_last_allowed_token": (
        "§4.10", ("lifecycle", "DECODING", "content_interrupt"),
        lambda m, a, b: b.selected == m.config.max_output_tokens and b.seq == a.seq),
    "replay_resumes_paused_producer": (
        "§4.7", ("stream", "PAUSED", "replay"), lambda m, a, b: b.stream in m.sending),
    # §4.8: the scheduler's moves (spec/sequence.toml)
    "preempted_then_resumed": ("§4.8", ("sequence", "SWAPPED", "resume"), _always),
    "parked_then_preempted": ("§4.8", ("sequence", "PARKED", "preempt"), _always),
    "cancelled_while_swapped": ("§4.9", ("sequence", "SWAPPED", "drop"), lambda m, a, b: _ends(m, b, "CANCELLED")),
}

# WITNESSES by trigger: a step looks up the ones its fired steps trigger.
_TRIGGERED: dict[tuple[str, str, str] | None, list] = {
    trigger: [(name, pred) for name, (_, t, pred) in WITNESSES.items() if t == trigger]
    for trigger in {t for _, t, _ in WITNESSES.values()}}

# What a witness needs from ModelConfig: a fault of FAULTS, "bytes" (byte_choices), a policy,
# "finish_conditions", "two_tokens" (max_output_tokens >= 2) or "preemption" (preemptions >= 1).
WITNESS_NEEDS: dict[str, tuple[str, ...]] = {
    "cancel_wins_over_completion": ("cancel", "two_tokens"),
    "late_cancel_ignored_in_draining": ("cancel",),
    "completion_wins_over_late_cancel": ("cancel",),
    "stop_at_last_allowed_token": ("bytes",),
    "deadline_ends_deadline_exceeded": ("deadline",),
    "deadline_while_queued": ("deadline",),
    "stop_spans_two_tokens": ("bytes", "two_tokens"),
    "stop_in_drained_tail": ("bytes",),
    "decoding_error_at_finish_fails": ("bytes",),
    "transport_error_fails": ("transport_error",),
    "model_error_fails": ("model_error",),
    "slow_reader_pauses_and_resumes": ("pause",),
    "buffer_overflow_fails": ("buffer",),
    "reconnect_then_finish": ("disconnect",),
    "cancel_during_prefill_discarded": ("cancel",),
    "cancel_during_decode_discarded": ("cancel", "two_tokens"),
    "content_interrupt_on_last_allowed_token": ("finish_conditions",),
    "replay_resumes_paused_producer": ("pause", "disconnect"),
    "preempted_then_resumed": ("preemption",),
    "parked_then_preempted": ("preemption", "pause", "two_tokens"),
    "cancelled_while_swapped": ("preemption", "cancel"),
    "guarded_eos_then_length": ("min_tokens", "two_tokens"),
    "ignored_eos_decoded": ("ignore_eos", "two_tokens"),
}


def config_offers(config: ModelConfig) -> frozenset[str]:
    """The WITNESS_NEEDS conditions `config` meets."""
    return frozenset({*config.faults, *config.policies, *config.guards} | {
        name for name, on in (("bytes", config.byte_choices), ("finish_conditions", config.finish_conditions),
                              ("two_tokens", config.max_output_tokens >= 2), ("preemption", config.preemptions >= 1))
        if on})
# Witnesses of the two-request configuration, over product states (§4.4 shared batch slots).
POOL_WITNESSES = {
    "request_waits_for_slot": "§4.1",
    "slot_reused_after_release": "§4.10",
}
