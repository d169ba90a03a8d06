"""§4.6 hold-back over HTTP (DECISIONS D59): a script case whose stream must hold text back for a
stop is streamed once more asking for per-token reports (http_script.run_script, chat.run_chat), and
judged from when each chunk went out in selected tokens: decodespec serve says it with every chunk
of such a stream (`decodespec.selected`), so it passes every stop case with hold-back checked, not
partial, on completions and on chat; an engine frontend that sends a stop's start before the stop
is ruled out (tests/_frontend_kit.py, `no_hold_back`) is caught where only the timing shows it."""

from __future__ import annotations

import pytest

from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.alignment import asks_reports
from decodespec.properties.conformance.cases import CaseKind, load_cases
from decodespec.properties.conformance.chat import splits
from decodespec.properties.conformance.chat_cases import chat_of
from decodespec.properties.conformance.checkpoints import build_group, group_of, http_blocker, with_chat
from decodespec.properties.conformance.judgement import expected_for
from decodespec.properties.conformance.runner import Verdict, run_cases, unexpected
from decodespec.properties.conformance.symptoms import Severity, severity_of
from decodespec.properties.conformance.wire import parse_sse
from decodespec.runtime.engine import Engine
from decodespec.runtime.server import create_app

pytest.importorskip("transformers")
from _frontend_kit import TokenEngine, frontend_app

NO_STOP = "detok/utf8-split/001"  # a byte_table case without stop strings: nothing to hold back


def _stop_cases(group):
    """The script cases of `group` with stop strings and a content channel alone (chat variants too)."""
    return [c for c in with_chat(load_cases()) if c.kind is CaseKind.SCRIPT and c.inputs.get("stop")
            and http_blocker(c) is None and group_of(c) == group and "context_limit" not in c.inputs and not splits(c)]


@pytest.fixture(scope="module")
def serve(tmp_path_factory, app_server):
    """`serve(group) -> (checkpoint, url)`: the checkpoint of the group's stop cases (and NO_STOP on
    byte_table), and decodespec serve on it, built once."""
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.tokenizers import HFTokenizer

    built = {}

    def start(group):
        if group not in built:
            cases = _stop_cases(group) + (load_cases([NO_STOP]) if group == "byte_table" else [])
            ck = build_group(group, cases, tmp_path_factory.mktemp("held") / group, long=False)
            built[group] = ck, app_server(create_app(Engine(HFModel(ck.folder), HFTokenizer(ck.folder))))
        return built[group]

    return start


class _Counting(OpenAIAdapter):
    """An OpenAIAdapter that keeps the body of every stream it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streams = []

    def stream_body(self, path, body, **kwargs):
        self.streams.append(body)
        return super().stream_body(path, body, **kwargs)


@pytest.mark.parametrize(("group", "endpoint"), [("byte_table", None), ("byte_table-chatml", "chatml")])
def test_decodespec_serve_passes_the_stop_cases_with_hold_back_checked(serve, group, endpoint):
    """Every stop case of the group passes with hold-back judged (no 'hold-back' left unchecked),
    from one stream asking for per-token reports, whose request the reproducer keeps; a case whose
    stop is kept in its output holds nothing back and sends none."""
    ck, url = serve(group)
    cases = _stop_cases(group)
    assert len(cases) >= 20 and {(chat_of(c) or {}).get("template") for c in cases} == {endpoint}
    results = run_cases(OpenAIAdapter(url, checkpoint=ck, sweep=False), cases)
    assert [(r.case.id, r.verdict) for r in results] == [(c.id, Verdict.PASS) for c in cases], [
        (r.case.id, r.verdict.value, r.reason, [f.message for f in r.failures]) for r in results
        if r.verdict is not Verdict.PASS]
    unchecked = [(r.case.id, m) for r in results for m in r.not_checked if m.startswith("hold-back")]
    assert unchecked == []
    for r in results:  # a stop kept in the output (include_stop_str_in_output) has nothing held (D33)
        asked = [e for e in r.observed["exchanges"] if e["request"]["body"].get("stream")
                 and asks_reports(e["request"]["body"])]
        want = expected_for(r.case, ck).holds_back
        assert len(asked) == want and all(_chunks_with_text_say_selected(e["sse"]) for e in asked), r.case.id


def _chunks_with_text_say_selected(sse: str) -> bool:
    """Every choice sent before the finish chunk with text says how many tokens were selected when it
    went out (D59); a stream whose stop cut all its text sends none."""
    with_text = [ch for ch in parse_sse(sse).choices()
                 if (ch.get("text") or (ch.get("delta") or {}).get("content")) and not ch.get("finish_reason")]
    return all("selected" in (ch.get("decodespec") or {}) for ch in with_text)


def test_one_stream_asks_for_reports_per_case_and_none_without_a_stop(serve):
    """The stream asking for per-token reports is sent once for a case with a stop, not again at
    each max_tokens of the sweep (§4.3), and not at all for a case with nothing to hold back."""
    ck, url = serve("byte_table")
    for case_id, want in (("stop/hold-back/001", 1), (NO_STOP, 0)):
        adapter = _Counting(url, checkpoint=ck, sweep=True)
        [res] = run_cases(adapter, load_cases([case_id]))
        assert res.verdict is Verdict.PASS, (res.reason, res.failures)
        assert len(adapter.streams) > 2 and sum(map(asks_reports, adapter.streams)) == want, adapter.streams


@pytest.mark.parametrize("bugs", [(), ("no_hold_back",)])
def test_a_frontend_that_sends_a_stop_prefix_early_is_caught_by_when_it_sent_it(serve, app_server, bugs):
    """stop/hold-back/001: 'B' of 'AB' may begin 'BX' until 'CD' rules it out; a frontend that sends
    'AB' at once ends with the right text, so only the timing shows it. Its stream asking for
    reports says one token was selected when 'AB' went out: the case leads with stop_prefix_sent,
    stream shape (it never fails a case alone, D69; --strict counts it). The frontend without the
    bug passes with hold-back checked."""
    ck, _ = serve("byte_table")
    [res] = run_cases(OpenAIAdapter(app_server(frontend_app(TokenEngine(ck), bugs)), checkpoint=ck),
                      load_cases(["stop/hold-back/001"]))
    assert res.verdict is Verdict.PASS and not any(m.startswith("hold-back") for m in res.not_checked), res
    if not bugs:
        assert res.failures == () and not unexpected([res], strict=True)
        return
    lead = res.lead
    assert (lead.symptom, severity_of(lead)) == ("stop_prefix_sent", Severity.STREAM_SHAPE), res.failures
    assert "with 1 token(s) selected the stream asking for per-token reports had sent 2 bytes" in lead.message
    assert unexpected([res], strict=True)
