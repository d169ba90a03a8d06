"""The request's life over HTTP, black box, against decodespec serve on a forced checkpoint
(§4.7-§4.10): many requests at once come back exactly as alone, every stream under load ends with
one terminal, a KV budget too small for the load preempts without changing an answer, abandoned
streams free their places, and a cut stream resumes from its Last-Event-ID. Counts are the cases'
own, made small where they only scale the load (the peers run them whole)."""

from __future__ import annotations

import attrs
import pytest

from decodespec.properties.conformance import load_cases
from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.checkpoints import (
    LONG,
    LONG_TOKENS,
    TABLE_GROUP,
    build_group,
    generate_batch,
    group_of,
    http_blocker,
)
from decodespec.properties.conformance.life import MODEL_CHECKED, RECIPES
from decodespec.properties.conformance.life.exchange import Exchange, Job
from decodespec.properties.conformance.life.recipes import against_alone
from decodespec.properties.conformance.runner import Verdict, run_case, unexpected
from decodespec.properties.conformance.wire import parse_sse, terminal_findings

pytest.importorskip("transformers")
LIFE = [c for c in load_cases(["http/"]) if c.recipe in RECIPES]
SMALL = {"in_flight": 12, "long": 4, "timeout_s": 120}  # the load, scaled down for CI


def small(case):
    """The case with less load, and long requests of 120 tokens (160 where a disconnect is timed
    against the rest of the run) instead of the long program's 480."""
    over = {k: v for k, v in SMALL.items() if k in case.inputs}
    return attrs.evolve(case, inputs={**case.inputs, **over, "long_tokens": 160 if "cut_at" in case.inputs else 120})


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    cases = [c for c in load_cases() if group_of(c) == TABLE_GROUP and http_blocker(c) is None]
    return build_group(TABLE_GROUP, cases, tmp_path_factory.mktemp("life") / TABLE_GROUP)


def _engine(ck, **kw):
    from decodespec.runtime.engine import Engine
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.tokenizers import HFTokenizer

    return Engine(HFModel(ck.folder), HFTokenizer(ck.folder), **kw)


@pytest.fixture(scope="module")
def servers(ck, app_server):
    """decodespec serve plain, and tight as the peers start it (`--max-batch 4`), its KV budget scaled
    to the shorter long requests (300 tokens: two of 122 fit, four do not)."""
    from decodespec.runtime.server import create_app

    return {"plain": app_server(create_app(_engine(ck))),
            "tight": app_server(create_app(_engine(ck, max_batch=4, cache_budget_tokens=300)))}


def adapter(ck, servers, case):
    tight = case.inputs.get("server") == "tight"
    return OpenAIAdapter(servers["tight" if tight else "plain"], checkpoint=ck, tight=tight)


def test_the_checkpoint_carries_a_long_program_to_its_eos(ck):
    """Item 1: a 480-token script (with its EOS) within the 512-token context, which transformers
    generate follows to its EOS (float32 here; `decodespec checkpoints build` proves it in every dtype)."""
    from transformers import AutoModelForCausalLM

    prog = ck.programs[LONG]
    assert len(prog.script) == LONG_TOKENS + 1 and prog.script[-1] == ck.eos_id
    assert len(prog.prompt) + len(prog.script) <= 512
    model = AutoModelForCausalLM.from_pretrained(ck.folder).eval()
    [got] = generate_batch(model, [prog.prompt], len(prog.script), ck.eos_id)
    assert got == list(prog.script)


def test_a_checkpoint_built_without_the_long_program_makes_the_life_cases_na(tmp_path):
    """A build for the script cases alone (build_group's `long`) leaves the long program out; a
    request-life case on it is n/a and says what is missing, never a crash or a vacuous pass."""
    cases = [c for c in load_cases() if group_of(c) == TABLE_GROUP and http_blocker(c) is None][:2]
    bare = build_group(TABLE_GROUP, cases, tmp_path / TABLE_GROUP, long=False)
    assert LONG not in bare.programs
    why = OpenAIAdapter("http://127.0.0.1:9", checkpoint=bare, tight=True).unsupported(LIFE[0])
    assert why is not None and "long" in why, why


