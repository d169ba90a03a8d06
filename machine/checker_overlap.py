"""Model-check the overlapped step (spec/overlap.toml; §4.3, §4.9, §4.11, DECISIONS D73).

Breadth-first over every run of the Engine's overlapped step (runtime/engine.py, `overlap=True`)
for one to three requests sharing one batch, a step at a time in the Engine's order:

1. top: each going request passes its check point (§4.3): a cancel or a deadline that arrived ends
   its loop there, with nothing in flight;
2. launch: y_t is chosen from the request's logits and its decode launched (`launch`), one forward
   for the batch;
3. host: each launched request's y_t is detokenized, matched and streamed while the forward runs:
   every outcome the host work can have (it goes on, a y_t other than the one launched, a stop, an
   EOS, the length at `max_tokens`, the context, another end of the loop, a failure) fires its
   event; one that goes on passes the check point once more (a cancel or a deadline observed while
   its step runs);
4. join: the forward completes (`complete`);
5. settle: a request whose loop ended is released (`release`).

The environment requests a cancel and passes a deadline, once each per request, between any two of
these moves. A request whose loop ended asks for its release at once (a failure found by the host
work releases in the lifecycle's own row): the Engine releases when the overlap table has a row
for `release` in the state its step is in, else after the join.

Every row's action runs through its effects on the abstract requests by this module's executor
(`MODEL`), checked both ways against the table (machine/actions.py). The invariants (`INVARIANTS`)
are said from what happened, independently of the rows: no token is chosen from a result that was
not taken; a result is taken only for a request that went on with the launched token; nothing is
released while a step of it is in flight, and each request is released exactly once; every run
ends. A move the table refuses is a `refinement` violation (the Engine would raise
IllegalTransition). The sometimes-property `cancel_observed_while_running` needs a witness.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs

from ..spec import DecisionKind, Table, load_spec
from ..spec.derived import discovered_events
from .actions import Executor, fire_with_effects
from .checker import Counterexample
from .compiled import IllegalTransition, compile_table

MAX_REQUESTS = 3
# What the host work on y_t can find (step 3 of the module doc), besides `length` at max_tokens.
HOST_OUTCOMES = ("go_on", "other_token", "stop_hit", "eos", "context_full", "loop_end", "failed")


@attrs.define
class Req:
    """One request as the Engine's overlapped step sees it (a mutable copy while a move is built)."""

    ov: str  # its overlap stepper's state
    loop: str = "on"  # "on" while its §4.3 loop goes on; else why it ended (an event of the table)
    tokens: int = 0  # y_1..y_t chosen
    logits: str = "prefill"  # "prefill", "step" (a taken result), "spent" (y_t chosen), "none" (discarded)
    launched_ok: bool = True  # the step in flight decodes the token the host chose
    cancel: int = 0  # 0 none, 1 requested, 2 observed
    deadline: int = 0  # 0 not passed, 1 passed, 2 observed
    released: int = 0
    wants_release: bool = False
    seen_running_cancel: bool = False

    def key(self) -> tuple:
        return attrs.astuple(self)


@attrs.define
class World:
    """A move under construction: the requests, whether the batch's forward runs, what broke."""

    reqs: list[Req]
    phase: str  # "top", "launch", "host<i>", "join", "settle"
    running: bool = False
    broken: list[tuple[str, str]] = attrs.field(factory=list)
    witnessed: list[str] = attrs.field(factory=list)


MODEL = Executor("overlap", "the checker model (checker_overlap)")


@MODEL.effect("start_step")
def _start_step(w: World, r: Req) -> None:
    w.running = True
    r.logits = "spent"  # y_t was chosen from them: the next logits are the step's, once taken


@MODEL.effect("take_result")
def _take_result(w: World, r: Req) -> None:
    if r.loop != "on":
        w.broken.append(("no_result_after_end", f"the result of a step was taken after the loop ended ({r.loop})"))
    elif not r.launched_ok:
        w.broken.append(("no_result_of_another_token", "the result of a step that decoded another token than y_t was taken"))
    r.logits = "step"


@MODEL.effect("discard_result")
def _discard_result(w: World, r: Req) -> None:
    r.logits = "none"


MODEL.abstracts("keep_cache", "the model keeps no cache contents: what it holds goes with the release")


@MODEL.effect("release_resources")
def _release_resources(w: World, r: Req) -> None:
    if w.running and r.ov != "IDLE":
        w.broken.append(("no_release_in_flight", "released while a step of the request was in flight (its cache is written)"))
    r.released += 1
    if r.released > 1:
        w.broken.append(("released_once", f"released {r.released} times"))


