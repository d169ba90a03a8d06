"""Load a table from TOML and refuse a broken one with an error naming file, entry and problem.

Validation classes (docs/concepts.md, "The tables come first"): unknown target, unreachable
state, non-terminal state that cannot reach a terminal, undeclared event (or state), row out of a
terminal state, duplicate pair, undecided pair; plus a reason outside the ten of §4.10.
"""

from __future__ import annotations

import functools
import tomllib
from collections import deque
from pathlib import Path
from typing import Any

from .tables import Decision, Effect, FinishCheck, FinishGuard, StepPhase, Table
from .vocabulary import SPEC_DIR, STEP_NEEDS, DecisionKind, FinishReason

MACHINES = ("lifecycle", "stop_matcher", "detokenizer", "stream", "resources", "sequence", "channels", "overlap")
_HEADER = ("name", "anchor", "spec_version", "initial", "terminal", "states", "events")
_SECTIONS = {"row": DecisionKind.ROW, "ignore": DecisionKind.IGNORE, "reject": DecisionKind.REJECT}
_FINISH = "finish_check"  # the ordered finish checks (lifecycle; DECISIONS D4)
_GUARDS = "finish_guards"  # what may turn a finish check off (lifecycle; DECISIONS D31)
_STEP = "step"  # the order of the phases of the §4.3 loop's step (lifecycle; DECISIONS D53)
_EFFECTS, _ACTIONS = "effects", "actions"  # what each action does (machine/actions.py)
_PHASES = ("before", "with", "after")
_REASONS = frozenset(r.value for r in FinishReason)


class SpecError(ValueError):
    """A table that cannot be loaded; the message names the file, the entry and the problem.

    `problems` holds every (where, problem) the loader found in one pass (`where`/`problem` are the
    first): a table with eight undecided pairs is refused once, with the eight listed.
    """

    def __init__(self, source: str, where: str, problem: str,
                 problems: tuple[tuple[str, str], ...] | None = None) -> None:
        self.source, self.where, self.problem = source, where, problem
        self.problems = problems or ((where, problem),)
        if len(self.problems) == 1:
            super().__init__(f"{source}: {where}: {problem}")
        else:
            lines = "".join(f"\n  {w}: {p}" for w, p in self.problems)
            super().__init__(f"{source}: {len(self.problems)} problems:{lines}")


class _Problems:
    """Collects SpecErrors of one table so the loader can report them all at once."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.found: list[tuple[str, str]] = []

    def add(self, exc: SpecError) -> None:
        self.found.extend(exc.problems)

    def raise_any(self) -> None:
        if self.found:
            (where, problem), *_ = self.found
            raise SpecError(self.source, where, problem, tuple(self.found))


def spec_path(name: str) -> Path:
    """The packaged file of machine `name`."""
    if name not in MACHINES:
        raise SpecError(name, "name", f"no such machine; known: {', '.join(MACHINES)}")
    return SPEC_DIR / f"{name}.toml"


@functools.cache
def load_spec(name: str) -> Table:
    """The validated table of a shipped machine (`lifecycle`, `stop_matcher`, ...)."""
    path = spec_path(name)
    return load_text(path.read_text(encoding="utf-8"), source=f"spec/{path.name}")


def load_file(path: str | Path) -> Table:
    """Load and validate a table from any TOML file."""
    p = Path(path)
    return load_text(p.read_text(encoding="utf-8"), source=str(p))


def load_text(text: str, source: str = "<text>") -> Table:
    """Parse TOML text into a validated Table, or raise SpecError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(source, "syntax", str(exc)) from None
    return build_table(data, source)


