"""Diagrams generated from a table (docs/concepts.md, "The diagrams"): deterministic DOT, SVG through graphviz.

States are nodes in the table's declaration order, drawn top to bottom so that the figure stays
legible at a page's width; terminal states are drawn double (§4.1: terminal states are exclusive
and irreversible), the initial state has an arrow from a start point. Every row is an edge
labelled ``event / action(reason)  §anchor`` (the finish reason a lifecycle row fixes, §4.10);
rows between the same pair of states share one edge with one line per row. Ignores change
nothing: each state's ignored events are one dashed grey self-loop (and its tooltip). A table
with finish checks (the lifecycle) lists them, in order and with their guards (D4, D31), in a
note beside the state whose rows they fire.
Rejections are not drawn at all.

A ``highlight`` path of (state, event) pairs (a trace, a counterexample) is drawn on top in red:
only the lines of the rows it fired turn red, each with the global step numbers at which it
fired, and steps that were ignored or rejected get their own red marks. ``violation`` names a
state to fill red (where an invariant broke). `to_mermaid` gives the same graph as a Mermaid
stateDiagram.
"""

from __future__ import annotations

import html
import shutil
from collections.abc import Sequence
from pathlib import Path

import graphviz

from ..spec import MACHINES, Decision, DecisionKind, Table, load_spec

FORMATS = ("dot", "svg", "mmd")
_FONT = "Helvetica"
_START = "__start__"
_CHECKS = "__finish_checks__"
_RED = "#c0392b"
_GREY = "#8a8a8a"


class GraphvizMissing(RuntimeError):
    """The graphviz ``dot`` program is needed to render SVG and is not installed."""


SPLIT_ROWS = 16  # a table with more rows is also drawn in views, one per terminal state, each legible


def views(table: Table) -> dict[str, list[Decision]]:
    """The table's rows split by where they lead: for each terminal state in declaration order, the
    rows not yet drawn whose target can still reach it (for the lifecycle: the way to FINISHED,
    finish reasons included, then the way to CANCELLED, then to FAILED). Every row is in one view."""
    left = list(table.rows)
    out: dict[str, list[Decision]] = {}
    for goal in table.terminal:
        reach, changed = {goal}, True
        while changed:
            changed = False
            for d in table.rows:
                if d.target in reach and d.state not in reach and not table.is_terminal(d.state):
                    reach.add(d.state)
                    changed = True
        out[goal] = [d for d in left if d.target in reach]
        left = [d for d in left if d.target not in reach]
    return out


