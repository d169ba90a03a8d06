"""The enums built from the tables at run time have a typed surface that matches the shipped tables.

FinishReason (§4.10, spec/reasons.toml), BackpressurePolicy (§4.8, spec/stream.toml `policies`) and
ResourceKind (§4.10, spec/resources.toml `kinds`) take their members from the tables loaded; for a
type checker each module declares the class under `if TYPE_CHECKING:` with the shipped members.
These tests hold each declaration equal to its shipped table, member by member and in order.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

import decodespec.runtime
import decodespec.spec

SPEC = Path(decodespec.spec.__file__).resolve().parent
RUNTIME = Path(decodespec.runtime.__file__).resolve().parent


def _shipped(table: str, *keys: str) -> list[str]:
    """The list at `keys` of the shipped spec/<table>.toml (its package copy, not DECODESPEC_SPEC_DIR)."""
    value = tomllib.loads((SPEC / f"{table}.toml").read_text(encoding="utf-8"))
    for key in keys:
        value = value[key]
    return value


# class -> (module file that declares it, its members' values in the shipped table)
ENUMS = {
    "FinishReason": (SPEC / "vocabulary.py", lambda: [e["name"] for e in _shipped("reasons", "reason")]),
    "BackpressurePolicy": (RUNTIME / "backpressure.py", lambda: _shipped("stream", "policies")),
    "ResourceKind": (RUNTIME / "ledger.py", lambda: _shipped("resources", "kinds")),
}


def typed_members(source: str, name: str) -> list[tuple[str, str]]:
    """(member, value) of the class `name` declared under `if TYPE_CHECKING:` in `source`."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for cls in node.body:
                if isinstance(cls, ast.ClassDef) and cls.name == name:
                    return [(a.targets[0].id, a.value.value) for a in cls.body
                            if isinstance(a, ast.Assign) and isinstance(a.targets[0], ast.Name)
                            and isinstance(a.value, ast.Constant)]
    raise AssertionError(f"no class {name} under `if TYPE_CHECKING:`")


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_the_members_a_type_checker_sees_are_the_shipped_tables(name: str) -> None:
    path, shipped = ENUMS[name]
    assert typed_members(path.read_text(encoding="utf-8"), name) == [(v.upper(), v) for v in shipped()]


def test_a_declaration_that_misses_a_member_of_the_table_differs() -> None:
    """The comparison can fail: FinishReason's declaration without its last member is caught."""
    path, shipped = ENUMS["FinishReason"]
    last = shipped()[-1]
    edited = path.read_text(encoding="utf-8").replace(f'        {last.upper()} = "{last}"\n', "")
    assert typed_members(edited, "FinishReason") != [(v.upper(), v) for v in shipped()]
