"""Trace monitors: every named invariant of spec/invariants.toml checked on a runtime trace.

`check_trace(events)` groups the events by request and runs each registered monitor once over
each request's events (one pass each). A monitor yields ``(event index, message)``; the index is
the offending event's per-request `index`, or None when the problem is the end of the trace
(something missing). Monitors read the event vocabulary of runtime/events.py as the reference
loop emits it (briefs: the trace contract); `refinement` replays the run through the tables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from ..machine import CompiledMachine, IllegalTransition, compiled_of
from ..runtime.events import TERMINAL_KINDS, Event, EventKind
from ..spec import FinishReason, Spec, default_spec
from ..spec.derived import final_reasons, model_resources_of, stream_end_of
from .invariants import MONITORS, MonitorFn, load_invariants, monitor, registered

K = EventKind
# Events another thread (or the fault injector) may log between two steps of the loop.
_ASYNC_KINDS = frozenset({K.CANCEL_REQUESTED, K.TRANSPORT, K.FAULT_INJECTED, K.READER_OPENED, K.DELIVERED})
_OVERFLOW_MARK = "overflow"


@attrs.frozen
class Violation:
    """One broken invariant: its name, its section, the offending event's index (None: end)."""

    invariant: str
    anchor: str
    index: int | None
    message: str
    request_id: str = ""

    def __str__(self) -> str:
        where = "end of trace" if self.index is None else f"event {self.index}"
        rid = f"{self.request_id}: " if self.request_id else ""
        return f"{rid}{self.invariant} ({self.anchor}) at {where}: {self.message}"


@attrs.frozen(eq=False)
class TraceTables:
    """What the monitors read from a spec's tables (§4.1, §4.7, §4.10): the compiled lifecycle,
    stream and resources machines the refinement replays, the resource kinds and those released
    before the terminal event, the terminal lifecycle states, the terminal lifecycle state of each
    terminal trace kind ("response." + the stream state its event reaches) and the finish reasons
    a run can end with in each terminal state."""

    life: CompiledMachine
    stream: CompiledMachine
    resources: CompiledMachine
    kinds: frozenset[str]
    model_resources: tuple[str, ...]
    life_terminal: frozenset[str]
    terminal_state: Mapping[str, str]
    reasons_of_state: Mapping[str, frozenset[FinishReason]]

    @classmethod
    def of(cls, spec: Spec) -> TraceTables:
        life, stream, res = spec["lifecycle"], spec["stream"], spec["resources"]
        return cls(compiled_of(life), compiled_of(stream), compiled_of(res), frozenset(res.params["kinds"]),
                   model_resources_of(res), frozenset(life.terminal),
                   {K(f"response.{end.lower()}"): state for state, end in stream_end_of(life, stream).items()},
                   final_reasons(life))


trace_tables = functools.cache(TraceTables.of)  # per Spec (a Spec is hashed by identity)


class RequestTrace:
    """One request's events with the facts several monitors share, computed once; `spec`: the
    tables the run followed (default: the spec directory's)."""

    def __init__(self, events: Sequence[Event], *, tokenizer: Any = None, complete: bool = True,
                 spec: Spec | None = None) -> None:
        self.tables = trace_tables(spec or default_spec())
        self.events = list(events)
        self.tokenizer = tokenizer
        self.complete = complete
        self.request_id = self.events[0].request_id if self.events else ""
        created = next((e for e in self.events if e.kind == K.REQUEST_CREATED), None)
        self.created: Mapping[str, Any] = created.data if created is not None else {}
        self.deltas = [e for e in self.events if e.kind == K.RESPONSE_DELTA]
        self.terminals = [e for e in self.events if e.kind in TERMINAL_KINDS]
        self.selected = [e for e in self.events if e.kind == K.TOKEN_SELECTED]
        self.terminal = self.terminals[0] if self.terminals else None

    @property
    def reason(self) -> str | None:
        return None if self.terminal is None else _value(self.terminal.data.get("finish_reason"))

    @property
    def output(self) -> bytes:
        return b"".join(bytes(e.data.get("bytes", b"")) for e in self.deltas)

    @property
    def echo(self) -> int:
        """How many of the output's first bytes are the echoed prompt (D33)."""
        return int(self.created.get("echo_bytes") or 0)

    @property
    def completion(self) -> bytes:
        """The output after the echoed prompt: what the tokens made."""
        return self.output[self.echo:]

    def eos_guarded(self, step: int) -> bool:
        """Does a guard of D31 turn the EOS check off for the step-th token (ignore_eos, or
        step <= min_tokens)? Read from the request, independently of the tables."""
        return bool(self.created.get("ignore_eos")) or step <= int(self.created.get("min_tokens") or 0)

    def of(self, *kinds: str) -> Iterator[Event]:
        return (e for e in self.events if e.kind in kinds)


