"""The conformance suite: cases, the reference adapter, a planted bug, CLI, reports, xdist."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from decodespec.cli import main
from decodespec.properties.conformance import (
    CaseError,
    EngineSpecError,
    Grade,
    Verdict,
    adapter_for,
    load_cases,
    run_cases,
    save_case,
)
from decodespec.properties.conformance.cases import case_from_trace, parse_case
from decodespec.properties.conformance.reports import REPORT_FILES, summary, write_reports
from decodespec.properties.conformance.runner import read_expectations, unexpected
from decodespec.runtime import runner as runner_module
from decodespec.runtime import stop as stop_module

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def reference_results():
    return run_cases(adapter_for("reference"), load_cases())


class OneTokenStopMatcher:
    """A planted bug (§4.12 row 2): each push is matched on its own bytes, nothing is held across tokens."""

    def __init__(self, stops, **_kw) -> None:
        self._stops = stops
        self.hit = None
        self.held = b""

    def push(self, data: bytes):
        inner = stop_module.StopMatcher(self._stops)
        safe, hit = inner.push(data)
        if hit is not None:
            self.hit = hit
            return safe, hit
        return safe + inner.flush(), None

    def flush(self) -> bytes:
        return b""

    def discard_from_first_match(self) -> None:
        pass


def test_cases_cover_sections_4_3_to_4_10_and_the_trace_invariants():
    """At least 30 cases, anchors §4.3-§4.10, unique stable ids, both grades."""
    cases = load_cases()
    assert len(cases) >= 30
    anchors = {c.anchor for c in cases}
    assert {"§4.3", "§4.5", "§4.6", "§4.7", "§4.9", "§4.10"} <= anchors
    assert {c.grade for c in cases} == {Grade.MUST, Grade.SHOULD}
    for cid in ("stop/cross-token/001", "stop/multi-byte/001", "stop/overlap/001", "stop/last-token/001",
                "detok/utf8-split/004", "detok/finish-tail/001", "stream/terminal-once/001", "stream/seq/001",
                "lifecycle/cancel-in-flight/001", "finish/eos-last-token/001", "usage/stop/001"):
        assert any(c.id == cid for c in cases), cid


def test_reference_passes_every_must_case(reference_results):
    """§4.3-§4.10: the reference engine passes every MUST case it can run, and runs nearly all of them."""
    must = [r for r in reference_results if r.case.grade is Grade.MUST and r.case.kind == "script"]
    bad = [(r.case.id, r.first_invariant or r.reason) for r in must if r.verdict is not Verdict.PASS]
    assert bad == []
    assert len(must) >= 30
    assert summary(reference_results)["must_all_pass"]


def test_http_cases_are_skipped_with_a_reason_not_passed(reference_results):
    """A case an engine cannot run is a SKIP with its reason, never a pass."""
    http = [r for r in reference_results if r.case.id.startswith("http/")]
    assert http and all(r.verdict is Verdict.SKIP and "HTTP" in r.reason for r in http)


def test_planted_one_token_stop_matcher_fails_with_the_invariant_named(monkeypatch):
    """§4.6/§4.12 row 2: a stop matcher that sees one token only leaks the cross-token stop's bytes."""
    monkeypatch.setattr(runner_module, "StopMatcher", OneTokenStopMatcher)
    results = {r.case.id: r for r in run_cases(adapter_for("reference"), load_cases(["stop/cross-token/"]))}
    r = results["stop/cross-token/001"]
    assert r.verdict is Verdict.FAIL
    assert "stop_bytes_never_emitted" in {f.invariant for f in r.failures}
    assert r.first_invariant == "stop_bytes_never_emitted"
    assert {results[f"stop/cross-token/00{i}"].verdict for i in (2, 3)} == {Verdict.FAIL}


