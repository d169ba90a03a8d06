"""The wheel holds every module and data file of the checkout (what `pip install decodespec` gets)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# source folder -> its package in the wheel (pyproject.toml's package-dir)
ROOTS = {"decodespec": "decodespec", "spec": "decodespec/spec", "machine": "decodespec/machine",
         "runtime": "decodespec/runtime", "properties": "decodespec/properties"}


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_the_conformance_data(tmp_path):
    """A subpackage left out of pyproject.toml's list would make `decodespec conform` fail to import
    from an installed wheel (the editable install hides it)."""
    src = tmp_path / "src"  # the checkout's files alone: a build/ folder left by an earlier build would hide a gap
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("decodespec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"{pkg}/{p.relative_to(REPO / src).as_posix()}" for src, pkg in ROOTS.items()
            for p in (REPO / src).rglob("*.py") if "__pycache__" not in p.parts}
    assert want - names == set()
    assert "decodespec/properties/conformance/report.schema.json" in names
    cases = {p.relative_to(REPO).as_posix() for p in (REPO / "properties/cases").rglob("*.json")}
    assert {f"decodespec/{c}" for c in cases} <= names