def to_dot(table: Table, *, highlight: Sequence[tuple[str, str]] | None = None,
           numbers: Sequence[int] | None = None, violation: str | None = None, view: str | None = None) -> str:
    """The DOT text of `table`; the same table (and path) always gives the same bytes.

    `numbers` gives the step number of each `highlight` entry (default 1, 2, ...): a trace of
    several machines numbers its steps globally, so each machine's drawing keeps those numbers.
    `view` (a terminal state) draws only that view's rows (`views`) and the states they touch.
    """
    path = list(highlight or ())
    nums = list(numbers) if numbers is not None else list(range(1, len(path) + 1))
    if len(nums) != len(path):
        raise ValueError(f"{len(nums)} step numbers for {len(path)} highlighted steps")
    steps = _steps_by_pair(table, path, nums)
    if violation is not None and violation not in table.states:
        raise ValueError(f"violation: {table.name} has no state '{violation}'")
    if view is not None and view not in table.terminal:
        raise ValueError(f"view: {table.name} has no terminal state '{view}'")
    rows = views(table)[view] if view else list(table.rows)
    shown = [s for s in table.states if view is None or any(s in (d.state, d.target) for d in rows)]
    title = f": the way to {view}" if view else ""
    g = graphviz.Digraph(
        table.name,
        graph_attr={
            "label": f"{table.name} ({table.anchor}){title}, spec_version {table.spec_version}",
            "labelloc": "t",
            # A fan-in (every row to one state) reads best left to right; the rest top to bottom.
            "rankdir": "LR" if view and len({d.target for d in rows}) == 1 else "TB",
            "fontname": _FONT,
            "fontsize": "16",
            "nodesep": "0.3",
            "ranksep": "0.45",
        },
        node_attr={"shape": "box", "style": "rounded", "fontname": _FONT, "fontsize": "14"},
        edge_attr={"fontname": _FONT, "fontsize": "12"},
    )
    if table.initial in shown:
        g.node(_START, label="", shape="point", width="0.15")
        g.edge(_START, table.initial)
    visited = {s for s, _ in path}
    for s in shown:
        attrs = {"tooltip": _ignores_tooltip(table, s)}
        if table.is_terminal(s):
            attrs["peripheries"] = "2"
        if s in visited:
            attrs.update(color=_RED, penwidth="2")
        if s == violation:
            attrs.update(style="rounded,filled", fillcolor="#f5b7b1", color=_RED, penwidth="3")
        g.node(s, **attrs)
    for (src, dst), lines in _edges(table, steps, rows).items():
        hot = any(n for n, _ in lines)
        attrs = {"label": _html_lines(lines)}
        if hot:
            attrs.update(color=_RED, penwidth="2")
        g.edge(src, dst, **attrs)
    checks_at = _checks_state(table)
    if checks_at in shown and view in (None, table.terminal[0]):  # the finish checks once, beside their state
        g.node(_CHECKS, label=_html_lines([(False, t) for t in _check_lines(table)]), shape="note",
               color=_GREY, fontcolor="#444444", fontsize="11")
        g.edge(checks_at, _CHECKS, style="dotted", color=_GREY, arrowhead="none")
    for s in shown if view in (None, table.terminal[0]) else ():  # ignores once: with the main view
        ignored = _ignored(table, s)
        if ignored:
            g.edge(s, s, label=f"ignored: {', '.join(ignored)}", style="dashed", color=_GREY, fontcolor=_GREY,
                   fontsize="10", arrowhead="none")
    for n, (state, event) in zip(nums, path):
        d = table.decision(state, event)
        if d.kind is DecisionKind.IGNORE:
            g.edge(state, state, label=f"{n}. {event} (ignored)", color=_RED, fontcolor=_RED, style="dashed")
        elif d.kind is DecisionKind.REJECT:
            stop = f"__rejected_{n}__"
            g.node(stop, label=f"{n}. {event}\\nrejected", shape="octagon", color=_RED, fontcolor=_RED)
            g.edge(state, stop, color=_RED, style="dotted")
    return g.source


def _checks_state(table: Table) -> str | None:
    """The state whose rows the finish checks fire (each check's event fixes a reason there)."""
    events = [c.event for c in table.finish_checks]
    for s in table.states:
        if events and all((d := table.decision(s, e)).kind is DecisionKind.ROW and d.reason for e in events):
            return s
    return None


def _check_lines(table: Table) -> list[str]:
    """The table's finish checks in order, each with its guards (D4, D31)."""
    lines = ["finish checks, in order: the first that holds fires"]
    for i, c in enumerate(table.finish_checks, start=1):
        guard = f"  unless {', '.join(c.unless)}" if c.unless else ""
        lines.append(f"{i}. {c.event}{' (token)' if c.tokens else ''}{guard}  {c.anchor}")
    return lines


def _html_lines(lines: list[tuple[bool, str]]) -> str:
    """An edge label with one left-aligned line per row; only fired rows are red (an HTML label)."""
    out = []
    for hot, text in lines:
        t = html.escape(text)
        out.append(f'<FONT COLOR="{_RED}">{t}</FONT>' if hot else t)
    return "<" + "".join(f'{t}<BR ALIGN="LEFT"/>' for t in out) + ">"


def to_mermaid(table: Table) -> str:
    """The table as a Mermaid stateDiagram-v2: rows as transitions, terminals to the end state,
    ignored events as a note on their state."""
    ident = {s: f"s{i}_{s}" for i, s in enumerate(table.states)}
    lines = ["---", f"title: {table.name} ({table.anchor}), spec_version {table.spec_version}", "---",
             "stateDiagram-v2", "    direction TB"]
    lines += [f"    state \"{s}\" as {ident[s]}" for s in table.states]
    lines.append(f"    [*] --> {ident[table.initial]}")
    for (src, dst), rows in _edges(table, {}).items():
        for _, text in rows:
            lines.append(f"    {ident[src]} --> {ident[dst]}: {text.replace(':', ' ')}")
    lines += [f"    {ident[s]} --> [*]" for s in table.states if table.is_terminal(s)]
    for s in table.states:
        ignored = _ignored(table, s)
        if ignored:
            lines.append(f"    note right of {ident[s]}: ignores {', '.join(ignored)}")
    checks_at = _checks_state(table)
    if checks_at is not None:
        lines.append(f"    note left of {ident[checks_at]}: {'<br/>'.join(_check_lines(table))}")
    return "\n".join(lines) + "\n"


