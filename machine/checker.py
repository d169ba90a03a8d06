"""The explicit-state model checker (DESIGN, machine/ "check"; issue 5 item 2).

Breadth-first search over the product of one to three requests of the §4.3 loop (machine/
checker_model.py: lifecycle, stream, five resources, stop matcher, detokenizer and the Engine's
sequence, each stepped through its table) with an environment that injects cancel, deadline,
model, decoding and transport errors, a slow reader and a client disconnect at every point, and a
scheduler that parks, preempts and resumes. The requests share the batch's places (spec/
sequence.toml: admission and resume take one, preemption and the drop give it back; with 1 place
the second request waits in QUEUED); the request components are kept in canonical (sorted)
order, so symmetric states are stored once.

Speed: a request is interned once as a small int; its successors, state checks, edge checks and
witnesses are computed once per distinct request and reused in every product state holding it; a
product state is one int (pool and the sorted request ids). Checked, in every state: the "state"
and "both" invariants of spec/invariants.toml; that every run can reach its end (a non-terminal
state with no successor is a deadlock, one from which no end is reachable a livelock); and every
sometimes-property has a witness. Each finding comes with the SHORTEST path (BFS parent pointers)
as a replayable list of (request, machine, state, event) steps.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ..spec import DecisionKind, Table
from ..spec.invariants import load_invariants
from .checker_model import (
    F_LC, F_PC, F_REASON, FAULTS, FINISH_GUARDS, PC_NAMES, POOL_WITNESSES, REASONS, WITNESS_NEEDS, WITNESSES, Model,
    ModelConfig, config_offers,
)

_MASK = (1 << 21) - 1
_LIVENESS = "every_run_terminates"


@attrs.frozen
class Counterexample:
    """A path from an initial state: labels of the model steps and the table steps they fire.

    `steps` is replayable: (request, machine, state, event) in order; `machine` is "lifecycle",
    "stream", "stop_matcher", "detokenizer" or "resources[kind]".
    """

    name: str
    anchor: str
    message: str
    labels: tuple[str, ...]
    steps: tuple[tuple[int, str, str, str], ...]
    # The state of every request before the first step and after each labelled step (TLC's
    # trace): one dict per request, from Model.describe.
    states: tuple[tuple[Mapping[str, Any], ...], ...] = ()

    def text(self) -> str:
        """The trace as TLC prints one: the initial state, then each step with what it changed."""
        if not self.states:
            return "\n".join(f"{i:3}. {label}" for i, label in enumerate(self.labels, start=1))
        lines = ["  0. initial state"] + [f"       r{r}: " + _fields(s) for r, s in enumerate(self.states[0])]
        for i, (label, before, after) in enumerate(zip(self.labels, self.states, self.states[1:]), start=1):
            lines.append(f"{i:3}. {label}")
            for r, (a, b) in enumerate(zip(before, after)):
                changed = {k: v for k, v in b.items() if a.get(k) != v}
                if changed:
                    lines.append(f"       r{r}: " + _fields(changed))
        return "\n".join(lines)

    def path(self, machine: str, request: int = 0) -> list[tuple[str, str]]:
        """The (state, event) pairs of one machine of one request: a path to highlight on its diagram."""
        return [(s, e) for r, m, s, e in self.steps if r == request and m == machine]

    def numbers(self, machine: str, request: int = 0) -> list[int]:
        """The global step numbers (1-based, over every machine) of `path(machine, request)`, so the
        drawings of several machines read as one sequence."""
        return [i for i, (r, m, _, _) in enumerate(self.steps, start=1) if r == request and m == machine]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "anchor": self.anchor, "message": self.message,
                "labels": list(self.labels), "steps": [list(s) for s in self.steps],
                "states": [[dict(r) for r in step] for step in self.states]}


def _fields(values: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


@attrs.frozen
class CheckReport:
    """What one exhaustive run found (issue 5: states, transitions, depth, time, rows never fired)."""

    requests: int
    config: ModelConfig
    states: int
    transitions: int
    max_depth: int
    seconds: float
    exhaustive: bool
    violations: tuple[Counterexample, ...]
    witnesses: Mapping[str, Counterexample]
    missing_witnesses: tuple[str, ...]
    rows_never_fired: Mapping[str, tuple[tuple[str, str], ...]]
    reasons_never_reached: tuple[str, ...] = ()
    slots: int = 1
    ignores_never_fired: Mapping[str, tuple[tuple[str, str], ...]] = attrs.field(factory=dict)

    @property
    def states_per_s(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float("inf")

    @property
    def unexplored(self) -> bool:
        """A row or an ignore no step fired, or a finish reason no run ended with: the model never
        tried part of the tables, so passing says nothing about it (a new event, a row the loop
        never offers, an ignore nobody sends)."""
        return (any(self.rows_never_fired.values()) or any(self.ignores_never_fired.values())
                or bool(self.reasons_never_reached))

    @property
    def ok(self) -> bool:
        """No violation, every witness found, and (for the one-request run, which explores every
        local behaviour the tables allow) nothing unexplored. The two-request run bounds the data
        (one token, one policy) to reach every interleaving, so its coverage is reported only."""
        covered = not (self.requests == 1 and self.exhaustive and self.unexplored)
        return not self.violations and not self.missing_witnesses and covered

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "slots": self.slots, "config": attrs.asdict(self.config), "states": self.states,
            "transitions": self.transitions, "max_depth": self.max_depth, "seconds": round(self.seconds, 3),
            "states_per_s": round(self.states_per_s), "exhaustive": self.exhaustive,
            "violations": [v.to_json() for v in self.violations],
            "witnesses": {k: v.to_json() for k, v in self.witnesses.items()},
            "missing_witnesses": list(self.missing_witnesses),
            "rows_never_fired": {k: [list(p) for p in v] for k, v in self.rows_never_fired.items()},
            "ignores_never_fired": {k: [list(p) for p in v] for k, v in self.ignores_never_fired.items()},
            "reasons_never_reached": list(self.reasons_never_reached),
        }


class _Local:
    """Interned request tuples with their successors and checks, each computed once."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.ids: dict[tuple[int, ...], int] = {}
        self.comps: list[tuple[int, ...]] = []
        self.succ: list[list | None] = []
        self.bad: list[list] = []  # state violations per request id
        self.labels: list[tuple[int, str, tuple, tuple[str, ...]]] = []  # (src id, label, fired, witnesses)
        self.edge_bad: list[tuple[int, int, bool, str, str]] = []  # (src, label, needs slot, name, message)
        self.edge_bad_of: dict[int, list[int]] = {}

    def intern(self, comp: tuple[int, ...]) -> int:
        cid = self.ids.get(comp)
        if cid is None:
            cid = self.ids[comp] = len(self.comps)
            if cid >= _MASK:
                raise RuntimeError("model too large for the state encoding (over 2M distinct requests)")
            self.comps.append(comp)
            self.succ.append(None)
            self.bad.append(self.model.state_violations(comp))
        return cid

    def successors(self, cid: int) -> list:
        out = self.succ[cid]
        if out is None:
            out = self.succ[cid] = []
            comp = self.comps[cid]
            for step in self.model.expand(comp):
                post = tuple(step.f)
                wit = tuple(self.model.witnesses(comp, post, step.fired)) if not step.dead else ()
                lab = len(self.labels)
                self.labels.append((cid, step.label, tuple(step.fired), wit))
                for name, msg, _ in step.bad:
                    self.edge_bad_of.setdefault(cid, []).append(len(self.edge_bad))
                    self.edge_bad.append((cid, lab, step.needs_slot, name, msg))
                if not step.dead:
                    out.append((lab, self.intern(post), step.pool, step.needs_slot, wit or None))
        return out