def check_trace(events: Iterable[Event], *, tokenizer: Any = None, complete: bool = True,
                spec: Spec | None = None) -> list[Violation]:
    """Every invariant on every request of `events`, judged by the tables of `spec` (the ones the
    run followed; default: the spec directory's); [] when the trace conforms.

    `complete=False` checks a prefix (a run still going): end-of-trace obligations (one terminal
    event, nothing leaked) are not checked. Invariants that `need` something not given (e.g. a
    tokenizer for detok_concat_equals_batch) are skipped: see `skipped()`.
    """
    by_request: dict[str, list[Event]] = {}
    for ev in events:
        if not isinstance(ev, Event):
            raise TypeError(f"check_trace takes runtime.events.Event objects, got {type(ev).__name__}")
        by_request.setdefault(ev.request_id, []).append(ev)
    invariants = load_invariants()
    run = [(name, fn) for name, fn in monitors().items() if name not in skipped(tokenizer=tokenizer)]
    out: list[Violation] = []
    for rid, evs in by_request.items():
        rt = RequestTrace(evs, tokenizer=tokenizer, complete=complete, spec=spec)
        for name, fn in run:
            anchor = invariants[name].anchor
            out.extend(Violation(name, anchor, idx, msg, rid) for idx, msg in fn(rt))
    return out


def skipped(*, tokenizer: Any = None) -> list[str]:
    """Trace invariants that cannot run without what they `need` (now: a tokenizer)."""
    have = {"tokenizer"} if tokenizer is not None else set()
    return [n for n, inv in load_invariants().items() if inv.on_traces and not set(inv.needs) <= have]


def _value(v: Any) -> Any:
    return getattr(v, "value", v)


def _usage(data: Mapping[str, Any]) -> Mapping[str, Any]:
    u = data.get("usage")
    if u is None:
        return {}
    if isinstance(u, Mapping):
        return u
    out = attrs.asdict(u) if attrs.has(type(u)) else dict(vars(u))
    if hasattr(u, "completion_tokens"):
        out["completion_tokens"] = u.completion_tokens
    return out


# ---------------------------------------------------------------- §4.1 terminal states


@monitor("terminal_exclusive")
def _terminal_exclusive(rt: RequestTrace):
    first = None
    for e in rt.of(K.LIFECYCLE):
        if e.data.get("to") in rt.tables.life_terminal:
            if first is None:
                first = e
            else:
                yield e.index, f"second terminal state {e.data['to']} after {first.data['to']}"
    if first is not None and rt.terminal is not None:
        expected = rt.tables.terminal_state[K(rt.terminal.kind)]
        if first.data["to"] != expected:
            yield rt.terminal.index, f"terminal event {rt.terminal.kind} but the lifecycle ended {first.data['to']}"


@monitor("terminal_irreversible")
def _terminal_irreversible(rt: RequestTrace):
    for e in rt.of(K.LIFECYCLE):
        if e.data.get("from") in rt.tables.life_terminal:
            yield e.index, f"transition out of terminal state {e.data['from']} on '{e.data.get('event')}'"


@monitor("refinement")
def _refinement(rt: RequestTrace):
    """Replay lifecycle, stream and per-kind resource steps through their compiled tables."""
    life = rt.tables.life.new()
    stream = rt.tables.stream.new()
    res_machine = rt.tables.resources
    kinds = rt.tables.kinds
    resources: dict[str, Any] = {}
    broken: set[str] = set()

    def step(machine: str, stepper: Any, event: str, e: Event) -> str | None:
        if machine in broken:
            return None
        try:
            stepper.fire(event)
        except IllegalTransition as exc:
            broken.add(machine)
            return str(exc) if machine == exc.machine else f"{machine}: {exc}"
        return None

    for e in rt.events:
        k, d = e.kind, e.data
        problem = None
        if k == K.LIFECYCLE:
            if "lifecycle" not in broken and str(life.state) != d.get("from"):
                broken.add("lifecycle")
                problem = f"lifecycle: logged from {d.get('from')} but the table is at {life.state}"
            else:
                problem = step("lifecycle", life, d.get("event", ""), e)
                if problem is None and "lifecycle" not in broken and str(life.state) != d.get("to"):
                    broken.add("lifecycle")
                    problem = f"lifecycle: '{d.get('event')}' from {d.get('from')} leads to {life.state}, logged {d.get('to')}"
        elif k == K.LIFECYCLE_IGNORED:
            problem = step("lifecycle", life, d.get("event", ""), e)
        elif k == K.TOKEN_SELECTED:
            problem = step("lifecycle", life, "select", e)
        elif k == K.DECODE_COMPLETED:
            problem = step("lifecycle", life, "decode_done", e)
        elif k == K.STOP_HIT and str(life.state) == "DRAINING":
            problem = step("lifecycle", life, "stop_hit", e)
        elif k == K.RESPONSE_START:
            problem = step("stream", stream, "start", e)
        elif k == K.RESPONSE_DELTA:
            problem = step("stream", stream, "delta", e)
        elif k in TERMINAL_KINDS:
            ev = {K.RESPONSE_COMPLETED: "complete", K.RESPONSE_CANCELLED: "cancel"}.get(K(k))
            if ev is None:
                ev = "overflow" if _OVERFLOW_MARK in str(d.get("error", "")) else "fail"
            problem = step("stream", stream, ev, e)
        elif k == K.TRANSPORT and d.get("what") in ("disconnect", "reconnect"):
            problem = step("stream", stream, d["what"], e)
        elif k in (K.RESOURCE_ACQUIRED, K.RESOURCE_RELEASED) or (
            k == K.RESOURCE_VIOLATION and d.get("problem") == "double_release"
        ):
            kind = d.get("resource")
            if kind not in kinds:
                problem = f"resources: unknown kind '{kind}' (spec/resources.toml lists {sorted(kinds)})"
            else:
                st = resources.setdefault(kind, res_machine.new())
                problem = step(f"resources[{kind}]", st, "acquire" if k == K.RESOURCE_ACQUIRED else "release", e)
        if problem:
            yield e.index, problem