# name -> (section, what it says); each is checked where it can break (the effects above, `_check`)
INVARIANTS: dict[str, tuple[str, str]] = {
    "no_token_from_discarded": ("§4.9", "no token is chosen from a result that was discarded"),
    "no_result_after_end": ("§4.3", "a step's result is taken only for a request whose loop goes on"),
    "no_result_of_another_token": ("§4.3", "a step's result is taken only when it decoded the token the host chose"),
    "no_release_in_flight": ("§4.9", "nothing is released while a step of the request is in flight"),
    "released_once": ("§4.10", "each request is released exactly once"),
    "every_run_ends": ("§4.3", "every request reaches its end with nothing in flight"),
    "refinement": ("§4.9", "the table allows every move the Engine makes"),
}
WITNESSES = {"cancel_observed_while_running": ("§4.11", "a cancel is observed while the request's step runs")}


@attrs.frozen
class OverlapReport:
    """What one exhaustive run over the overlap table found."""

    requests: int
    states: int
    violations: tuple[Counterexample, ...]
    witnesses: dict[str, Counterexample]
    rows_never_fired: tuple[tuple[str, str], ...]

    @property
    def ok(self) -> bool:
        return not self.violations and set(self.witnesses) == set(WITNESSES) and not self.rows_never_fired


