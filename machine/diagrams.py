"""Diagrams generated from a table (DESIGN, machine/): deterministic DOT, SVG through graphviz.

States are nodes in the table's declaration order, terminal states are drawn double (§4.1:
terminal states are exclusive and irreversible), the initial state has an arrow from a start
point. Every row is an edge labelled ``event / action  §anchor``; rows between the same pair of
states share one edge with one line per row. Ignores are not edges (they change nothing): each
node lists them in its tooltip. Rejections are not drawn at all.

A ``highlight`` path of (state, event) pairs (a trace, a counterexample) is drawn on top in red
with step numbers, including the steps that were ignored or rejected.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import graphviz

from ..spec import MACHINES, DecisionKind, Table, load_spec

FORMATS = ("dot", "svg")
_FONT = "Helvetica"
_START = "__start__"
_RED = "#c0392b"


class GraphvizMissing(RuntimeError):
    """The graphviz ``dot`` program is needed to render SVG and is not installed."""


def to_dot(table: Table, *, highlight: Sequence[tuple[str, str]] | None = None) -> str:
    """The DOT text of `table`; the same table (and path) always gives the same bytes."""
    steps = _steps_by_pair(table, highlight or ())
    g = graphviz.Digraph(
        table.name,
        graph_attr={
            "label": f"{table.name} ({table.anchor}), spec_version {table.spec_version}",
            "labelloc": "t",
            "rankdir": "LR",
            "fontname": _FONT,
        },
        node_attr={"shape": "box", "style": "rounded", "fontname": _FONT},
        edge_attr={"fontname": _FONT, "fontsize": "10"},
    )
    g.node(_START, label="", shape="point", width="0.15")
    g.edge(_START, table.initial)
    visited = {s for s, _ in highlight or ()}
    for s in table.states:
        attrs = {"tooltip": _ignores_tooltip(table, s)}
        if table.is_terminal(s):
            attrs["peripheries"] = "2"
        if s in visited:
            attrs.update(color=_RED, penwidth="2")
        g.node(s, **attrs)
    for (src, dst), lines in _edges(table, steps).items():
        hot = any(n for n, _ in lines)
        attrs = {"label": "".join(text + "\\l" for _, text in lines)}
        if hot:
            attrs.update(color=_RED, fontcolor=_RED, penwidth="2")
        g.edge(src, dst, **attrs)
    for i, (state, event) in enumerate(highlight or (), start=1):
        d = table.decision(state, event)
        if d.kind is DecisionKind.IGNORE:
            g.edge(state, state, label=f"{i}. {event} (ignored)", color=_RED, fontcolor=_RED, style="dashed")
        elif d.kind is DecisionKind.REJECT:
            stop = f"__rejected_{i}__"
            g.node(stop, label=f"{i}. {event}\\nrejected", shape="octagon", color=_RED, fontcolor=_RED)
            g.edge(state, stop, color=_RED, style="dotted")
    return g.source


def render(
    table: Table,
    out_dir: str | Path,
    *,
    formats: Sequence[str] = FORMATS,
    highlight: Sequence[tuple[str, str]] | None = None,
    stem: str | None = None,
) -> list[Path]:
    """Write ``<stem>.<fmt>`` (stem defaults to the table's name) for each format; return the paths."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown diagram format(s) {unknown}; supported: {list(FORMATS)}")
    source = to_dot(table, highlight=highlight)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        path = out / f"{stem or table.name}.{fmt}"
        if fmt == "dot":
            path.write_text(source, encoding="utf-8")
        else:
            path.write_bytes(_run_dot(source, fmt))
        written.append(path)
    return written


def render_all(out_dir: str | Path, *, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Render the five shipped machines into `out_dir`."""
    return [p for name in MACHINES for p in render(load_spec(name), out_dir, formats=formats)]


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


def _steps_by_pair(table: Table, path: Sequence[tuple[str, str]]) -> dict[tuple[str, str], list[int]]:
    """Step numbers (1-based) at which each (state, event) pair of `path` was fired."""
    steps: dict[tuple[str, str], list[int]] = {}
    for i, (state, event) in enumerate(path, start=1):
        if state not in table.states:
            raise ValueError(f"highlight step {i}: {table.name} has no state '{state}'")
        if event not in table.events:
            raise ValueError(f"highlight step {i}: {table.name} has no event '{event}'")
        steps.setdefault((state, event), []).append(i)
    return steps


def _edges(table: Table, steps: dict[tuple[str, str], list[int]]) -> dict[tuple[str, str], list[tuple[bool, str]]]:
    """Rows merged per (source, target) in table order: lines of (highlighted, text)."""
    order = {s: i for i, s in enumerate(table.states)}
    edges: dict[tuple[str, str], list[tuple[bool, str]]] = {}
    for d in table.rows:
        text = f"{d.event} / {d.action}  {d.anchor}"
        numbers = steps.get((d.state, d.event))
        if numbers:
            text = f"[{','.join(map(str, numbers))}] {text}"
        edges.setdefault((d.state, d.target), []).append((bool(numbers), text))
    return {k: edges[k] for k in sorted(edges, key=lambda k: (order[k[0]], order[k[1]]))}


def _ignores_tooltip(table: Table, state: str) -> str:
    ignored = [
        f"{d.event} / {d.action}" if d.action else d.event
        for d in (table.decision(state, e) for e in table.events)
        if d.kind is DecisionKind.IGNORE
    ]
    return f"{state}; ignores: {', '.join(ignored)}" if ignored else state