def test_cli_dry_run_lists_selected_cases_only():
    """--dry-run lists the cases, --select filters by id prefix."""
    out = CliRunner().invoke(main, ["conform", "--engine", "reference", "--dry-run", "--select", "stop/overlap/"])
    assert out.exit_code == 0, out.output
    assert "stop/overlap/001" in out.output and "stop/overlap/003" in out.output
    assert "detok/" not in out.output and "stop/cross-token" not in out.output
    assert "earliest" in out.output  # each case's description is listed beside it


def test_cli_expect_file_tracks_known_failures(monkeypatch, tmp_path):
    """A MUST failure exits 1; listed in --expect it is known, and the run exits 0."""
    monkeypatch.setattr(runner_module, "StopMatcher", OneTokenStopMatcher)
    args = ["conform", "--engine", "reference", "--select", "stop/cross-token/001"]
    assert CliRunner().invoke(main, args).exit_code == 1
    known = tmp_path / "known.txt"
    known.write_text("# planted bug\nstop/cross-token/001  # leaks BCD\n")
    assert read_expectations(known.read_text()) == frozenset({"stop/cross-token/001"})
    out = CliRunner().invoke(main, [*args, "--expect", str(known)])
    assert out.exit_code == 0, out.output


def test_reports_are_well_formed(reference_results, tmp_path):
    """JSON, JUnit XML, Markdown and HTML per engine, one row per case."""
    paths = write_reports(reference_results, "reference", tmp_path, diagrams_dir=REPO / "diagrams")
    assert [p.name for p in paths] == list(REPORT_FILES)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["summary"]["total"] == len(reference_results) == len(data["cases"])
    assert data["summary"]["must_all_pass"] is True
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert suite.tag == "testsuite" and len(suite.findall("testcase")) == len(reference_results)
    assert int(suite.get("skipped")) == sum(r.verdict is Verdict.SKIP for r in reference_results)
    md = (tmp_path / "report.md").read_text()
    ran = sum(r.verdict is Verdict.PASS for r in reference_results)  # the request-field cases too
    skipped = sum(r.verdict is Verdict.SKIP for r in reference_results)
    total = len(reference_results)
    assert md.splitlines()[2].startswith("engine reference, generated ")
    assert md.splitlines()[4].startswith(f"**reference: {ran} of {total} cases ran; no findings; {ran} pass (100%), "
                                         "0 fail the chapter, 0 differ") and ran >= 60
    assert f"; {skipped} n/a: " in md.splitlines()[4]
    assert all(f"`{r.case.id}`" in md for r in reference_results)
    assert f"<details><summary>Not applicable to this engine ({skipped})</summary>" in md
    assert "<table>" in (tmp_path / "report.html").read_text()


def test_report_json_follows_its_shipped_schema(reference_results, tmp_path, monkeypatch):
    """report.json carries a version and validates against report.schema.json, a passing
    run and a failing one (with reproducers) alike; a report missing a field does not."""
    jsonschema = pytest.importorskip("jsonschema")
    from decodespec.properties.conformance.reports import REPORT_VERSION, SCHEMA_PATH

    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    write_reports(reference_results, "reference", tmp_path / "ok")
    monkeypatch.setattr(runner_module, "StopMatcher", OneTokenStopMatcher)
    write_reports(run_cases(adapter_for("reference"), load_cases(["stop/"])), "mutant", tmp_path / "bad")
    for name in ("ok", "bad"):
        data = json.loads((tmp_path / name / "report.json").read_text())
        assert data["version"] == REPORT_VERSION
        jsonschema.validate(data, schema)
    del data["cases"][0]["statement"]
    with pytest.raises(jsonschema.ValidationError, match="statement"):
        jsonschema.validate(data, schema)


