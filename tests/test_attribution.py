"""A run behind a gateway read against its worker judged directly (properties/conformance/attribution.py).

Each finding is the worker's when the direct run of its case shows it too, the gateway's own when the
direct run ran the case without it, unjudged when no direct run ran the case. The recorded reports
are the evidence: reports/vllm-router ran the suite through two vLLM workers that reports/vllm,
vllm-chat and vllm-align judged directly.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from decodespec.properties.conformance.attribution import Attributed, attribute, attribution_json, owned
from decodespec.properties.conformance.matrix import to_markdown as matrix_markdown
from decodespec.properties.conformance.regrade import main as regrade_main

REPORTS = Path(__file__).resolve().parent.parent / "reports"
VLLM = ("vllm", "vllm-chat", "vllm-align")  # vLLM judged directly: the router's worker
AFTER_STOP = "detok/after-stop/001"  # vLLM selects a token past the stop, directly and through the router (§4.6)


def _report(name: str) -> dict[str, Any]:
    return json.loads((REPORTS / name / "report.json").read_text(encoding="utf-8"))


def _case(report: dict[str, Any], cid: str) -> dict[str, Any]:
    return next(c for c in report["cases"] if c["id"] == cid)


def _finding(symptom: str, invariant: str = "inv", severity: str = "text") -> dict[str, Any]:
    return {"invariant": invariant, "symptom": symptom, "severity": severity}


def test_a_finding_the_worker_shows_directly_is_the_workers() -> None:
    """The recorded vllm-router run: every finding is one vLLM shows directly on the same case (the
    token selected past a stop among them), so the router has none of its own."""
    found, _ = attribute(_report("vllm-router"), [_report(w) for w in VLLM])
    assert found and {f.owner for f in found} == {"worker"}
    assert (AFTER_STOP, "token_after_stop", "worker") in {(f.case, f.symptom, f.owner) for f in found}


def test_a_finding_only_behind_the_gateway_is_the_gateways() -> None:
    """A case the worker passes directly without findings fails behind the gateway: the gateway's own;
    the worker's finding in another case stays the worker's."""
    router = copy.deepcopy(_report("vllm-router"))
    cut = _case(router, "http/usage/001")
    cut["verdict"], cut["failures"] = "FAIL", [_finding("done_missing", "openai_sse_done", "wire")]
    found, _ = attribute(router, [_report(w) for w in VLLM])
    owners = {(f.case, f.symptom): f.owner for f in found}
    assert owners[("http/usage/001", "done_missing")] == "gateway"
    assert owners[(AFTER_STOP, "token_after_stop")] == "worker"
    assert [f.case for f in found if f.owner == "gateway"] == ["http/usage/001"]


def _pair(gateway_cases: list[dict[str, Any]], *workers: list[dict[str, Any]]) -> tuple[list[Attributed],
                                                                                       list[Attributed]]:
    return attribute({"cases": gateway_cases}, [{"cases": w} for w in workers])


def test_a_case_no_direct_run_judged_is_unjudged() -> None:
    """Absent from the direct runs, or n/a there: nothing tells the layers apart."""
    seen = [{"id": "a", "verdict": "FAIL", "failures": [_finding("x")]},
            {"id": "b", "verdict": "FAIL", "failures": [_finding("y")]}]
    found, _ = _pair(seen, [{"id": "b", "verdict": "SKIP", "failures": []}])
    assert [f.owner for f in found] == ["unjudged", "unjudged"]


def test_an_error_only_behind_the_gateway_is_the_gateways_and_one_the_worker_shares_is_the_workers() -> None:
    seen = [{"id": "a", "verdict": "ERROR", "failures": []}, {"id": "b", "verdict": "ERROR", "failures": []}]
    found, _ = _pair(seen, [{"id": "a", "verdict": "PASS", "failures": []},
                            {"id": "b", "verdict": "ERROR", "failures": []}])
    assert [(f.case, f.symptom, f.owner) for f in found] == [("a", "error", "gateway"), ("b", "error", "worker")]


def test_the_first_direct_run_that_judged_the_case_decides() -> None:
    """The chapter's run has the case n/a, the chat run judged it: the chat run decides."""
    seen = [{"id": "chat/a", "verdict": "FAIL", "failures": [_finding("x"), _finding("y")]}]
    found, _ = _pair(seen, [{"id": "chat/a", "verdict": "SKIP", "failures": []}],
                     [{"id": "chat/a", "verdict": "FAIL", "failures": [_finding("x")]}],
                     [{"id": "chat/a", "verdict": "FAIL", "failures": [_finding("y")]}])
    assert [(f.symptom, f.owner) for f in found] == [("x", "worker"), ("y", "gateway")]


def test_a_workers_finding_the_gateway_run_lacks_is_listed_hidden() -> None:
    """Same invariant, other symptom: a different finding, so the gateway's own, and the worker's is hidden."""
    seen = [{"id": "a", "verdict": "FAIL", "failures": [_finding("x", "i1")]}]
    found, hidden = _pair(seen, [{"id": "a", "verdict": "FAIL", "failures": [_finding("x", "i2"), _finding("z")]}])
    assert [(f.invariant, f.owner) for f in found] == [("i1", "gateway")]
    assert [(f.invariant, f.symptom, f.owner) for f in hidden] == [("i2", "x", "worker"), ("inv", "z", "worker")]


def test_an_unknown_owner_is_refused() -> None:
    with pytest.raises(ValueError, match="owner 'proxy' is not one of gateway, worker, unjudged"):
        owned({"findings": []}, "proxy")


