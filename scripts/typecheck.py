"""Run mypy over the decodespec package as it installs, under pyproject.toml's [tool.mypy].

The layers live in top-level folders (spec/, machine/, ...) that install as subpackages of
decodespec (setup.PACKAGE_DIR) and import each other relatively (`from ..spec import ...`), so mypy
cannot name their modules from the folders themselves. This script lays out the package as it
installs, as links into the checkout under build/typecheck/, runs mypy on it, and prints each
reported path as the checkout's file (runtime/server.py, not build/typecheck/decodespec/runtime/...).
Arguments go to mypy. The exit status is mypy's.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"


def package_dir() -> dict[str, str]:
    """setup.py's map of each package to its folder (the one place that says where a layer lives)."""
    spec = importlib.util.spec_from_file_location("decodespec_setup", ROOT / "setup.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"typecheck: cannot load {ROOT / 'setup.py'}")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    return dict(setup.PACKAGE_DIR)


def link_tree(mapping: dict[str, str]) -> dict[str, str]:
    """Lay out the installed package under TREE as links; returns each linked prefix -> its folder.

    The top package's folder is linked file by file (its subpackages are other folders); every
    other mapped package is one link to its folder. A mapped package must be a direct subpackage
    of the top one, as every layer is.
    """
    shutil.rmtree(TREE, ignore_errors=True)
    top, *subs = sorted(mapping, key=len)
    top_dir = TREE / top
    top_dir.mkdir(parents=True)
    for source in sorted((ROOT / mapping[top]).glob("*.py")):
        (top_dir / source.name).symlink_to(source)
    prefixes = {f"{top_dir.relative_to(ROOT)}/": f"{mapping[top]}/"}
    for package in subs:
        parent, _, name = package.rpartition(".")
        if parent != top:
            raise SystemExit(f"typecheck: {package} is not a direct subpackage of {top} (setup.PACKAGE_DIR)")
        (top_dir / name).symlink_to(ROOT / mapping[package], target_is_directory=True)
        prefixes[f"{(top_dir / name).relative_to(ROOT)}/"] = f"{mapping[package]}/"
    return prefixes


def main(argv: list[str]) -> int:
    os.chdir(ROOT)  # mypy reads pyproject.toml and names files relative to the working directory
    prefixes = link_tree(package_dir())
    top = min(prefixes, key=len)
    stdout, stderr, status = api.run([*argv, top.rstrip("/")])
    # the longest prefix first: build/typecheck/decodespec/spec/ before build/typecheck/decodespec/
    for linked in sorted(prefixes, key=len, reverse=True):
        stdout = stdout.replace(linked, prefixes[linked])
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