# ---------------------------------------------------------------- §4.7 the ordered stream


@monitor("start_first")
def _start_first(rt: RequestTrace):
    started = False
    for e in rt.events:
        if e.kind == K.RESPONSE_START:
            started = True
        elif not started and (e.kind == K.RESPONSE_DELTA or e.kind in TERMINAL_KINDS):
            yield e.index, f"{e.kind} before response.start"
            return


@monitor("no_delta_after_terminal")
def _no_delta_after_terminal(rt: RequestTrace):
    if rt.terminal is None:
        return
    for e in rt.deltas:
        if e.index > rt.terminal.index:
            yield e.index, f"delta seq={e.data.get('seq')} after the terminal event {rt.terminal.kind}"


@monitor("single_terminal_event")
def _single_terminal_event(rt: RequestTrace):
    for e in rt.terminals[1:]:
        yield e.index, f"second terminal event {e.kind} after {rt.terminals[0].kind}"
    if rt.complete and not rt.terminals:
        yield None, "the run ended without a terminal event"


@monitor("terminal_after_all_deltas")
def _terminal_after_all_deltas(rt: RequestTrace):
    if rt.terminal is None:
        return
    before = [e for e in rt.deltas if e.index < rt.terminal.index]
    expected = before[-1].data.get("seq", -1) + 1 if before else 0
    if rt.terminal.data.get("seq") != expected:
        yield rt.terminal.index, f"terminal seq={rt.terminal.data.get('seq')}, expected {expected} (last delta + 1)"


@monitor("terminal_with_transition")
def _terminal_with_transition(rt: RequestTrace):
    """The terminal transition and the terminal event are adjacent, in either order (§4.3)."""
    steps = [e for e in rt.events if e.kind not in _ASYNC_KINDS]
    for i, e in enumerate(steps):
        near = steps[max(0, i - 1): i] + steps[i + 1: i + 2]
        if e.kind == K.LIFECYCLE and e.data.get("to") in rt.tables.life_terminal:
            if not any(n.kind in TERMINAL_KINDS for n in near) and (rt.complete or i + 1 < len(steps)):
                yield e.index, f"transition to {e.data['to']} without its terminal event next to it"
        elif e.kind in TERMINAL_KINDS and not any(
                n.kind == K.LIFECYCLE and n.data.get("to") in rt.tables.life_terminal for n in near):
            yield e.index, f"{e.kind} not next to a terminal lifecycle transition"


@monitor("seq_strictly_increasing")
def _seq_strictly_increasing(rt: RequestTrace):
    last = None
    for e in rt.deltas:
        seq = e.data.get("seq")
        if not isinstance(seq, int):
            yield e.index, f"delta without an integer seq: {seq!r}"
        elif last is not None and seq <= last:
            yield e.index, f"delta seq={seq} after seq={last}"
        else:
            last = seq


@monitor("seq_contiguous")
def _seq_contiguous(rt: RequestTrace):
    for n, e in enumerate(rt.deltas):
        if e.data.get("seq") != n:
            yield e.index, f"delta number {n} has seq={e.data.get('seq')}: a gap or a restart"
            return


@monitor("reader_delivery_complete")
def _reader_delivery_complete(rt: RequestTrace):
    """Per reader (stream.reader_opened, then stream.delivered entries, each a run of events handed
    out: `first`, `seq` (the last; None is response.start) and `count`): the events from its start
    point (`first` at opening; a first reader's is response.start), each once, in order, with no gap,
    and each after the stream logged it (a reader reads the stream's log, never ahead of it); the
    terminal event at most once and last; nothing after it or after the reader closed. In a
    finished trace every reader got the terminal or closed: a delivery that just stops is broken."""
    # where the stream logged each seq (None: response.start), the first time
    logged: dict[int | None, int] = {}
    for e in [*rt.of(K.RESPONSE_START), *rt.deltas, *rt.terminals]:
        logged.setdefault(e.data.get("seq"), e.index)
    end = rt.terminal.data.get("seq") if rt.terminal is not None else None
    opened = {e.data["reader"]: e for e in rt.of(K.READER_OPENED)}
    last: dict[int, int | None] = {}
    done: dict[int, str] = {}
    for e in rt.of(K.DELIVERED):
        r, seq = e.data["reader"], e.data["seq"]
        first, count = e.data.get("first", seq), e.data.get("count", 1)
        opening = opened.get(r)
        if opening is None:
            yield e.index, f"reader {r} was handed seq={seq} but never opened"
            continue
        if r in done:
            yield e.index, f"reader {r} was handed seq={seq} after its {done[r]}"
            continue
        if e.data.get("closed"):
            done[r] = "close"
        if count == 0:
            continue
        how = opening.data
        if r in last:
            prev = last[r]
            due = 0 if prev is None else prev + 1
        elif "first" in how:
            due = how["first"]
            if not how["resume"] and r == min(opened) and due is not None:
                yield e.index, f"reader {r}, the first, started at seq={due}: response.start and seq=0 were due"
        elif how["resume"]:
            due = 0 if how["after"] is None else how["after"] + 1
            if end is not None and due > end:
                due = end  # a resume past the end: the terminal event again
        else:
            due = first  # a trace that does not say where the reader started
        if first != due:
            kind = "a gap" if _pos(first) > _pos(due) else "a duplicate"
            yield e.index, f"reader {r} was handed seq={first} where seq={due} was due ({kind})"
        span = _pos(seq) - _pos(first) + 1
        if count != span:
            kind = "a gap" if count < span else "a duplicate"
            yield e.index, f"reader {r} was handed {count} events for seq={first}..{seq} ({kind})"
        for x in (first, seq):
            if x not in logged:
                yield e.index, f"reader {r} was handed {_named(x)}, which the stream never logged"
            elif logged[x] > e.index:
                yield e.index, f"reader {r} was handed {_named(x)} before the stream logged it (entry {logged[x]})"
        last[r] = seq
        if e.data["terminal"]:
            done[r] = "terminal event"
            if seq != end:
                yield e.index, f"reader {r} was handed a terminal with seq={seq}; the stream's terminal is seq={end}"
    if rt.complete and rt.terminal is not None:
        for r, opening in opened.items():
            if r not in done:
                got = f"seq={last[r]}" if r in last else "nothing"
                yield opening.index, f"reader {r} neither got the terminal event nor closed (it stopped after {got})"


