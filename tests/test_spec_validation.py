"""The loader refuses every class of broken table with an exact message (§4.1; docs/concepts.md,
"The tables come first").

Each case edits one small valid table (A -go-> B -end-> Z) and asserts the full error text
"<source>: <where>: <problem>".
"""

from __future__ import annotations

import pytest

from decodespec.spec import MACHINES, SpecError, load_file, load_spec, load_text, spec_path

SOURCE = "toy.toml"
TOY = """\
name = "toy"
anchor = "§4.1"
spec_version = 1
initial = "A"
terminal = ["Z"]
states = ["A", "B", "Z"]
events = ["go", "end"]

[[row]]
state = "A"
event = "go"
target = "B"
action = "move"
anchor = "§4.1"

[[reject]]
state = "A"
events = ["end"]
note = "nothing to end yet"

[[row]]
state = "B"
event = "end"
target = "Z"
action = "finish"
anchor = "§4.1"

[[ignore]]
state = "B"
event = "go"

[[reject]]
state = "Z"
events = ["go", "end"]
note = "terminal states are irreversible"
"""

_ROW_GO = 'state = "A"\nevent = "go"\ntarget = "B"\n'
_REASONS = (
    "['cancelled', 'content_interrupted', 'context_limit', 'deadline_exceeded', 'eos', "
    "'grammar_complete', 'max_output_tokens', 'model_error', 'stop_sequence', 'tool_calls', 'transport_error']"
)


def _edit(*pairs: tuple[str, str]) -> str:
    text = TOY
    for old, new in pairs:
        assert old in text, f"the toy table has no {old!r}"
        text = text.replace(old, new, 1)
    return text


# A state C that the graph can reach (B -go-> C) but that never leaves (C -go-> C).
_STUCK = (
    ('states = ["A", "B", "Z"]', 'states = ["A", "B", "C", "Z"]'),
    ('[[ignore]]\nstate = "B"\nevent = "go"\n', '[[row]]\nstate = "B"\nevent = "go"\ntarget = "C"\naction = "park"\nanchor = "§4.1"\n'
     '\n[[row]]\nstate = "C"\nevent = "go"\ntarget = "C"\naction = "spin"\nanchor = "§4.1"\n'
     '\n[[reject]]\nstate = "C"\nevents = ["end"]\n'),
)

CASES = {
    "unknown target": (
        _edit((_ROW_GO, _ROW_GO.replace('"B"', '"Q"'))),
        "toy.toml: row 1: unknown target 'Q' in (A, go)",
    ),
    "unreachable state": (
        _edit(('states = ["A", "B", "Z"]', 'states = ["A", "B", "C", "Z"]'),
              ('[[reject]]\nstate = "Z"', '[[reject]]\nstate = "C"\nevents = ["go", "end"]\n\n[[reject]]\nstate = "Z"')),
        "toy.toml: 2 problems:\n  state C: unreachable state C: no row leads to it from A"
        "\n  state C: non-terminal state C cannot reach a terminal state",
    ),
    "non-terminal state cannot reach a terminal": (
        _edit(*_STUCK),
        "toy.toml: state C: non-terminal state C cannot reach a terminal state",
    ),
    "undeclared event": (
        _edit((_ROW_GO, _ROW_GO.replace('"go"', '"jump"'))),
        "toy.toml: row 1: undeclared event 'jump' in (A, jump)",
    ),
    "undeclared state": (
        _edit(('[[ignore]]\nstate = "B"', '[[ignore]]\nstate = "Q"')),
        "toy.toml: ignore 1: undeclared state 'Q'",
    ),
    "undeclared initial state": (
        _edit(('initial = "A"', 'initial = "START"')),
        "toy.toml: initial: undeclared state 'START'",
    ),
    "row out of a terminal state": (
        _edit(('events = ["go", "end"]\nnote = "terminal', 'events = ["end"]\nnote = "terminal'),
              ("[[ignore]]", '[[row]]\nstate = "Z"\nevent = "go"\ntarget = "A"\naction = "revive"\nanchor = "§4.1"\n\n[[ignore]]')),
        "toy.toml: row 3: row out of terminal state Z on 'go': terminal states are irreversible",
    ),
    "duplicate pair": (
        _edit(("[[ignore]]", '[[ignore]]\nstate = "A"\nevent = "go"\n\n[[ignore]]')),
        "toy.toml: ignore 1: duplicate pair (A, go), first decided in row 1",
    ),
    "undecided pair": (
        _edit(('[[reject]]\nstate = "A"\nevents = ["end"]\nnote = "nothing to end yet"\n', "")),
        "toy.toml: state A: undecided pair (A, end): add a row, an ignore or a reject",
    ),
    "unknown finish reason": (
        _edit(('action = "finish"\n', 'action = "finish"\nreason = "timeout"\n')),
        f"toy.toml: row 2: unknown finish reason 'timeout' (§4.10 lists {_REASONS})",
    ),
    "missing header key": (
        _edit(('initial = "A"\n', "")),
        "toy.toml: header: missing key 'initial'",
    ),
    "TOML syntax error": (
        _edit(('spec_version = 1', 'spec_version 1')),
        "toy.toml: syntax: Expected '=' after a key in a key/value pair (at line 3, column 14)",
    ),
}


# The toy's actions as effects (machine/actions.py): `finish` fixes the row's reason.
_ACTS = """
[effects]
moved = { phase = "after", anchor = "§4.1" }
ended = { phase = "with", anchor = "§4.10", takes_reason = true }

[actions]
move = ["moved"]
finish = ["ended"]
"""
TOY_ACTS = _edit(('action = "finish"\n', 'action = "finish"\nreason = "eos"\n')) + _ACTS