def _broken_router(tmp_path: Path) -> Path:
    """reports/vllm and reports/vllm-router copied, the router's keep-alive case given a finding vLLM lacks."""
    for name in ("vllm", "vllm-router"):
        shutil.copytree(REPORTS / name, tmp_path / name)
    path = tmp_path / "vllm-router" / "report.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    cut = _case(data, "http/stream/keep-alive/001")
    cut["verdict"] = "FAIL"
    cut["failures"] = [{"invariant": "single_terminal_event", "symptom": "no_reason", "family": "semantics",
                        "message": "the stream ended without its finish chunk"}]
    path.write_text(json.dumps(data), encoding="utf-8")
    return tmp_path / "vllm-router"


def test_a_regraded_gateway_report_leads_with_the_gateways_own_findings_and_keeps_its_workers(tmp_path: Path) -> None:
    """regrade --worker: report.json says the split, report.md's first screen names the gateway's own
    finding before the severity table; a second regrade without --worker reads the same workers again."""
    folder = _broken_router(tmp_path)
    assert regrade_main([str(folder), "--worker", "vllm"]) == 0
    data = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    assert data["attribution"]["workers"] == ["vllm"]
    assert data["attribution"]["counts"]["gateway"] == {"findings": 1, "cases": 1}
    md = (folder / "report.md").read_text(encoding="utf-8")
    own = md.index("## The gateway's own findings (1)")
    assert own < md.index("| severity | findings |")
    assert "| `http/stream/keep-alive/001` | FAIL | ending | no_reason | single_terminal_event |" in md
    assert "The gateway's own findings (1)" in (folder / "report.html").read_text(encoding="utf-8")
    assert regrade_main([str(folder)]) == 0
    assert json.loads((folder / "report.json").read_text(encoding="utf-8"))["attribution"] == data["attribution"]


def test_a_regrade_against_a_missing_worker_report_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _broken_router(tmp_path)
    assert regrade_main([str(folder), "--worker", "vllm-nowhere"]) == 2
    assert "vllm-nowhere/report.json: not a readable report.json" in capsys.readouterr().err


def test_the_matrix_counts_a_gateways_own_findings_apart_and_marks_their_cells() -> None:
    direct, router = _report("vllm"), copy.deepcopy(_report("vllm-router"))
    cut = _case(router, "http/usage/001")
    cut.update(verdict="FAIL", failures=[_finding("done_missing", "openai_sse_done", "wire")],
               lead_symptom="no data: [DONE]", lead_severity="wire")
    router["attribution"] = attribution_json(router, {"vllm": direct})
    md = matrix_markdown({"vllm": direct, "vllm-router": router})
    assert "behind a gateway: 1 the gateway's own (1 cases), " in md
    row = next(line for line in md.splitlines() if "`http/usage/001`" in line)
    assert row.endswith("| PASS | **FAIL** [wire] no data: [DONE] · gateway's own: done_missing |")


def test_a_case_judged_directly_and_na_behind_the_gateway_is_listed_lost() -> None:
    """A gateway that drops a field the case reads makes it n/a: no finding, but not judged either."""
    seen = [{"id": "a", "verdict": "SKIP", "reason": "the engine reports no logprobs", "failures": []},
            {"id": "b", "verdict": "SKIP", "reason": "needs the tight server", "failures": []}]
    data = attribution_json({"cases": seen}, {"w": {"cases": [{"id": "a", "verdict": "PASS", "failures": []},
                                                               {"id": "b", "verdict": "SKIP", "failures": []}]}})
    assert data["lost"] == [{"case": "a", "reason": "the engine reports no logprobs"}]


def test_every_gateway_preset_names_worker_reports_that_are_committed() -> None:
    """A gateway preset's findings are read against its worker's direct reports: each must exist, or
    `conform --preset` refuses before it starts anything."""
    from decodespec.properties.conformance.presets import load_presets

    presets = load_presets([REPORTS.parent / "scripts" / "peers" / "presets.toml"])
    gateways = {name: p.worker for name, p in presets.items() if p.worker}
    assert sorted(gateways) == ["litellm-llama-server", "litellm-vllm", "smg", "vllm-router"]
    for name, workers in gateways.items():
        assert all((REPORTS / w / "report.json").is_file() for w in workers), (name, workers)


def test_conform_with_a_worker_writes_the_split_and_says_it_last(tmp_path: Path) -> None:
    """`conform --worker NAME`: the report is read against reports/NAME beside it, the console says the
    split after the headline; a worker report that is missing is refused before anything runs."""
    from click.testing import CliRunner

    from decodespec.cli import main

    args = ["conform", "--engine", "reference", "--select", "stop/cross-token/001", "--report"]
    runner = CliRunner()
    assert runner.invoke(main, [*args, str(tmp_path / "direct")]).exit_code == 0
    out = runner.invoke(main, [*args, str(tmp_path / "gateway"), "--worker", "direct"])
    assert out.exit_code == 0, out.output
    assert out.output.rstrip().endswith("behind a gateway: 0 the gateway's own (0 cases), 0 the worker's (0 cases), "
                                        "0 unjudged (no direct run of their case); against direct")
    assert json.loads((tmp_path / "gateway" / "report.json").read_text())["attribution"]["workers"] == ["direct"]
    refused = runner.invoke(main, [*args, str(tmp_path / "gateway"), "--worker", "absent"])
    assert refused.exit_code == 2 and "absent/report.json: not a readable report.json" in refused.output
