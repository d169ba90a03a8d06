"""`decodespec spec validate|show` and `decodespec diagrams`."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from decodespec import __version__
from decodespec.checkout import default_diagrams_dir
from decodespec.cli import main
from decodespec.spec import MACHINES, DecisionKind, load_spec

BROKEN = 'name = "x"\nanchor = "§4.1"\nspec_version = 1\nterminal = ["Z"]\nstates = ["Z"]\nevents = []\n'


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_validate_passes_on_the_shipped_tables() -> None:
    """All five tables load; the summary counts rows, ignores and rejections (§4.1 ... §4.10)."""
    result = _run("spec", "validate")
    assert result.exit_code == 0, result.output
    for name in MACHINES:
        assert name in result.stdout
    t = load_spec("lifecycle")
    cells = f"│ lifecycle    │ {t.anchor:<6} │ {t.spec_version:>7} │ {len(t.states):>6} │ {len(t.events):>6} │ {len(t.rows):>4} │"
    assert cells in result.stdout
    assert result.stdout.endswith(f"{len(MACHINES)} table(s) valid\n")


def test_validate_file_reports_the_exact_error_and_fails(tmp_path) -> None:
    """A broken table exits 1 with the loader's message naming file, entry and problem."""
    path = tmp_path / "x.toml"
    path.write_text(BROKEN, encoding="utf-8")
    result = _run("spec", "validate", "--file", str(path))
    assert result.exit_code == 1
    assert result.stderr == f"invalid table: {path}: header: missing key 'initial'\n"


def test_validate_file_accepts_a_valid_table_file(repo_root) -> None:
    """Any table file can be checked before it replaces a shipped one, before anyone writes engine code."""
    result = _run("spec", "validate", "--file", str(repo_root / "spec" / "stream.toml"))
    assert result.exit_code == 0 and result.stdout.endswith("1 table(s) valid\n")


def test_show_prints_every_decided_pair_and_every_rejection() -> None:
    """The Markdown lists rows and ignores with anchors, then rejections grouped per state (§4.6)."""
    table = load_spec("stop_matcher")
    result = _run("spec", "show", "stop_matcher")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == "# stop_matcher (§4.6)"
    assert "| HOLDING | hit | row | HIT | emit_before_match |  | §4.6 |" in result.stdout
    body = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| state")]
    assert len(body) == sum(d.allowed for d in table.decisions.values())
    assert "- **HIT**: `clear`, `hold`, `hit`, `flush`: the first hit is absorbing" in result.stdout
    rejected = {(d.state, d.event) for d in table.decisions.values() if d.kind is DecisionKind.REJECT}
    listed = {
        (ln.split("**")[1], e.strip("`"))
        for ln in lines if ln.startswith("- **")
        for e in ln.split("**: ")[1].split(": ")[0].split(", ")
    }
    assert listed == rejected


def test_show_refuses_an_unknown_machine() -> None:
    """Only shipped machines can be shown by name (usage error, exit 2)."""
    result = _run("spec", "show", "scheduler")
    assert result.exit_code == 2 and "'scheduler' is not one of" in result.stderr


def test_diagrams_writes_dot_svg_and_mermaid_for_the_five_machines(tmp_path, repo_root) -> None:
    """`decodespec diagrams --out DIR` writes what is committed in diagrams/: each
    machine as DOT, SVG and Mermaid, and the lifecycle's views (one per terminal state) as DOT and SVG."""
    result = _run("diagrams", "--out", str(tmp_path))
    assert result.exit_code == 0
    written = {p.name for p in tmp_path.iterdir()}
    assert written == {p.name for p in (repo_root / "diagrams").iterdir()}
    assert {f"{n}.{fmt}" for n in MACHINES for fmt in ("dot", "svg", "mmd")} <= written
    assert {f"lifecycle.{t}.{fmt}" for t in load_spec("lifecycle").terminal for fmt in ("dot", "svg")} <= written
    assert sorted(result.stdout.splitlines()) == sorted(str(tmp_path / n) for n in written)
    for name in sorted(written - {n for n in written if n.endswith(".svg")}):
        assert (tmp_path / name).read_bytes() == (repo_root / "diagrams" / name).read_bytes(), name


def test_default_diagrams_dir_is_the_checkouts_diagrams_folder(tmp_path, repo_root) -> None:
    """From anywhere inside the checkout the default is its diagrams/; elsewhere ./diagrams."""
    assert default_diagrams_dir(repo_root / "spec") == repo_root / "diagrams"
    assert default_diagrams_dir(tmp_path) == tmp_path.resolve() / "diagrams"


def test_python_dash_m_runs_the_cli() -> None:
    """`python -m decodespec` is the same command line."""
    out = subprocess.run(
        [sys.executable, "-m", "decodespec", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout == f"decodespec, version {__version__}\n"