class _Search:
    def __init__(self, table: Table, requests: int, max_tokens: int, outcomes: tuple[str, ...]) -> None:
        self.table, self.n, self.max_tokens, self.outcomes = table, requests, max_tokens, outcomes
        self.plans = MODEL.plans(table)
        self.machine = compile_table(table)
        self.discovered = discovered_events(table)
        self.fired: set[tuple[str, str]] = set()

    # -- one move ----------------------------------------------------------------------------
    def fire(self, w: World, i: int, event: str, steps: list) -> bool:
        """Fire `event` on request i's overlap stepper; False (and a refinement violation) when refused."""
        r = w.reqs[i]
        st = self.machine.new(r.ov)
        before = r.ov
        try:
            fire_with_effects(st, self.plans, event, w, r)
        except IllegalTransition:
            w.broken.append(("refinement", f"request {i}: the table refuses '{event}' in {before}"))
            return False
        if self.table.decision(before, event).kind is DecisionKind.ROW:
            self.fired.add((before, event))
        r.ov = st.state.value
        steps.append((i, "overlap", before, event))
        return True

    def end_loop(self, w: World, i: int, why: str, steps: list) -> None:
        """Request i's loop ended (`why`, an event of the table): released now if the table lets it."""
        r = w.reqs[i]
        r.loop, r.wants_release = why, True
        self.try_release(w, i, steps)

    def try_release(self, w: World, i: int, steps: list) -> None:
        r = w.reqs[i]
        if r.wants_release and self.table.decision(r.ov, "release").kind is DecisionKind.ROW:
            r.wants_release = False
            self.fire(w, i, "release", steps)

    def observe(self, w: World, i: int, steps: list) -> bool:
        """The check point (§4.3) of request i: True when a cancel or a deadline ended its loop."""
        r = w.reqs[i]
        for field, event in (("cancel", "cancel"), ("deadline", "deadline")):
            if getattr(r, field) == 1:
                setattr(r, field, 2)
                if w.running and r.ov in ("IN_FLIGHT", "GOING_ON") and event == "cancel":
                    w.witnessed.append("cancel_observed_while_running")
                self.fire(w, i, event, steps)
                self.end_loop(w, i, event, steps)
                return True
        return False

    def moves(self, reqs: tuple, phase: str, running: bool) -> list[tuple[str, World, list]]:
        """Every successor (label, world, table steps) of a state."""
        out: list[tuple[str, World, list]] = []

        def new(label: str) -> tuple[World, list]:
            w = World([Req(*k) for k in reqs], phase, running)
            steps: list = []
            out.append((label, w, steps))
            return w, steps

        for i, k in enumerate(reqs):  # the environment: a cancel, a deadline, once each
            r = Req(*k)
            if r.released:
                continue
            for field in ("cancel", "deadline"):
                if getattr(r, field) == 0:
                    w, _ = new(f"env: {field} for request {i}")
                    setattr(w.reqs[i], field, 1)
        going = [i for i, k in enumerate(reqs) if Req(*k).loop == "on"]
        if phase == "top":
            w, steps = new("engine: check points")
            for i in going:
                self.observe(w, i, steps)
            w.phase = "launch"
        elif phase == "launch":
            w, steps = new("engine: y_t chosen and its decode launched")
            for i in going:
                r = w.reqs[i]
                if r.logits not in ("prefill", "step"):
                    w.broken.append(("no_token_from_discarded", f"request {i} chose y_{r.tokens + 1} from logits "
                                     f"no step's taken result gave it ({r.logits})"))
                r.tokens += 1
                r.launched_ok = True
                self.fire(w, i, "launch", steps)
            w.phase = "host" if any(x.ov == "IN_FLIGHT" for x in w.reqs) else "join"
        elif phase == "host":
            i = next(j for j, k in enumerate(reqs) if Req(*k).ov == "IN_FLIGHT")
            r0 = Req(*reqs[i])
            outcomes = ("length",) if r0.tokens >= self.max_tokens else self.outcomes
            for outcome in outcomes:
                w, steps = new(f"host work on y_{r0.tokens} of request {i}: {outcome}")
                r = w.reqs[i]
                if outcome == "other_token":
                    r.launched_ok = False
                    self.fire(w, i, "other_token", steps)  # it goes on: y_t is decoded again after the join
                elif outcome != "go_on":
                    self.fire(w, i, outcome, steps)
                    self.end_loop(w, i, outcome, steps)
                elif self.fire(w, i, "go_on", steps):
                    self.observe(w, i, steps)  # the check point again, while the step runs
                if not any(x.ov == "IN_FLIGHT" for x in w.reqs) or r.ov == "IN_FLIGHT":
                    w.phase = "join"
        elif phase == "join":
            w, steps = new("engine: the forward completes")
            w.running = False
            for i, r in enumerate(w.reqs):
                if r.ov in ("IN_FLIGHT", "GOING_ON", "DISCARDING"):
                    self.fire(w, i, "complete", steps)
                    if not r.launched_ok and r.loop == "on":
                        r.logits, r.launched_ok = "step", True  # decoded again, alone (the Engine's sync decode)
            w.phase = "settle"
        elif phase == "settle":
            w, steps = new("engine: ended requests released")
            for i in range(len(w.reqs)):
                self.try_release(w, i, steps)
            w.phase = "top"
        return out

    def run(self) -> OverlapReport:
        init = (tuple(Req(self.table.initial).key() for _ in range(self.n)), "top", False)
        parent: dict[Any, tuple[Any, str, list] | None] = {init: None}
        queue = deque([init])
        found: dict[str, Counterexample] = {}
        witnesses: dict[str, Counterexample] = {}

        def path_to(state: Any, last: tuple[str, list] | None = None) -> tuple[tuple[str, ...], tuple]:
            labels: list[str] = []
            steps: list[list] = []
            node, link = state, parent[state]
            while link is not None:
                node, label, st = link
                labels.append(label)
                steps.append(st)
                link = parent[node]
            labels.reverse()
            steps.reverse()
            if last is not None:
                labels.append(last[0])
                steps.append(last[1])
            return tuple(labels), tuple(s for group in steps for s in group)

        while queue:
            state = queue.popleft()
            reqs, phase, running = state
            done = all(Req(*k).ov == "ENDED" for k in reqs)
            twice = [i for i, k in enumerate(reqs) if Req(*k).released != 1]
            if done and twice and "released_once" not in found:
                labels, path = path_to(state)
                found["released_once"] = Counterexample("released_once", INVARIANTS["released_once"][0],
                                                        f"request(s) {twice} ended without exactly one release",
                                                        labels, path)
            succ = [] if done else self.moves(reqs, phase, running)
            idle = phase == "top" and not any(Req(*k).loop == "on" or Req(*k).wants_release for k in reqs)
            if not done and (idle or all(label.startswith("env:") for label, _, _ in succ)):
                name = "every_run_ends"
                if name not in found:
                    labels, path = path_to(state)
                    found[name] = Counterexample(name, INVARIANTS[name][0], "no move is left and a request has not "
                                                 "ended: " + ", ".join(Req(*k).ov for k in reqs), labels, path)
                continue
            for label, w, steps in succ:
                for name in w.witnessed:
                    if name not in witnesses:
                        labels, st = path_to(state, (label, steps))
                        witnesses[name] = Counterexample(name, WITNESSES[name][0], WITNESSES[name][1], labels, st)
                if w.broken:
                    name, message = w.broken[0]
                    if name not in found:
                        labels, st = path_to(state, (label, steps))
                        found[name] = Counterexample(name, INVARIANTS[name][0], message, labels, st)
                    continue
                nxt = (tuple(r.key() for r in w.reqs), w.phase, w.running)
                if nxt not in parent:
                    parent[nxt] = (state, label, steps)
                    queue.append(nxt)
        never = tuple((d.state, d.event) for d in self.table.rows if (d.state, d.event) not in self.fired)
        return OverlapReport(self.n, len(parent), tuple(found.values()), witnesses, never)


def check_overlap(table: Table | None = None, *, requests: int = 1, max_tokens: int = 2,
                  outcomes: tuple[str, ...] = HOST_OUTCOMES) -> OverlapReport:
    """Explore every run of `requests` (1..3) overlapped requests of up to `max_tokens` tokens each
    whose host work has `outcomes` (a subset of HOST_OUTCOMES; `length` at max_tokens always),
    module doc; shortest counterexamples and witnesses first."""
    if not outcomes or not set(outcomes) <= set(HOST_OUTCOMES):
        raise ValueError(f"outcomes must be a non-empty subset of {HOST_OUTCOMES}, got {outcomes}")
    if not 1 <= requests <= MAX_REQUESTS:
        raise ValueError(f"requests must be 1..{MAX_REQUESTS}, got {requests}")
    if not 1 <= max_tokens <= 4:
        raise ValueError(f"max_tokens must be 1..4 for model checking, got {max_tokens}")
    return _Search(table or load_spec("overlap"), requests, max_tokens, tuple(outcomes)).run()

