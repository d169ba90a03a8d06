"""Reviewing a report's refresh: what moved between two runs of one report (properties/conformance/report_diff.py)."""

from __future__ import annotations

import json

from decodespec.properties.conformance.report_diff import Moved, main, moved


def _case(cid, verdict, lead=None, partial=False):
    return {"id": cid, "verdict": verdict, "lead_symptom": lead, "partial": partial}


OLD = {"headline": "old", "cases": [_case("a", "FAIL", "bytes never sent"), _case("b", "PASS"), _case("c", "PASS", None, True),
                                    _case("d", "PASS"), _case("gone", "FAIL", "empty delta")]}
NEW = {"headline": "new", "cases": [_case("a", "FAIL", "held stop prefix never sent"), _case("b", "FAIL", "empty delta"),
                                    _case("c", "PASS"), _case("d", "PASS"), _case("added", "SKIP")]}


def test_a_case_moves_when_its_verdict_lead_or_partial_flag_differs_or_it_runs_once():
    """A refresh is reviewed case by case (this session's judge changes moved leads, not verdicts):
    every difference in verdict, lead symptom or partial flag is listed, and a case in one run only."""
    moves, same = moved(OLD, NEW)
    assert moves == [Moved("a", ("FAIL", "bytes never sent", False), ("FAIL", "held stop prefix never sent", False)),
                     Moved("added", None, ("SKIP", None, False)),
                     Moved("b", ("PASS", None, False), ("FAIL", "empty delta", False)),
                     Moved("c", ("PASS", None, True), ("PASS", None, False)),
                     Moved("gone", ("FAIL", "empty delta", False), None)]
    assert same == 1


def test_the_command_prints_each_move_and_names_a_file_that_is_no_report(tmp_path, capsys):
    old, new, junk = tmp_path / "old.json", tmp_path / "new.json", tmp_path / "junk.json"
    old.write_text(json.dumps(OLD))
    new.write_text(json.dumps(NEW))
    junk.write_text(json.dumps({"cases": [{"id": "a"}]}))
    assert main([str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "  b: PASS -> FAIL [empty delta]" in out and "  gone: FAIL [empty delta] -> (not run)" in out
    assert out.rstrip().endswith("5 case(s) moved, 1 unmoved")
    assert main([str(old), str(junk)]) == 2
    assert f"{junk}: not a report.json" in capsys.readouterr().err
    assert main([str(old), str(tmp_path / "missing.json")]) == 2
    assert "missing.json: not a readable report.json" in capsys.readouterr().err