ACTION_CASES = {
    "action not declared": (
        TOY_ACTS.replace('finish = ["ended"]\n', 'close = ["ended"]\n'),
        "toy.toml: row 2: action 'finish' of (B, end) is not declared in [actions]",
    ),
    "undeclared effect": (
        TOY_ACTS.replace('finish = ["ended"]', 'finish = ["ended", "vanish"]'),
        "toy.toml: actions.finish: undeclared effect 'vanish'",
    ),
    "effect listed twice": (
        TOY_ACTS.replace('finish = ["ended"]', 'finish = ["ended", "ended"]'),
        "toy.toml: actions.finish: effect 'ended' is listed twice",
    ),
    "a reason the action does not fix": (
        TOY_ACTS.replace('finish = ["ended"]', 'finish = []\nclose = ["ended"]'),
        "toy.toml: row 2: (B, end) has reason 'eos' and its action 'finish' does not fix one",
    ),
    "an action that fixes a reason the row lacks": (
        TOY_ACTS.replace('reason = "eos"\n', ""),
        "toy.toml: row 2: action 'finish' fixes a reason and (B, end) gives none",
    ),
    "an effect no action has": (
        TOY_ACTS.replace('[effects]\n', '[effects]\nspare = { phase = "after", anchor = "§4.1" }\n'),
        "toy.toml: effects.spare: no action has this effect",
    ),
    "bad phase": (
        TOY_ACTS.replace('moved = { phase = "after"', 'moved = { phase = "during"'),
        "toy.toml: effects.moved: phase must be one of before, with, after, got 'during'",
    ),
    "actions without effects": (
        TOY_ACTS.replace(_ACTS.split("[actions]")[0], "\n"),
        "toy.toml: actions: [effects] and [actions] are tables and come together",
    ),
}


@pytest.mark.parametrize("case", list(ACTION_CASES))
def test_a_broken_action_declaration_is_refused_with_the_exact_message(case: str) -> None:
    """A row's action is declared, as declared effects; a reason goes with an
    effect that takes it, both ways."""
    text, message = ACTION_CASES[case]
    with pytest.raises(SpecError) as info:
        load_text(text, source=SOURCE)
    assert str(info.value) == message


def test_the_toy_with_actions_is_valid() -> None:
    table = load_text(TOY_ACTS, source=SOURCE)
    assert table.actions == {"move": ("moved",), "finish": ("ended",)} and table.effects["ended"].takes_reason


def test_the_toy_table_itself_is_valid() -> None:
    """The base of every broken case loads: each case breaks exactly one thing (§4.1)."""
    table = load_text(TOY, source=SOURCE)
    assert (table.initial, table.terminal, table.decision("B", "go").kind.value) == ("A", ("Z",), "ignore")


@pytest.mark.parametrize("case", list(CASES))
def test_broken_table_is_refused_with_the_exact_message(case: str) -> None:
    """Every validation class names the source, the entry and the problem (§4.1)."""
    text, message = CASES[case]
    with pytest.raises(SpecError) as info:
        load_text(text, source=SOURCE)
    assert str(info.value) == message
    first = message if "problems:" not in message else f"{SOURCE}: " + message.split("\n  ")[1]
    assert (info.value.source, f"{info.value.source}: {info.value.where}: {info.value.problem}") == (SOURCE, first)


def test_load_file_names_the_file_in_the_error(tmp_path) -> None:
    """A table loaded from disk is reported under its path."""
    path = tmp_path / "broken.toml"
    path.write_text(CASES["missing header key"][0], encoding="utf-8")
    with pytest.raises(SpecError, match=r"^.*broken\.toml: header: missing key 'initial'$") as info:
        load_file(path)
    assert info.value.source == str(path)


def test_unknown_machine_name_is_refused() -> None:
    """Only the six shipped machines have packaged tables."""
    with pytest.raises(SpecError) as info:
        load_spec("scheduler")
    assert str(info.value) == (
        "scheduler: name: no such machine; known: lifecycle, stop_matcher, detokenizer, stream, resources, sequence, channels, overlap"
    )


@pytest.mark.parametrize("name", MACHINES)
def test_shipped_table_validates_and_decides_every_pair(name: str) -> None:
    """Each shipped table loads, carries spec_version, and decides every (state, event) pair (§4.1)."""
    table = load_spec(name)
    assert table.name == name and isinstance(table.spec_version, int) and table.spec_version >= 1
    assert "spec_version" in spec_path(name).read_text(encoding="utf-8")
    assert len(table.decisions) == len(table.states) * len(table.events)
    assert table.anchor.startswith("§4.")


def test_every_problem_of_a_table_is_reported_at_once() -> None:
    """With the CREATED rejections dropped, many pairs are left undecided: the table is refused once,
    naming every one of them; a bad entry does not hide the next one either."""
    lifecycle = spec_path("lifecycle").read_text(encoding="utf-8")
    block = lifecycle[lifecycle.index('[[reject]]\nstate = "CREATED"'):]
    block = block[: block.index("\n\n") + 2]
    with pytest.raises(SpecError) as info:
        load_text(lifecycle.replace(block, ""), source="lifecycle.toml")
    undecided = [p for w, p in info.value.problems if p.startswith("undecided pair (CREATED, ")]
    assert len(undecided) == len(info.value.problems) > 8
    assert str(info.value).startswith(f"lifecycle.toml: {len(undecided)} problems:\n  state CREATED: undecided pair")
    assert 'reason = "eos"' in lifecycle
    two_bad = lifecycle.replace('target = "QUEUED"', 'target = "LIMBO"', 1).replace('reason = "eos"', 'reason = "bored"', 1)
    with pytest.raises(SpecError) as info:
        load_text(two_bad, source="lifecycle.toml")
    text = str(info.value)
    assert "unknown target 'LIMBO'" in text and "unknown finish reason 'bored'" in text