def _named(seq: int | None) -> str:
    """A delivery position in words: response.start (None) or seq=N."""
    return "response.start" if seq is None else f"seq={seq}"


def _pos(seq: int | None) -> int:
    """A delivery position: response.start (None) comes before seq 0."""
    return -1 if seq is None else seq


@monitor("delta_nonempty")
def _delta_nonempty(rt: RequestTrace):
    for e in rt.deltas:
        if not e.data.get("bytes"):
            yield e.index, f"empty delta seq={e.data.get('seq')}"


@monitor("stream_bounded")
def _stream_bounded(rt: RequestTrace):
    """Occupancy fields, when the runtime logs them, stay within the caps of request.created that
    the stream's policy applies (D6): `pause` both (one delta larger than max_bytes may wait alone),
    `buffer` the bytes, `fail` the events (a trace that names no policy: both)."""
    policy = _value(rt.created.get("policy"))
    caps = {"unread_events": rt.created.get("max_events") if policy != "buffer" else None,
            "unread_bytes": rt.created.get("max_bytes") if policy != "fail" else None}
    for e in rt.deltas:
        for field, cap in caps.items():
            value = e.data.get(field, 0)
            lone = field == "unread_bytes" and policy == "pause" and e.data.get("unread_events") == 1
            if cap is not None and value > cap and not lone:
                yield e.index, f"{field}={value} exceeds the cap {cap} of the {policy or 'unnamed'} policy"
    for e in rt.terminals:
        if _OVERFLOW_MARK in str(e.data.get("error", "")) and _value(e.data.get("finish_reason")) != FinishReason.TRANSPORT_ERROR:
            yield e.index, f"buffer overflow reported as {e.data.get('finish_reason')}, not transport_error"


# ---------------------------------------------------------------- §4.10 resources


@monitor("release_exactly_once")
def _release_exactly_once(rt: RequestTrace):
    seen: set[str | None] = set()  # None: an entry that names no resource
    for e in rt.events:
        kind = e.data.get("resource")
        if e.kind == K.RESOURCE_RELEASED:
            if kind in seen:
                yield e.index, f"{kind} released a second time"
            seen.add(kind)
        elif e.kind == K.RESOURCE_VIOLATION and e.data.get("problem") == "double_release":
            yield e.index, f"{kind}: double release recorded"


@monitor("no_leak")
def _no_leak(rt: RequestTrace):
    held: dict[str | None, int] = {}  # None: an entry that names no resource
    for e in rt.events:
        kind = e.data.get("resource")
        if e.kind == K.RESOURCE_ACQUIRED:
            held[kind] = e.index
        elif e.kind == K.RESOURCE_RELEASED:
            held.pop(kind, None)
        elif e.kind == K.RESOURCE_VIOLATION and e.data.get("problem") == "leak":
            yield e.index, f"{kind} leaked (recorded by the ledger)"
    if rt.complete:
        for kind, idx in held.items():
            yield None, f"{kind} acquired at event {idx} and never released"


@monitor("model_released_before_terminal")
def _model_released_before_terminal(rt: RequestTrace):
    held: set[str] = set()
    for e in rt.events:
        kind = e.data.get("resource")
        if e.kind == K.RESOURCE_ACQUIRED and kind in rt.tables.model_resources:
            held.add(kind)
        elif e.kind == K.RESOURCE_RELEASED:
            held.discard(kind)
        elif e.kind == K.LIFECYCLE and e.data.get("to") in rt.tables.life_terminal and held:
            yield e.index, f"{sorted(held)} still held at the transition to {e.data['to']}"


# ---------------------------------------------------------------- §4.6, §4.12 stops and EOS


@monitor("stop_bytes_never_emitted")
def _stop_bytes_never_emitted(rt: RequestTrace):
    """No stop string in the output after the echoed prompt; with include_stop_str_in_output (D33)
    the winning stop ends the output and appears nowhere before its end."""
    stops = [s.encode("utf-8") for s in rt.created.get("stop", ()) if s]
    kept = b""
    hit = next(rt.of(K.STOP_HIT), None)
    if rt.created.get("include_stop_str_in_output") and hit is not None and hit.data.get("kind") != "token_ids":
        kept = str(hit.data.get("stop", "")).encode("utf-8")
    limit = len(rt.completion) - len(kept) if kept and rt.completion.endswith(kept) else None
    out, skip = b"", rt.echo
    for e in rt.deltas:
        data = bytes(e.data.get("bytes", b""))
        cut = min(skip, len(data))
        skip -= cut
        start = len(out)
        out += data[cut:]
        for s in stops:
            i = out.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (limit is None or i < limit):
                yield e.index, f"stop string {s!r} reached the client"
                return


