"""Every finding has a severity and a basis, both read from tables (symptoms.SYMPTOMS, decisions.DECISIONS).

Severity: text > ending > accounting > stream shape > wire; a case leads with its most severe
finding. Basis: a rule of chapter 4, a project decision where engines differ (spec/DECISIONS.md),
request fields that had no effect, or a wire convention.
"""

from __future__ import annotations

import pytest

from decodespec.properties.conformance.adapters.base import Finding
from decodespec.properties.conformance.cases import CaseError, load_cases, parse_case
from decodespec.properties.conformance.decisions import DECISIONS, decision_line
from decodespec.properties.conformance.symptoms import (
    SEVERITIES,
    SYMPTOMS,
    Basis,
    Severity,
    _check_rows,
    basis_of,
    by_severity,
    finding,
    severity_of,
)
from decodespec.spec.invariants import load_invariants

CASES = {c.id: c for c in load_cases()}


def test_severities_run_from_text_to_wire() -> None:
    assert [s.value for s in SEVERITIES] == ["text", "ending", "accounting", "stream_shape", "wire"]


@pytest.mark.parametrize("name", sorted(SYMPTOMS))
def test_every_symptom_has_a_severity_and_a_basis_a_reader_can_look_up(name: str) -> None:
    row = SYMPTOMS[name]
    assert isinstance(row.severity, Severity)
    assert row.family == ("wire" if row.severity is Severity.WIRE else "semantics")
    assert not row.decision or row.decision in DECISIONS


def test_a_row_naming_an_unknown_decision_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from decodespec.properties.conformance import symptoms

    bad = dict(SYMPTOMS, stop_sent=symptoms.Symptom("stop_bytes_never_emitted", Severity.TEXT, "x", decision="D999"))
    monkeypatch.setattr(symptoms, "SYMPTOMS", bad)
    with pytest.raises(ValueError, match="D999"):
        _check_rows()


def test_every_invariant_of_the_chapter_has_a_severity_even_without_a_symptom() -> None:
    """A trace monitor's finding carries no symptom: its invariant gives its severity."""
    for name in load_invariants():
        assert isinstance(severity_of(Finding(name, "seen")), Severity), name
    assert severity_of(Finding("seq_contiguous", "gap")) is Severity.STREAM_SHAPE
    with pytest.raises(KeyError, match="UNNAMED_SEVERITY"):
        severity_of(Finding("no_such_invariant", "seen"))


def test_a_case_leads_with_its_most_severe_finding_ties_keep_the_judges_order() -> None:
    found = [finding("empty_delta", "e"), finding("done_missing", "d"), finding("count_low", "c"),
             finding("bytes_lost", "b"), finding("precedence", "p"), finding("stop_sent", "s")]
    assert [f.symptom for f in by_severity(found)] == [
        "bytes_lost", "stop_sent", "precedence", "count_low", "empty_delta", "done_missing"]


def test_an_ignored_guard_rests_on_the_field_the_request_set_not_on_the_invariant() -> None:
    """§4.3, D31: an engine that takes min_tokens and lets EOS end the run ignored min_tokens."""
    f = finding("guard_ignored", "EOS ended it")
    assert basis_of(f, CASES["finish/min-tokens/001"]) == Basis("field_ignored", "min_tokens")
    assert basis_of(f, CASES["finish/ignore-eos/001"]) == Basis("field_ignored", "ignore_eos")


def test_a_finding_the_cases_decision_covers_rests_on_that_decision() -> None:
    """D31: vLLM searches stops only after min_tokens, so the stop it sends rests on D31; the same
    symptom in a case without that decision is the chapter's (§4.6)."""
    sent = finding("stop_sent", "stop sent")
    assert basis_of(sent, CASES["stop/min-tokens/001"]) == Basis("decision", "D31")
    assert basis_of(sent, CASES["stop/cross-token/001"]) == Basis("chapter", "stop_bytes_never_emitted")
    lost = finding("bytes_lost", "lost")  # D34 covers the counts of n choices, not their text
    assert basis_of(lost, CASES["stop/n-choices/001"]).chapter
    assert basis_of(finding("count_low", "c"), CASES["stop/n-choices/001"]) == Basis("decision", "D34")


def test_a_rows_own_decision_and_the_wire_need_no_case() -> None:
    assert basis_of(finding("precedence", "p"), None) == Basis("decision", "D4")
    assert basis_of(finding("done_missing", "d"), None) == Basis("wire", "openai_sse_done")
    assert basis_of(finding("stop_sent", "s"), None).chapter


def test_a_case_declaring_an_unknown_decision_is_refused() -> None:
    obj = CASES["stop/overlap/002"].to_json()
    assert obj["decisions"] == ["D3"]
    parse_case(obj)
    with pytest.raises(CaseError, match="decisions"):
        parse_case({**obj, "decisions": ["D3", "D1000"]})


def test_each_decision_says_what_the_project_chose_and_what_engines_do_instead() -> None:
    for number, d in DECISIONS.items():
        line = decision_line(number)
        assert line.startswith(f"{number} ({d.title}): ") and d.ours in line and d.instead in line
        assert d.covers <= set(SYMPTOMS), number
