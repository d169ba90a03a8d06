"""A run behind a gateway read against its worker judged directly (properties/conformance/attribution.py).

Each finding is the worker's when the direct run of its case shows it too, the gateway's own when the
direct run ran the case without it, unjudged when no direct run ran the case. The recorded reports
are the evidence: reports/vllm-router ran the suite through two vLLM workers that reports/vllm,
vllm-chat and vllm-align judged directly; reports/litellm-vllm through LiteLLM's proxy, whose zero
usage is one cause of its own in some fifty cases. A gateway report's first screen groups each
layer's findings by cause, as an engine's report groups its own (D71), the gateway's first.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from decodespec.properties.conformance.attribution import (
    ERROR,
    OWNERS,
    Attributed,
    attribute,
    attribution_json,
    grouped,
    hidden_groups,
    owned,
)
from decodespec.properties.conformance.matrix import load_reports
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
    """regrade --worker: report.json says the split; report.md's and report.html's first screens name
    the gateway's own cause before the worker's and before the severity table, and leave out the
    run's causes table (the two layers' tables hold it); a second regrade without --worker reads the
    same workers again."""
    folder = _broken_router(tmp_path)
    assert regrade_main([str(folder), "--worker", "vllm"]) == 0
    data = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    assert data["attribution"]["workers"] == ["vllm"]
    assert data["attribution"]["counts"]["gateway"] == {"findings": 1, "cases": 1}
    md = (folder / "report.md").read_text(encoding="utf-8")
    own = md.index("## The gateway's own findings: 1 cause in 1 case")
    assert own < md.index("## The worker's findings: ") < md.index("| severity | findings |")
    assert "| ending | no finish_reason | §4.7 | single_terminal_event | 1 | `http/stream/keep-alive/001` |" in md
    assert "## Causes (" not in md
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert page.index("The gateway&#x27;s own findings: 1 cause in 1 case") < page.index("class='severities'")
    assert regrade_main([str(folder)]) == 0
    assert json.loads((folder / "report.json").read_text(encoding="utf-8"))["attribution"] == data["attribution"]


def _keys(found: list[dict[str, Any]], owner: str) -> dict[tuple[str, str, str], set[str]]:
    """An owner's attributed findings as {(severity, invariant, symptom): cases}."""
    out: dict[tuple[str, str, str], set[str]] = {}
    for f in found:
        if f["owner"] == owner:
            out.setdefault((f["severity"], f["invariant"], f["symptom"]), set()).add(f["case"])
    return out


@pytest.mark.parametrize("name", ["litellm-vllm", "vllm-router", "smg"])
def test_each_layer_states_each_of_its_causes_once_with_every_case_it_covers(name: str) -> None:
    """On the recorded gateway reports: per owner, one group per severity, invariant and symptom, its
    cases exactly those the attribution gives that owner for it (none lost, none moved to the other
    layer), most severe first with the errors ahead, and the case to open first one of its own that
    the report details where there is one."""
    data = _report(name)
    by = grouped(data["attribution"], data["causes"])
    rank = ["", "text", "ending", "accounting", "stream_shape", "wire"]
    verdict = {c["id"]: c["verdict"] for c in data["cases"]}
    for owner in OWNERS:
        groups = by[owner]
        assert {(g.severity, g.invariant, g.symptom): set(g.cases) for g in groups} == \
            _keys(data["attribution"]["findings"], owner)
        assert len({(g.severity, g.invariant, g.symptom) for g in groups}) == len(groups)
        assert [rank.index(g.severity) for g in groups] == sorted(rank.index(g.severity) for g in groups)
        for g in groups:
            assert sorted(c for p in g.parts for c in p.cases) == sorted(g.cases)
            detailed = [c for c in g.cases if verdict[c] in ("FAIL", "ERROR", "DIFFERS")]
            assert g.first in (detailed or g.cases)


def test_litellms_zero_usage_is_one_cause_of_its_own_not_a_row_per_case() -> None:
    """LiteLLM in front of vLLM reports too low a token count where vLLM judged directly does not: one
    group of the gateway's, over every case that shows it whatever decision the case rests on, and
    none of the worker's."""
    data = _report("litellm-vllm")
    by = grouped(data["attribution"], data["causes"])
    low = [g for g in by["gateway"] if g.symptom == "count_low"]
    cases = {f["case"] for f in owned(data["attribution"], "gateway") if f["symptom"] == "count_low"}
    assert len(low) == 1 and set(low[0].cases) == cases and len(cases) > 40
    assert len(low[0].parts) > 1 and low[0].label == "token count too low"
    assert not [g for g in by["worker"] if g.symptom == "count_low"]


