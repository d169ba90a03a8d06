"""The name of a built set of forced checkpoints (presets.set_stamp): it follows what decides the
checkpoints (the cases, the construction, the chat templates, the fixtures) and nothing else, so an
edit of a comment, a docstring or a type annotation keeps every built set, and an edit of the code
or of a case names a new one (§4.3: the checkpoints force the cases' scripts).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from decodespec.cli import main
from decodespec.properties.conformance import presets as ps

REPO = Path(__file__).resolve().parent.parent
FORCED = REPO / "properties" / "conformance" / "forced.py"
CASE = next(iter(sorted((REPO / "properties" / "cases").rglob("*.json"))))


def _sources(tmp_path: Path) -> tuple[Path, Path]:
    """Copies of forced.py and of one case, as a set's sources."""
    (tmp_path / "cases").mkdir()
    forced = tmp_path / "forced.py"
    shutil.copy(FORCED, forced)
    shutil.copy(CASE, tmp_path / "cases" / CASE.name)
    return forced, tmp_path / "cases"


def _edited(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{path.name} no longer holds {old!r}: update the test's edit"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


# (old, new) edits of forced.py that leave what it computes as it was
SAME = [
    ("HEAD_DIM = 32  # vLLM's", "HEAD_DIM = 32  # another comment; vLLM's"),  # a comment
    ('"""One scripted run: `prompt`', '"""A scripted run, reworded: `prompt`'),  # a class docstring
    ("\nclass ProgramError", "\n\n# a comment of its own\n\nclass ProgramError"),  # layout and a comment line
    ("    prompt: tuple[int, ...] = attrs.field(", "    prompt: Sequence[int] = attrs.field("),  # a field's annotation
    ("def theta() -> np.ndarray:", "def theta() -> Any:"),  # a return annotation
    ("def _sigmoid(x: np.ndarray)", "def _sigmoid(x: Any)"),  # a parameter's annotation
]
# edits that change what it computes (or which fields a Program has)
CHANGED = [
    ("GATE = 16.0", "GATE = 17.0"),
    ("attrs.field(converter=_ids)\n    script", "attrs.field(converter=list)\n    script"),
    ("    marker: int\n    prompt:", "    prompt:"),  # an annotated name is an attrs field: dropping it is code
    ('raise ProgramError(f"program {p.name}: the script is empty")', 'raise ProgramError("empty")'),
]


@pytest.mark.parametrize(("old", "new"), SAME)
def test_a_comment_docstring_or_annotation_edit_keeps_the_stamp(tmp_path, old, new):
    forced, cases = _sources(tmp_path)
    before = ps.set_stamp((cases, forced))
    _edited(forced, old, new)
    assert ps.set_stamp((cases, forced)) == before


@pytest.mark.parametrize(("old", "new"), CHANGED)
def test_an_edit_of_the_code_changes_the_stamp(tmp_path, old, new):
    forced, cases = _sources(tmp_path)
    before = ps.set_stamp((cases, forced))
    _edited(forced, old, new)
    assert ps.set_stamp((cases, forced)) != before


def test_a_case_file_counts_as_it_is_and_by_its_path(tmp_path):
    """A case is hashed byte for byte (JSON is data: any edit is one), under its path in the cases
    folder, so a case moved to another folder (another id) names a new set too."""
    forced, cases = _sources(tmp_path)
    before = ps.set_stamp((cases, forced))
    case = cases / CASE.name
    case.write_bytes(case.read_bytes() + b"\n")
    assert ps.set_stamp((cases, forced)) != before
    case.write_bytes(CASE.read_bytes())
    assert ps.set_stamp((cases, forced)) == before
    (cases / "elsewhere").mkdir()
    case.rename(cases / "elsewhere" / CASE.name)
    assert ps.set_stamp((cases, forced)) != before


def test_the_command_prints_the_stamp_the_preset_runs_use():
    """`decodespec checkpoints stamp` (what scripts/peers/checkpoints.sh names its set by) is
    set_stamp over the shipped sources, whose folder `conform --preset` serves."""
    got = CliRunner().invoke(main, ["checkpoints", "stamp"])
    assert got.exit_code == 0, got.output
    assert got.output.strip() == ps.set_stamp()
    assert "decodespec checkpoints stamp" in (REPO / "scripts" / "peers" / "checkpoints.sh").read_text()