@pytest.mark.slow
@pytest.mark.parametrize("case", LIFE, ids=lambda c: c.id)
def test_the_reference_passes_every_request_life_case_over_http(ck, servers, case):
    """Items 2-6 and 8: decodespec serve passes each case, resumption included (a MUST for the
    reference: D5), and the preemption case saw the engine preempt (else it would be n/a)."""
    res = run_case(adapter(ck, servers, case), small(case))
    assert res.verdict is Verdict.PASS, (res.reason, res.failures, res.observed.get("notes"))
    notes = " ".join(res.observed["notes"])
    assert "approximates the model-checked" in notes
    if case.recipe == "preemption":
        assert "decodespec_preemptions_total +" in notes and "+0 " not in notes + " "
    assert res.observed["exchanges"]


def test_tight_cases_are_na_on_a_server_not_started_tight(ck, servers):
    """Preemption and the freed places mean nothing on a server with room for everything: n/a, naming the flag."""
    case = next(c for c in LIFE if c.recipe == "preemption")
    res = run_case(OpenAIAdapter(servers["plain"], checkpoint=ck), small(case))
    assert res.verdict is Verdict.SKIP and "--launch-tight" in res.reason


def _ex(job, sse=None, data=None):
    st = parse_sse(sse) if sse is not None else None
    return Exchange(job, status=200, raw=sse or "", data=data, streamed=st)


def test_an_answer_changed_by_its_neighbours_is_a_finding_that_keeps_both_exchanges(ck):
    """§4.8: the answer under load differs from the same request alone: batch_mismatch, both kept."""
    a = OpenAIAdapter("http://127.0.0.1:9", checkpoint=ck)
    log: list = []
    a._case.log = log
    job = Job("stop/x/001", "/v1/completions", {"prompt": [1]}, False)
    solo = _ex(job, data={"choices": [{"text": "ABCD", "finish_reason": "stop"}], "usage": {"completion_tokens": 2}})
    busy = _ex(job, data={"choices": [{"text": "ABCE", "finish_reason": "stop"}], "usage": {"completion_tokens": 2}})
    [f] = against_alone(a, {("stop/x/001", False): solo}, [busy], "with 2 in flight")
    assert (f.symptom, f.invariant) == ("batch_mismatch", "refinement") and "first difference at 3" in f.message
    assert [e["label"] for e in log] == ["stop/x/001 alone", "stop/x/001 (not streamed, request 1 of 1 with 2 in flight)"]
    assert against_alone(a, {("stop/x/001", False): solo}, [solo], "alone") == []


def test_a_stream_the_server_closes_mid_body_breaks_single_terminal_event(ck):
    """§4.7: a stream answered 200 whose connection the server closes before any terminal event
    (llama-cpp-python interrupting it for a newer request) is `stream_cut`, a MUST finding of
    single_terminal_event, not a dropped connection; a failure before any answer, or after the
    finish chunk, is the connection's (`connection_dropped`, wire)."""
    a = OpenAIAdapter("http://127.0.0.1:9", checkpoint=ck)
    job = Job(LONG, "/v1/completions", {"prompt": [1], "stream": True}, True)
    text = 'data: {"id":"c","choices":[{"index":0,"text":"w000","finish_reason":null}]}\n'
    solo = Exchange(job, status=200, streamed=parse_sse(text.replace("null", '"stop"') + "data: [DONE]\n"))
    failure = "RemoteProtocolError: peer closed connection without sending complete message body"
    cut = Exchange(job, status=200, streamed=parse_sse(text), failed=failure)
    never = Exchange(job, failed="ConnectError: [Errno 111] Connection refused")
    late = Exchange(job, status=200, streamed=parse_sse(text.replace("null", '"stop"')), failed=failure)
    found = against_alone(a, {(LONG, True): solo}, [cut, never, late], "with 3 in flight")
    assert [(f.symptom, f.invariant, f.family) for f in found] == [
        ("stream_cut", "single_terminal_event", "semantics"), ("connection_dropped", "http_keep_alive", "wire")]
    assert "1 deltas" in found[0].message and "request 1 of 3" in found[0].message
    assert "request 2 of 3" in found[1].message and "request 3 of 3" in found[1].message  # merged per symptom