def build_table(data: dict[str, Any], source: str) -> Table:
    """Validate parsed table data; every check names the entry it refuses, and every problem of a
    phase (declarations, entries, undecided pairs, the graph) is reported together."""
    problems = _Problems(source)
    states, events, terminal = _declarations(data, source, problems)
    decisions = _decisions(data, states, events, terminal, source, problems)
    for s in states:
        for e in events:
            if (s, e) not in decisions:
                problems.add(SpecError(source, f"state {s}", f"undecided pair ({s}, {e}): add a row, an ignore or a reject"))
    problems.raise_any()

    _check_graph(data["initial"], states, terminal, decisions, source, problems)
    guards = _finish_guards(data.get(_GUARDS, {}), source, problems)
    checks = _finish_checks(data.get(_FINISH, []), events, decisions, guards, source, problems)
    effects, actions = _actions(data, decisions, source, problems)
    step = _step(data.get(_STEP, []), source, problems)
    problems.raise_any()
    params = {k: v for k, v in data.items()
              if k not in _HEADER and k not in _SECTIONS and k not in (_FINISH, _GUARDS, _EFFECTS, _ACTIONS, _STEP)}
    return Table(
        name=data["name"],
        anchor=data["anchor"],
        spec_version=int(data["spec_version"]),
        initial=data["initial"],
        terminal=terminal,
        states=states,
        events=events,
        decisions={k: decisions[k] for k in sorted(decisions, key=lambda k: (states.index(k[0]), events.index(k[1])))},
        params=params,
        source=source,
        finish_checks=checks,
        finish_guards=guards,
        step=step,
        effects=effects,
        actions=actions,
    )


def _declarations(data: dict[str, Any], source: str, problems: _Problems) -> tuple[tuple, tuple, tuple]:
    """The header's keys present; the states, events and terminal states, each listed once; the
    initial and terminal states declared."""
    for key in _HEADER:
        if key not in data:
            problems.add(SpecError(source, "header", f"missing key '{key}'"))
    problems.raise_any()
    states = tuple(data["states"])
    events = tuple(data["events"])
    terminal = tuple(data["terminal"])
    for label, seq in (("states", states), ("events", events), ("terminal", terminal)):
        dup = _first_duplicate(seq)
        if dup is not None:
            problems.add(SpecError(source, label, f"'{dup}' is listed twice"))
    if data["initial"] not in states:
        problems.add(SpecError(source, "initial", f"undeclared state '{data['initial']}'"))
    for t in terminal:
        if t not in states:
            problems.add(SpecError(source, "terminal", f"undeclared state '{t}'"))
    problems.raise_any()
    return states, events, terminal


def _decisions(data: dict[str, Any], states: tuple, events: tuple, terminal: tuple, source: str,
               problems: _Problems) -> dict[tuple[str, str], Decision]:
    """The rows, rejects and ignores (_SECTIONS) as decisions by (state, event): each entry well
    formed, on declared names, and each pair decided once."""
    decisions: dict[tuple[str, str], Decision] = {}
    for section, kind in _SECTIONS.items():
        for i, entry in enumerate(data.get(section, []), start=1):
            where = f"{section} {i}"
            try:
                entry_decisions = _entry_decisions(entry, kind, where, source)
            except SpecError as exc:
                problems.add(exc)
                continue
            for d in entry_decisions:
                _decide(d, where, decisions, states, events, terminal, source, problems)
    problems.raise_any()
    return decisions


def _decide(d: Decision, where: str, decisions: dict[tuple[str, str], Decision], states: tuple, events: tuple,
            terminal: tuple, source: str, problems: _Problems) -> None:
    """Record one decision, unless its entry is wrong or its pair was decided already."""
    try:
        _check_entry(d, states, events, terminal, source)
    except SpecError as exc:
        problems.add(exc)
        return
    pair = (d.state, d.event)
    if pair in decisions:
        problems.add(SpecError(source, where, f"duplicate pair ({d.state}, {d.event}), first decided in "
                                              f"{decisions[pair].where}"))
        return
    decisions[pair] = d