def test_reports_lead_with_failures_grouped_by_section(monkeypatch, tmp_path):
    """The headline gives the pass rate over what ran; failures come first, by section,
    with the broken invariant's statement; passes follow; skips are folded with their reasons; the
    HTML embeds the diagram a failure names, so the page stands alone."""
    monkeypatch.setattr(runner_module, "StopMatcher", OneTokenStopMatcher)
    results = run_cases(adapter_for("reference"), load_cases(["stop/", "lifecycle/", "http/stop/"]))
    write_reports(results, "mutant", tmp_path, diagrams_dir=REPO / "diagrams")
    md = (tmp_path / "report.md").read_text()
    assert md.index("## Failures") < md.index("### §4.6") < md.index("## Passed") < md.index("Not applicable")
    assert "> chapter §4.6 stop_bytes_never_emitted: the returned bytes never contain a configured stop string" in md
    page = (tmp_path / "report.html").read_text()
    assert "<svg" in page and "id='diagram-stop_matcher'" in page and "diagrams/" not in page
    assert page.index("Failures of the chapter (") < page.index("Passed (")


def test_a_pass_that_could_not_check_everything_is_marked_partial(tmp_path):
    """DecodeStream reports no finish reason and applies no limit (the adapter feeds max_tokens ids):
    its passes say so instead of looking complete."""
    pytest.importorskip("tokenizers")
    from decodespec.properties import fixtures

    tok = fixtures.byte_level_bpe(tmp_path / "tok")
    results = run_cases(adapter_for(f"decode-stream:{tok}"), load_cases(["finish/length/002"]))
    assert results[0].verdict is Verdict.PASS and "finish_reason" in results[0].not_checked
    assert any(n.startswith("the length limit") for n in results[0].not_checked)
    write_reports(results, "ds", tmp_path / "rep")
    assert "partial: not checked the length limit" in (tmp_path / "rep" / "report.md").read_text()
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["summary"]["partial"] == 1


def test_failed_case_report_has_invariant_and_reproducer(monkeypatch, tmp_path):
    """A failure's row names the first violated invariant; the reproducer shows expected vs observed."""
    monkeypatch.setattr(runner_module, "StopMatcher", OneTokenStopMatcher)
    results = run_cases(adapter_for("reference"), load_cases(["stop/cross-token/001"]))
    write_reports(results, "reference-mutant", tmp_path)
    case = json.loads((tmp_path / "report.json").read_text())["cases"][0]
    assert case["verdict"] == "FAIL" and case["first_violated_invariant"] == "stop_bytes_never_emitted"
    rep = case["reproducer"]
    assert rep["expected"]["output"] == "A" and rep["observed"]["output"] != "A"
    assert rep["inputs"]["stop"] == ["BCD"]
    assert ET.parse(tmp_path / "junit.xml").getroot().find("testcase/failure").get("type") == "stop_bytes_never_emitted"


def test_unexpected_counts_must_failures_and_errors_only(reference_results, monkeypatch):
    """One rule for CLI and plugin: ERRORs and unlisted MUST failures fail a run; SHOULD failures
    only with strict; a listed id is a known failure."""
    assert unexpected(reference_results) == []
    monkeypatch.setattr(runner_module, "StopMatcher", OneTokenStopMatcher)
    res = run_cases(adapter_for("reference"), load_cases(["stop/cross-token/001", "stop/overlap/001"]))
    grades = {r.case.id: r.case.grade.value for r in res if r.failed}
    assert grades == {"stop/cross-token/001": "MUST", "stop/overlap/001": "SHOULD"}
    assert [r.case.id for r in unexpected(res)] == ["stop/cross-token/001"]
    assert {r.case.id for r in unexpected(res, strict=True)} == set(grades)
    assert unexpected(res, frozenset({"stop/cross-token/001"})) == []


def test_cli_refuses_an_expect_file_naming_no_case(tmp_path):
    """A typo in --expect would hide a failure: unknown ids are refused before anything runs."""
    known = tmp_path / "known.txt"
    known.write_text("stop/cross-token/001\nstop/cross-tokn/001\n")
    out = CliRunner().invoke(main, ["conform", "--engine", "reference", "--expect", str(known)])
    assert out.exit_code == 2 and "stop/cross-tokn/001" in out.output and "Traceback" not in out.output


