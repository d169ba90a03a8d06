"""§4.6 hold-back over HTTP (DECISIONS D59): a script case whose stream must hold text back for a
stop is streamed once more asking for per-token reports (http_script.run_script), and judged from
when each chunk went out in selected tokens: decodespec serve says it with every chunk of such a
stream (`decodespec.selected`), so it passes every stop case with hold-back checked, not partial."""

from __future__ import annotations

import pytest

from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.alignment import asks_reports
from decodespec.properties.conformance.cases import CaseKind, load_cases
from decodespec.properties.conformance.chat_cases import chat_of
from decodespec.properties.conformance.judgement import expected_for
from decodespec.properties.conformance.checkpoints import build_group, group_of, http_blocker
from decodespec.properties.conformance.runner import Verdict, run_cases
from decodespec.runtime.engine import Engine
from decodespec.runtime.server import create_app

NO_STOP = "detok/utf8-split/001"  # a byte_table case without stop strings: nothing to hold back


def _stop_cases():
    return [c for c in load_cases() if c.kind is CaseKind.SCRIPT and c.inputs.get("stop") and chat_of(c) is None
            and http_blocker(c) is None and group_of(c) == "byte_table" and "context_limit" not in c.inputs]


@pytest.fixture(scope="module")
def served(tmp_path_factory, app_server):
    """The byte_table checkpoint of every stop case (and NO_STOP), and decodespec serve on it."""
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.tokenizers import HFTokenizer

    cases = _stop_cases() + load_cases([NO_STOP])
    ck = build_group("byte_table", cases, tmp_path_factory.mktemp("held") / "byte_table", long=False)
    return ck, app_server(create_app(Engine(HFModel(ck.folder), HFTokenizer(ck.folder))))


class _Counting(OpenAIAdapter):
    """An OpenAIAdapter that keeps the body of every stream it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streams = []

    def stream_body(self, path, body, **kwargs):
        self.streams.append(body)
        return super().stream_body(path, body, **kwargs)


def test_decodespec_serve_passes_the_stop_cases_with_hold_back_checked(served):
    """Every byte_table stop case passes with hold-back judged (no 'hold-back' left unchecked), from
    one stream asking for per-token reports, whose request the reproducer keeps; a case whose stop is
    kept in its output holds nothing back and sends none."""
    ck, url = served
    cases = _stop_cases()
    assert len(cases) >= 20
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
        assert len(asked) == want and all('"selected"' in e["sse"] for e in asked), r.case.id


def test_one_stream_asks_for_reports_per_case_and_none_without_a_stop(served):
    """The stream asking for per-token reports is sent once for a case with a stop, not again at
    each max_tokens of the sweep (§4.3), and not at all for a case with nothing to hold back."""
    ck, url = served
    for case_id, want in (("stop/hold-back/001", 1), (NO_STOP, 0)):
        adapter = _Counting(url, checkpoint=ck, sweep=True)
        [res] = run_cases(adapter, load_cases([case_id]))
        assert res.verdict is Verdict.PASS, (res.reason, res.failures)
        assert len(adapter.streams) > 2 and sum(map(asks_reports, adapter.streams)) == want, adapter.streams
