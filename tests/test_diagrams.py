"""Diagrams are generated from the tables and kept in step with them (docs/concepts.md, "The diagrams")."""

from __future__ import annotations

import re

import pytest

from decodespec.machine.diagrams import GraphvizMissing, render, to_dot, to_mermaid, views
from decodespec.spec import MACHINES, load_spec

_EDGE = re.compile(r'^\t(\w+) -> (\w+) \[label=<(.*)>[ \]]', re.M)
_LINE = re.compile(r'(?:<FONT COLOR="[^"]+">)?(.*?)(?:</FONT>)?<BR ALIGN="LEFT"/>')
_NODE = re.compile(r"^\t(\w+) \[(.*)\]$", re.M)


@pytest.mark.parametrize("name", MACHINES)
def test_committed_dot_matches_the_table(name: str, repo_root) -> None:
    """diagrams/<name>.dot is exactly what the table renders to; if not, run `make diagrams`."""
    committed = (repo_root / "diagrams" / f"{name}.dot").read_text(encoding="utf-8")
    assert to_dot(load_spec(name)) == committed, f"diagrams/{name}.dot is stale: run `make diagrams`"


@pytest.mark.parametrize("name", MACHINES)
def test_committed_svg_exists(name: str, repo_root) -> None:
    """Each of the five machines has a rendered SVG a person can open (docs/concepts.md, "The diagrams")."""
    svg = (repo_root / "diagrams" / f"{name}.svg").read_text(encoding="utf-8")
    assert "<svg" in svg and f">{load_spec(name).initial}</text>" in svg


def _drawn_rows(dot: str) -> set[tuple[str, str, str, str, str | None, str]]:
    return {
        (src, event, dst, action, reason, anchor)
        for src, dst, label in _EDGE.findall(dot)
        for line in _LINE.findall(label)
        for event, action, reason, anchor in [re.fullmatch(r"(\w+) / (\w+)(?:\((\w+)\))?  (§[\d.]+)", line).groups()]
    }


@pytest.mark.parametrize("name", MACHINES)
def test_edges_are_exactly_the_rows(name: str) -> None:
    """Every row is drawn once with its anchor and the finish reason it fixes (§4.10); ignores are
    dashed grey loops, and rejections are not drawn (§4.1)."""
    table = load_spec(name)
    expected = {(d.state, d.event, d.target, d.action, d.reason, d.anchor) for d in table.rows}
    assert _drawn_rows(to_dot(table)) == expected


def test_a_large_table_is_also_drawn_in_views_that_cover_every_row_once() -> None:
    """The lifecycle is drawn as well in one view per terminal state (the way to FINISHED, to
    CANCELLED, to FAILED), each legible at page width; together they hold every row exactly once."""
    table = load_spec("lifecycle")
    per_view = [_drawn_rows(to_dot(table, view=v)) for v in views(table)]
    assert list(views(table)) == list(table.terminal)
    assert set().union(*per_view) == _drawn_rows(to_dot(table)) and sum(map(len, per_view)) == len(table.rows)
    assert ("DECODING", "eos", "DRAINING", "fix_reason", "eos", "§4.3") in per_view[0]
    with pytest.raises(ValueError, match="no terminal state 'DECODING'"):
        to_dot(table, view="DECODING")


def test_ignored_pairs_are_drawn_as_dashed_grey_loops() -> None:
    """A late cancel in DRAINING or FINISHED is ignored (§4.9): the picture shows it."""
    dot = to_dot(load_spec("lifecycle"))
    assert 'DRAINING -> DRAINING [label="ignored: cancel" arrowhead=none color="#8a8a8a"' in dot
    assert 'FINISHED -> FINISHED [label="ignored: cancel"' in dot


@pytest.mark.parametrize("name", MACHINES)
def test_committed_mermaid_matches_the_table(name: str, repo_root) -> None:
    """diagrams/<name>.mmd is the Mermaid stateDiagram of the table: every row a transition."""
    table = load_spec(name)
    text = to_mermaid(table)
    assert (repo_root / "diagrams" / f"{name}.mmd").read_text(encoding="utf-8") == text
    assert text.count(" --> ") == len(table.rows) + 1 + len(table.terminal)  # rows, [*] start, ends


@pytest.mark.parametrize("name", MACHINES)
def test_terminal_states_are_drawn_double(name: str) -> None:
    """Terminal states are exclusive and irreversible, and look it (§4.1)."""
    table = load_spec(name)
    nodes = dict(_NODE.findall(to_dot(table)))
    for state in table.states:
        assert ("peripheries=2" in nodes[state]) == table.is_terminal(state), state


def test_initial_state_has_the_start_arrow() -> None:
    """The initial state is marked by an arrow from an unlabelled start point (§4.1: CREATED)."""
    assert "\t__start__ -> CREATED\n" in to_dot(load_spec("lifecycle"))