@pytest.mark.parametrize("engine, words", [
    ("openai:http://127.0.0.1:1", "nothing answers at http://127.0.0.1:1"),
    ("hf:/nonexistent", "/nonexistent"),
    ("bogus", "unknown engine 'bogus'"),
    ("string:Formatter", "lacks"),
    ("no_such_module_xyz:make", "cannot import module"),
])
def test_cli_bad_or_unreachable_engine_is_one_clear_error(engine, words):
    """A misspelt or unreachable engine fails fast with one message (exit 2), no traceback,
    and no case is run or reported as a failure."""
    out = CliRunner().invoke(main, ["conform", "--engine", engine])
    assert out.exit_code == 2, out.output
    assert words in " ".join(out.output.split()) and "Traceback" not in out.output and "MUST" not in out.output


@pytest.mark.parametrize("listing, words", [
    ('[1, 2]', "is not a model list"),
    ('{"data": [{"name": "m"}]}', "is not a model list"),
    ('{"data": []}', "lists no model; pass --model"),
])
def test_a_server_whose_model_list_cannot_name_the_model_is_one_clear_error(listing, words):
    """/v1/models in another shape stops the run at once with one message (exit 2), not with every
    case an ERROR whose reason is a Python AttributeError or KeyError."""
    from _engine_kit import answering

    with answering({"/v1/models": listing}) as url:
        out = CliRunner().invoke(main, ["conform", "--engine", f"openai:{url}", "--select", "stop/cross-token/001"])
    assert out.exit_code == 2, out.output
    assert words in " ".join(out.output.split()) and "Traceback" not in out.output and "MUST" not in out.output


def test_a_selection_prefix_that_starts_no_case_is_refused_not_run_as_a_smaller_suite(tmp_path):
    """With `--select stop/ --select finsh/` the typo is named and nothing runs (the CLI,
    `checkpoints build` and the pytest plugin alike): no run of stop/ alone that passes."""
    out = CliRunner().invoke(main, ["conform", "--engine", "reference", "--select", "stop/", "--select", "finsh/"])
    assert out.exit_code == 2 and "no case id starts with 'finsh/'" in out.output and "pass" not in out.output
    out = CliRunner().invoke(main, ["checkpoints", "build", "--select", "finsh/", "--out", str(tmp_path / "ck")])
    assert out.exit_code == 2 and "no case id starts with 'finsh/'" in out.output and not (tmp_path / "ck").exists()
    plugin = subprocess.run([sys.executable, "-m", "pytest", "-p", "decodespec", "-p", "no:cacheprovider", "--rootdir",
                             str(tmp_path), "--decodespec-engine=reference", "--decodespec-select=stop/",
                             "--decodespec-select=finsh/", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert plugin.returncode == 4 and "no case id starts with 'finsh/'" in plugin.stdout + plugin.stderr


def test_a_report_reruns_on_exactly_its_own_cases_and_a_stale_one_is_refused(tmp_path):
    """`--cases-of REPORT` re-runs a report on its own snapshot's cases by exact id (how the peers'
    reports are refreshed without the suite's newer cases joining them); a file that is no report,
    or an id the suite no longer has, is named and nothing runs."""
    first = tmp_path / "first"
    out = CliRunner().invoke(main, ["conform", "--engine", "reference", "--select", "stop/cross-token/00",
                                    "--select", "finish/length/001", "--report", str(first)])
    assert out.exit_code == 0, out.output
    ids = [c["id"] for c in json.loads((first / "report.json").read_text())["cases"]]
    again = tmp_path / "again"
    out = CliRunner().invoke(main, ["conform", "--engine", "reference", "--cases-of", str(first / "report.json"),
                                    "--report", str(again)])
    assert out.exit_code == 0, out.output
    assert [c["id"] for c in json.loads((again / "report.json").read_text())["cases"]] == ids
    out = CliRunner().invoke(main, ["conform", "--engine", "reference", "--cases-of", str(first / "report.json"),
                                    "--select", "finish/", "--dry-run"])
    assert out.exit_code == 0 and "finish/length/001" in out.output and "stop/cross-token" not in out.output
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"cases": [{"id": "stop/cross-token/001"}, {"id": "stop/retired/001"}]}))
    junk = tmp_path / "junk.json"
    junk.write_text('{"cases": 3}')
    for path, words in ((stale, "the suite has no case 'stop/retired/001'"), (junk, "not a report.json")):
        out = CliRunner().invoke(main, ["conform", "--engine", "reference", "--cases-of", str(path),
                                        "--report", str(tmp_path / "never")])
        assert out.exit_code == 2 and words in " ".join(out.output.split()), out.output
        assert not (tmp_path / "never").exists()


