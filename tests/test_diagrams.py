"""Diagrams are generated from the tables and kept in step with them (DESIGN, machine/ and diagrams/)."""

from __future__ import annotations

import re

import pytest

from decodespec.machine.diagrams import GraphvizMissing, render, to_dot
from decodespec.spec import MACHINES, load_spec

_EDGE = re.compile(r'^\t(\w+) -> (\w+) \[label="(.*?)"', re.M)
_NODE = re.compile(r"^\t(\w+) \[(.*)\]$", re.M)


@pytest.mark.parametrize("name", MACHINES)
def test_committed_dot_matches_the_table(name: str, repo_root) -> None:
    """diagrams/<name>.dot is exactly what the table renders to; if not, run `make diagrams`."""
    committed = (repo_root / "diagrams" / f"{name}.dot").read_text(encoding="utf-8")
    assert to_dot(load_spec(name)) == committed, f"diagrams/{name}.dot is stale: run `make diagrams`"


@pytest.mark.parametrize("name", MACHINES)
def test_committed_svg_exists(name: str, repo_root) -> None:
    """Each of the five machines has a rendered SVG a person can open (DESIGN, diagrams/)."""
    svg = (repo_root / "diagrams" / f"{name}.svg").read_text(encoding="utf-8")
    assert "<svg" in svg and f">{load_spec(name).initial}</text>" in svg


@pytest.mark.parametrize("name", MACHINES)
def test_edges_are_exactly_the_rows(name: str) -> None:
    """Every row is drawn once with its anchor; ignores and rejections are not edges (§4.1)."""
    table = load_spec(name)
    drawn = {
        (src, event, dst, f"{event} / {action}  {anchor}")
        for src, dst, label in _EDGE.findall(to_dot(table))
        for line in label.split("\\l")
        if line
        for event, action, anchor in [re.fullmatch(r"(\w+) / (\w+)  (§[\d.]+)", line).groups()]
    }
    expected = {(d.state, d.event, d.target, f"{d.event} / {d.action}  {d.anchor}") for d in table.rows}
    assert drawn == expected


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
    """A counterexample path: the §4.6 cross-token fixture, then a rejected write after the hit."""
    table = load_spec("stop_matcher")
    path = [("SCANNING", "hold"), ("HOLDING", "hold"), ("HOLDING", "hit"), ("HIT", "clear")]
    dot = to_dot(table, highlight=path)
    assert 'SCANNING -> HOLDING [label="[1] hold / emit_safe_hold_suffix  §4.6\\l" color="#c0392b"' in dot
    assert 'HOLDING -> HOLDING [label="[2] hold / emit_safe_hold_suffix  §4.6\\l" color="#c0392b"' in dot
    assert 'HOLDING -> HIT [label="[3] hit / emit_before_match  §4.6\\l" color="#c0392b"' in dot
    assert '__rejected_4__ [label="4. clear\\nrejected"' in dot and "HIT -> __rejected_4__" in dot
    assert to_dot(table) != dot and to_dot(table, highlight=path) == dot
    written = render(table, tmp_path, highlight=path, stem="counterexample")
    assert [p.name for p in written] == ["counterexample.dot", "counterexample.svg"]
    assert "4. clear" in written[1].read_text(encoding="utf-8")


def test_highlighted_ignore_is_drawn_as_a_dashed_loop() -> None:
    """An ignored step of a path still shows on the picture (§4.9: a repeated cancel)."""
    dot = to_dot(load_spec("lifecycle"), highlight=[("CREATED", "enqueue"), ("QUEUED", "cancel"), ("CANCEL_REQUESTED", "cancel")])
    assert 'CANCEL_REQUESTED -> CANCEL_REQUESTED [label="3. cancel (ignored)"' in dot


def test_highlight_with_unknown_names_is_refused() -> None:
    """A path must use the table's own states and events (DESIGN, machine/)."""
    with pytest.raises(ValueError, match=r"^highlight step 2: lifecycle has no event 'go'$"):
        to_dot(load_spec("lifecycle"), highlight=[("CREATED", "enqueue"), ("QUEUED", "go")])
    with pytest.raises(ValueError, match=r"^highlight step 1: lifecycle has no state 'IDLE'$"):
        to_dot(load_spec("lifecycle"), highlight=[("IDLE", "enqueue")])


def test_render_refuses_unknown_formats(tmp_path) -> None:
    """Only DOT and SVG are produced (DESIGN, diagrams/)."""
    with pytest.raises(ValueError, match=r"unknown diagram format\(s\) \['png'\]"):
        render(load_spec("resources"), tmp_path, formats=("svg", "png"))


def test_missing_dot_program_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """Without graphviz's `dot` the SVG cannot be made, and the error says how to fix it."""
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(GraphvizMissing, match=r"graphviz's 'dot' program is not on PATH"):
        render(load_spec("resources"), tmp_path)
    assert render(load_spec("resources"), tmp_path, formats=("dot",)) == [tmp_path / "resources.dot"]
