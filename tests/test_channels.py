"""The chat answer's split into content, reasoning_content and tool calls is a table
(spec/channels.toml; §4.7, DECISIONS D45-D47): the runtime runs it, a split tag never
leaks, the checker explores it, and a seeded edit of it is caught."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.machine.checker_channels import MODEL, check_channels
from decodespec.runtime.channels import CHANNELS, Splitter, merged, wire_finish
from decodespec.spec import load_spec
from decodespec.spec.loader import SPEC_DIR, load_text

ANSWER = '<think>plan: call f</think>Sure. <tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>'


def _split(pieces, *, reasoning=True, tools=True, closed_by_token=False):
    s = Splitter(reasoning=reasoning, tools=tools)
    parts = [p for piece in pieces for p in s.push(piece)] + s.finish(closed_by_token)
    return merged(parts), s


def test_reasoning_content_and_a_call_are_told_apart():
    got, s = _split([ANSWER])
    assert got["reasoning"] == "plan: call f" and got["content"] == "Sure. "
    assert [(c.name, c.arguments) for c in got["calls"]] == [("f", '{"city": "Zürich"}')]
    assert s.state == "ENDED_CALLS" and wire_finish("stop", s) == "tool_calls"


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(1, len(ANSWER) - 1), unique=True, max_size=12))
def test_a_tag_split_across_pushes_never_leaks(cuts):
    """§4.7: wherever the text is cut into deltas (a tag in two tokens, `<th` + `ink>`), every
    channel gets the same text as from one push, and no delta carries a fragment of a tag."""
    bounds = [0, *sorted(cuts), len(ANSWER)]
    s = Splitter(reasoning=True, tools=True)
    deltas = [s.push(ANSWER[a:b]) for a, b in zip(bounds, bounds[1:])] + [s.finish()]
    whole, _ = _split([ANSWER])
    assert merged([p for d in deltas for p in d]) == whole
    for d in deltas:
        for p in d:
            assert "<" not in p.text, p  # the only "<" of ANSWER are its tags'


def test_a_call_cut_open_is_content_and_never_reported():
    """D47: a call the budget cuts is no call: its text goes out as content at the end, nothing before."""
    s = Splitter(reasoning=True, tools=True)
    assert merged(s.push('Hi <tool_call>{"name": "f", "argu'))["content"] == "Hi "
    end = merged(s.finish())
    assert end == {"content": '<tool_call>{"name": "f", "argu', "reasoning": "", "calls": []}
    assert s.state == "ENDED" and wire_finish("length", s) == "length"


def test_the_tool_call_token_closes_the_open_call():
    """D47: the lifecycle's tool_call token check ends the run on </tool_call>, which is not text."""
    got, s = _split(['<tool_call>{"name": "f", "arguments": {}}'], closed_by_token=True)
    assert [c.name for c in got["calls"]] == ["f"] and wire_finish("tool_calls", s) == "tool_calls"
    got, s = _split(["plain"], closed_by_token=True)  # the token outside a call: a turn with no call
    assert got["content"] == "plain" and wire_finish("tool_calls", s) == "stop"


def test_tags_the_request_did_not_ask_for_are_text():
    """Without tools a call tag is content; without a reasoning parser so is <think>; a closing tag
    no section opened is content (the table rejects it there, so the scanner never looks for it)."""
    assert _split([ANSWER], tools=False, reasoning=False)[0]["content"] == ANSWER
    assert _split(["a</think>b"])[0]["content"] == "a</think>b"
    got, _ = _split(['<tool_call>not json</tool_call> x'])
    assert got == {"content": "<tool_call>not json</tool_call> x", "reasoning": "", "calls": []}


def test_each_executor_implements_exactly_the_channel_effects():
    table = load_spec("channels")
    for executor in (CHANNELS, MODEL):
        assert set(executor.impl) == set(table.effects)
        assert set(executor.plans(table)) == {k for k, d in table.decisions.items() if d.allowed}


def test_the_checker_explores_every_row_and_finds_nothing():
    report = check_channels()
    assert report.ok and report.rows_never_fired == () and report.sequences > 500


def _edit(old: str, new: str):
    text = (SPEC_DIR / "channels.toml").read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    return load_text(text.replace(old, new), "channels.toml (seeded)")


@pytest.mark.parametrize(("old", "new", "invariant"), [
    ('event = "text"\ntarget = "REASONING"\naction = "reasoning"', 'event = "text"\ntarget = "REASONING"\naction = "content"',
     "reasoning_is_bracketed"),
    ('event = "think_close"\ntarget = "CONTENT"', 'event = "think_close"\ntarget = "REASONING"', "reasoning_is_bracketed"),
    ('event = "call_bad"\ntarget = "CONTENT"\naction = "call_as_content"',
     'event = "call_bad"\ntarget = "CALLED"\naction = "report_call"', "calls_only_when_closed"),
    ('state = "CALL"\nevent = "end"\ntarget = "ENDED"', 'state = "CALL"\nevent = "end"\ntarget = "ENDED_CALLS"',
     "calls_end_as_calls"),
    ('event = "think_open"\ntarget = "REASONING"\naction = "open_reasoning"',
     'event = "think_open"\ntarget = "REASONING"\naction = "content"', "think_tags_never_text"),
    ('state = "CALL"\nevent = "end"\ntarget = "ENDED"\naction = "cut_call"',
     'state = "CALL"\nevent = "end"\ntarget = "ENDED"\naction = "end_output"', "pieces_once"),
])
def test_a_seeded_edit_of_the_table_is_caught_by_the_checker(old, new, invariant):
    """Edits the loader accepts (every pair still decided, every state reachable) that break what
    D45-D47 say the answer is: the checker refuses each, naming the invariant, with the shortest path."""
    report = check_channels(_edit(old, new))
    assert invariant in [v.name for v in report.violations], [(v.name, v.message) for v in report.violations]
    assert len(report.violations[0].steps) <= 6


def test_decodespec_check_checks_the_split_and_refuses_a_seeded_table(tmp_path):
    """`decodespec check --table channels.toml` (a researcher's edit) runs the channel checker after
    the loop's model: the edit that keeps reasoning text in the content fails the run, named."""
    from click.testing import CliRunner

    from decodespec.cli import main

    text = (SPEC_DIR / "channels.toml").read_text(encoding="utf-8")
    old = 'event = "text"\ntarget = "REASONING"\naction = "reasoning"'
    path = tmp_path / "channels.toml"
    path.write_text(text.replace(old, 'event = "text"\ntarget = "REASONING"\naction = "content"'), encoding="utf-8")
    result = CliRunner().invoke(main, ["check", "--table", str(path), "--max-depth", "1"])
    assert result.exit_code == 1 and "reasoning_is_bracketed" in result.output, result.output
