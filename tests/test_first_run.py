"""An honest first run: a run in which most cases could not run is not a pass (`decodespec conform`).

A newcomer's first try is `decodespec conform --engine openai:URL` against a live server, without
this project's forced checkpoints: the script cases cannot run there. The headline leads with how
many cases ran and why the rest did not, and the exit status tells CI the engine was not judged,
unless the run asks for a partial one (--partial-ok).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from decodespec.cli import main
from decodespec.cli_conform import PARTIAL_RUN_EXIT
from decodespec.properties.conformance.cases import load_cases
from decodespec.properties.conformance.reports import headline, summary
from decodespec.properties.conformance.runner import CaseResult, Verdict

REPO = Path(__file__).resolve().parents[1]
SELECT = ["--select", "stop/cross-token/", "--select", "stop/overlap/", "--select", "http/stream/terminal-once/"]


@pytest.fixture(scope="module")
def serve_url() -> Iterator[str]:
    """`decodespec serve` on 127.0.0.1 with its default model (no forced checkpoint)."""
    from _engine_kit import decodespec_serve

    with decodespec_serve(REPO) as url:
        yield url


def test_a_run_without_checkpoints_says_how_many_cases_ran_first_and_does_not_pass(serve_url: str, tmp_path: Path) -> None:
    """Without --checkpoint only the black-box recipes run: the headline leads with '2 of N cases ran',
    names the forced checkpoints as why the rest did not, and the exit status is not 0."""
    out = CliRunner().invoke(main, ["conform", "--engine", f"openai:{serve_url}", *SELECT, "--report", str(tmp_path)])
    total = len(load_cases(["stop/cross-token/", "stop/overlap/", "http/stream/terminal-once/"]))
    said = (tmp_path / "report.md").read_text().splitlines()[4]
    lead = f"**openai-127.0.0.1-{serve_url.rsplit(':', 1)[1]}: 2 of {total} cases ran, too few to judge the engine: "
    assert said.startswith(lead + f"{total - 2} need this project's forced checkpoints (see `decodespec conform --preset`)"), said
    assert "2 pass (100%)" in said  # what ran passed, and still the run is not a pass
    assert out.exit_code == PARTIAL_RUN_EXIT != 0, out.output
    assert "did not judge the engine" in out.output and lead.strip("*") in " ".join(out.output.split())


def test_partial_ok_accepts_a_partial_run_explicitly(serve_url: str) -> None:
    out = CliRunner().invoke(main, ["conform", "--engine", f"openai:{serve_url}", *SELECT, "--partial-ok"])
    assert out.exit_code == 0, out.output
    assert "too few to judge the engine" in " ".join(out.output.split())


def test_cases_an_engine_declines_do_not_make_a_run_partial() -> None:
    """A case n/a because the engine declares its own choice (--declare, --without) is the engine's
    word, not a case the run could not reach."""
    cases = load_cases(["stop/overlap/"])  # three rest on D3, one does not
    results = [CaseResult(c, "e", Verdict.SKIP, reason="the engine declares its own choice on D3 (--declare D3)")
               if "D3" in c.decisions else CaseResult(c, "e", Verdict.PASS) for c in cases]
    assert summary(results)["partial_run"] is False
    said = headline(results, "e")
    assert said.startswith(f"e: 1 of {len(cases)} cases ran; ") and "too few" not in said
    assert said.endswith(f"; {len(cases) - 1} n/a: {len(cases) - 1} rest on a decision the engine declares its own")
    unreached = [CaseResult(c, "e", Verdict.SKIP, reason="a script case runs over HTTP only on a forced checkpoint")
                 if "D3" in c.decisions else r for c, r in zip(cases, results)]
    assert summary(unreached)["partial_run"] is True


def test_why_cases_did_not_run_agrees_with_their_count() -> None:
    """The headline's n/a reasons read as sentences: '1 needs ...', '2 need ...', '1 is ...'; a reason
    no row knows is given as the engine's own words, unchanged."""
    cases = load_cases(["stop/overlap/"])[:4]
    reasons = ["a script case runs over HTTP only on a forced checkpoint",
               "a script case runs over HTTP only on a forced checkpoint",
               "its program is compiled into the byte_table checkpoint",
               "the server runs with a context of 256 positions"]
    results = [CaseResult(c, "e", Verdict.SKIP, reason=why) for c, why in zip(cases, reasons)]
    said = {g["why"]: g["cases"] for g in summary(results)["not_run"]}
    assert said == {"need this project's forced checkpoints (see `decodespec conform --preset`)": 2,
                    "is compiled into a checkpoint this run did not serve": 1,
                    "the server runs with a context of 256 positions": 1}
