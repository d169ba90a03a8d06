"""Facts every layer needs, derived from the tables once (no layer keeps its own copy).

- `model_resources()` / `stream_resources()`: resources.toml's `model_kinds`, and the other kinds
  in table order (released before / after the terminal event, §4.10).
- `terminal_stream_event()`: lifecycle terminal state -> the stream event that carries it
  (lifecycle.toml `terminal_events`); `stream_end_of()`: -> the stream terminal state it reaches.
- `final_reasons()`: per lifecycle terminal state, the finish reasons a run can end there with:
  the reason of the last row on any path that fixes one (§4.10). Found by search over the table,
  so a new row or reason changes it with no edit anywhere else.
- `driver_states()`: the lifecycle states the drivers (the Engine's scheduler and shutdown, a run's
  end) branch on, each set the states where the table has a row for the events that say it;
  `sequence_states()`: the same for where the Engine holds a sequence (spec/sequence.toml);
  `stream_states()`: where the ordered stream sends and where its producer waits (spec/stream.toml);
  `resource_states()`: where a resource of the ledger is held (spec/resources.toml);
  `stop_states()`: where a stop string has matched (spec/stop_matcher.toml); `detokenizer_states()`:
  where bytes wait for the rest of a character (spec/detokenizer.toml). Each refuses a set no
  state fills unless asked not to (`refuse=False`: the model checker judges such a table).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from .loader import SpecError, load_spec
from .tables import Table
from .vocabulary import DecisionKind, FinishReason


@functools.cache
def model_resources() -> tuple[str, ...]:
    return model_resources_of(load_spec("resources"))


def model_resources_of(table: Table) -> tuple[str, ...]:
    """`table`'s (a resources table's) `model_kinds`."""
    kinds, model = table.params["kinds"], table.params.get("model_kinds", ())
    unknown = [k for k in model if k not in kinds]
    if unknown:
        raise SpecError(table.source, "model_kinds", f"{unknown} are not in kinds {kinds}")
    return tuple(model)


@functools.cache
def stream_resources() -> tuple[str, ...]:
    return stream_resources_of(load_spec("resources"))


def stream_resources_of(table: Table) -> tuple[str, ...]:
    """`table`'s (a resources table's) kinds that are not model kinds, in table order."""
    model = model_resources_of(table)
    return tuple(k for k in table.params["kinds"] if k not in model)


def terminal_stream_event(life: Table | None = None, stream: Table | None = None) -> Mapping[str, str]:
    life, stream = life or load_spec("lifecycle"), stream or load_spec("stream")
    events = life.params.get("terminal_events", {})
    if set(events) != set(life.terminal):
        raise SpecError(life.source, "terminal_events", f"must name each terminal state {list(life.terminal)} once, "
                                                         f"got {sorted(events)}")
    for state, event in events.items():
        if event not in stream.events:
            raise SpecError(life.source, "terminal_events", f"{state}: '{event}' is not an event of the stream table")
    return dict(events)


def stream_end_of(life: Table | None = None, stream: Table | None = None) -> Mapping[str, str]:
    """Lifecycle terminal state -> the stream state its event leads to from OPEN."""
    stream = stream or load_spec("stream")
    out = {}
    for state, event in terminal_stream_event(life, stream).items():
        d = stream.decision("OPEN", event)
        if d.kind is not DecisionKind.ROW or d.target not in stream.terminal:
            raise SpecError(stream.source, f"OPEN {event}", f"must lead to a terminal stream state (for {state})")
        out[state] = d.target
    return out


def final_reasons(life: Table | None = None) -> Mapping[str, frozenset[FinishReason]]:
    life = life or load_spec("lifecycle")
    rows: dict[str, list] = {}
    for d in life.decisions.values():
        if d.kind is DecisionKind.ROW:
            rows.setdefault(d.state, []).append(d)
    seen = {(life.initial, None)}
    queue = deque(seen)
    out: dict[str, set[FinishReason]] = {s: set() for s in life.terminal}
    while queue:
        state, reason = queue.popleft()
        if state in out:
            if reason is not None:
                out[state].add(FinishReason(reason))
            continue
        for d in rows.get(state, ()):
            nxt = (d.target, d.reason or reason)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return {s: frozenset(r) for s, r in out.items()}


def _where(events: tuple[str, ...], means: str, one: str | None = None) -> Any:
    """A field of a states class (DriverStates, SequenceStates, StreamStates, ResourceStates, ...): the
    states where every one of `events` is a row (what `means`); `one`, when given, says why the
    set must be a single state."""
    return attrs.field(metadata={"events": events, "means": means, "one": one})


@attrs.frozen
class DriverStates:
    """Sets of lifecycle states the drivers branch on, each found from the table's rows (§4.3,
    §4.9, §4.10): an edited table moves them with no edit in the Engine."""

    selecting: frozenset[str] = _where(("select",), "the loop of §4.3 goes on selecting tokens (DECODING)",
                                       one="the loop selects in one state")
    safe_point: frozenset[str] = _where(("cancel", "deadline"),
                                        "check_cancel_or_deadline runs there (§4.3): a cancel or a deadline is observed")
    model_work: frozenset[str] = _where(("model_error",), "a failed kernel ends the run FAILED (§4.10)")
    transport: frozenset[str] = _where(("transport_error",), "a reader that gave up ends the run FAILED (D5)")
    draining: frozenset[str] = _where(("complete",), "the loop has ended: the tail is sent, then the run finishes (§4.3)")
    cancel_observed: frozenset[str] = _where(("safe_point",), "a cancel was observed: the safe point ends the run (§4.9)")


@attrs.frozen
class SequenceStates:
    """Sets of sequence states the Engine's scheduler branches on, each found from the rows of
    spec/sequence.toml (§4.4, §4.8)."""

    parked: frozenset[str] = _where(("unpark",), "held back by its reader, it goes on when the reader catches up (§4.8)")
    swapped: frozenset[str] = _where(("resume",), "out of the batch, its cache given back, it comes back by resuming (§4.8)")


@attrs.frozen
class StreamStates:
    """Sets of stream states OrderedStream branches on, each found from the rows of
    spec/stream.toml (§4.7, §4.8)."""

    sending: frozenset[str] = _where(("delta",), "a producer's delta is taken there (OPEN, §4.7)",
                                     one="the stream takes deltas in one state")
    paused: frozenset[str] = _where(("unblock",), "a pause-policy producer waits there for its reader (§4.8)")


@attrs.frozen
class ResourceStates:
    """The resource states the ledger branches on, found from the rows of spec/resources.toml (§4.10)."""

    held: frozenset[str] = _where(("release",), "a resource is held: its one release frees it (§4.10)")


@attrs.frozen
class StopStates:
    """The stop-matcher states the loop branches on, found from the rows of spec/stop_matcher.toml (§4.6)."""

    matched: frozenset[str] = _where(("discard",), "a stop string matched: the match is discarded, never sent (§4.6)")


@attrs.frozen
class DetokenizerStates:
    """The detokenizer states the loop branches on, found from the rows of spec/detokenizer.toml (§4.5)."""

    pending: frozenset[str] = _where(("finish_invalid",),
                                     "bytes wait for the rest of a character: finish() may find them invalid (§4.5)")


def driver_states(life: Table | None = None, *, refuse: bool = True) -> DriverStates:
    """The DriverStates of `life` (default: the spec directory's lifecycle table). A set no state
    fills, an event the table does not have, or a loop that selects in more than one state is a
    SpecError naming the set and its events; with `refuse` False (the model checker, which judges
    a table the drivers would refuse) only the unknown event is, and each set is what the rows give."""
    return _states_where(DriverStates, life or load_spec("lifecycle"), "driver states", refuse)


def sequence_states(sequence: Table | None = None, *, refuse: bool = True) -> SequenceStates:
    """The SequenceStates of `sequence` (default: the spec directory's sequence table), refused as
    driver_states refuses."""
    return _states_where(SequenceStates, sequence or load_spec("sequence"), "sequence states", refuse)


def stream_states(stream: Table | None = None, *, refuse: bool = True) -> StreamStates:
    """The StreamStates of `stream` (default: the spec directory's stream table), refused as
    driver_states refuses (a stream that takes deltas in more than one state too)."""
    return _states_where(StreamStates, stream or load_spec("stream"), "stream states", refuse)


def resource_states(resources: Table | None = None, *, refuse: bool = True) -> ResourceStates:
    """The ResourceStates of `resources` (default: the spec directory's resources table), refused
    as driver_states refuses."""
    return _states_where(ResourceStates, resources or load_spec("resources"), "resource states", refuse)


def stop_states(stop: Table | None = None, *, refuse: bool = True) -> StopStates:
    """The StopStates of `stop` (default: the spec directory's stop_matcher table), refused as
    driver_states refuses."""
    return _states_where(StopStates, stop or load_spec("stop_matcher"), "stop matcher states", refuse)


def detokenizer_states(detok: Table | None = None, *, refuse: bool = True) -> DetokenizerStates:
    """The DetokenizerStates of `detok` (default: the spec directory's detokenizer table), refused
    as driver_states refuses."""
    return _states_where(DetokenizerStates, detok or load_spec("detokenizer"), "detokenizer states", refuse)


_States = TypeVar("_States", DriverStates, SequenceStates, StreamStates, ResourceStates, StopStates,
                  DetokenizerStates)


def _states_where(cls: type[_States], table: Table, what: str, refuse: bool) -> _States:
    found: dict[str, frozenset[str]] = {}
    for field in attrs.fields(cls):
        events, means = field.metadata["events"], field.metadata["means"]
        unknown = [e for e in events if e not in table.events]
        if unknown:
            raise SpecError(table.source, f"{what} {field.name}", f"{unknown} are not events of the table")
        found[field.name] = frozenset(s for s in table.states
                                      if all(table.decision(s, e).kind is DecisionKind.ROW for e in events))
        if not refuse:
            continue
        if not found[field.name]:
            raise SpecError(table.source, f"{what} {field.name}",
                            f"no state has a row for {' and '.join(events)}; the drivers need one: {means}")
        one = field.metadata["one"]
        if one is not None and len(found[field.name]) != 1:
            raise SpecError(table.source, f"{what} {field.name}",
                            f"{one}; {' and '.join(events)} is a row in {sorted(found[field.name])}")
    return cls(**found)


def discovered_events(overlap: Table | None = None) -> Mapping[FinishReason, str]:
    """The overlap table's [discovered] (§4.9, D73): for each finish reason the host work on y_t can
    fix, the event it is to the step in flight. A reason without an entry, an unknown reason or an
    event the table does not have is a SpecError naming it."""
    table = overlap or load_spec("overlap")
    raw = table.params.get("discovered")
    if not isinstance(raw, Mapping):
        raise SpecError(table.source, "discovered", "missing: a table { finish reason = event } of every reason")
    known = {r.value for r in FinishReason}
    if unknown := sorted(set(raw) - known):
        raise SpecError(table.source, "discovered", f"{unknown} are not finish reasons (§4.10)")
    if missing := sorted(known - set(raw)):
        raise SpecError(table.source, "discovered", f"no event for the finish reason(s) {missing}")
    if bad := sorted(f"{r} = {e!r}" for r, e in raw.items() if e not in table.events):
        raise SpecError(table.source, "discovered", f"{bad}: not events of the table")
    return {FinishReason(r): e for r, e in raw.items()}
