"""The command line answers its help and the case list without loading torch or numpy: those come
with a command that runs a model, an engine or the checker, not with `decodespec --help`."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Run in a fresh interpreter (this one has torch already): the CLI's answer, then which of the heavy
# modules it loaded.
_PROBE = """
import contextlib, io, sys
from decodespec.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(sys.argv[1:], standalone_mode=False)
    except SystemExit:
        pass
print(len(out.getvalue().splitlines()), sorted(m for m in ("torch", "numpy", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("args", [["--help"], ["conform", "--list"], ["conform", "--help"], ["check", "--help"],
                                  ["serve", "--help"], ["generate", "--help"],
                                  ["fuzz", "--help"]])
def test_help_and_the_case_list_load_no_torch(args):
    done = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, check=True)
    lines, heavy = done.stdout.split(" ", 1)
    assert int(lines) > 5, done.stdout  # it answered
    assert heavy.strip() == "[]", f"decodespec {' '.join(args)} loaded {heavy.strip()}"