def test_a_python_adapter_plugs_in_as_module_factory(tmp_path, monkeypatch):
    """`--engine module:factory` loads an in-house adapter (here one wrapping the reference)."""
    (tmp_path / "wrapped_reference.py").write_text(
        "from decodespec.properties.conformance.adapters.reference import ReferenceAdapter\n"
        "def make():\n    a = ReferenceAdapter()\n    a.name = 'my-engine'\n    return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = CliRunner().invoke(main, ["conform", "--engine", "wrapped_reference:make", "--select", "stop/cross-token/001"])
    assert out.exit_code == 0, out.output
    assert "1 of 1 cases ran; no findings; 1 pass (100%)" in out.output


def test_cli_list_shows_descriptions_without_an_engine():
    out = CliRunner().invoke(main, ["conform", "--list", "--select", "stop/overlap/001"])
    assert out.exit_code == 0 and "earliest" in out.output, out.output


def test_pytest_plugin_exits_as_the_cli_does(tmp_path):
    """The plugin fails items exactly where the CLI exits 1: a SHOULD-only failure is an xfail (exit 0),
    and a bogus engine is one usage error, not one failure per case."""
    conftest = tmp_path / "conftest.py"
    conftest.write_text(  # the planted one-token stop matcher, for the whole (separate) pytest process
        "from decodespec.runtime import runner\nimport test_conformance as t\nrunner.StopMatcher = t.OneTokenStopMatcher\n")
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
            "--decodespec-engine=reference", str(tmp_path)]
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO / "tests")}
    should = subprocess.run([*base, "--decodespec-select=stop/overlap/001"], capture_output=True, text=True, env=env)
    assert should.returncode == 0 and "1 xfailed" in should.stdout, should.stdout[-800:]
    strict = subprocess.run([*base, "--decodespec-select=stop/overlap/001", "--decodespec-strict"], capture_output=True,
                            text=True, env=env)
    assert strict.returncode == 1, strict.stdout[-800:]
    bogus = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                            "--decodespec-engine=bogus", str(tmp_path)],
                           capture_output=True, text=True, env=env)
    assert bogus.returncode == 4 and "unknown engine 'bogus'" in bogus.stderr + bogus.stdout
    assert len((bogus.stdout + bogus.stderr).splitlines()) < 20


def test_malformed_case_is_refused_with_the_field_named():
    """A case file with a bad id, grade or tokenizer is a CaseError naming the problem."""
    good = json.loads((REPO / "properties/cases/stop/cross-token--001.json").read_text())
    for key, value, words in (("id", "stop-1", "id"), ("grade", "MAY", "MAY"), ("anchor", "4.6", "anchor")):
        with pytest.raises(CaseError, match=words):
            parse_case({**good, key: value})
    with pytest.raises(CaseError, match="tokenizer"):
        parse_case({**good, "inputs": {**good["inputs"], "tokenizer": {}}})
    with pytest.raises(EngineSpecError, match="hf:PATH"):
        adapter_for("hf")
    with pytest.raises(EngineSpecError, match="unknown engine"):
        adapter_for("vllm")