@monitor("nothing_after_stop_hit")
def _nothing_after_stop_hit(rt: RequestTrace):
    return _forbidden_after(
        rt, lambda e: e.kind == K.STOP_HIT, "the stop hit",
        (K.RESPONSE_DELTA, K.TOKEN_SELECTED, K.DECODE_STARTED, K.DECODE_COMPLETED),
    )


def _forbidden_after(rt: RequestTrace, is_mark, what: str, kinds: tuple[str, ...]):
    """Every event of `kinds` after the first event that `is_mark` accepts."""
    mark = None
    for e in rt.events:
        if mark is None:
            if is_mark(e):
                mark = e
        elif e.kind in kinds:
            yield e.index, f"{e.kind} after {what} at event {mark.index}"


@monitor("stop_prefix_held")
def _stop_prefix_held(rt: RequestTrace):
    every = [s.encode("utf-8") for s in rt.created.get("stop", ()) if s]
    stops = [s for s in every if len(s) > 1]
    if not stops or rt.created.get("include_stop_str_in_output"):  # a kept stop is output either way (D33)
        return
    id_stops = [tuple(s) for s in rt.created.get("stop_token_ids", ()) if s]
    longest = max(len(s) for s in stops)
    seen = sent = b""
    ids: list[int] = []
    complete = False  # some stop, string or token ids, is complete in what was selected
    for e in rt.events:
        if e.kind == K.TOKEN_SELECTED:
            ids.append(e.data["token"])
            start = len(seen)
            if not e.data.get("eos"):
                seen += rt.tokenizer.token_bytes(e.data["token"])
            complete = complete or any(s in seen[max(0, start - len(s) + 1):] for s in every) or any(
                tuple(ids[-len(q):]) == q for q in id_stops)
        elif e.kind == K.RESPONSE_DELTA:
            sent += bytes(e.data.get("bytes", b""))
            if _left_decoding(rt, 0, e.index):
                return  # the flush at the end: nothing follows, every held byte goes out
            if complete:
                # The output ends at the first stop to end (a token-id stop at its cut, D3); a match
                # still open would end after it and can never win, so every byte before the cut is
                # final and may go out with this token.
                return
            # a tail shorter than the longest stop can be a proper prefix of one; the echoed prompt is
            # no stop's (D3: output only)
            for j in range(max(0, len(seen) - longest + 1), len(sent) - rt.echo):
                tail = seen[j:]
                if any(len(tail) < len(s) and s.startswith(tail) for s in stops):
                    yield e.index, f"sent byte {j} onward ({tail!r}) can still begin a stop"
                    return


@monitor("stop_earliest_wins")
def _stop_earliest_wins(rt: RequestTrace):
    hit = next((e for e in rt.of(K.STOP_HIT) if e.data.get("kind", "string") == "string"), None)
    if hit is None:
        return
    won = str(hit.data.get("stop", "")).encode("utf-8")
    # the output ends where the winning match starts (D3), or with it when it is kept (D33)
    text = rt.completion if rt.created.get("include_stop_str_in_output") else rt.completion + won
    for s in (s.encode("utf-8") for s in rt.created.get("stop", ()) if s):
        at = text.find(s)
        if at >= 0 and (at + len(s) < len(text) or at + len(s) == len(text) and len(s) > len(won)):
            yield hit.index, f"the stop {won!r} won, but {s!r} ends at byte {at + len(s)}, before or with it (D3)"
            return


@monitor("stop_reason_requires_hit")
def _stop_reason_requires_hit(rt: RequestTrace):
    end = rt.terminal
    if (end is not None and rt.reason == FinishReason.STOP_SEQUENCE
            and not any(e.index < end.index for e in rt.of(K.STOP_HIT))):
        yield end.index, "finish reason stop_sequence without a stop.hit"


@monitor("eos_not_emitted")
def _eos_not_emitted(rt: RequestTrace):
    eos = None
    eos_id = rt.created.get("eos_id")  # a runtime that forgets to flag EOS is still caught (§4.12 row 1)
    for e in rt.events:
        is_eos = e.kind == K.TOKEN_SELECTED and (e.data.get("eos") or (
            eos_id is not None and e.data.get("token") == eos_id and not rt.eos_guarded(e.data.get("step", 0))))
        if is_eos and eos is None:
            eos = e
        elif eos is None:
            continue
        elif e.kind == K.TOKEN_SELECTED:
            yield e.index, f"token selected after EOS at step {eos.data.get('step')}"
        elif e.kind in (K.DECODE_STARTED, K.DECODE_COMPLETED):
            yield e.index, f"{e.kind} for the EOS token (step {eos.data.get('step')})"
        elif e.kind == K.RESPONSE_DELTA and not _left_decoding(rt, eos.index, e.index):
            yield e.index, "a delta sent for the EOS token itself (before the EOS transition)"


@monitor("eos_guards_respected")
def _eos_guards_respected(rt: RequestTrace):
    end = rt.terminal
    if end is None or rt.reason != FinishReason.EOS or not rt.selected:
        return
    step = rt.selected[-1].data.get("step", len(rt.selected))
    if rt.eos_guarded(step):
        why = "ignore_eos" if rt.created.get("ignore_eos") else f"min_tokens {rt.created.get('min_tokens')}"
        yield end.index, f"the request ended with eos on token {step} despite {why}"