MAX_REQUESTS = 3


def default_config(requests: int) -> ModelConfig:
    """The bounds `check` uses: for one request every local behaviour (2 tokens, both policies,
    every byte outcome, requests with a finish guard's field set); for several, what they share (the batch's places under preemption,
    cancel, deadline and errors) with 1 token, the pause policy and plain text (a request's byte
    outcomes do not touch another's; the one-request run explores them); for three, also no
    reader disconnects (the reader is each request's own)."""
    if requests == 1:
        return ModelConfig(guards=tuple(FINISH_GUARDS))
    faults = tuple(f for f in FAULTS if requests < 3 or f != "disconnect")
    return ModelConfig(max_output_tokens=1, policies=("pause",), byte_choices=False, faults=faults)


def parked_config(requests: int) -> ModelConfig:
    """Bounds under which several requests reach parked sequences (§4.8), the main cross-request
    hazard of slow readers: two tokens each (a reader behind after the first delta parks the
    second select), the pause policy, plain text, no finish-condition choices, and as faults the
    reader's own (a disconnect) and a cancel for two requests, none for three (whose product with
    a cancel is some 3 million states). `default_config` keeps one token, so it never parks."""
    faults = ("cancel", "disconnect") if requests < 3 else ()
    return ModelConfig(max_output_tokens=2, policies=("pause",), byte_choices=False, finish_conditions=False,
                       faults=faults)