def test_grouping_refuses_an_attribution_its_causes_do_not_hold() -> None:
    """A finding one side lists and the other lacks is named, not dropped from the first screen."""
    found = {"findings": [{"case": "a", "invariant": "i", "symptom": "x", "severity": "text", "verdict": "FAIL",
                           "owner": "gateway"}], "hidden": [], "lost": []}
    with pytest.raises(ValueError, match="no cause of the run holds the attributed finding 'x' of case 'a'"):
        grouped(found, [])
    cause = {"severity": "text", "invariant": "i", "symptom": "y", "basis": {"kind": "chapter", "ref": "i"},
             "cases": ["a"], "lead_in": []}
    with pytest.raises(ValueError, match="the cause 'y' \\(i\\) names case 'a'"):
        grouped(found, [cause])


def test_an_error_is_its_own_group_ahead_of_the_findings() -> None:
    found = {"findings": [{"case": "a", "invariant": "", "symptom": ERROR, "severity": "", "verdict": "ERROR",
                           "owner": "gateway"}], "hidden": [], "lost": []}
    (g,) = grouped(found, [])["gateway"]
    assert (g.symptom, g.cases, g.first) == (ERROR, ("a",), "a")


def _one_group(verdicts: dict[str, str], lead_in: list[str]) -> str:
    """The case a one-cause gateway group opens first, its cases with these verdicts, leading in `lead_in`."""
    found = {"findings": [{"case": c, "invariant": "i", "symptom": "x", "severity": "ending", "verdict": v,
                           "owner": "gateway"} for c, v in verdicts.items()], "hidden": [], "lost": []}
    cause = {"severity": "ending", "invariant": "i", "symptom": "x", "basis": {"kind": "chapter", "ref": "i"},
             "cases": list(verdicts), "lead_in": lead_in}
    return grouped(found, [cause])["gateway"][0].first


def test_a_group_opens_first_a_case_it_leads_that_the_report_details() -> None:
    """A pass with a stream-shape note has no reproducer: the group opens a failing case, one where
    the cause is the first finding when there is one."""
    assert _one_group({"a": "PASS", "b": "FAIL", "c": "DIFFERS"}, ["a", "c"]) == "c"
    assert _one_group({"a": "PASS", "b": "FAIL", "c": "DIFFERS"}, ["a"]) == "b"
    assert _one_group({"a": "PASS", "b": "PASS"}, ["b"]) == "a"


def test_the_hidden_findings_are_grouped_by_symptom() -> None:
    data = _report("litellm-vllm")
    groups = hidden_groups(data["attribution"])
    assert sum(len(g.cases) for g in groups) == len(data["attribution"]["hidden"])
    assert len(groups) == len({(f["invariant"], f["symptom"]) for f in data["attribution"]["hidden"]})


def test_a_regrade_against_a_missing_worker_report_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _broken_router(tmp_path)
    assert regrade_main([str(folder), "--worker", "vllm-nowhere"]) == 2
    assert "vllm-nowhere/report.json: not a readable report.json" in capsys.readouterr().err


def test_the_matrix_gives_a_gateway_two_columns_its_own_findings_and_the_workers(tmp_path: Path) -> None:
    """The gateway's column pair: `own` names what only the gateway adds, `the worker's` what vLLM
    shows directly too; its head counts each layer's causes; a clean pass is one PASS in both."""
    folder = _broken_router(tmp_path)
    assert regrade_main([str(folder), "--worker", "vllm"]) == 0
    md = matrix_markdown(load_reports(tmp_path))
    head = next(line for line in md.splitlines() if line.startswith("| § |"))
    assert head.endswith("| vllm | vllm-router: own | vllm-router: the worker's |")
    assert "against vllm: own 1 cause in 1 case; the worker's " in md
    rows = {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| §")}
    assert rows["`http/stream/keep-alive/001`"].endswith("| PASS | [ending] no finish_reason | — |")
    assert rows[f"`{AFTER_STOP}`"].endswith("| — | [ending] token selected after the stop +2 |")
    assert rows["`http/usage/001`"].endswith("| PASS | PASS | PASS |")


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
    assert sorted(gateways) == ["litellm-llama-server", "litellm-vllm", "litellm-vllm-pair", "smg", "vllm-router"]
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