def _step(entries: Any, source: str, problems: _Problems) -> tuple[StepPhase, ...]:
    """[[step]]: every phase of the loop's step (vocabulary.STEP_NEEDS) once, each with an anchor,
    each after the phases it reads. A table without [[step]] has no loop (every table but the
    lifecycle's)."""
    if not entries:
        return ()
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        problems.add(SpecError(source, _STEP, "[[step]] is a list of tables { phase, anchor, note }"))
        return ()
    out: list[StepPhase] = []
    for i, entry in enumerate(entries, start=1):
        where, phase = f"{_STEP} {i}", entry.get("phase")
        before = {p.phase for p in out}
        if extra := sorted(set(entry) - {"phase", "anchor", "note"}):
            problems.add(SpecError(source, where, f"unknown key '{extra[0]}'"))
        elif phase not in STEP_NEEDS:
            problems.add(SpecError(source, where, f"unknown phase {phase!r}; the phases: {', '.join(STEP_NEEDS)}"))
        elif phase in before:
            problems.add(SpecError(source, where, f"phase '{phase}' is listed twice"))
        elif "anchor" not in entry:
            problems.add(SpecError(source, where, "missing 'anchor'"))
        elif late := [p for p in STEP_NEEDS[phase] if p not in before]:
            problems.add(SpecError(source, where, f"phase '{phase}' reads what '{late[0]}' does: it must come after it"))
        else:
            out.append(StepPhase(phase, entry["anchor"], entry.get("note", "")))
    missing = [p for p in STEP_NEEDS if p not in {x.phase for x in out}]
    if missing and len(out) == len(entries):
        problems.add(SpecError(source, _STEP, f"phase(s) {missing} missing: the step runs every phase once"))
    return tuple(out)


def _finish_guards(raw: Any, source: str, problems: _Problems) -> dict[str, FinishGuard]:
    """[finish_guards]: each guard a table { anchor, note }."""
    if not isinstance(raw, dict):
        problems.add(SpecError(source, _GUARDS, "[finish_guards] is a table of guards"))
        return {}
    out = {}
    for name, g in raw.items():
        where = f"{_GUARDS}.{name}"
        if not isinstance(g, dict):
            problems.add(SpecError(source, where, "a guard is a table: { anchor, note }"))
        elif extra := sorted(set(g) - {"anchor", "note"}):
            problems.add(SpecError(source, where, f"unknown key '{extra[0]}'"))
        elif "anchor" not in g:
            problems.add(SpecError(source, where, "missing 'anchor'"))
        else:
            out[name] = FinishGuard(name, g["anchor"], g.get("note", ""))
    return out


def _finish_checks(entries: list, events: tuple, decisions: dict, guards: dict, source: str,
                   problems: _Problems) -> tuple:
    """The ordered finish checks: each names a declared event, once, that some row fires with a
    finish reason (what the check decides is that reason). `unless` lists declared guards, on a
    check whose token is not text only (eos or a token check: a guarded token becomes text; a
    condition such as a stop hit has already cut the output). A guard no check names is allowed,
    as an action no row names is: a table edit may take a guard off a check."""
    out: list[FinishCheck] = []
    seen: set[str] = set()
    reasons = {d.event for d in decisions.values() if d.kind is DecisionKind.ROW and d.reason}
    for i, entry in enumerate(entries, start=1):
        event = entry.get("event")
        unless = entry.get("unless", [])
        why = _finish_check_problem(entry, event, unless, events, seen, reasons, guards)
        if why is not None:
            problems.add(SpecError(source, f"{_FINISH} {i}", why))
            continue
        seen.add(event)
        out.append(FinishCheck(event, entry["anchor"], entry.get("note", ""), entry.get("tokens", False),
                               tuple(unless)))
    return tuple(out)