def test_answers_whose_request_failed_alone_are_named_unjudged_not_passed(ck):
    """§4.8: an answer under load is judged against the same request alone. Where that request failed
    alone (a dropped connection, a cut stream), its answers under load were compared with nothing:
    the failure is a finding of its own and the answers are listed as not checked, so the case is
    partial, never a silent pass."""
    from decodespec.properties.conformance.life.recipes import unjudged

    a = OpenAIAdapter("http://127.0.0.1:9", checkpoint=ck)
    short = Job("stop/x/001", "/v1/completions", {"prompt": [1]}, False)
    answer = {"choices": [{"text": "ABCD", "finish_reason": "stop"}], "usage": {"completion_tokens": 2}}
    solo = {("stop/x/001", False): Exchange(short, failed="RemoteProtocolError: Server disconnected without sending a response."),
            (LONG, False): _ex(attrs.evolve(short, name=LONG), data=answer)}
    got = [_ex(short, data=answer), _ex(short, data={**answer, "choices": [{"text": "other", "finish_reason": "stop"}]}),
           _ex(attrs.evolve(short, name=LONG), data=answer)]
    [f] = against_alone(a, solo, got, "with 3 in flight")
    assert (f.symptom, f.family) == ("connection_dropped", "wire") and "stop/x/001 (not streamed) alone" in f.message
    [why] = unjudged(solo, got)
    assert why.startswith("2 answer(s) of stop/x/001 (not streamed) under load: the same request alone failed")
    assert unjudged(solo, got[2:]) == [] and against_alone(a, solo, got[2:], "alone") == []


def test_a_request_alone_that_got_no_answer_is_sent_again_and_the_drop_kept_as_a_finding():
    """The answers alone are what the load is judged against: one whose connection failed before any
    answer (llama-server drops idle keep-alive connections) is sent again, up to ALONE_TRIES, and each
    failed try is a finding, so the load is still judged and nothing is retried silently."""
    import json
    import socket
    import threading
    from types import SimpleNamespace

    from decodespec.properties.conformance.life.recipes import ALONE_TRIES, alone, sent_again

    listener = socket.create_server(("127.0.0.1", 0))
    body = json.dumps({"choices": [{"text": "ABCD", "finish_reason": "stop"}]}).encode()

    def serve(drops: int) -> None:
        with listener:
            for i in range(drops + 1):
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    if i == drops:
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                                     b"content-length: %d\r\n\r\n%s" % (len(body), body))

    thread = threading.Thread(target=serve, args=(ALONE_TRIES - 1,), daemon=True)
    thread.start()
    job = Job("stop/x/001", "/v1/completions", {"prompt": [1]}, False)
    solo, retried = alone(SimpleNamespace(url=f"http://127.0.0.1:{listener.getsockname()[1]}"), [job, job], 10)
    thread.join(10)
    assert solo["stop/x/001", False].answer[1] == "ABCD" and len(retried) == ALONE_TRIES - 1
    found = sent_again(retried)
    assert {(f.symptom, f.family) for f in found} == {("connection_dropped", "wire")}
    assert "stop/x/001 (not streamed) alone, sent again" in found[0].message


def test_a_stream_cut_with_done_and_no_finish_reason_breaks_single_terminal_event():
    """§4.7 (llama-cpp-python's interrupt_requests): text, then [DONE] without a finish chunk."""
    cut = 'data: {"id":"c","choices":[{"index":0,"text":"w000","finish_reason":null}]}\n\ndata: [DONE]\n'
    [f] = terminal_findings(parse_sse(cut))
    assert (f.symptom, f.invariant) == ("no_reason", "single_terminal_event") and "before [DONE]" in f.message
    whole = cut.replace('"finish_reason":null}]}\n\ndata: [DONE]', '"finish_reason":"stop"}]}\n\ndata: [DONE]')
    assert terminal_findings(parse_sse(whole)) == []


def test_a_router_that_serves_its_workers_metrics_at_engine_metrics_is_read():
    """SGLang's gateway (smg) answers /metrics with 404 and offers its workers' Prometheus text at
    /engine_metrics, each sample labelled with its worker: the gauges are read there, summed."""
    import httpx

    from decodespec.properties.conformance.life.exchange import preemptions, read_metrics, running

    text = "\n".join(f'vllm:{n}{{engine="0",worker_addr="http://127.0.0.1:{w}"}} {v}'
                     for w, run, pre in ((1, 1, 3), (2, 2, 4)) for n, v in (("num_requests_running", run),
                                                                            ("num_preemptions_total", pre)))

    def router(request):
        return httpx.Response(200, text=text) if request.url.path == "/engine_metrics" else httpx.Response(404)

    with httpx.Client(transport=httpx.MockTransport(router), base_url="http://router") as c:
        got = read_metrics(c)
    assert running(got) == {"vllm:num_requests_running": 3.0}
    assert preemptions(got) == {"vllm:num_preemptions_total": 7.0}
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(404)), base_url="http://bare") as c:
        assert read_metrics(c) is None