def render(
    table: Table,
    out_dir: str | Path,
    *,
    formats: Sequence[str] = FORMATS,
    highlight: Sequence[tuple[str, str]] | None = None,
    numbers: Sequence[int] | None = None,
    violation: str | None = None,
    view: str | None = None,
    stem: str | None = None,
) -> list[Path]:
    """Write ``<stem>.<fmt>`` (stem defaults to the table's name) for each format; return the paths."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown diagram format(s) {unknown}; supported: {list(FORMATS)}")
    source = to_dot(table, highlight=highlight, numbers=numbers, violation=violation, view=view)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        path = out / f"{stem or table.name}.{fmt}"
        if fmt == "dot":
            path.write_text(source, encoding="utf-8")
        elif fmt == "mmd":
            path.write_text(to_mermaid(table), encoding="utf-8")
        else:
            path.write_bytes(_run_dot(source, fmt))
        written.append(path)
    return written


def render_all(out_dir: str | Path, *, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Render the six shipped machines into `out_dir`, and the views of a table with more than
    SPLIT_ROWS rows (`lifecycle.FINISHED.svg`, one per terminal state) as DOT and SVG."""
    out = []
    for name in MACHINES:
        table = load_spec(name)
        out += render(table, out_dir, formats=formats)
        if len(table.rows) > SPLIT_ROWS:
            for view in table.terminal:
                out += render(table, out_dir, formats=[f for f in formats if f != "mmd"], view=view,
                              stem=f"{name}.{view}")
    return out


def _run_dot(source: str, fmt: str) -> bytes:
    if shutil.which("dot") is None:
        raise GraphvizMissing(
            f"cannot render {fmt}: graphviz's 'dot' program is not on PATH "
            "(install graphviz, e.g. 'apt-get install graphviz', or run scripts/setup.sh)"
        )
    try:
        return graphviz.pipe("dot", fmt, source.encode("utf-8"))
    except graphviz.ExecutableNotFound as exc:
        raise GraphvizMissing(f"cannot render {fmt}: {exc}") from exc


def _steps_by_pair(table: Table, path: Sequence[tuple[str, str]], numbers: Sequence[int]) -> dict[tuple[str, str], list[int]]:
    """The step numbers at which each (state, event) pair of `path` was fired."""
    steps: dict[tuple[str, str], list[int]] = {}
    for n, (state, event) in zip(numbers, path):
        if state not in table.states:
            raise ValueError(f"highlight step {n}: {table.name} has no state '{state}'")
        if event not in table.events:
            raise ValueError(f"highlight step {n}: {table.name} has no event '{event}'")
        steps.setdefault((state, event), []).append(n)
    return steps


def _edges(table: Table, steps: dict[tuple[str, str], list[int]],
           rows: Sequence[Decision] | None = None) -> dict[tuple[str, str], list[tuple[bool, str]]]:
    """Rows (all, or those given) merged per (source, target) in table order: lines of (highlighted, text)."""
    order = {s: i for i, s in enumerate(table.states)}
    edges: dict[tuple[str, str], list[tuple[bool, str]]] = {}
    for d in table.rows if rows is None else rows:
        action = f"{d.action}({d.reason})" if d.reason else d.action
        text = f"{d.event} / {action}  {d.anchor}"
        numbers = steps.get((d.state, d.event))
        if numbers:
            text = f"[{','.join(map(str, numbers))}] {text}"
        edges.setdefault((d.state, d.target), []).append((bool(numbers), text))
    return {k: edges[k] for k in sorted(edges, key=lambda k: (order[k[0]], order[k[1]]))}


def _ignored(table: Table, state: str) -> list[str]:
    return [e for e in table.events if table.decision(state, e).kind is DecisionKind.IGNORE]


def _ignores_tooltip(table: Table, state: str) -> str:
    ignored = [
        f"{d.event} / {d.action}" if d.action else d.event
        for d in (table.decision(state, e) for e in _ignored(table, state))
    ]
    return f"{state}; ignores: {', '.join(ignored)}" if ignored else state