def test_ignores_are_listed_in_the_node_tooltip() -> None:
    """Ignores change nothing and are not edges, but a reader can still find them (§4.9)."""
    nodes = dict(_NODE.findall(to_dot(load_spec("lifecycle"))))
    assert 'tooltip="CANCEL_REQUESTED; ignores: prefill_done / discard_step_result' in nodes["CANCEL_REQUESTED"]


def test_highlight_path_is_drawn_in_red_with_step_numbers(tmp_path) -> None:
    """A counterexample path: the §4.6 cross-token fixture, then a rejected write after the hit.
    Only the fired row's line of a merged edge turns red, with its step numbers."""
    table = load_spec("stop_matcher")
    path = [("SCANNING", "hold"), ("HOLDING", "hold"), ("HOLDING", "hit"), ("HIT", "clear")]
    dot = to_dot(table, highlight=path)
    red = '<FONT COLOR="#c0392b">'
    assert f'SCANNING -> HOLDING [label=<{red}[1] hold / emit_safe_hold_suffix  §4.6</FONT>' in dot
    assert f'{red}[2] hold / emit_safe_hold_suffix  §4.6</FONT>' in dot
    assert f'HOLDING -> HIT [label=<{red}[3] hit / emit_before_match  §4.6</FONT>' in dot
    assert '__rejected_4__ [label="4. clear\\nrejected"' in dot and "HIT -> __rejected_4__" in dot
    assert to_dot(table) != dot and to_dot(table, highlight=path) == dot
    written = render(table, tmp_path, highlight=path, stem="counterexample", formats=("dot", "svg"))
    assert [p.name for p in written] == ["counterexample.dot", "counterexample.svg"]
    assert "4. clear" in written[1].read_text(encoding="utf-8")


def test_a_merged_edge_reddens_only_the_row_that_fired() -> None:
    """DECODING -> DRAINING holds seven rows; a path through `eos` marks that line alone (D4)."""
    dot = to_dot(load_spec("lifecycle"), highlight=[("DECODING", "eos")], numbers=[12])
    line = next(x for x in dot.splitlines() if x.startswith("\tDECODING -> DRAINING"))
    assert line.count('<FONT COLOR="#c0392b">') == 1 and "[12] eos / fix_reason(eos)" in line
    assert "stop_hit / fix_reason(stop_sequence)  §4.6<BR" in line  # not highlighted


def test_a_violation_state_is_filled_and_step_numbers_can_be_global() -> None:
    dot = to_dot(load_spec("stream"), highlight=[("NEW", "start"), ("OPEN", "delta")], numbers=[3, 7], violation="OPEN")
    assert "[3] start / emit_start" in dot and "[7] delta / emit_delta" in dot
    assert re.search(r'\tOPEN \[.*fillcolor="#f5b7b1"', dot)
    with pytest.raises(ValueError, match="2 step numbers for 1"):
        to_dot(load_spec("stream"), highlight=[("NEW", "start")], numbers=[1, 2])


def test_highlighted_ignore_is_drawn_as_a_dashed_loop() -> None:
    """An ignored step of a path still shows on the picture (§4.9: a repeated cancel)."""
    dot = to_dot(load_spec("lifecycle"), highlight=[("CREATED", "enqueue"), ("QUEUED", "cancel"), ("CANCEL_REQUESTED", "cancel")])
    assert 'CANCEL_REQUESTED -> CANCEL_REQUESTED [label="3. cancel (ignored)"' in dot


def test_highlight_with_unknown_names_is_refused() -> None:
    """A path must use the table's own states and events."""
    with pytest.raises(ValueError, match=r"^highlight step 2: lifecycle has no event 'go'$"):
        to_dot(load_spec("lifecycle"), highlight=[("CREATED", "enqueue"), ("QUEUED", "go")])
    with pytest.raises(ValueError, match=r"^highlight step 1: lifecycle has no state 'IDLE'$"):
        to_dot(load_spec("lifecycle"), highlight=[("IDLE", "enqueue")])


def test_render_refuses_unknown_formats(tmp_path) -> None:
    """Only DOT, SVG and Mermaid are produced (docs/concepts.md, "The diagrams")."""
    with pytest.raises(ValueError, match=r"unknown diagram format\(s\) \['png'\]"):
        render(load_spec("resources"), tmp_path, formats=("svg", "png"))


def test_missing_dot_program_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """Without graphviz's `dot` the SVG cannot be made, and the error says how to fix it."""
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(GraphvizMissing, match=r"graphviz's 'dot' program is not on PATH"):
        render(load_spec("resources"), tmp_path)
    assert render(load_spec("resources"), tmp_path, formats=("dot",)) == [tmp_path / "resources.dot"]
