"""Copies of spec/ for tests that edit a table and run a fresh interpreter on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

from decodespec.spec.loader import SPEC_DIR


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
