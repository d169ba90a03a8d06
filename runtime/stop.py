"""Cross-token stop matching (§4.6): stop strings on the output byte stream, stop token-id
sequences on the token stream.

A stop string can begin in one token and end several tokens later, so the matcher may not emit a
byte while it could still be the start of a stop: it holds back exactly the longest suffix of the
output that is a proper prefix of some stop string, and emits the rest. All stops of a set are
matched at once by one Aho-Corasick automaton whose failure links are resolved into a flat
transition table, built once per stop set and cached; a byte costs one table lookup whatever the
number of stops.

Several matches (spec/DECISIONS.md, ``stop_rule_version`` 1, after §4.6): the match that ends
earliest in the stream wins; at the same end, the longest; then the first in configuration
order. The automaton reaches a match at the first byte where any stop ends, and each automaton
state knows the longest stop that is a suffix of it, so the rule falls out of the construction.

Control state lives in the ``stop_matcher`` table: each push is classified as ``clear`` (nothing
held), ``hold`` (a suffix held back) or ``hit``; ``flush`` and ``discard`` close the matcher. The
first hit is absorbing (§4.3): the table rejects any later push or flush with IllegalTransition.
Stops match the output only, never the prompt (DECISIONS).
"""

from __future__ import annotations

import enum
import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..machine import CompiledMachine, compiled_of, per_table
from ..machine.actions import Executor
from ..spec import Table, default_spec

__all__ = ["StopHit", "StopKind", "StopMatcher", "TokenStopMatcher"]

DEFAULT_MAX_STOPS = 4096
# The transition table has (total stop bytes + 1) x (distinct bytes + 1) entries: bound it.
DEFAULT_MAX_STOP_BYTES = 1 << 16


StopValue = str | bytes | tuple[int, ...]  # a stop as configured: a string, its bytes, or token ids


class StopKind(enum.StrEnum):
    """Which stream a stop was matched on (§4.6: token ids vs decoded bytes)."""

    STRING = "string"
    TOKEN_IDS = "token_ids"


@attrs.frozen(slots=True)
class StopHit:
    """The winning match of a stop (§4.6).

    ``stop`` is the stop exactly as configured (str, bytes, or a tuple of token ids), ``index`` its
    position in the configured list; ``start``/``end`` (end exclusive) are offsets in the whole
    output seen by the matcher: bytes for strings, token positions for token ids.
    """

    stop: StopValue
    index: int
    start: int
    end: int
    rule_version: int  # the table's stop_rule_version
    kind: StopKind = StopKind.STRING

    @property
    def own_bytes(self) -> bytes:
        """The stop string's own bytes, which end the output where the request keeps the match
        (include_stop_str_in_output, D33); a token-id stop has none of its own (its bytes are its
        tokens')."""
        stop = self.stop
        return stop.encode("utf-8") if isinstance(stop, str) else stop if isinstance(stop, bytes) else b""


# -- automaton construction (once per stop set) -------------------------------------------------


@attrs.frozen(slots=True)
class _Trie:
    """The trie of a stop set. ``children[n]`` maps a symbol to a child node; ``own[n]`` is the
    first configured stop equal to n's string, or -1; n's string is ``stops[via[n]][:depth[n]]``.
    Nodes are numbered breadth first, so a node's failure target always has a smaller number."""

    children: list[dict[int, int]]
    own: list[int]
    depth: list[int]
    via: list[int]


def _trie(stops: Sequence[Sequence[int]]) -> _Trie:
    children: list[dict[int, int]] = [{}]
    depth, via, own = [0], [-1], [-1]
    for i, stop in enumerate(stops):
        node = 0
        for sym in stop:
            nxt = children[node].get(sym)
            if nxt is None:
                nxt = len(children)
                children[node][sym] = nxt
                children.append({})
                depth.append(depth[node] + 1)
                via.append(i)
                own.append(-1)
            node = nxt
        if own[node] < 0:  # duplicates: the first configured wins
            own[node] = i
    return _Trie(children, own, depth, via)


