"""Edited tables for tests: a Spec with some tables edited (run in process, beside the shipped
one), and copies of spec/ for the edits a process fixes at import (a new finish reason)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

from decodespec.spec import Spec, default_spec, load_text, spec_path
from decodespec.spec.loader import SPEC_DIR


def edited_spec(edits: Mapping[str, Callable[[str], str]]) -> Spec:
    """The spec directory's tables with `edits` (machine name -> function of its TOML text) applied;
    each edited table must differ from the shipped one (an edit that matched nothing is an error)."""
    tables = []
    for name, edit in edits.items():
        text = spec_path(name).read_text(encoding="utf-8")
        changed = edit(text)
        assert changed != text, f"the edit of {name}.toml changed nothing"
        tables.append(load_text(changed, f"{name}.toml (edited)"))
    return default_spec().replace(*tables)


def spec_copy(tmp_path: Path, edits: Mapping[str, Callable[[str], str]]) -> Path:
    """A copy of spec/ with `edits` (file name -> function of its text) applied: for DECODESPEC_SPEC_DIR."""
    copy = tmp_path / "spec"
    shutil.copytree(SPEC_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    for name, edit in edits.items():
        (copy / name).write_text(edit((copy / name).read_text(encoding="utf-8")), encoding="utf-8")
    return copy


def probe(spec_dir: Path, source: str) -> list[str]:
    """Run `source` in a fresh interpreter whose every layer loads the tables of `spec_dir`."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DECODESPEC_SPEC_DIR": str(spec_dir)},
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")