def check(
    requests: int = 1,
    max_depth: int | None = None,
    tables: Mapping[str, Table] | None = None,
    *,
    config: ModelConfig | None = None,
    slots: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> CheckReport:
    """Exhaust the model of `requests` (1 to 3) requests sharing `slots` batch places.

    `tables` replaces shipped tables by name (e.g. {"lifecycle": modified}); `config` bounds the
    data (default: `default_config(requests)`). `max_depth` stops the search there (then liveness
    is not judged).
    """
    if requests not in range(1, MAX_REQUESTS + 1):
        raise ValueError(f"requests must be 1 to {MAX_REQUESTS}, got {requests!r}")
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if config is None:
        config = default_config(requests)
    model = Model(tables, config)
    return _Search(model, requests, slots, max_depth, progress).run()


class _Search:
    """One BFS. A product state is an int: the free places, then the N request ids in ascending
    order, 21 bits each (pool << 21N | id_0 << 21(N-1) | ... | id_N-1)."""

    def __init__(self, model: Model, requests: int, slots: int, max_depth: int | None, progress) -> None:
        self.model, self.requests, self.slots = model, requests, slots
        self.max_depth = max_depth
        self.progress = progress
        self.local = _Local(model)
        self.invariants = load_invariants()
        self.found: dict[str, tuple[int, int, str, tuple | None]] = {}  # name -> (state, label or -1, msg, guard)
        self.witness_at: dict[str, tuple[int, int]] = {}  # name -> (state, label or -1)
        self._shift = 21 * requests
        self._fired: set[tuple[str, str, str]] | None = None

    def _pack(self, pool: int, ids: list[int]) -> int:
        out = pool
        for c in sorted(ids):
            out = (out << 21) | c
        return out

    def run(self) -> CheckReport:
        t0 = time.perf_counter()
        loc, model, n_req, shift = self.local, self.model, self.requests, self._shift
        inits = [loc.intern(c) for c in model.initial()]
        acyclic = self._prepass(inits)
        n = len(loc.comps)
        comps = loc.comps
        hold = self._hold = [int(model.holds_slot(c)) for c in comps]
        done = [model.done(c) for c in comps]
        self._waits = [model.waits_for_slot(c) for c in comps]
        self._used = [model.used_slot(c) for c in comps]
        flagged = [bool(b) for b in loc.bad]
        free: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # (next id, pool delta, change of free + held)
        slot: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # steps that take a place
        witness_edges: list[list] = [[] for _ in range(n)]
        for c in range(n):
            for lab, nx, dp, need, wit in loc.succ[c]:
                if nx != c or dp:  # a step that changes nothing is no edge (see _prepass)
                    (slot if need else free)[c].append((nx, dp, dp + hold[nx] - hold[c]))
                if wit:
                    witness_edges[c].append((lab, need, wit))
        both = [free[c] + slot[c] for c in range(n)]
        ebad: list[list | None] = [None] * n
        for c, ks in loc.edge_bad_of.items():
            ebad[c] = [loc.edge_bad[k] for k in ks]
        expanded = bytearray(n)

        combos = sorted({tuple(sorted(x)) for x in itertools.product(inits, repeat=n_req)})
        frontier = sorted({self._pack(self.slots, list(x)) for x in combos})
        seen: dict[int, int] = dict.fromkeys(frontier, -1)
        for s in frontier:
            self._check_state(s)
        pred: dict[int, list[int]] | None = None if acyclic else {}
        found, wit_found = self.found, self.witness_at
        missing = set(self._expected_witnesses()) - set(POOL_WITNESSES)
        pool_missing = [w for w in self._expected_witnesses() if w in POOL_WITNESSES]
        shifts = [21 * (n_req - 1 - k) for k in range(n_req)]
        transitions = depth = 0
        truncated = False
        while frontier:
            if self.max_depth is not None and depth >= self.max_depth:
                truncated = True
                break
            nxt: list[int] = []
            for s in frontier:
                pool = s >> shift
                ids = [(s >> 21) & _MASK, s & _MASK] if n_req == 2 else [(s >> sh) & _MASK for sh in shifts]
                en = 0
                prev = -1
                for k, x in enumerate(ids):
                    if x == prev:
                        continue
                    prev = x
                    expanded[x] = 1
                    moves = both[x] if pool else free[x]
                    en += len(moves)
                    # the others' ids stay sorted; the mover's new id sorts in among them (unrolled
                    # for up to MAX_REQUESTS = 3: this is the search's innermost loop)
                    if n_req == 2:
                        y = ids[1 - k]
                    elif n_req == 3:
                        y, z = ids[:k] + ids[k + 1:]
                    for nx, dp, dh in moves:  # dh: what the move changes in the place accounting
                        np = pool + dp
                        if n_req == 2:
                            ns = (np << 42) | ((nx << 21) | y if nx <= y else (y << 21) | nx)
                        elif n_req == 1:
                            ns = (np << 21) | nx
                        elif nx <= y:
                            ns = (np << 63) | (nx << 42) | (y << 21) | z
                        elif nx <= z:
                            ns = (np << 63) | (y << 42) | (nx << 21) | z
                        else:
                            ns = (np << 63) | (y << 42) | (z << 21) | nx
                        if ns not in seen:
                            seen[ns] = s
                            nxt.append(ns)
                            # a state whose places do not add up is first reached by a move that
                            # changes the sum (free + held), so only those are checked for it
                            if flagged[nx] or dh or pool_missing:
                                self._check_state(ns)
                                pool_missing = [w for w in pool_missing if w not in wit_found]
                        if pred is not None:
                            pred.setdefault(ns, []).append(s)
                    if ebad[x]:
                        for _, lab, need, name, msg in ebad[x]:
                            if name not in found and (pool or not need):
                                found[name] = (s, lab, msg, None)
                    if missing:
                        for lab, need, wit in witness_edges[x]:
                            if pool or not need:
                                for w in wit:
                                    if w not in wit_found:
                                        wit_found[w] = (s, lab)
                                        missing.discard(w)
                transitions += en
                if not en and not all(done[c] for c in ids) and _LIVENESS not in found:
                    pcs = ", ".join(PC_NAMES[comps[c][F_PC]] for c in ids)
                    found[_LIVENESS] = (s, -1, f"deadlock: no successor (loop at {pcs})", None)
            frontier = nxt
            depth += 1
            if self.progress is not None:
                self.progress(len(seen), depth)
        if pred is not None and not truncated:
            self._liveness(seen, pred, done)
        seconds = time.perf_counter() - t0
        self._seen = seen
        return CheckReport(
            requests=self.requests, config=model.config, states=len(seen), transitions=transitions,
            max_depth=depth - 1 if not truncated else depth, seconds=seconds, exhaustive=not truncated,
            violations=tuple(self._counterexample(k, *v) for k, v in sorted(found.items(), key=lambda kv: self._depth(kv[1][0]))),
            witnesses={k: self._counterexample(k, s, lab, f"witness: {k}") for k, (s, lab) in sorted(wit_found.items())},
            missing_witnesses=tuple(sorted(set(self._expected_witnesses()) - set(wit_found))),
            rows_never_fired=self._never_fired(expanded, DecisionKind.ROW),
            reasons_never_reached=self._reasons_never_reached(expanded),
            ignores_never_fired=self._never_fired(expanded, DecisionKind.IGNORE),
            slots=self.slots,
        )

    def _prepass(self, inits: list[int]) -> bool:
        """Expand every request tuple reachable alone (slots ignored); True if that graph has no cycle.

        Without a cycle in the one-request graph the product has none either (every product step
        advances one request), so liveness reduces to: no reachable non-final state without a
        successor. With a cycle, the search keeps predecessor lists and checks that an end is
        reachable from every state. A step that changes nothing (an ignore row offered where it
        can occur, e.g. a release of a released resource) is no edge: it is checked and counted
        as fired, and it neither moves the search nor keeps a state from being a deadlock.
        """
        loc = self.local
        todo, seen = list(inits), set(inits)
        while todo:
            for _, nx, _, _, _ in loc.successors(todo.pop()):
                if nx not in seen:
                    seen.add(nx)
                    todo.append(nx)
        indeg = [0] * len(loc.comps)
        for c in range(len(loc.comps)):
            for _, nx, dp, _, _ in loc.succ[c]:
                if nx != c or dp:
                    indeg[nx] += 1
        ready = [c for c in range(len(loc.comps)) if indeg[c] == 0]
        ordered = 0
        while ready:
            c = ready.pop()
            ordered += 1
            for _, nx, dp, _, _ in loc.succ[c]:
                if nx == c and not dp:
                    continue
                indeg[nx] -= 1
                if indeg[nx] == 0:
                    ready.append(nx)
        return ordered == len(loc.comps)

    def _comps(self, s: int) -> tuple[int, ...]:
        return tuple((s >> (21 * (self.requests - 1 - k))) & _MASK for k in range(self.requests))

    def _check_state(self, s: int) -> None:
        loc = self.local
        pool = s >> self._shift
        comps = self._comps(s)
        for c in comps:
            for name, msg, extra in loc.bad[c]:
                if name not in self.found:
                    self.found[name] = (s, -1, msg, extra)
        holders = sum(self._hold[c] for c in comps)
        if pool + holders != self.slots and "release_exactly_once" not in self.found:
            self.found["release_exactly_once"] = (s, -1, f"batch places: {pool} free + {holders} held != {self.slots}", None)
        if self.requests > 1:
            if pool == 0 and any(self._waits[c] for c in comps):
                self.witness_at.setdefault("request_waits_for_slot", (s, -1))
            if all(self._used[c] for c in comps):
                self.witness_at.setdefault("slot_reused_after_release", (s, -1))

    def _liveness(self, seen: dict[int, int], pred: dict[int, list[int]], done: list[bool]) -> None:
        """With cycles: every state must reach a state where all requests are done (no livelock)."""
        ok = {s for s in seen if all(done[c] for c in self._comps(s))}
        todo = list(ok)
        while todo:
            for p in pred.get(todo.pop(), ()):
                if p not in ok:
                    ok.add(p)
                    todo.append(p)
        stuck = [s for s in seen if s not in ok]
        if stuck:
            s = min(stuck, key=self._depth)
            pcs = ", ".join(PC_NAMES[self.local.comps[c][F_PC]] for c in self._comps(s))
            self.found.setdefault(_LIVENESS, (s, -1, f"livelock: no way to an end (loop at {pcs})", None))

    def _depth(self, s: int) -> int:
        d = 0
        while self._seen[s] >= 0:
            s = self._seen[s]
            d += 1
        return d

    def _witness_anchor(self, name: str) -> str:
        return WITNESSES[name][0] if name in WITNESSES else POOL_WITNESSES[name]

    def _expected_witnesses(self) -> list[str]:
        names = list(WITNESSES)
        if self.requests > 1:
            names += [w for w in POOL_WITNESSES if w != "request_waits_for_slot" or self.slots < self.requests]
        offered = config_offers(self.model.config)
        skip = {name for name, needs in WITNESS_NEEDS.items() if not set(needs) <= offered}
        return [n for n in names if n not in skip]

    def _counterexample(self, name: str, state: int, edge: int, msg: str, extra: tuple | None = None) -> Counterexample:
        """The BFS parent chain to `state`, then the local step `edge` (if >= 0) and a guard step."""
        chain = [state]
        while self._seen[chain[-1]] >= 0:
            chain.append(self._seen[chain[-1]])
        chain.reverse()
        loc = self.local
        ids = list(self._comps(chain[0]))
        labels: list[str] = []
        steps: list[tuple[int, str, str, str]] = []

        states = []

        def snap() -> None:
            states.append(tuple(self.model.describe(loc.comps[c]) for c in ids[: self.requests]))

        def take(label_id: int) -> int:
            src, text, fired, _ = loc.labels[label_id]
            who = ids.index(src)
            labels.append(f"r{who}: {text}")
            steps.extend((who, m, s, e) for m, s, e in fired)
            return who

        snap()
        for prev, cur in zip(chain, chain[1:]):
            lab, who, nx = self._edge(ids, prev, cur)
            take(lab)
            ids[who] = nx
            snap()
        if edge >= 0:
            who = take(edge)
            nxt = next((nx for lab, nx, *_ in loc.succ[ids[who]] or () if lab == edge), None)
            if nxt is not None:  # a step the table refused has no successor: the state stays
                ids[who] = nxt
            snap()
        if extra is not None:
            who = next(r for r, c in enumerate(ids) if any(b[2] == extra for b in loc.bad[c]))
            labels.append(f"r{who}: the table allows {extra[1]} --{extra[2]}--> ({extra[0]})")
            steps.append((who, *extra))
            snap()
        anchor = self.invariants[name].anchor if name in self.invariants else self._witness_anchor(name)
        return Counterexample(name, anchor, msg, tuple(labels), tuple(steps), tuple(states))

    def _edge(self, ids: list[int], prev: int, cur: int) -> tuple[int, int, int]:
        """Which request moved from `prev` to `cur`, by which local step, to which request id."""
        pool = prev >> self._shift
        target = sorted(self._comps(cur))
        for who, x in enumerate(ids):
            rest = ids[:who] + ids[who + 1:]
            for lab, nx, dp, need, _ in self.local.succ[x]:
                if (pool or not need) and pool + dp == cur >> self._shift and sorted(rest + [nx]) == target:
                    return lab, who, nx
        raise AssertionError("no step links two states of a BFS chain")

    def _reasons_never_reached(self, expanded: bytearray) -> tuple[str, ...]:
        """The finish reasons the lifecycle table's rows fix that no explored request ended with."""
        life = self.model.life
        declared = {d.reason for d in life.table.decisions.values() if d.kind is DecisionKind.ROW and d.reason}
        comps, reached = self.local.comps, set()
        for cid, succ in enumerate(self.local.succ):
            if succ and expanded[cid]:
                for _, nx, *_ in succ:
                    c = comps[nx]
                    if life.terminal[c[F_LC]] and REASONS[c[F_REASON]] is not None:
                        reached.add(REASONS[c[F_REASON]].value)
        return tuple(sorted(declared - reached))

    def _never_fired(self, expanded: bytearray, kind: DecisionKind) -> dict[str, tuple[tuple[str, str], ...]]:
        """Per machine, the decisions of `kind` (rows, ignores) no explored step fired (requests
        expanded in the product only)."""
        if self._fired is None:
            self._fired = {(m.split("[")[0], s, e) for src, _, steps, _ in self.local.labels if expanded[src]
                           for m, s, e in steps}
        out = {}
        for name, table in self.model.tables.items():
            pairs = [(d.state, d.event) for d in table.decisions.values() if d.kind is kind]
            out[name] = tuple(p for p in pairs if (name, *p) not in self._fired)
        return out
