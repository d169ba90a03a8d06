"""The explicit-state model checker (docs/concepts.md, "How it is checked"; D51: a BFS a level at a time).

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
product state is one int (pool and the sorted request ids), and the search expands a whole BFS
level at once over numpy arrays (every request's moves as flat arrays, a level's successors
computed in blocks and deduplicated in a dense array of marks indexed by the free places and the
rank of the request ids as a multiset), so the product costs a few array operations a block
instead of Python bytecode a transition; the cycle collector is paused meanwhile (nothing the
search makes holds a cycle). Checked, in every state: the "state" and "both" invariants of
spec/invariants.toml (machine/checker_invariants.py on each request's state, checker_model.
STEP_CHECKS on each step, SEARCH_CHECKS here); that every run can reach its end (a non-terminal
state with no successor is a deadlock, one from which no end is reachable a livelock); and every
sometimes-property has a witness. Each finding comes with the SHORTEST path (BFS parent pointers)
as a replayable list of (request, machine, state, event) steps.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np

from ..spec import DecisionKind, Spec, Table
from ..spec.invariants import load_invariants
from .checker_invariants import STATE_CHECKS, StateJudge
from .checker_model import (
    FAULTS,
    FINISH_GUARDS,
    MAX_REQUESTS,
    POOL_WITNESSES,
    REASONS,
    STEP_CHECKS,
    WITNESS_NEEDS,
    WITNESSES,
    Model,
    ModelConfig,
    config_offers,
)
from .checker_state import PC_NAMES, F

_MASK = (1 << 21) - 1  # request ids stay under 2M
_MAX_INDEX = 1 << 31  # entries of the dense index of states seen (4 bytes each)
_BLOCK = 1 << 16  # frontier states expanded at once (some 300k moves)
_LIVENESS = "every_run_terminates"
# What the product search checks itself, beside the state checks and what the steps report.
SEARCH_CHECKS = {
    _LIVENESS: "_Search.run and _liveness: a state with no successor (deadlock) or no way to an end (livelock)",
    "release_exactly_once": "_Search._check_state: the free batch places plus the held ones are the slots",
}


def registry_mismatch() -> tuple[list[str], list[str]]:
    """(state invariants the checker does not judge, names it judges that are no state invariant):
    its state checks, its steps' reports and its search together, against spec/invariants.toml."""
    return STATE_CHECKS.mismatch(elsewhere={*STEP_CHECKS, *SEARCH_CHECKS})


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
    """What one exhaustive run found: states, transitions, depth, time, rows never fired."""

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
    """Interned requests (plain tuples of checker_state.RequestState's fields) with their
    successors and checks, each computed once."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.judge = StateJudge(model)
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
            self.bad.append(self.judge(comp))
        return cid

    def successors(self, cid: int) -> list:
        out = self.succ[cid]
        if out is None:
            out = self.succ[cid] = []
            comp = self.comps[cid]
            for step in self.model.expand(comp):
                post = tuple(step.f)
                wit = tuple(self.model.witnesses(comp, step)) if not step.dead else ()
                lab = len(self.labels)
                self.labels.append((cid, step.label, tuple(step.fired), wit))
                for name, msg in step.bad:
                    self.edge_bad_of.setdefault(cid, []).append(len(self.edge_bad))
                    self.edge_bad.append((cid, lab, step.needs_slot, name, msg))
                if not step.dead:
                    out.append((lab, self.intern(post), step.pool, step.needs_slot, wit or None))
        return out


class _Moves:
    """Every request tuple's moves as flat arrays: those of request c are off[c] .. off[c] +
    n_both[c] when a place is free, else the first n_free[c] (the ones that take no place).

    A product state's ascending request ids also have a rank among the multisets of `requests`
    ids, below `multisets` = C(n + N - 1, N) (i_0 <= ... <= i_N-1 ranks as sum_j C(i_j + j, j + 1)):
    with its free places, a dense index of the states seen (_Seen), a sixth of n^3 for three."""

    def __init__(self, loc: _Local, hold: list[int], requests: int) -> None:
        nx: list[int] = []
        dp: list[int] = []
        check: list[bool] = []
        off: list[int] = []
        n_free: list[int] = []
        n_both: list[int] = []
        for c, succ in enumerate(loc.succ):
            free: list[tuple[int, int, int]] = []
            slot: list[tuple[int, int, int]] = []
            for _, y, d, need, _ in succ or ():
                if y != c or d:  # a step that changes nothing is no edge (see _prepass)
                    (slot if need else free).append((y, d, d + hold[y] - hold[c]))
            off.append(len(nx))
            for y, d, dh in free + slot:
                nx.append(y)
                dp.append(d)
                # a state whose places do not add up is first reached by a move that changes the
                # sum (free + held), so only those, and moves into a flagged request, are checked
                check.append(bool(loc.bad[y]) or dh != 0)
            n_free.append(len(free))
            n_both.append(len(free) + len(slot))
        self.nx, self.dp = np.array(nx, dtype=np.int64), np.array(dp, dtype=np.int64)
        self.check = np.array(check, dtype=bool)
        self.off = np.array(off, dtype=np.int64)
        self.n_free, self.n_both = np.array(n_free, dtype=np.int64), np.array(n_both, dtype=np.int64)
        n = len(loc.succ)
        self.rank = [np.array([math.comb(i + j, j + 1) for i in range(n)], dtype=np.int64) for j in range(requests)]
        self.multisets = math.comb(n + requests - 1, requests)

    def index(self, rows: Iterable[np.ndarray]) -> np.ndarray:
        """The multiset rank of each column of ascending request ids (rows)."""
        return functools.reduce(np.add, (rank[row] for rank, row in zip(self.rank, rows)))

    def expand(self, frontier: np.ndarray, pool: np.ndarray, cols: np.ndarray,
               base: int) -> tuple[np.ndarray, Iterator[tuple[np.ndarray, ...]]]:
        """Every move of every frontier state: (moves per frontier state, the moves in blocks of
        (next states, their free places, the rank of their ids, their sources, which must be
        checked)), in the level's order: by the request that moves, then by frontier state.
        `cols` holds each state's ascending request ids, [N, F]; a request id held twice moves
        once (the two are the same request by symmetry)."""
        size = cols.shape[1]
        per_state = np.zeros(size, dtype=np.int64)
        movers = []
        for k in range(len(cols)):
            at = np.flatnonzero(cols[k] != cols[k - 1]) if k else np.arange(size)
            counts = np.where(pool[at] > 0, self.n_both[cols[k, at]], self.n_free[cols[k, at]])
            per_state[at] += counts
            movers.append((k, at, counts))
        return per_state, self._blocks(movers, frontier, pool, cols, base)

    def _blocks(self, movers: list, frontier: np.ndarray, pool: np.ndarray, cols: np.ndarray,
                base: int) -> Iterator[tuple[np.ndarray, ...]]:
        """The moves of `_BLOCK` frontier states at a time, so a level's arrays stay small."""
        for k, at_all, counts_all in movers:
            others = [j for j in range(len(cols)) if j != k]
            for lo in range(0, len(at_all), _BLOCK):
                at, counts = at_all[lo:lo + _BLOCK], counts_all[lo:lo + _BLOCK]
                fi = np.repeat(at, counts)  # the frontier state of each move
                mi = np.repeat(self.off[cols[k, at]] - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
                key = places = pool[fi] + self.dp[mi]
                rows = _insert_sorted([cols[j, fi] for j in others], self.nx[mi])
                for row in rows:
                    key = key * base + row
                yield key, places, self.index(rows), frontier[fi], self.check[mi]


def _insert_sorted(rows: list[np.ndarray], y: np.ndarray) -> list[np.ndarray]:
    """`rows` (ascending down every column) with `y` inserted in each column's order: the j-th
    smallest is max(rows[j-1], min(rows[j], y)), a few element-wise operations where a sort along
    the short axis would sort every column on its own."""
    out = []
    for j in range(len(rows) + 1):
        at_most = np.minimum(rows[j], y) if j < len(rows) else y
        out.append(np.maximum(rows[j - 1], at_most) if j else at_most)
    return out


def _first_holding(cols: np.ndarray, pooled: np.ndarray, n: int) -> np.ndarray:
    """[2, n]: the first frontier index of a state holding request x (row 0), and of one holding it
    with a free place (row 1); the frontier's size where there is none."""
    size = cols.shape[1]
    first = np.full((2, n), size, dtype=np.int64)
    for row, keep in enumerate((np.ones(size, dtype=bool), pooled)):
        where = np.flatnonzero(keep)
        for col in cols[:, where]:
            xs, i = np.unique(col, return_index=True)
            first[row, xs] = np.minimum(first[row, xs], where[i])
    return first


_UNSEEN, _SEEN = np.iinfo(np.int32).max, -1  # a dense index's mark between two blocks


class _Seen:
    """The product states reached, a mark per dense index (free places - lo)·multisets + the rank
    of the request ids (_Moves.index): _UNSEEN or _SEEN. The places run from 0 to the slots; a
    table whose rows take or give back places wrongly reaches other counts, and the marks grow."""

    def __init__(self, multisets: int, slots: int) -> None:
        self.multisets, self.lo, self.hi = multisets, 0, slots
        self.marks = self._blank()

    def _blank(self) -> np.ndarray:
        size = (self.hi - self.lo + 1) * self.multisets
        if size > _MAX_INDEX:
            raise RuntimeError(f"model too large for the dense index of states seen ({size * 4 / 2 ** 30:.0f} GiB)")
        return np.full(size, _UNSEEN, dtype=np.int32)

    def _dense(self, places: np.ndarray, rank: np.ndarray) -> np.ndarray:
        lo, hi = min(self.lo, int(places.min())), max(self.hi, int(places.max()))
        if (lo, hi) != (self.lo, self.hi):
            old, start = self.marks, (self.lo - lo) * self.multisets
            self.lo, self.hi = lo, hi
            self.marks = self._blank()
            self.marks[start:start + len(old)] = old
        return (places - self.lo) * self.multisets + rank

    def mark(self, places: np.ndarray, rank: np.ndarray) -> None:
        self.marks[self._dense(places, rank)] = _SEEN

    def first_reached(self, places: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """The positions of the moves (a block of the level, in its order) that reach a state not
        seen before, the first such move of each, and their states marked seen. Meanwhile a
        state's mark is the least position of a move into it; a block's first move into a state is
        the level's, as the blocks before it marked the states they reached."""
        if not len(rank):
            return np.zeros(0, dtype=np.int32)
        dense = self._dense(places, rank)
        marks = self.marks
        at = np.flatnonzero(marks[dense] == _UNSEEN).astype(np.int32)
        np.minimum.at(marks, dense[at], at)
        first = at[marks[dense[at]] == at]
        marks[dense[first]] = _SEEN
        return first


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
    tables: Spec | Mapping[str, Table] | None = None,
    *,
    config: ModelConfig | None = None,
    slots: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> CheckReport:
    """Exhaust the model of `requests` (1 to 3) requests sharing `slots` batch places.

    `tables`: a Spec, or tables by name that replace the spec directory's (e.g. {"lifecycle":
    modified}); `config` bounds the
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
    with _cycle_collector_paused():
        return _Search(model, requests, slots, max_depth, progress).run()


@contextlib.contextmanager
def _cycle_collector_paused() -> Iterator[None]:
    """The search makes millions of small objects that hold no cycle (reference counting frees
    each), and the cycle collector's passes over those it keeps cost as much time as the search
    itself: the collector is paused while it runs, then left as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Search:
    """One BFS, a level at a time over numpy arrays. A product state is an int: the free places,
    then the N request ids in ascending order, in base n (n distinct request tuples):
    pool·n^N + id_0·n^(N-1) + ... + id_N-1. Each level's states are kept sorted with their BFS
    parents, so a state's depth is its level and its shortest path is the chain of parents."""

    def __init__(self, model: Model, requests: int, slots: int, max_depth: int | None, progress) -> None:
        self.model, self.requests, self.slots = model, requests, slots
        self.max_depth = max_depth
        self.progress = progress
        self.local = _Local(model)
        self.invariants = load_invariants()
        self.found: dict[str, tuple[int, int, str, tuple | None]] = {}  # name -> (state, label or -1, msg, guard)
        self.witness_at: dict[str, tuple[int, int]] = {}  # name -> (state, label or -1)
        self._fired: set[tuple[str, str, str]] | None = None
        self._base = self._span = 1
        self._levels: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted states, their parents) per depth

    def _pack(self, pool: int, ids: Iterable[int]) -> int:
        out = pool
        for c in sorted(ids):
            out = out * self._base + c
        return out

    def _pool(self, s: int) -> int:
        return s // self._span

    def run(self) -> CheckReport:
        t0 = time.perf_counter()
        loc, model, n_req = self.local, self.model, self.requests
        inits = [loc.intern(tuple(c)) for c in model.initial()]
        acyclic = self._prepass(inits)
        n = self._base = len(loc.comps)
        self._span = n ** n_req
        if (self.slots + 1) * self._span >= 1 << 63:
            raise RuntimeError(f"model too large for the state encoding ({n} distinct requests, {n_req} of them)")
        comps = loc.comps
        hold = self._hold = [int(model.holds_slot(c)) for c in comps]
        done = np.array([model.done(c) for c in comps], dtype=bool)
        self._waits = [model.waits_for_slot(c) for c in comps]
        self._used = [model.used_slot(c) for c in comps]
        moves = _Moves(loc, hold, n_req)
        seen = _Seen(moves.multisets, self.slots)
        waits, used = np.array(self._waits, dtype=bool), np.array(self._used, dtype=bool)
        witness_edges: dict[int, list] = {}
        for c in range(n):
            for lab, _, _, need, wit in loc.successors(c):
                if wit:
                    witness_edges.setdefault(c, []).append((lab, need, wit))
        ebad = {c: [loc.edge_bad[k] for k in ks] for c, ks in loc.edge_bad_of.items()}
        expanded = np.zeros(n, dtype=bool)

        frontier = np.array(sorted({self._pack(self.slots, x) for x in itertools.product(inits, repeat=n_req)}),
                            dtype=np.int64)
        self._levels = [(frontier, np.full(len(frontier), -1, dtype=np.int64))]
        seen.mark(frontier // self._span, moves.index(self._columns(frontier)))
        states = len(frontier)
        for s in frontier.tolist():
            self._check_state(s)
        edges: list[tuple[np.ndarray, np.ndarray]] | None = None if acyclic else []
        found, wit_found = self.found, self.witness_at
        missing = set(self._expected_witnesses()) - set(POOL_WITNESSES)
        pool_missing = [w for w in self._expected_witnesses() if w in POOL_WITNESSES]
        transitions = depth = 0
        truncated = False
        while len(frontier):
            if self.max_depth is not None and depth >= self.max_depth:
                truncated = True
                break
            pool = frontier // self._span
            cols = self._columns(frontier)  # [N, F], ascending
            expanded[cols] = True
            en, blocks = moves.expand(frontier, pool, cols, n)
            transitions += int(en.sum())
            stuck = (en == 0) & ~done[cols].all(axis=0)
            if stuck.any() and _LIVENESS not in found:
                s = int(frontier[stuck.argmax()])
                pcs = ", ".join(PC_NAMES[comps[c][F.pc]] for c in self._comps(s))
                found[_LIVENESS] = (s, -1, f"deadlock: no successor (loop at {pcs})", None)
            if ebad or missing:
                first = _first_holding(cols, pool > 0, n)
                for x, bad in ebad.items():
                    for _, lab, need, name, msg in bad:
                        at = first[int(need), x]
                        if name not in found and at < len(frontier):
                            found[name] = (int(frontier[at]), lab, msg, None)
                for x in [x for x in witness_edges if first[0, x] < len(frontier)] if missing else ():
                    for lab, need, wit in witness_edges[x]:
                        at = first[int(need), x]
                        for w in wit:
                            if w not in wit_found and at < len(frontier):
                                wit_found[w] = (int(frontier[at]), lab)
                                missing.discard(w)
            reached, sources, flagged = [], [], []
            for nxt, places, rank, src, check in blocks:
                if edges is not None:
                    edges.append((src, nxt))
                won = seen.first_reached(places, rank)
                reached.append(nxt[won])
                sources.append(src[won])
                flagged.append(nxt[check])
            new = np.concatenate(reached)
            order = np.argsort(new)
            new, parents = new[order], np.concatenate(sources)[order]
            for s in new[np.isin(new, np.concatenate(flagged))].tolist():
                self._check_state(s)  # a flagged request, or a move that changes free + held (see below)
            if pool_missing and len(new):
                self._pool_witnesses(new, waits, used)
                pool_missing = [w for w in pool_missing if w not in wit_found]
            self._levels.append((new, parents))
            frontier = new
            states += len(new)
            depth += 1
            if self.progress is not None:
                self.progress(states, depth)
        if edges is not None and not truncated:
            self._liveness(np.sort(np.concatenate([lv[0] for lv in self._levels])), edges, done)
        seconds = time.perf_counter() - t0
        return CheckReport(
            requests=self.requests, config=model.config, states=states, transitions=transitions,
            max_depth=depth - 1 if not truncated else depth, seconds=seconds, exhaustive=not truncated,
            violations=tuple(self._counterexample(k, *v) for k, v in sorted(found.items(), key=lambda kv: self._depth(kv[1][0]))),
            witnesses={k: self._counterexample(k, s, lab, f"witness: {k}") for k, (s, lab) in sorted(wit_found.items())},
            missing_witnesses=tuple(sorted(set(self._expected_witnesses()) - set(wit_found))),
            rows_never_fired=self._never_fired(expanded, DecisionKind.ROW),
            reasons_never_reached=self._reasons_never_reached(expanded),
            ignores_never_fired=self._never_fired(expanded, DecisionKind.IGNORE),
            slots=self.slots,
        )

    def _pool_witnesses(self, new: np.ndarray, waits: np.ndarray, used: np.ndarray) -> None:
        """The first new state where a request waits for a place none is free, and the first where
        every request has used one (as _check_state finds them, for a whole level at once)."""
        cols = self._columns(new)
        for name, hit in (("request_waits_for_slot", (new // self._span == 0) & waits[cols].any(axis=0)),
                          ("slot_reused_after_release", used[cols].all(axis=0))):
            if name not in self.witness_at and hit.any():
                self.witness_at[name] = (int(new[hit.argmax()]), -1)

    def _prepass(self, inits: list[int]) -> bool:
        """Expand every request tuple reachable alone (slots ignored); True if that graph has no cycle.

        Without a cycle in the one-request graph the product has none either (every product step
        advances one request), so liveness reduces to: no reachable non-final state without a
        successor. With a cycle, the search keeps every edge and checks that an end is reachable
        from every state. A step that changes nothing (an ignore row offered where it can occur,
        e.g. a release of a released resource) is no edge: it is checked and counted as fired, and
        it neither moves the search nor keeps a state from being a deadlock.
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
            for _, nx, dp, _, _ in loc.successors(c):
                if nx != c or dp:
                    indeg[nx] += 1
        ready = [c for c in range(len(loc.comps)) if indeg[c] == 0]
        ordered = 0
        while ready:
            c = ready.pop()
            ordered += 1
            for _, nx, dp, _, _ in loc.successors(c):
                if nx == c and not dp:
                    continue
                indeg[nx] -= 1
                if indeg[nx] == 0:
                    ready.append(nx)
        return ordered == len(loc.comps)

    def _columns(self, states: np.ndarray) -> np.ndarray:
        """[N, len(states)]: each state's request ids, ascending."""
        n = self._base
        return np.stack([(states // n ** (self.requests - 1 - k)) % n for k in range(self.requests)])

    def _comps(self, s: int) -> tuple[int, ...]:
        n, out = self._base, []
        for _ in range(self.requests):
            s, c = divmod(s, n)
            out.append(c)
        return tuple(reversed(out))

    def _check_state(self, s: int) -> None:
        loc = self.local
        pool = self._pool(s)
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

    def _liveness(self, seen: np.ndarray, edges: list[tuple[np.ndarray, np.ndarray]], done: np.ndarray) -> None:
        """With cycles: every state must reach a state where all requests are done (no livelock)."""
        src = np.searchsorted(seen, np.concatenate([e[0] for e in edges]))
        dst = np.searchsorted(seen, np.concatenate([e[1] for e in edges]))
        ok = done[self._columns(seen)].all(axis=0)
        while True:  # backwards from the ends, one edge at a time
            grow = src[ok[dst] & ~ok[src]]
            if not len(grow):
                break
            ok[grow] = True
        if not ok.all():
            s = min(seen[~ok].tolist(), key=self._depth)
            pcs = ", ".join(PC_NAMES[self.local.comps[c][F.pc]] for c in self._comps(s))
            self.found.setdefault(_LIVENESS, (s, -1, f"livelock: no way to an end (loop at {pcs})", None))

    def _parent(self, s: int) -> tuple[int, int]:
        """(depth, BFS parent or -1) of a reached state."""
        for depth, (states, parents) in enumerate(self._levels):
            i = int(np.searchsorted(states, s))
            if i < len(states) and states[i] == s:
                return depth, int(parents[i])
        raise KeyError(f"state {s} was not reached")

    def _depth(self, s: int) -> int:
        return self._parent(s)[0]

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
        while (parent := self._parent(chain[-1])[1]) >= 0:
            chain.append(parent)
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
        pool, target = self._pool(prev), sorted(self._comps(cur))
        for who, x in enumerate(ids):
            rest = ids[:who] + ids[who + 1:]
            for lab, nx, dp, need, _ in self.local.successors(x):
                if (pool or not need) and pool + dp == self._pool(cur) and sorted(rest + [nx]) == target:
                    return lab, who, nx
        raise AssertionError("no step links two states of a BFS chain")

    def _reasons_never_reached(self, expanded: np.ndarray) -> tuple[str, ...]:
        """The finish reasons the lifecycle table's rows fix that no explored request ended with."""
        life = self.model.life
        declared = {d.reason for d in life.table.decisions.values() if d.kind is DecisionKind.ROW and d.reason}
        comps, reached = self.local.comps, set()
        for cid, succ in enumerate(self.local.succ):
            if succ and expanded[cid]:
                for _, nx, *_ in succ:
                    c = comps[nx]
                    if life.terminal[c[F.lifecycle]] and REASONS[c[F.reason]] is not None:
                        reached.add(REASONS[c[F.reason]].value)
        return tuple(sorted(declared - reached))

    def _never_fired(self, expanded: np.ndarray, kind: DecisionKind) -> dict[str, tuple[tuple[str, str], ...]]:
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
