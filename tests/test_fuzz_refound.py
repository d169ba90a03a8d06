"""Which committed deviations a fuzz run found again (properties/conformance/fuzz/refound.py): a
deviation is a failing case's lead finding keyed by symptom and basis, as the fuzz run keys its
failures (§4.3-§4.10 findings); the must-show of a fuzz run lists, per engine, the committed text and
ending deviations it re-found and what it found that no committed case shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decodespec.properties.conformance.fuzz.refound import RefoundError, compare, compare_paths, render, same
from decodespec.properties.conformance.symptoms import SYMPTOMS

ROOT = Path(__file__).resolve().parent.parent


def _finding(symptom: str, kind: str, ref: str) -> dict:
    return {"invariant": SYMPTOMS[symptom].invariant, "symptom": symptom,
            "severity": SYMPTOMS[symptom].severity.value, "basis": {"kind": kind, "ref": ref}}


def _case(case_id: str, *findings: tuple[str, str, str], verdict: str = "FAIL") -> dict:
    return {"id": case_id, "verdict": verdict, "failures": [_finding(*f) for f in findings]}


def _report(*cases: dict) -> dict:
    return {"engine": "e", "cases": list(cases)}


TAIL = ("tail_dropped", "chapter", "detok_concat_equals_batch")
LOST_D3 = ("bytes_lost", "decision", "D3")
AFTER_STOP = ("token_after_stop", "chapter", "nothing_after_stop_hit")
COUNT = ("count_low", "decision", "D34")

COMMITTED = _report(_case("detok/utf8-split/001", TAIL), _case("detok/after-stop/001", AFTER_STOP),
                    _case("stop/n-choices/001", COUNT), _case("stop/plain/001", TAIL, verdict="PASS"))


def test_a_committed_deviation_a_fuzz_case_leads_with_is_refound_minimal_case_first():
    """§4.5: the committed tail dropped at the end (lead of a FAIL) is re-found by the fuzz cases
    leading with the same symptom and basis, the minimal case named first."""
    fz = _report(_case("fuzz/g0003/007", TAIL, LOST_D3), _case("fuzz-minimal/tail-dropped/002", TAIL))
    got = {r.committed.key: r.by for r in compare(("fz", fz), [("c", COMMITTED)]).refound}
    assert got[TAIL] == ("fuzz-minimal/tail-dropped/002", "fuzz/g0003/007")


def test_a_deviation_a_fuzz_case_shows_only_after_its_lead_is_not_refound():
    """§4.6: a token selected after the stop, seen only as a later finding of a fuzz case, is not
    re-found: the fuzz run keys a failure by its lead."""
    fz = _report(_case("fuzz-minimal/bytes-lost/001", LOST_D3, AFTER_STOP))
    c = compare(("fz", fz), [("c", COMMITTED)])
    assert {r.committed.key: r.by for r in c.refound}[AFTER_STOP] == ()
    assert "`token_after_stop` (chapter: nothing_after_stop_hit), ending, in `detok/after-stop/001`: " \
           "**not re-found**" in render(c)


def test_only_the_text_and_ending_deviations_are_listed_and_passing_cases_are_none():
    """The must-show counts what changes the text (§4.5, §4.6) and the ending (§4.10); an accounting
    deviation (D34's count) is not listed, and a PASS case shows no deviation."""
    c = compare(("fz", _report()), [("c", COMMITTED)])
    assert [r.committed.key for r in c.refound] == [TAIL, AFTER_STOP]
    assert c.refound[0].committed.cases == ("detok/utf8-split/001",)


def test_a_fuzz_kind_no_committed_case_leads_with_is_new_naming_the_cases_that_show_it_later():
    """What the fuzz run found beyond the committed cases: a kind they never lead with, with the
    committed cases that show it as a later finding (none here for D3's lost bytes)."""
    committed = _report(_case("detok/utf8-split/001", TAIL, COUNT))
    fz = _report(_case("fuzz-minimal/bytes-lost/001", LOST_D3), _case("fuzz-minimal/count-low/002", COUNT),
                 _case("fuzz-minimal/tail-dropped/003", TAIL))
    new = {d.key: d.later for d in compare(("fz", fz), [("c", committed)]).new}
    assert new == {LOST_D3: (), COUNT: ("detok/utf8-split/001",)}


def test_field_ignored_keys_match_when_their_fields_share_one():
    """A finding resting on several ignored fields (echo, logprobs) shows one of them had no
    effect: it matches a committed finding on echo alone, not one on min_tokens."""
    echo = ("fields_ignored", "field_ignored", "echo")
    assert same(echo, ("fields_ignored", "field_ignored", "logprobs, echo"))
    assert not same(echo, ("fields_ignored", "field_ignored", "min_tokens"))
    assert not same(("bytes_lost", "decision", "D3"), ("bytes_lost", "decision", "D31"))


def test_the_command_writes_refound_md_from_recorded_reports_and_refuses_what_is_no_report(tmp_path):
    """`decodespec refound RUN --against REPORT`: on the committed vLLM fuzz run and vLLM report,
    refound.md lists every committed text and ending deviation; a file that is no report.json is
    refused by name."""
    import shutil

    from click.testing import CliRunner

    from decodespec.cli import main

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ROOT / "reports/fuzz/vllm/report.json", run / "report.json")
    done = CliRunner().invoke(main, ["refound", str(run), "--against", str(ROOT / "reports/vllm")])
    assert done.exit_code == 0, done.output
    text = (run / "refound.md").read_text(encoding="utf-8")
    c = compare_paths(run, [ROOT / "reports/vllm"])
    assert c.refound and all(f"`{r.committed.key[0]}` ({r.committed.key[1]}: {r.committed.key[2]})" in text
                             for r in c.refound)
    (tmp_path / "bad.json").write_text(json.dumps({"cases": "none"}), encoding="utf-8")
    bad = CliRunner().invoke(main, ["refound", str(run), "--against", str(tmp_path / "bad.json")])
    assert bad.exit_code == 2 and "no `cases` list" in bad.output
    with pytest.raises(RefoundError, match="no committed report"):
        compare_paths(run, [])


def test_a_deviation_only_recipe_cases_lead_with_is_out_of_the_generators_reach():
    """The generator draws script cases only: a committed deviation whose lead cases all run a
    recipe (a batch under load, max_tokens 0) is listed out of reach and left out of the count of
    those a script case shows; one a script case also leads with stays in reach."""
    batch = _case("http/batch/exact/001", TAIL)
    batch["reproducer"] = {"recipe": "batch_exact"}
    zero = _case("http/finish/length-zero/001", LOST_D3)
    zero["reproducer"] = {"recipe": "max_tokens_zero"}
    c = compare(("run", _report(_case("fuzz-minimal/tail-dropped/001", AFTER_STOP))),
                [("committed", _report(batch, zero, _case("detok/utf8-split/001", TAIL)))])
    drawable = {r.committed.key: r.committed.drawable for r in c.refound}
    assert drawable == {TAIL: True, LOST_D3: False}
    text = render(c)
    assert "0 of 2 re-found, 0 of the 1 a script case shows" in text
    assert "out of the generator's reach (recipe `max_tokens_zero`)" in text
    assert "in `http/batch/exact/001`, `detok/utf8-split/001`: **not re-found**" in text