def test_save_case_turns_a_trace_into_a_replayable_case(tmp_path):
    """A counterexample trace becomes a new case file that runs (and passes) on the reference."""
    ref = run_cases(adapter_for("reference"), load_cases(["stop/cross-token/001"]))[0]
    assert ref.verdict is Verdict.PASS
    from decodespec.runtime.experiments import experiment_a

    events = experiment_a().result.events
    tok = {"table": {"1": "> ", "101": "AB", "102": "CD", "103": "E", "104": "F"}}
    inputs = case_from_trace(events, tokenizer_spec=tok, prompt=[1])
    case = save_case("stop/cross-token", anchor="§4.6", invariant="stop_bytes_never_emitted",
                     description="replayed experiment A trace", inputs=inputs,
                     expect={"output": "A", "finish_reason": "stop_sequence"}, folder=tmp_path)
    assert case.id == "stop/cross-token/001" and case.path.is_file()
    loaded = load_cases(folder=tmp_path)
    assert [c.id for c in loaded] == ["stop/cross-token/001"]
    assert run_cases(adapter_for("reference"), loaded)[0].verdict is Verdict.PASS
    second = save_case("stop/cross-token", anchor="§4.6", invariant="stop_bytes_never_emitted",
                       description="again", inputs=inputs, expect={"output": "A"}, folder=tmp_path)
    assert second.id == "stop/cross-token/002"


