"""The report writer never loses a run to one case's record (reports.written, reports.is_http), and
its first screen says what was run and where every counted finding and error is.

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
from decodespec.properties.conformance.runner import CaseResult, Verdict, grade

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


SERVER = {"url": "http://127.0.0.1:1", "model": "m", "version": "9.8.7",
          "launch": "engine-serve --model {model} --dtype bfloat16 --port {port}",
          "checkpoint": {"group": "byte_table", "sha256": "de6449b2ea5d37cb" + "0" * 48}}


def _first_screen(tmp_path) -> tuple[str, str]:
    """report.md and report.html up to the causes of a run with an ERROR case (its reason a paragraph),
    a wire finding and a server recorded."""
    wire = grade(CaseResult(CASES[0], "engine", Verdict.PASS,
                            (Finding("openai_sse_done", "no [DONE]", "done_missing", family="wire"),),
                            observed={"server": SERVER, "notes": []}), "project")
    error = CaseResult(CASES[1], "engine", Verdict.ERROR, reason="the engine left its forced script at token 1. "
                       "An engine that does so is judged on nothing.", observed={"server": SERVER})
    write_reports([wire, error, _failed(CASES[2], [HTTP])], "engine", tmp_path)
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    return md[:md.index("## Causes")], page[:page.index("<h2>Causes")]


def test_the_first_screen_lists_each_error_case_with_its_reason(tmp_path):
    """An ERROR the headline counts is under the severity table, linked to its case, its reason's first sentence."""
    md, page = _first_screen(tmp_path)
    assert f"- `{CASES[1].id}`: the engine left its forced script at token 1\n" in md, md
    assert f"<li><a href='#{CASES[1].id}'>{CASES[1].id}</a>: the engine left its forced script at token 1</li>" in page
    assert page.index("<table class='severities'>") < page.index("Errors (1)")


def test_the_severity_table_splits_every_finding_by_its_basis(tmp_path):
    """A wire finding rests on its convention (symptoms.basis_of): the row counts it there, so each
    row's bases add up to its findings."""
    md, page = _first_screen(tmp_path)
    assert "| on a wire convention (OpenAI API) |" in md
    assert "| wire | 1 | 0 | 0 | 1 | 1 |" in md, md
    rows = [line.split(" | ")[1:5] for line in md.splitlines() if line.startswith("| ") and line[2:3].isalpha()
            and not line.startswith("| severity")]
    assert all(int(n) == int(c) + int(d) + int(w) for n, c, d, w in rows), rows
    assert "<td>1</td><td>0</td><td>0</td><td>1</td><td>1</td>" in page


def test_the_first_screen_names_what_was_run(tmp_path):
    """The engine with its recorded version, the checkpoints served with their hash, when, and the launch command."""
    md, page = _first_screen(tmp_path)
    generated = json.loads((tmp_path / "report.json").read_text())["generated"]
    line = (f"engine engine 9.8.7, checkpoints byte_table (sha256 de6449b2ea5d…), generated {generated}, "
            "launched as `engine-serve --model {model} --dtype bfloat16 --port {port}`")
    assert line in md, md
    assert "<p class='run'>engine engine 9.8.7, checkpoints byte_table" in page
    assert "<code>engine-serve --model {model} --dtype bfloat16 --port {port}</code>" in page
