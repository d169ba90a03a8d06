"""Where the decodespec checkout a command runs in keeps its generated files."""

from __future__ import annotations

from pathlib import Path


def default_diagrams_dir(start: Path | None = None) -> Path:
    """diagrams/ at the root of the decodespec checkout containing `start` (cwd), else ./diagrams."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "spec" / "lifecycle.toml").is_file():
            return folder / "diagrams"
    return here / "diagrams"
