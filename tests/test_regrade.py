"""Re-grading a stored report without running the engine (properties/conformance/regrade.py, D69).

Severity and basis are table data, so a stored finding's symptom and its case give them back; the
verdict follows. A recorded stream without its terminal is found in the stored exchanges. The
re-graded report says which run produced it.
"""

from __future__ import annotations

import json
from pathlib import Path

from decodespec.properties.conformance.adapters.base import Outcome
from decodespec.properties.conformance.cases import load_cases
from decodespec.properties.conformance.regrade import main as regrade_main
from decodespec.properties.conformance.reports import to_json
from decodespec.properties.conformance.runner import judge
from decodespec.properties.conformance.symptoms import finding

CASES = {c.id: c for c in load_cases()}
_BARE = {"request": {"path": "/v1/completions", "body": {"stream": True}}, "status": 200,
         "sse": 'data: {"choices": [{"text": "O", "index": 0, "finish_reason": null}]}\n\ndata: [DONE]\n'}


def _stored(tmp_path: Path) -> Path:
    """A report as the judge before D69 wrote it: verdicts FAIL on an empty chunk, on D31 alone, and
    a PASS whose recorded stream has no terminal."""
    results = [judge(CASES[cid], Outcome(findings=tuple(finding(s, f"{s} seen") for s in syms), judged=True,
                                         exchanges=ex), "old", frozenset())
               for cid, syms, ex in (("stop/cross-token/001", ("empty_delta",), ()),
                                     ("stop/min-tokens/001", ("stop_sent",), ()),
                                     ("http/lifecycle/disconnect/001", (), ()))]
    data = to_json(results, "old-engine")
    data["version"], data["generated"] = 3, "2026-01-02T03:04:05+00:00"
    del data["grading"]
    for c in data["cases"]:
        c["verdict"] = "FAIL" if c["failures"] else "PASS"
        for f in c["failures"]:
            del f["severity"], f["basis"]
    data["cases"][2]["evidence"] = {"exchanges": [_BARE]}
    folder = tmp_path / "old-engine"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(data), encoding="utf-8")
    return folder


def test_a_stored_report_is_regraded_from_its_findings_and_says_which_run_it_is(tmp_path: Path) -> None:
    folder = _stored(tmp_path)
    assert regrade_main([str(folder)]) == 0
    data = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    got = {c["id"]: (c["verdict"], c["lead_severity"], (c["failures"] or [{}])[0].get("basis", {}).get("kind"))
           for c in data["cases"]}
    assert got == {"stop/cross-token/001": ("PASS", "stream_shape", "chapter"),
                   "stop/min-tokens/001": ("DIFFERS", "text", "decision"),
                   "http/lifecycle/disconnect/001": ("FAIL", "ending", "chapter")}
    assert data["generated"] == "2026-01-02T03:04:05+00:00"
    said = data["grading"]["provenance"]
    assert said.startswith("Run of 2026-01-02T03:04:05+00:00 (report version 3); re-graded on ")
    assert "the engine was not run again" in said and said in (folder / "report.md").read_text(encoding="utf-8")
    assert regrade_main([str(folder)]) == 0  # again: the provenance names the run, once
    again = json.loads((folder / "report.json").read_text(encoding="utf-8"))["grading"]["provenance"]
    assert again.count("Run of") == 1 and again.count("re-graded") == 1


def test_a_report_naming_a_case_the_suite_lacks_is_refused(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    folder = _stored(tmp_path)
    data = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    data["cases"][0]["id"] = "stop/no-such/001"
    (folder / "report.json").write_text(json.dumps(data), encoding="utf-8")
    assert regrade_main([str(folder)]) == 2
    assert "stop/no-such/001" in capsys.readouterr().err
