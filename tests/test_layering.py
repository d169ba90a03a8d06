"""Data flows one way: spec -> machine -> runtime -> properties (DESIGN, "Layout").

Each layer may import only the layers before it; a module that reaches forward is named here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = ["spec", "machine", "runtime", "properties"]


def _imported_layers(path: Path) -> set[str]:
    """Layers named by the module's imports, absolute (decodespec.x) or relative (..x / .x)."""
    own = path.parent.name
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level >= 2 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.add(own)
            elif node.module and node.module.startswith("decodespec."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("decodespec."))
    return found & set(LAYERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_only_earlier_layers(layer):
    """No module of `layer` imports a later layer."""
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    offenders = {
        str(p.relative_to(REPO)): sorted(_imported_layers(p) - allowed)
        for p in sorted((REPO / layer).rglob("*.py"))
        if _imported_layers(p) - allowed
    }
    assert offenders == {}