@pytest.mark.slow
def test_cases_shard_across_xdist_workers():
    """The pytest plugin makes each case an item, and pytest-xdist runs them on 2 workers."""
    cmd = [sys.executable, "-m", "pytest", "-p", "decodespec", "-n", "2",
           "--decodespec-engine=reference", "--decodespec-select=stop/",
           "--decodespec-select=finish/", "-v", "properties/cases"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    n = len(load_cases(["stop/", "finish/"]))
    assert f"{n} passed" in out.stdout
    assert "[gw0]" in out.stdout and "[gw1]" in out.stdout


# ---- the openai adapter, against a tiny fake server and against `decodespec serve` ----------------

FAKE_TEXT = ["Once", " upon", " a", " mid", "night", " dreary", ",", " while", " I", " ponder", "ed"]


def _fake_app(*, leak_stops: bool):
    """A deterministic OpenAI-style server: greedy text FAKE_TEXT, logprobs tokens, SSE; optionally buggy."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        body = await request.json()
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1 or not isinstance(body.get("stop", []), (list, str)) \
                or not isinstance(body.get("temperature", 0), (int, float)):
            return JSONResponse({"error": {"message": "bad request"}}, status_code=400)
        toks = FAKE_TEXT[: body["max_tokens"]]
        reason = "length"
        stops = body.get("stop") or []
        text = "".join(toks)
        hits = [(text.find(s) + len(s), -len(s), s) for s in ([stops] if isinstance(stops, str) else stops) if s in text]
        if hits:  # earliest end, then longest (D3)
            end, _, s = min(hits)
            text = text[: end if leak_stops else end - len(s)]
            reason = "stop"
        usage = {"prompt_tokens": 3, "completion_tokens": len(toks), "total_tokens": 3 + len(toks)}
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": text, "finish_reason": reason, "logprobs": {"tokens": toks} if text == "".join(toks) else None}], "usage": usage})

        async def sse():
            sent = 0
            for t in toks:
                piece = text[sent: sent + len(t)]
                if piece:
                    yield f"data: {json.dumps({'choices': [{'text': piece, 'finish_reason': None}]})}\n\n"
                sent += len(t)
            yield f"data: {json.dumps({'choices': [{'text': '', 'finish_reason': reason}]})}\n\n"
            if leak_stops:  # a second terminal chunk: the §4.7 bug
                yield f"data: {json.dumps({'choices': [{'text': '', 'finish_reason': reason}]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"data": [{"id": "fake"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])


@pytest.fixture
def fake_server(app_server):
    return lambda leak_stops: app_server(_fake_app(leak_stops=leak_stops))


def test_openai_adapter_passes_a_conforming_fake_server(fake_server):
    """§4.5-§4.7 black box: a server that cuts stops and frames SSE correctly passes the completions recipes."""
    results = run_cases(adapter_for(f"openai:{fake_server(False)}"), [c for c in load_cases(["http/"]) if c.inputs.get("endpoint") != "chat"])
    verdicts = {r.case.id: r.verdict for r in results}
    assert verdicts["http/stop/cross-token/001"] is Verdict.PASS
    assert verdicts["http/stream/terminal-once/001"] is Verdict.PASS
    assert verdicts["http/stop/overlap/001"] is Verdict.PASS
    assert not [r for r in results if r.failed], [(r.case.id, r.failures, r.reason) for r in results if r.failed]


def test_openai_adapter_catches_stop_leak_and_double_terminal(fake_server):
    """§4.6/§4.7: a server that returns the stop string and sends two finish chunks fails, invariants named."""
    results = {r.case.id: r for r in run_cases(adapter_for(f"openai:{fake_server(True)}"),
                                               load_cases(["http/stop/cross-token/001", "http/stream/terminal-once/001"]))}
    assert results["http/stop/cross-token/001"].first_invariant == "stop_bytes_never_emitted"
    assert results["http/stream/terminal-once/001"].first_invariant == "single_terminal_event"


def test_a_cross_token_stop_on_an_answer_without_text_is_na_saying_so():
    """§4.6: a chat answer whose content is empty (vLLM's reasoning parser sends all of it as
    reasoning_content) has no token boundary to place a stop across: n/a, saying that, not that the
    server reveals no tokens."""
    from decodespec.properties.conformance.adapters.openai import Answer, OpenAIAdapter, stop_cross_token

    class Reasoned(OpenAIAdapter):
        def complete(self, case, log=None, **over):
            return Answer("", "stop", None, None)

    case = next(c for c in load_cases(["http/stop/cross-token/002"]))
    out = stop_cross_token(Reasoned("http://127.0.0.1:9"), case)
    assert out.skip.startswith("the unconstrained answer has no text (chat endpoint"), out.skip


@pytest.mark.slow
def test_openai_adapter_against_decodespec_serve():
    """The project's own server (runtime/server.py) as a black-box peer: every MUST recipe passes or is skipped."""
    from _engine_kit import decodespec_serve

    with decodespec_serve(REPO) as url:
        results = run_cases(adapter_for(f"openai:{url}"), load_cases(["http/"]))
    assert not [r for r in results if r.verdict is Verdict.ERROR], [(r.case.id, r.reason) for r in results]
    # its chat logprobs end with the EOS, whose bytes are null: the tokens still place the stop (D59)
    cross = next(r for r in results if r.case.id == "http/stop/cross-token/002")
    assert cross.verdict is Verdict.PASS, cross.reason
    assert unexpected(results) == []
    assert sum(r.verdict is Verdict.PASS for r in results) >= 8


def test_expected_results_follow_the_engines_tokenizer_not_the_fixture():
    """DecodeStream over the project's own byte-level tokenizer (not the fixture) is
    judged on the reference's answer for the same ids; only its real §4.5 faults remain (an invalid
    byte shown as U+FFFD, an incomplete tail lost), the cases whose text splits differently pass."""
    pytest.importorskip("tokenizers")
    adapter = adapter_for(f"decode-stream:{REPO / 'runtime/assets/default/tokenizer.json'}")
    results = {r.case.id: r for r in run_cases(adapter, load_cases(["detok/", "finish/", "stream/"]))}
    failed = {cid for cid, r in results.items() if r.failed}
    assert failed == {"detok/finish-tail/002", "detok/invalid/001"}, {c: results[c].failures for c in failed}
    for cid in ("detok/utf8-split/002", "detok/utf8-split/004", "stream/terminal-once/001"):
        assert results[cid].verdict is Verdict.PASS and results[cid].expected is not None, cid


def test_pytest_plugin_grades_under_the_clis_profile_and_declared_decisions(tmp_path):
    """D69: `--decodespec-profile` and `--decodespec-declare` are `conform`'s --profile and --declare
    (runner.PROFILES, decisions.DECISIONS). A MUST case whose one finding rests on D34 (n's usage)
    fails its item under the default profile, passes under `chapter`, is skipped with D34's line
    when D34 is declared; an unknown decision is one usage error naming it."""
    (tmp_path / "counts_one.py").write_text(
        "from decodespec.properties.conformance.adapters.base import Outcome\n"
        "from decodespec.properties.conformance.adapters.reference import ReferenceAdapter\n"
        "from decodespec.properties.conformance.symptoms import finding\n"
        "class CountsOne(ReferenceAdapter):\n"
        "    def run(self, case):\n"
        "        return Outcome(findings=(finding('count_low', \"one choice's count for 2 choices\"),), judged=True)\n"
        "def make():\n    return CountsOne()\n")
    base = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
            "--decodespec-engine=counts_one:make", "--decodespec-select=stop/n-choices/001", str(tmp_path)]
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}

    def plugin(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*base, *extra], capture_output=True, text=True, env=env, timeout=120)

    project = plugin()
    assert project.returncode == 1 and "DIFFERS" in project.stdout, project.stdout[-800:]
    assert plugin("--decodespec-profile=chapter").returncode == 0
    declared = plugin("--decodespec-declare=D34")
    assert declared.returncode == 0 and "1 skipped" in declared.stdout and "--declare D34" in declared.stdout, \
        declared.stdout[-800:]
    bogus = plugin("--decodespec-declare=D999")
    assert bogus.returncode == 4 and "D999" in bogus.stderr, bogus.stderr[-800:]


