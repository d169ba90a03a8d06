"""Data flows one way: spec -> machine -> runtime -> properties (docs/concepts.md, "Layout and layering").

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


PACKAGES = ["decodespec", *LAYERS]


def _module_name(path: Path) -> str:
    """`spec.loader`, `properties.conformance`, `cli` (decodespec/ is the root package)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    parts = parts[1:] if parts[0] == "decodespec" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (function bodies and
    TYPE_CHECKING blocks too: a deferred import is still a circle)."""
    paths = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + (node.module.split(".") if node.module else []))
            elif node.module and node.module.startswith("decodespec."):
                base = node.module.removeprefix("decodespec.")
            else:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                deps.add(full if full in paths else base)
        graph[name] = (deps & paths.keys()) - {name}
    return graph


def test_no_two_modules_import_each_other():
    """An import circle (such as cli <-> cli_conform or adapters.openai <-> http_script) makes the
    import order matter; each module's imports lead away."""
    graph = _import_graph()
    assert {"cli", "checkout", "properties.monitors", "properties.conformance.http_script"} <= graph.keys()
    seen: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(name: str, path: list[str]) -> list[str] | None:
        seen[name] = 1
        for dep in sorted(graph[name]):
            if seen.get(dep) == 1:
                return [*path[path.index(dep):], dep] if dep in path else [name, dep]
            if dep not in seen and (circle := walk(dep, [*path, dep])):
                return circle
        seen[name] = 2
        return None

    circles = [c for name in sorted(graph) if name not in seen and (c := walk(name, [name]))]
    assert circles == []