def _left_decoding(rt: RequestTrace, start: int, end: int) -> bool:
    """Did the lifecycle leave DECODING between event indices start and end?"""
    return any(
        e.kind == K.LIFECYCLE and e.data.get("from") == "DECODING" and start < e.index < end for e in rt.events
    )


# ---------------------------------------------------------------- §4.2 selected vs decoded


@monitor("selected_minus_decoded_0_or_1")
def _selected_minus_decoded(rt: RequestTrace):
    sel = dec = 0
    for e in rt.events:
        if e.kind == K.TOKEN_SELECTED:
            sel += 1
        elif e.kind == K.DECODE_COMPLETED:
            dec += 1
        else:
            continue
        if sel - dec not in (0, 1):
            yield e.index, f"selected {sel}, decoded {dec}: the difference must be 0 or 1"
            return


@monitor("decode_after_selected")
def _decode_after_selected(rt: RequestTrace):
    selected: set[int | None] = set()  # None: an entry that names no step
    started: set[int | None] = set()
    for e in rt.events:
        step = e.data.get("step")
        if e.kind == K.TOKEN_SELECTED:
            selected.add(step)
        elif e.kind == K.DECODE_STARTED:
            if step not in selected:
                yield e.index, f"decode of step {step} started before token {step} was selected"
            elif step in started:
                yield e.index, f"decode of step {step} started twice"
            started.add(step)
        elif e.kind == K.DECODE_COMPLETED and step not in started:
            yield e.index, f"decode of step {step} completed without having started"


@monitor("steps_consecutive")
def _steps_consecutive(rt: RequestTrace):
    for n, e in enumerate(rt.selected, start=1):
        if e.data.get("step") != n:
            yield e.index, f"selection number {n} has step={e.data.get('step')}"
            return


# ---------------------------------------------------------------- §4.9 cancel and deadline


@monitor("no_select_after_cancel_observed")
def _no_select_after_cancel_observed(rt: RequestTrace):
    return _forbidden_after(
        rt,
        lambda e: e.kind == K.CANCEL_OBSERVED or (e.kind == K.LIFECYCLE and e.data.get("to") == "CANCEL_REQUESTED"),
        "the cancel was observed", (K.TOKEN_SELECTED, K.DECODE_STARTED),
    )


@monitor("no_kernel_in_flight_at_cancelled")
def _no_kernel_in_flight_at_cancelled(rt: RequestTrace):
    in_flight = 0
    for e in rt.events:
        if e.kind in (K.PREFILL_STARTED, K.DECODE_STARTED):
            in_flight += 1
        elif e.kind in (K.PREFILL_COMPLETED, K.DECODE_COMPLETED):
            in_flight -= 1
        elif e.kind == K.LIFECYCLE_IGNORED and e.data.get("event") == "model_error":
            in_flight = 0  # the failed kernel is over; its error is recorded, not reported
        elif e.kind == K.LIFECYCLE and e.data.get("to") == "CANCELLED" and in_flight > 0:
            yield e.index, f"CANCELLED while {in_flight} kernel(s) still in flight: not a safe point"


def _before_cancel_request(rt: RequestTrace, effect: Callable[[Event], bool]) -> Iterator[Event]:
    """The events satisfying `effect` that come before any cancel.requested (§4.9 moment 1)."""
    for e in rt.events:
        if e.kind == K.CANCEL_REQUESTED:
            return
        if effect(e):
            yield e


@monitor("cancel_observed_after_requested")
def _cancel_observed_after_requested(rt: RequestTrace):
    for e in _before_cancel_request(rt, lambda e: e.kind == K.CANCEL_OBSERVED):
        yield e.index, "cancel observed but never requested"


@monitor("cancelled_only_if_requested")
def _cancelled_only_if_requested(rt: RequestTrace):
    def cancel_effect(e: Event) -> bool:
        return (e.kind == K.LIFECYCLE and e.data.get("to") in ("CANCELLED", "CANCEL_REQUESTED")) or (
            e.kind in TERMINAL_KINDS and _value(e.data.get("finish_reason")) == FinishReason.CANCELLED
        )

    for e in _before_cancel_request(rt, cancel_effect):
        yield e.index, f"{e.kind} {e.data.get('to') or 'cancelled'} without a cancel.requested"


@monitor("observed_cancel_ends_cancelled")
def _observed_cancel_ends_cancelled(rt: RequestTrace):
    observed = None
    for e in rt.of(K.LIFECYCLE):
        if e.data.get("to") == "CANCEL_REQUESTED":
            observed = observed or e
        elif observed is not None and e.data.get("to") in rt.tables.life_terminal and e.data.get("to") != "CANCELLED":
            yield e.index, (f"the cancel observed at event {observed.index} did not take effect: "
                            f"'{e.data.get('event')}' ends {e.data.get('to')}")


@monitor("no_select_while_draining")
def _no_select_while_draining(rt: RequestTrace):
    draining = None
    for e in rt.events:
        if e.kind == K.LIFECYCLE and e.data.get("to") == "DRAINING":
            draining = draining or e
        elif draining is not None and e.kind == K.TOKEN_SELECTED:
            yield e.index, f"token {e.data.get('step')} selected after DRAINING was entered at event {draining.index}"


