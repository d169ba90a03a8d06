"""The report writer never loses a run to one case's record (reports.written, reports.is_http).

Whatever an adapter put into a case's exchanges (an in-house engine's calls, a value that is no
JSON), that case's reproducer says what could not be rendered and every other case, and the four
report files, are written.
"""

from __future__ import annotations

import json

import attrs
import pytest

from decodespec.properties.conformance import Finding, load_cases
from decodespec.properties.conformance.contract import CONTRACT_VERSION
from decodespec.properties.conformance.reports import REPORT_FILES, SCHEMA_PATH, replay, write_reports
from decodespec.properties.conformance.runner import CaseResult, Verdict

CASES = load_cases(["stop/cross-token/", "stop/overlap/001"])
HTTP = {"request": {"path": "/v1/completions", "body": {"prompt": [1], "stream": False}}, "status": 200,
        "response": "{}"}


def _failed(case, exchanges) -> CaseResult:
    return CaseResult(case, "engine", Verdict.FAIL, (Finding("stop_string_never_emitted", "seen", "stop_sent"),),
                      observed={"exchanges": exchanges, "notes": []})


def test_an_exchange_that_is_no_http_request_gets_no_curl_line():
    """An in-house engine's call has a `request` without a path and a body: replay writes curl lines
    for the HTTP exchanges only."""
    call = {"call": "complete", "request": {"prompt": [1, 2], "max_tokens": 3}, "answer": {"choices": []}}
    text = replay(_failed(CASES[0], [call, HTTP]))
    requests = [line for line in text.splitlines() if line.startswith("curl ")]
    assert len(requests) == 1 and '"$URL/v1/completions"' in requests[0], text


def test_a_case_the_writer_cannot_render_is_marked_and_the_report_is_written(tmp_path):
    """One case holding a value that is no JSON (and one a curl line cannot be made of) loses its
    detail, named in its reproducer's writer_error; the other cases and all four files are written,
    and report.json still follows its schema and records the contract version."""
    jsonschema = pytest.importorskip("jsonschema")
    odd = [_failed(CASES[0], [{"request": {"body": {}}, "status": 200}, {"seen": object()}]),
           attrs.evolve(_failed(CASES[1], [HTTP]), verdict=Verdict.PASS, failures=()),
           _failed(CASES[2], [HTTP])]
    paths = write_reports(odd, "engine", tmp_path)
    assert [p.name for p in paths] == list(REPORT_FILES)
    data = json.loads((tmp_path / "report.json").read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["contract"] == CONTRACT_VERSION
    first, second, third = data["cases"]
    assert "TypeError" in first["reproducer"]["writer_error"] and first["reproducer"]["inputs"] == dict(CASES[0].inputs)
    assert "writer_error" not in second["evidence"] and "writer_error" not in third["reproducer"]
    assert "curl -sS" in third["reproducer"]["replay"]
    assert "writer_error" in (tmp_path / "report.md").read_text()
