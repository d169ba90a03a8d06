"""Edits of the lifecycle table's [[step]] (the order of the §4.3 loop's phases, D53) for tests."""

from __future__ import annotations


def move_phase(text: str, phase: str, before: str) -> str:
    """lifecycle.toml with the [[step]] entry of `phase` moved right before that of `before`."""
    def block(name: str) -> str:
        start = text.index(f'[[step]]\nphase = "{name}"\n')
        return text[start: text.index("\n\n", start) + 2]

    moved = block(phase)
    rest = text.replace(moved, "", 1)
    target = rest.index(f'[[step]]\nphase = "{before}"\n')
    return rest[:target] + moved + rest[target:]