def _finish_check_problem(entry: dict[str, Any], event: Any, unless: Any, events: tuple, seen: set, reasons: set,
                          guards: dict) -> str | None:
    """The first thing wrong with one finish check (see _finish_checks), or None."""
    if extra := sorted(set(entry) - {"event", "anchor", "note", "tokens", "unless"}):
        return f"unknown key '{extra[0]}'"
    if event not in events:
        return f"undeclared event '{event}'"
    if event in seen:
        return f"'{event}' is checked twice"
    if event not in reasons:
        return f"no row fires '{event}' with a finish reason"
    if "anchor" not in entry:
        return "missing 'anchor'"
    if not isinstance(entry.get("tokens", False), bool):
        return f"'tokens' must be true or false, got {entry['tokens']!r}"
    if not isinstance(unless, list) or not all(isinstance(g, str) for g in unless):
        return "'unless' is a list of guard names"
    if undeclared := [g for g in unless if g not in guards]:
        return f"'unless' names '{undeclared[0]}', which [finish_guards] does not declare"
    if (dup := _first_duplicate(tuple(unless))) is not None:
        return f"guard '{dup}' is listed twice"
    if unless and not (event == "eos" or entry.get("tokens", False)):
        return (f"'unless' guards only a check whose token is not text (eos or a token check); '{event}' is a "
                "condition")
    return None


def _actions(data: dict[str, Any], decisions: dict, source: str, problems: _Problems) -> tuple[dict, dict]:
    """[effects] and [actions]: every action a row or an ignore names is declared, once, as a list
    of declared effects; every effect is some action's; a row has a `reason` exactly when its action
    has an effect that takes one (an action no row names yet is allowed: a table edit may swap one
    action for another). A table without both sections declares no actions (the
    executors of machine/actions.py refuse such a table by name)."""
    raw_effects, raw_actions = data.get(_EFFECTS), data.get(_ACTIONS)
    if raw_effects is None and raw_actions is None:
        return {}, {}
    if not isinstance(raw_effects, dict) or not isinstance(raw_actions, dict):
        problems.add(SpecError(source, "actions", "[effects] and [actions] are tables and come together"))
        return {}, {}
    effects = {name: e for name, raw in raw_effects.items() if (e := _effect(name, raw, source, problems)) is not None}
    actions = {name: a for name, listed in raw_actions.items()
               if (a := _action(name, listed, raw_effects, source, problems)) is not None}
    for d in decisions.values():
        _check_action_reason(d, raw_actions, actions, effects, source, problems)
    used = {x for listed in raw_actions.values() if isinstance(listed, list) for x in listed}
    for name in effects:
        if name not in used:
            problems.add(SpecError(source, f"effects.{name}", "no action has this effect"))
    return effects, actions


def _effect(name: str, e: Any, source: str, problems: _Problems) -> Effect | None:
    """One [effects] entry: { phase, anchor, note, takes_reason }, its phase one of _PHASES."""
    where = f"effects.{name}"
    if not isinstance(e, dict):
        problems.add(SpecError(source, where, "an effect is a table: { phase, anchor, note }"))
        return None
    extra = sorted(set(e) - {"phase", "anchor", "note", "takes_reason"})
    if extra:
        problems.add(SpecError(source, where, f"unknown key '{extra[0]}'"))
    elif e.get("phase") not in _PHASES:
        problems.add(SpecError(source, where, f"phase must be one of {', '.join(_PHASES)}, got {e.get('phase')!r}"))
    elif "anchor" not in e:
        problems.add(SpecError(source, where, "missing 'anchor'"))
    else:
        return Effect(name, e["phase"], e["anchor"], e.get("note", ""), bool(e.get("takes_reason", False)))
    return None


def _action(name: str, listed: Any, raw_effects: dict, source: str, problems: _Problems) -> tuple[str, ...] | None:
    """One [actions] entry: a list of declared effect names, each once."""
    where = f"actions.{name}"
    if not isinstance(listed, list) or not all(isinstance(x, str) for x in listed):
        problems.add(SpecError(source, where, "an action is a list of effect names"))
        return None
    unknown = [x for x in listed if x not in raw_effects]
    dup = _first_duplicate(tuple(listed))
    if unknown:
        problems.add(SpecError(source, where, f"undeclared effect '{unknown[0]}'"))
    elif dup is not None:
        problems.add(SpecError(source, where, f"effect '{dup}' is listed twice"))
    else:
        return tuple(listed)
    return None