def _anonymous(app):
    """The server with its X-Request-Id header taken off every answer: a client can then neither
    cancel nor resume its stream (D5), so an abandoned one runs on and keeps its place."""

    async def wrapped(scope, receive, send):
        async def strip(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message["headers"] if k.lower() != b"x-request-id"]}
            await send(message)

        await app(scope, receive, strip)

    return wrapped


@pytest.mark.slow
def test_streams_that_run_on_after_their_client_left_are_found(ck, app_server):
    """§4.9, §4.10: a server whose abandoned streams keep their places (here the reference with its
    request ids hidden, so nobody cancels: a stream pauses once 4 events wait unread and then parks
    for --detach-timeout, 4 s) fails the disconnect cases; one that names no request to resume has a
    stream-shape finding (D42: asked of engines, a failure only with --strict). The small buffer makes
    the park certain: with the default 256 events a 60-token stream could end on its own within the
    bound and free its place."""
    from decodespec.runtime.server import create_app

    url = app_server(_anonymous(create_app(_engine(ck, max_batch=2, detach_timeout_s=4.0), max_buffer_events=4)))
    a = OpenAIAdapter(url, checkpoint=ck, tight=True)
    by = {c.recipe: c for c in LIFE}
    short = {"slots": 2, "bound_s": 2, "long_tokens": 60}
    frees = run_case(a, attrs.evolve(by["disconnect_frees"], inputs={**by["disconnect_frees"].inputs, **short}))
    assert frees.verdict is Verdict.FAIL and frees.failures[0].symptom == "slot_leaked", frees.failures
    abort = run_case(a, attrs.evolve(by["disconnect_abort"], inputs={**by["disconnect_abort"].inputs, **short}))
    assert abort.verdict is Verdict.FAIL and "ran_on" in {f.symptom for f in abort.failures}
    res = run_case(a, attrs.evolve(by["resume"], inputs={**by["resume"].inputs, "long_tokens": 60}))
    # resumption is the stream's shape, asked of engines by D42: reported, failing the run only with --strict
    assert res.verdict is Verdict.PASS and [f.symptom for f in res.shape] == ["no_resume"]
    assert unexpected([res]) == [] and unexpected([res], strict=True) == [res]


def test_each_black_box_recipe_cites_model_checked_properties_that_exist():
    """Item 8: the properties cited beside each recipe are invariants of spec/invariants.toml or
    witnesses of the model checker."""
    from decodespec.machine.checker_model import POOL_WITNESSES, WITNESSES
    from decodespec.spec.invariants import load_invariants

    known = set(load_invariants()) | set(WITNESSES) | set(POOL_WITNESSES)
    assert set(MODEL_CHECKED) == set(RECIPES)
    assert {n for names in MODEL_CHECKED.values() for n in names} <= known


def test_request_life_cases_run_one_at_a_time_after_the_others(ck, monkeypatch, tmp_path):
    """A launched run (`conform --launch -j N`) sends the request-life cases one at a time, after the
    script cases: a load case timed beside other cases would measure them, not the engine alone."""
    import contextlib

    from decodespec.properties.conformance import launch

    calls: list[tuple[list[str], int]] = []

    def fake_run_cases(adapter, cases, *, jobs=1, on_result=None):
        calls.append(([c.id for c in cases], jobs))
        return [launch.CaseResult(c, "fake", Verdict.SKIP, reason="not run") for c in cases]

    monkeypatch.setattr(launch, "launched", lambda *a, **k: contextlib.nullcontext("http://127.0.0.1:9"))
    monkeypatch.setattr(launch, "run_cases", fake_run_cases)
    script = [c for c in load_cases() if c.id in ck.programs][:3]
    cases = [*LIFE, *script]
    launch.run_launched(cases, [ck.folder], "serve {port}", log_dir=tmp_path, jobs=4, tight_command="tight {port}")
    life = {c.id for c in LIFE}
    assert [ids for ids, _ in calls if set(ids) & life and set(ids) - life] == []  # never mixed in one call
    assert all(jobs == 1 for ids, jobs in calls if set(ids) & life)
    order = [i for ids, _ in calls for i in ids]
    assert max(order.index(c.id) for c in script) < min(order.index(i) for i in life if i in order)
    assert life <= set(order) and any(jobs == 4 and ids for ids, jobs in calls)
