"""Edits of the lifecycle table for tests: its [[step]] (the order of the §4.3 loop's phases, D53)
and its [[finish_check]] list (D4), an entry moved before another."""

from __future__ import annotations


def _move(text: str, kind: str, key: str, name: str, before: str) -> str:
    """`text` with the [[kind]] entry whose `key` is `name` moved right before the one of `before`."""
    def head(of: str) -> str:
        return f'[[{kind}]]\n{key} = "{of}"\n'

    start = text.index(head(name))
    moved = text[start: text.index("\n\n", start) + 2]
    rest = text.replace(moved, "", 1)
    target = rest.index(head(before))
    return rest[:target] + moved + rest[target:]


def move_phase(text: str, phase: str, before: str) -> str:
    """lifecycle.toml with the [[step]] entry of `phase` moved right before that of `before`."""
    return _move(text, "step", "phase", phase, before)


def move_check(text: str, event: str, before: str) -> str:
    """lifecycle.toml with the [[finish_check]] of `event` moved right before that of `before`."""
    return _move(text, "finish_check", "event", event, before)