def _check_action_reason(d: Decision, raw_actions: dict, actions: dict[str, tuple[str, ...]],
                         effects: dict[str, Effect], source: str, problems: _Problems) -> None:
    """A decision's action is declared, and the decision gives a reason exactly when one of the
    action's effects takes one (an ignore needs none)."""
    if d.action and d.action not in raw_actions:
        problems.add(SpecError(source, d.where, f"action '{d.action}' of ({d.state}, {d.event}) is not declared in [actions]"))
        return
    if d.action not in actions:
        return
    takes = any(effects[x].takes_reason for x in actions[d.action] if x in effects)
    if takes and d.kind is DecisionKind.ROW and not d.reason:
        problems.add(SpecError(source, d.where, f"action '{d.action}' fixes a reason and ({d.state}, {d.event}) gives none"))
    elif d.reason and not takes:
        problems.add(SpecError(source, d.where, f"({d.state}, {d.event}) has reason '{d.reason}' and its action '{d.action}' does not fix one"))


def _entry_decisions(entry: dict[str, Any], kind: DecisionKind, where: str, source: str) -> list[Decision]:
    if "state" not in entry:
        raise SpecError(source, where, "missing 'state'")
    if kind is DecisionKind.ROW:
        for key in ("event", "target", "action", "anchor"):
            if key not in entry:
                raise SpecError(source, where, f"missing '{key}'")
        evs = [entry["event"]]
    else:
        if ("event" in entry) == ("events" in entry):
            raise SpecError(source, where, "give exactly one of 'event' or 'events'")
        evs = [entry["event"]] if "event" in entry else list(entry["events"])
    return [
        Decision(
            kind=kind,
            state=entry["state"],
            event=e,
            target=entry.get("target", entry["state"]) if kind is DecisionKind.ROW else entry["state"],
            action=entry.get("action"),
            anchor=entry.get("anchor"),
            note=entry.get("note", ""),
            reason=entry.get("reason"),
            where=where,
        )
        for e in evs
    ]


def _check_entry(d: Decision, states: tuple, events: tuple, terminal: tuple, source: str) -> None:
    if d.state not in states:
        raise SpecError(source, d.where, f"undeclared state '{d.state}'")
    if d.event not in events:
        raise SpecError(source, d.where, f"undeclared event '{d.event}' in ({d.state}, {d.event})")
    if d.kind is DecisionKind.ROW:
        if d.target not in states:
            raise SpecError(source, d.where, f"unknown target '{d.target}' in ({d.state}, {d.event})")
        if d.state in terminal:
            raise SpecError(
                source, d.where, f"row out of terminal state {d.state} on '{d.event}': terminal states are irreversible"
            )
    if d.reason is not None and d.reason not in _REASONS:
        raise SpecError(source, d.where, f"unknown finish reason '{d.reason}' (§4.10 lists {sorted(_REASONS)})")


def _check_graph(initial: str, states: tuple, terminal: tuple, decisions: dict, source: str,
                 problems: _Problems) -> None:
    succ: dict[str, set[str]] = {s: set() for s in states}
    for d in decisions.values():
        if d.kind is DecisionKind.ROW:
            succ[d.state].add(d.target)
    seen = _closure([initial], succ)
    for s in states:
        if s not in seen:
            problems.add(SpecError(source, f"state {s}", f"unreachable state {s}: no row leads to it from {initial}"))
    pred: dict[str, set[str]] = {s: set() for s in states}
    for a, targets in succ.items():
        for b in targets:
            pred[b].add(a)
    can_end = _closure(list(terminal), pred)
    for s in states:
        if s not in can_end:
            problems.add(SpecError(source, f"state {s}", f"non-terminal state {s} cannot reach a terminal state"))


def _closure(start: list[str], edges: dict[str, set[str]]) -> set[str]:
    seen, todo = set(start), deque(start)
    while todo:
        for nxt in sorted(edges[todo.popleft()]):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _first_duplicate(seq: tuple) -> str | None:
    seen: set = set()
    for x in seq:
        if x in seen:
            return x
        seen.add(x)
    return None