@monitor("transport_failure_reported_as_such")
def _transport_failure_reported_as_such(rt: RequestTrace):
    for e in rt.of(K.LIFECYCLE):
        if (e.data.get("event") == "transport_error" and e.data.get("to") in rt.tables.life_terminal
                and _value(e.data.get("reason")) != FinishReason.TRANSPORT_ERROR):
            yield e.index, f"a transport error ends {e.data.get('to')} with reason {e.data.get('reason')}"


@monitor("deadline_not_cancelled")
def _deadline_not_cancelled(rt: RequestTrace):
    deadline = None
    for e in rt.events:
        if e.kind == K.DEADLINE_EXCEEDED or (e.kind == K.LIFECYCLE and e.data.get("event") == "deadline"):
            deadline = deadline or e
            if e.kind == K.LIFECYCLE and e.data.get("reason") != FinishReason.DEADLINE_EXCEEDED:
                yield e.index, f"deadline transition with reason {e.data.get('reason')}"
        elif deadline is not None and e.kind in TERMINAL_KINDS and _value(e.data.get("finish_reason")) == FinishReason.CANCELLED:
            yield e.index, f"deadline observed at event {deadline.index} but reported as cancelled"


# ---------------------------------------------------------------- §4.10 reasons and usage


@monitor("transport_not_eos")
def _transport_not_eos(rt: RequestTrace):
    eos_selected = False
    for e in rt.events:
        if e.kind == K.TOKEN_SELECTED:
            eos_selected = bool(e.data.get("eos"))
        elif e.kind == K.LIFECYCLE and e.data.get("event") == "eos" and not eos_selected:
            yield e.index, "eos transition without an EOS token just selected"
        elif e.kind in TERMINAL_KINDS and _value(e.data.get("finish_reason")) == FinishReason.EOS and not eos_selected:
            yield e.index, "reason eos but the last selected token is not EOS (a transport fact reported as EOS?)"


@monitor("finish_reason_matches_state")
def _finish_reason_matches_state(rt: RequestTrace):
    for e in rt.terminals:
        state = rt.tables.terminal_state[K(e.kind)]
        reason = _value(e.data.get("finish_reason"))
        if reason not in rt.tables.reasons_of_state[state]:
            yield e.index, f"{e.kind} ({state}) with finish reason {reason!r}"


@monitor("length_respected")
def _length_respected(rt: RequestTrace):
    limit = rt.created.get("max_output_tokens")
    if limit is None:
        return
    if len(rt.selected) > limit:
        yield rt.selected[limit].index, f"token {limit + 1} selected with max_output_tokens={limit}"
    if rt.terminal is not None and rt.reason == FinishReason.MAX_OUTPUT_TOKENS and len(rt.selected) != limit:
        yield rt.terminal.index, f"reason max_output_tokens after {len(rt.selected)} of {limit} tokens"


@monitor("finish_reason_precedence")
def _finish_reason_precedence(rt: RequestTrace):
    if rt.terminal is None or not rt.selected or rt.reason not in (FinishReason.MAX_OUTPUT_TOKENS, FinishReason.STOP_SEQUENCE):
        return
    last = rt.selected[-1]
    eos_id = rt.created.get("eos_id")
    is_eos = last.data.get("eos") or (eos_id is not None and last.data.get("token") == eos_id)
    if is_eos and not rt.eos_guarded(last.data.get("step", 0)):
        yield rt.terminal.index, f"the last selected token is EOS, but the reason is {rt.reason} (D4: EOS first)"
    elif rt.reason == FinishReason.MAX_OUTPUT_TOKENS and any(rt.of(K.STOP_HIT)):
        yield rt.terminal.index, "a stop was hit, but the reason is max_output_tokens (D4: stop before length)"


@monitor("usage_consistent")
def _usage_consistent(rt: RequestTrace):
    if rt.terminal is None:
        return
    u = _usage(rt.terminal.data)
    if not u:
        yield rt.terminal.index, "terminal event without usage"
        return
    out_bytes = len(rt.completion)  # the echoed prompt is no token's (D33)
    counts = {
        "selected_tokens": len(rt.selected),
        "completion_tokens": len(rt.selected),
        "processed_tokens": sum(1 for _ in rt.of(K.DECODE_COMPLETED)),
        "returned_bytes": out_bytes,
        "prompt_tokens": rt.created.get("prompt_tokens"),
    }
    for field, expected in counts.items():
        if expected is not None and field in u and u[field] != expected:
            yield rt.terminal.index, f"usage.{field}={u[field]} but the trace shows {expected}"
    returned = u.get("returned_tokens")
    if returned is not None and not (
        (returned == 0) == (out_bytes == 0) and returned <= len(rt.selected) and returned <= out_bytes
    ):
        yield rt.terminal.index, f"usage.returned_tokens={returned} with {out_bytes} bytes returned of {len(rt.selected)} selected"


# ---------------------------------------------------------------- §4.5 the detokenizer


def _whole_chars(data: bytes) -> bytes:
    """`data` without an unfinished UTF-8 character at its end."""
    for k in range(1, min(4, len(data)) + 1):
        lead = data[-k]
        if lead & 0xC0 != 0x80:  # the first byte of the last character
            need = 1 if lead < 0x80 else 2 if lead >> 5 == 6 else 3 if lead >> 4 == 14 else 4
            return data if k >= need else data[:-k]
    return data


