"""What only a gateway can break, caught by the right case and attributed to the gateway.

decodespec serve on a forced checkpoint is the worker; tests/_gateway_kit.py's pass-through stands in
front of it. Honest, every case of DUTIES passes through it as it passes directly; told to break one
duty (re-streaming, a request field carried, an error carried, a disconnect carried), the duty's case
shows the duty's symptom, and the report read against the direct run (attribution.py) marks that
finding the gateway's own. The rules: §4.3 (the deltas' concatenation, no empty delta), §4.6 (stop),
§4.5 (max_tokens), §4.7 (one terminal, nothing after it; usage; SSE ids a client resumes from, D42; a
worker's failure is no end of the answer), §4.9 (a client's disconnect ends the work), and the OpenAI
API (`[DONE]`, n, a bad request's 4xx). The worker-failure case runs on two workers, one of which the
test makes fail mid-answer (life/failover.py).
"""

from __future__ import annotations

import attrs
import pytest

from decodespec.properties.conformance import load_cases
from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.attribution import attribution_json
from decodespec.properties.conformance.checkpoints import TABLE_GROUP, build_group, group_of, http_blocker
from decodespec.properties.conformance.life import failover
from decodespec.properties.conformance.reports import to_json
from decodespec.properties.conformance.runner import CaseResult, Verdict, run_case

pytest.importorskip("transformers")
_gateway_kit = pytest.importorskip("_gateway_kit")


@attrs.frozen
class Duty:
    """What a gateway must carry, the case that shows it, the symptom it shows when broken (None: the
    case becomes n/a behind the gateway, judged directly: attribution's `lost`)."""

    fault: str
    case: str
    symptom: str | None


DUTIES = (
    Duty("reorder", "detok/utf8-split/001", "stream_vs_batch"),
    Duty("finish_early", "stop/cross-token/001", "content_after_finish"),
    Duty("empty_chunks", "stream/delta-nonempty/001", "empty_delta"),
    Duty("drop_usage", "http/usage/001", "usage_chunk"),
    Duty("drop_done", "stream/delta-nonempty/001", "done_missing"),
    Duty("drop_ids", "http/stream/resume/001", "no_event_ids"),
    Duty("hide_request_id", "http/stream/resume/001", "no_resume"),
    Duty("drop_stop", "stop/cross-token/001", "stop_sent"),
    Duty("drop_max_tokens", "finish/length/001", "stop_without_hit"),
    Duty("drop_n", "stop/n-choices/001", "choices_missing"),
    Duty("drop_token_reports", "stream/tokens-aligned/001", None),
    Duty("error_as_200", "http/request/bad-input/001", "accepted_bad_input"),
    Duty("error_as_502", "http/request/bad-input/001", "accepted_bad_input"),
    Duty("keeps_reading", "http/lifecycle/disconnect/001", "ran_on"),
)
CASES = {c.id: c for c in load_cases()}
SMALL = {"slots": 2, "timeout_s": 60}  # the disconnect case's load, scaled down for CI


def _small(case):
    """The case with two abandoned streams instead of its load (their 480 tokens kept: a place a
    disconnect frees must come back well before the abandoned rest would have run)."""
    return attrs.evolve(case, inputs={**case.inputs, **{k: v for k, v in SMALL.items() if k in case.inputs}})


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    cases = [c for c in load_cases() if group_of(c) == TABLE_GROUP and http_blocker(c) is None]
    return build_group(TABLE_GROUP, cases, tmp_path_factory.mktemp("gateway") / TABLE_GROUP)


def _worker_app(ck):
    """decodespec serve, a stream's disconnect cancelling its request (`--on-disconnect cancel`), so a
    disconnect the gateway carries frees the worker's place at once."""
    from decodespec.runtime.engine import Engine
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.server import create_app
    from decodespec.runtime.tokenizers import HFTokenizer

    return create_app(Engine(HFModel(ck.folder), HFTokenizer(ck.folder), max_batch=2), on_disconnect="cancel")


@pytest.fixture(scope="module")
def worker(ck, app_server):
    return app_server(_worker_app(ck))


def _run(url, ck, case_id) -> CaseResult:
    return run_case(OpenAIAdapter(url, checkpoint=ck, tight=True), _small(CASES[case_id]))


@pytest.fixture(scope="module")
def direct(worker, ck):
    """Each duty's case judged directly: the worker's own run, that a gateway's is read against."""
    return {cid: _run(worker, ck, cid) for cid in sorted({d.case for d in DUTIES})}


def _report(results):
    return to_json(list(results), "run")