def _bfs(trie: _Trie) -> list[int]:
    """Non-root nodes in breadth-first order (each after its failure target)."""
    order = list(trie.children[0].values())
    for node in order:
        order.extend(trie.children[node].values())
    return order


def _held_prefixes(stops: Sequence[Sequence[int]], trie: _Trie, empty: Any) -> tuple:
    return tuple(stops[v][:d] if v >= 0 else empty for v, d in zip(trie.via, trie.depth))


@attrs.frozen(slots=True)
class _ByteAutomaton:
    """Aho-Corasick over bytes, failure links resolved into one flat transition table.

    Bytes are first mapped to classes (one per byte value used by some stop, class 0 for all
    others) with ``bytes.translate``; a state is stored pre-multiplied by ``stride`` so a step is
    ``delta[state + cls]``. A transition into a node where a stop ends is stored as ``~index``
    (negative) of the winning stop: the longest stop that is a suffix of the node's string, the
    first configured among equal ones. ``prefixes[n]`` is node n's string, the bytes held back
    while the automaton is at n; ``lengths[i]`` the length of stop i.
    """

    delta: tuple[int, ...]
    classes: bytes
    stride: int
    prefixes: tuple[bytes, ...]
    lengths: tuple[int, ...]


@functools.lru_cache(maxsize=32)
def _byte_automaton(stops: tuple[bytes, ...]) -> _ByteAutomaton:
    trie = _trie(stops)
    alphabet = sorted({b for s in stops for b in s})
    first = 0 if len(alphabet) == 256 else 1  # class 0 stands for every byte no stop uses
    cls = [0] * 256
    for k, b in enumerate(alphabet):
        cls[b] = first + k
    stride = first + len(alphabet)
    n = len(trie.children)
    table = [0] * (n * stride)  # node numbers while building
    fail, win = [0] * n, trie.own[:]
    for b, child in trie.children[0].items():
        table[cls[b]] = child
    for node in _bfs(trie):
        base, fbase = node * stride, fail[node] * stride
        table[base : base + stride] = table[fbase : fbase + stride]  # inherit the failure row
        for b, child in trie.children[node].items():
            fail[child] = table[fbase + cls[b]]
            if win[child] < 0:
                win[child] = win[fail[child]]
            table[base + cls[b]] = child
    # one int object per target, shared by every entry that leads there (a compact table)
    code = [~w if w >= 0 else node * stride for node, w in enumerate(win)]
    delta = tuple(map(code.__getitem__, table))
    prefixes = _held_prefixes(stops, trie, b"")
    return _ByteAutomaton(delta, bytes(cls), stride, prefixes, tuple(map(len, stops)))


@attrs.frozen(slots=True)
class _TokenAutomaton:
    """Aho-Corasick over token ids; ids are unbounded, so rows are sparse.

    ``root`` maps an id to the next node from the root; ``rows[n]`` holds the transitions out of
    node n that differ from the root's (resolved along the failure chain), so a step is
    ``rows[n].get(t)``, falling back to ``root.get(t, 0)``. ``~index`` marks a winning node, as
    in _ByteAutomaton; ``prefixes[n]`` is node n's id sequence (the partial match held at n).
    """

    root: dict[int, int]
    rows: tuple[dict[int, int], ...]
    prefixes: tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=32)
def _token_automaton(seqs: tuple[tuple[int, ...], ...]) -> _TokenAutomaton:
    trie = _trie(seqs)
    n = len(trie.children)
    rows: list[dict[int, int]] = [{} for _ in range(n)]
    fail, win = [0] * n, trie.own[:]
    root = trie.children[0]
    for node in _bfs(trie):
        f = fail[node]
        rows[node] = {**rows[f], **trie.children[node]} if f else dict(trie.children[node])
        for t, child in trie.children[node].items():
            fail[child] = rows[f].get(t, root.get(t, 0)) if f else root.get(t, 0)
            if win[child] < 0:
                win[child] = win[fail[child]]

    def code(nxt: int) -> int:
        return ~win[nxt] if win[nxt] >= 0 else nxt

    return _TokenAutomaton(
        {t: code(c) for t, c in root.items()},
        tuple({t: code(c) for t, c in row.items()} for row in rows),
        _held_prefixes(seqs, trie, ()),
    )