def test_pytest_plugin_grades_its_items_as_one_run_at_the_end(tmp_path):
    """D71: each item is judged alone, so a usage chunk the engine never sends fails every MUST item
    it shows in (DIFFERS); at the session's end the items are graded as one run, as `decodespec
    conform` grades them: the field is stated once in the summary, and when the items that failed
    only on it are all the failures, the exit status is the run's (0). An item that also lost bytes
    still fails the session; two cases are not enough to make a field engine-wide."""
    (tmp_path / "no_usage.py").write_text(
        "from decodespec.properties.conformance.adapters.base import Outcome\n"
        "from decodespec.properties.conformance.adapters.reference import ReferenceAdapter\n"
        "from decodespec.properties.conformance.judgement import no_usage_chunk\n"
        "from decodespec.properties.conformance.symptoms import finding\n"
        "class NoUsage(ReferenceAdapter):\n"
        "    def run(self, case):\n"
        "        lost = (finding('bytes_lost', 'lost'),) if case.id.startswith('detok/') else ()\n"
        "        return Outcome(findings=(no_usage_chunk(), *lost), judged=True)\n"
        "def make():\n    return NoUsage()\n")
    usage_only = ("stop/cross-token/001", "stop/cross-token/002", "finish/length/001")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}

    def plugin(*ids: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                               str(tmp_path), "--decodespec-engine=no_usage:make",
                               *(f"--decodespec-select={i}" for i in ids), str(tmp_path)],
                              capture_output=True, text=True, env=env, timeout=120)

    said = "engine-wide: field_ignored: stream_options.include_usage in all {} cases that could show it"
    run = plugin(*usage_only)
    out = " ".join(run.stdout.split())
    assert run.returncode == 0 and "3 failed" in out and said.format(3) in out, run.stdout[-1500:]
    lost = plugin(*usage_only, "detok/replacement-char/001")
    out = " ".join(lost.stdout.split())
    assert lost.returncode == 1 and said.format(4) in out, lost.stdout[-1500:]
    assert "3 failed item(s) fail only on it: finish/length/001, stop/cross-token/001, stop/cross-token/002" in out, out
    two = plugin(*usage_only[:2])
    assert two.returncode == 1 and "engine-wide" not in two.stdout, two.stdout[-1500:]
