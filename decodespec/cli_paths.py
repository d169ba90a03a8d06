"""Click callbacks for the paths a command writes: checked before any work, so a run never ends in a
traceback after its results are made (a conformance run, a benchmark, a checkpoint build).

Nothing is created here: the check walks up to the nearest folder that exists and asks whether a
new entry can be made there, so a command refused later leaves no empty folder behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import click


def _refusal(path: Path, folder: bool) -> str | None:
    """Why `path` cannot be written as a folder (or as a file); None when it can."""
    if path.exists():
        if folder and not path.is_dir():
            return f"{path} is a file, not a folder"
        if not folder and path.is_dir():
            return f"{path} is a folder, not a file"
        if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
            return f"{path} is not writable"
        return None
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder, so {path} cannot be made"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be made: {parent} is not writable"
    return None


def output_folder(ctx: click.Context, param: click.Parameter | None, value: Path | str | None) -> Path | str | None:
    """A folder the command writes into (made later, with its parents)."""
    if value is not None and (why := _refusal(Path(value), folder=True)) is not None:
        raise click.BadParameter(why)
    return value


def output_file(ctx: click.Context, param: click.Parameter | None, value: Path | str | None) -> Path | str | None:
    """A file the command writes at its end."""
    if value is not None and (why := _refusal(Path(value), folder=False)) is not None:
        raise click.BadParameter(why)
    return value