@pytest.mark.parametrize("case_id", sorted({d.case for d in DUTIES}))
def test_an_honest_gateway_passes_each_duty_case_as_the_worker_does(case_id, direct, worker, ck, app_server):
    res = _run(app_server(_gateway_kit.gateway_app(worker)), ck, case_id)
    assert direct[case_id].verdict is Verdict.PASS, direct[case_id].failures
    assert res.verdict is Verdict.PASS, (res.reason, res.failures)
    own = attribution_json(_report([res]), {"worker": _report([direct[case_id]])})
    assert own["counts"]["gateway"]["findings"] == 0 and own["lost"] == []


@pytest.mark.parametrize("duty", DUTIES, ids=[d.fault for d in DUTIES])
def test_a_gateway_breaking_a_duty_is_caught_by_its_case_and_attributed_to_the_gateway(duty, direct, worker, ck,
                                                                                      app_server):
    res = _run(app_server(_gateway_kit.gateway_app(worker, duty.fault)), ck, duty.case)
    own = attribution_json(_report([res]), {"worker": _report([direct[duty.case]])})
    if duty.symptom is None:
        assert res.verdict is Verdict.SKIP and [c["case"] for c in own["lost"]] == [duty.case], res.reason
        return
    assert duty.symptom in {f.symptom for f in res.failures}, (res.verdict, res.reason, res.failures)
    assert {(f["symptom"], f["owner"]) for f in own["findings"] if f["symptom"] == duty.symptom} == {
        (duty.symptom, "gateway")}


# A worker's failure needs two workers and one that fails: its duty runs apart from DUTIES.
FAILOVER = Duty("finishes_broken", failover.CASE.id, "cut_as_finished")


def _through_a_failure(ck, app_server, fault):
    """The worker-failure case through the kit's gateway in front of two fresh workers, the first
    made to fail once each stream has read the case's `cut_at` deltas."""
    mortals = [_gateway_kit.Mortal(_worker_app(ck)) for _ in range(2)]
    gateway = app_server(_gateway_kit.gateway_app([app_server(m) for m in mortals], fault))

    def stop_one() -> str:
        mortals[0].kill()
        return "the first worker failed (its answers broke off mid-body)"

    with failover.stopping(stop_one):
        return run_case(OpenAIAdapter(gateway, checkpoint=ck, tight=True), failover.CASE)


def test_an_honest_gateway_ends_a_failed_workers_streams_as_errors_and_keeps_the_others_whole(ck, app_server):
    """§4.7: each stream of the failed worker ends as an error; the other worker's are whole."""
    res = _through_a_failure(ck, app_server, None)
    assert res.verdict is Verdict.PASS and not res.failures, (res.reason, res.failures)
    assert not res.not_checked, res.not_checked  # the failure did break streams off: the case was shown
    assert "2 whole, 2 ended as an error" in res.observed["notes"][0], res.observed["notes"]


def test_a_gateway_ending_a_broken_off_stream_as_whole_is_caught():
    """The case's rules on recorded streams need no server: a short stream ended by a finish chunk
    and [DONE] is the finding, the same stream ended by an error event is not."""
    from decodespec.properties.conformance.life.exchange import Exchange, Job
    from decodespec.properties.conformance.wire import Streamed, feed

    def stream(*lines):
        st = Streamed()
        for line in lines:
            feed(st, line)
        return Exchange(Job("long", "/v1/completions", {}, True), status=200, streamed=st)

    text = 'data: {"choices": [{"index": 0, "text": "ab"}]}'
    whole = stream(text, "", 'data: {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]}', "",
                   "data: [DONE]", "")
    short = stream(text, "", 'data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}', "",
                   "data: [DONE]", "")
    error = stream(text, "", 'data: {"error": {"message": "the worker failed"}}', "")
    found, counts = failover.judge_streams([whole, error], "abc")
    assert found == [] and counts["whole"] == 1 and counts["error"] == 1
    found, _ = failover.judge_streams([whole, short], "abc")
    assert [f.symptom for f in found] == ["cut_as_finished"]
    found, _ = failover.judge_streams([error, error], "abc")
    assert [f.symptom for f in found] == ["healthy_cut"]


def test_a_gateway_hiding_a_workers_failure_is_caught_by_the_worker_failure_case(ck, app_server):
    res = _through_a_failure(ck, app_server, FAILOVER.fault)
    assert FAILOVER.symptom in {f.symptom for f in res.failures}, (res.verdict, res.reason, res.failures)
    assert res.verdict is Verdict.FAIL


def test_every_fault_of_the_gateway_kit_has_its_duty():
    """A misbehaviour the kit can do and no case is shown to catch would be an untested claim."""
    assert sorted(d.fault for d in (*DUTIES, FAILOVER)) == sorted(_gateway_kit.FAULTS)