@monitor("detok_concat_equals_batch")
def _detok_concat_equals_batch(rt: RequestTrace):
    """Streamed bytes == batch decode of the selected ids that are text (not EOS, not a token
    check's), cut at the stop (prefix if cut short)."""
    if rt.terminal is None:
        return
    special = {i for ids in (rt.created.get("finish_tokens") or {}).values() for i in ids}  # not text (D4)
    ids = [e.data.get("token") for e in rt.selected if not e.data.get("eos") and e.data.get("token") not in special]
    hit = next(rt.of(K.STOP_HIT), None)
    if hit is not None and hit.data.get("kind") == "token_ids":
        ids = ids[: len(ids) - len(hit.data.get("stop", ()))]
    tok = rt.tokenizer
    prompt = list(rt.created.get("prompt_ids", ()))
    # DECISIONS D12: the output is decode(prompt + output) minus decode(prompt), as bytes.
    skip = rt.created.get("skip_special_tokens", True)
    whole, head = _decode(tok, prompt + ids, skip), _decode(tok, prompt, skip)
    if not whole.startswith(head):
        yield rt.terminal.index, f"decode(prompt) {head[-20:]!r} is not a prefix of decode(prompt + output)"
        return
    full = whole[len(head):]
    dropped = next(rt.of(K.DETOK_DROPPED), None)
    if dropped is not None:  # a guarded run dropped its unfinished last character (D16)
        full = full[: len(full) - dropped.data["bytes"]]
    if hit is not None and hit.data.get("kind") != "token_ids":
        full = _cut_at_stop(full, [s.encode("utf-8") for s in rt.created.get("stop", ()) if s],
                            keep=bool(rt.created.get("include_stop_str_in_output")))
    elif hit is not None:  # a stop-id cut keeps no unfinished character (D24)
        full = _whole_chars(full)
    if rt.echo:  # the output begins with the prompt's own bytes (D33)
        full = head + full
    out = rt.output
    exact = rt.terminal.kind == K.RESPONSE_COMPLETED and rt.reason != FinishReason.CONTENT_INTERRUPTED
    if (out != full) if exact else not full.startswith(out):
        relation = "equal" if exact else "be a prefix of"
        yield rt.terminal.index, f"streamed {out[:60]!r}... must {relation} the batch decode {full[:60]!r}..."


@monitor("stream_tokens_aligned")
def _stream_tokens_aligned(rt: RequestTrace):
    """D59 on the trace: at every delta, the bytes sent so far (the echo aside) are a prefix of the
    batch decode of the text tokens selected before it, so a chunk can name the tokens its text
    comes from (runtime/alignment.Releaser). Under a decode plan whose prompt decodes to some bytes,
    an output token is never a sequence's first, so the decode grows by the token's `rest` bytes
    (DecodePlan.decode_bytes) and is kept as it grows; otherwise the prefix is decoded anew where a
    delta's bytes reach past what the last decode covered."""
    tok = rt.tokenizer
    if rt.echo or not rt.deltas:
        return  # an echoed prompt may end inside a character its first output token completes (D33)
    special = {i for ids in (rt.created.get("finish_tokens") or {}).values() for i in ids}
    prompt = list(rt.created.get("prompt_ids", ()))
    skip = rt.created.get("skip_special_tokens", True)
    head = _decode(tok, prompt, skip)
    plan = tok.plan(skip_special=skip) if head and hasattr(tok, "plan") else None
    ids: list[int] = []
    sent = bytearray()
    grown = bytearray()  # the output's decode so far, under `plan`
    covered = b""
    for e in rt.events:
        if e.kind == K.TOKEN_SELECTED:
            if not e.data.get("eos") and e.data.get("token") not in special:
                ids.append(e.data["token"])  # the trace's schema: token.selected names its token
                if plan is not None:
                    grown += plan.rest.get(ids[-1], b"")
            covered = b""  # a new token: decode again when a delta needs it
        elif e.kind == K.RESPONSE_DELTA:
            sent += bytes(e.data.get("bytes", b""))
            if len(sent) <= len(covered) and covered.startswith(sent):
                continue
            if plan is not None:
                covered = bytes(grown)
            else:
                whole = _decode(tok, prompt + ids, skip)
                covered = whole[len(head):] if whole.startswith(head) else whole
            if not covered.startswith(bytes(sent)):
                yield e.index, (f"delta seq={e.data.get('seq')} brings the output to {bytes(sent)[-40:]!r}, past the "
                                f"{len(ids)} text token(s) selected so far, which spell {covered[-40:]!r}")
                return


def _decode(tok: Any, ids: list[int], skip_special: bool = True) -> bytes:
    if hasattr(tok, "decode_bytes"):
        return tok.decode_bytes(ids, skip_special=skip_special)
    return tok.decode(ids, skip_special=skip_special).encode("utf-8")


def _cut_at_stop(data: bytes, stops: list[bytes], keep: bool = False) -> bytes:
    """Cut before the winning match (after it with `keep`, D33): earliest end, then longest (D3)."""
    best = None
    for s in stops:
        i = data.find(s)
        if i >= 0:
            key = (i + len(s), -len(s))
            if best is None or key < best[0]:
                best = (key, i)
    if best is None:
        return data
    (end, _), start = best
    return data[: end if keep else start]


def monitors() -> dict[str, MonitorFn]:
    """Every registered monitor by invariant name (this module registers them at import)."""
    return registered()


def registry_mismatch() -> tuple[list[str], list[str]]:
    """(trace invariants without a monitor, monitors without a trace invariant in the TOML)."""
    return MONITORS.mismatch()