# -- input validation ---------------------------------------------------------------------------


def _check_list(values: Any, what: str, item: str, max_stops: int) -> None:
    """Refuse a bare string/bytes, a non-sequence, or too many entries, naming the value."""
    if isinstance(values, (str, bytes, bytearray)):
        raise TypeError(
            f"{what} must be a list of {item}, not a bare {type(values).__name__}; "
            f"pass [{values!r}] for a single stop"
        )
    if not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a list or tuple of {item}, got {type(values).__name__}")
    _check_limit("max_stops", max_stops)
    if len(values) > max_stops:
        raise ValueError(f"{what}: {len(values)} stops given, more than max_stops={max_stops}")


def _check_limit(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _encode_stop(i: int, stop: Any) -> bytes:
    if isinstance(stop, str):
        raw = stop.encode("utf-8")
    elif isinstance(stop, bytes):
        raw = stop
    else:
        raise TypeError(f"stops[{i}] must be str or bytes, got {type(stop).__name__}: {stop!r}")
    if not raw:
        raise ValueError(f"stops[{i}] is empty: a stop string needs at least one byte")
    return raw


def _encode_all(stops: tuple) -> tuple[bytes, ...]:
    return tuple(_encode_stop(i, s) for i, s in enumerate(stops))


_encode_cached = functools.lru_cache(maxsize=32)(_encode_all)


def _encode_stops(stops: tuple) -> tuple[bytes, ...]:
    """The stops' bytes, each entry checked; a stop set seen before is not checked again (a
    server builds one matcher per request, often with the same 1024 stops)."""
    try:
        return _encode_cached(stops)
    except TypeError:  # an unhashable entry, or a wrong type: the plain pass names the entry
        return _encode_all(stops)


def _token_sequence(i: int, seq: Any) -> tuple[int, ...]:
    if isinstance(seq, (str, bytes, bytearray)) or not isinstance(seq, Sequence):
        raise TypeError(
            f"sequences[{i}] must be a list of token ids, got {type(seq).__name__}: {seq!r}"
        )
    if not seq:
        raise ValueError(f"sequences[{i}] is empty: a stop sequence needs at least one token id")
    return tuple(_token_id(t, f"sequences[{i}][{j}]") for j, t in enumerate(seq))


def _token_id(value: Any, name: str) -> int:
    """A non-negative int id (numpy/torch integers accepted via __index__; bool refused)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        token_id = operator.index(value)
    except TypeError:
        kind = type(value).__name__
        raise TypeError(f"{name} must be an int token id, got {kind}: {value!r}") from None
    if token_id < 0:
        raise ValueError(f"{name} is a negative token id: {token_id}")
    return token_id


# -- the matchers -------------------------------------------------------------------------------


class _TableControl:
    """What both matchers share: the ``stop_matcher`` stepper of their table (`table`, default the
    spec directory's) and the absorbing first hit."""

    __slots__ = ("_st", "_hit", "_rules", "_clear_fast", "_hold_fast")

    def __init__(self, table: Table | None) -> None:
        rules = self._rules = stop_rules(table or default_spec()["stop_matcher"])
        self._st = rules.machine.new()
        self._clear_fast, self._hold_fast = rules.clear_fast, rules.hold_fast  # read per token: a slot each
        self._hit: StopHit | None = None

    @property
    def state(self) -> enum.Enum:
        """The control state (SCANNING, HOLDING, HIT, FLUSHED, DISCARDED)."""
        return self._st.state

    @property
    def hit(self) -> StopHit | None:
        """The first (winning) hit, once one occurred."""
        return self._hit

    def _route(self, event: str) -> tuple[int, int]:
        """Fire `event` (raises, changing nothing, when the table refuses it) and return where
        its row's action sends the candidates: (what goes out, what stays held), indices into
        (safe, held, match, nothing) (StopRules.routes, derived from the effects below)."""
        st = self._st
        state = st.state._value_
        st.fire(event)
        return self._rules.routes[(state, event)]


class StopMatcher(_TableControl):
    """Stop strings on the output byte stream (§4.6): bytes in, safe bytes out.

    ``push`` returns the bytes now safe to emit and the hit, if any. Without a hit the matcher
    holds exactly the longest output suffix that is a proper prefix of some stop; after a hit it
    holds the match and everything pushed after it, which are never returned and are dropped by
    ``discard_from_first_match`` (§4.3). ``flush`` ends the output without a hit and returns the
    held bytes (flush_safe_suffix, §4.3). ``max_stops`` and ``max_stop_bytes`` (the stops' UTF-8
    bytes together) bound the size of the automaton a request can make the server build. `table`:
    the stop_matcher table it follows (default: the spec directory's; StopRules).
    """

    __slots__ = (
        "_stops", "_auto", "_delta", "_classes", "_stride", "_prefixes", "_s", "held", "_pos",
    )

    def __init__(
        self,
        stops: Sequence[str | bytes],
        *,
        max_stops: int = DEFAULT_MAX_STOPS,
        max_stop_bytes: int = DEFAULT_MAX_STOP_BYTES,
        table: Table | None = None,
    ) -> None:
        _check_list(stops, "stops", "str or bytes", max_stops)
        _check_limit("max_stop_bytes", max_stop_bytes)
        encoded = _encode_stops(tuple(stops))
        total = sum(map(len, encoded))
        if total > max_stop_bytes:
            raise ValueError(
                f"stops: {total} bytes in all, more than max_stop_bytes={max_stop_bytes}"
            )
        super().__init__(table)
        self._stops = tuple(stops)
        self._auto = auto = _byte_automaton(encoded)
        self._delta, self._classes, self._stride = auto.delta, auto.classes, auto.stride
        self._prefixes = auto.prefixes
        self._s = 0  # automaton state (pre-multiplied node index)
        self.held = b""  # bytes pushed but not (yet) returned; read it, only the matcher writes it
        self._pos = 0  # bytes pushed so far

    @property
    def stops(self) -> tuple[str | bytes, ...]:
        return self._stops

    def push(self, data: bytes) -> tuple[bytes, StopHit | None]:
        """Feed output bytes; return (safe bytes, the hit or None). §4.6."""
        if type(data) is not bytes:
            if not isinstance(data, (bytearray, memoryview)):
                raise TypeError(f"push() takes bytes, got {type(data).__name__}: {data!r}")
            data = bytes(data)
        delta = self._delta
        s = self._s
        symbols = data.translate(self._classes)
        for c in symbols:
            s = delta[s + c]
            if s < 0:
                return self._on_hit(data, symbols, ~s)
        held = self._prefixes[s // self._stride]
        old = self.held
        n = len(data) - len(held)  # the held suffix may reach back into the old held bytes
        safe = (old + data[:n] if old else data[:n]) if n >= 0 else old[: len(old) + n]
        # fire and route by the row's effects unless it is a self-loop that releases the safe
        # bytes and keeps the suffix (the fast path, derived from the table)
        if held:
            if self._st.state not in self._hold_fast:
                safe, held = self._reroute("hold", self._rules.hold_routes, _KEEP_SUFFIX, safe, held)
        elif self._st.state not in self._clear_fast:
            safe, held = self._reroute("clear", self._rules.clear_routes, _RELEASE, safe, held)
        self._s = s
        self._pos += len(data)
        self.held = held
        return safe, None

    def _on_hit(self, data: bytes, symbols: bytes, index: int) -> tuple[bytes, StopHit]:
        delta, s, at = self._delta, self._s, 0
        while s >= 0:  # find where in `data` the winning match ends (once per request)
            s = delta[s + symbols[at]]
            at += 1
        end = self._pos + at
        start = end - self._auto.lengths[index]
        hit = StopHit(self._stops[index], index, start, end, self._rules.rule_version, StopKind.STRING)
        out, keep = self._route("hit")
        base = self._pos - len(self.held)
        buf = self.held + data
        safe, match = buf[: start - base], buf[start - base :]
        self._s = 0
        self._pos += len(data)
        candidates = (safe, b"", match, b"")
        self.held = candidates[keep]
        self._hit = hit
        return candidates[out], hit

    def flush(self) -> bytes:
        """End of output without a hit: the held suffix is safe after all (§4.3)."""
        out, keep = self._route("flush")
        candidates = (b"", self.held, b"", b"")
        self.held = candidates[keep]
        return candidates[out]

    def _reroute(self, event: str, routes: Mapping[Any, tuple[int, int]], plain: tuple[int, int], safe: bytes,
                 held: bytes) -> tuple[bytes, bytes]:
        """A push off the fast path: fire `event` (raises, changing nothing, when the table refuses
        it) and route (safe, held) as its row's effects say (`plain`: as the fast path does)."""
        state = self._st.state
        self._st.fire(event)
        route = routes[state]
        if route == plain:
            return safe, held
        candidates = (safe, held, b"", b"")
        return candidates[route[0]], candidates[route[1]]

    def discard_from_first_match(self) -> None:
        """After a hit: drop the match and everything after it (§4.3)."""
        out, keep = self._route("discard")
        self.held = (b"", self.held, b"", b"")[keep]

    def __repr__(self) -> str:
        return f"<StopMatcher {len(self._stops)} stops at {self.state.value}, held {self.held!r}>"


class TokenStopMatcher(_TableControl):
    """Stop token-id sequences on the token stream (§4.6), same rule and table as StopMatcher.

    ``push`` takes one selected token id and returns the hit, if any; ``held`` is the longest
    suffix of the token stream that is a proper prefix of some stop sequence (the caller decides
    whether to withhold those tokens' text). Positions in a hit count tokens.
    """

    __slots__ = ("_seqs", "_auto", "_root", "_rows", "_s", "_pos")

    def __init__(
        self, sequences: Sequence[Sequence[int]], *, max_stops: int = DEFAULT_MAX_STOPS, table: Table | None = None
    ) -> None:
        _check_list(sequences, "sequences", "token-id sequences", max_stops)
        seqs = tuple(_token_sequence(i, s) for i, s in enumerate(sequences))
        super().__init__(table)
        self._seqs = seqs
        self._auto = _token_automaton(seqs)
        self._root, self._rows = self._auto.root, self._auto.rows
        self._s = 0  # automaton node
        self._pos = 0  # tokens pushed so far

    @property
    def sequences(self) -> tuple[tuple[int, ...], ...]:
        return self._seqs

    @property
    def held(self) -> tuple[int, ...]:
        """The token ids of the current partial match (empty after a hit or a flush)."""
        return self._auto.prefixes[self._s]

    def push(self, token_id: int) -> StopHit | None:
        """Feed one selected token id; return the hit or None. §4.6."""
        if type(token_id) is not int or token_id < 0:
            token_id = _token_id(token_id, "push(): token_id")
        s = self._rows[self._s].get(token_id)
        if s is None:
            s = self._root.get(token_id, 0)
        if s < 0:
            index = ~s
            end = self._pos + 1
            stop = self._seqs[index]
            hit = StopHit(stop, index, end - len(stop), end, self._rules.rule_version, StopKind.TOKEN_IDS)
            self._route("hit")  # the ids' text is the caller's: only the hit and its place count here
            self._s, self._pos, self._hit = 0, end, hit
            return hit
        if self._st.state not in (self._hold_fast if s else self._clear_fast):
            _, keep = self._route("hold" if s else "clear")
            s = (0, s, 0, 0)[keep]  # a row that keeps no suffix forgets the partial match
        self._s = s
        self._pos += 1
        return None

    def flush(self) -> tuple[int, ...]:
        """End of the token stream without a hit: returns and forgets the partial match (§4.3)."""
        out, _ = self._route("flush")
        held = ((), self.held, (), ())[out]
        self._s = 0
        return held

    def discard_from_first_match(self) -> None:
        """After a hit: close the matcher (§4.3)."""
        self._route("discard")

    def __repr__(self) -> str:
        return f"<TokenStopMatcher {len(self._seqs)} sequences at {self.state.value}>"


# ---- the runtime's implementation of every stop-matcher effect (machine/actions.py) ----------
# A push, a flush or a discard has candidates: the safe bytes (SAFE), the held suffix (HELD) and,
# at a hit, the match with what follows it (MATCH). Each effect says where one goes; run once per
# row on a record of those names, they give the row's route (what goes out, what stays held),
# which the matchers apply as indices into (safe, held, match, nothing). A row whose action lacks
# an effect sends or keeps NOTHING there.
SAFE, HELD, MATCH, NOTHING = 0, 1, 2, 3
STOP = Executor("stop_matcher", "the runtime (stop.StopMatcher, stop.TokenStopMatcher)")


@STOP.effect("release_safe")
def _release_safe(r: dict) -> None:
    r["out"] = SAFE


@STOP.effect("hold_suffix")
def _hold_suffix(r: dict) -> None:
    r["keep"] = HELD


@STOP.effect("cut_at_match")
def _cut_at_match(r: dict) -> None:
    r["keep"] = MATCH


@STOP.effect("release_held")
def _release_held(r: dict) -> None:
    r["out"] = HELD


@STOP.effect("drop_held")
def _drop_held(r: dict) -> None:
    r["keep"] = NOTHING


# Where a push's row is a self-loop that releases the safe bytes (and, holding, keeps the suffix)
# the matchers skip the fire and the routing: the per-token fast path, derived from the table.
_RELEASE, _KEEP_SUFFIX = (SAFE, NOTHING), (SAFE, HELD)  # what emit_safe and emit_safe_hold_suffix route


def _routes(table: Table) -> dict[tuple[str, str], tuple[int, int]]:
    out = {}
    for key, plan in STOP.plans(table).items():
        r = {"out": NOTHING, "keep": HELD if key[1] == "discard" else NOTHING}  # a discard keeps what no effect drops
        for fn in plan.before + plan.with_ + plan.after:
            fn(r)
        out[key] = (r["out"], r["keep"])
    return out


@attrs.frozen(eq=False)
class StopRules:
    """A stop_matcher table as the matchers run it (§4.6): its machine, each row's route, per state
    the route of a push event and the states of its fast path (a self-loop routing as `plain`),
    and its stop_rule_version (DECISIONS, after §4.6), which every hit carries."""

    machine: CompiledMachine
    routes: Mapping[tuple[str, str], tuple[int, int]]
    clear_routes: Mapping[enum.Enum, tuple[int, int]]
    clear_fast: frozenset[enum.Enum]
    hold_routes: Mapping[enum.Enum, tuple[int, int]]
    hold_fast: frozenset[enum.Enum]
    rule_version: int

    @classmethod
    def of(cls, table: Table) -> StopRules:
        machine, routes = compiled_of(table), _routes(table)

        def push(event: str, plain: tuple[int, int]) -> tuple[dict, frozenset]:
            by_state = {machine.State[s]: r for (s, e), r in routes.items() if e == event}
            return by_state, frozenset(st for st, r in by_state.items()
                                       if r == plain and table.decision(st.value, event).target == st.value)

        return cls(machine, routes, *push("clear", _RELEASE), *push("hold", _KEEP_SUFFIX),
                   table.params["stop_rule_version"])


stop_rules = per_table(StopRules.of)
