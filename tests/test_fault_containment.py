"""Fault containment (§4.10, DECISIONS D20, D21): an exception raised by one request's
own step (its sampler on +inf logits, an id its tokenizer cannot decode, a content policy that
raises) ends that request FAILED with an error naming the cause while the engine serves the others;
an engine that cannot go on ends every live request at once and says so."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import torch
from _engine_kit import VOCAB, ascii_tokenizer, serve_in_thread, tiny_model

from decodespec.properties.monitors import check_trace
from decodespec.runtime import ByteTableTokenizer, Request, ScriptedModel, generate
from decodespec.runtime.engine import Engine, EngineFailed
from decodespec.runtime.server import create_app, reference_server, uvicorn_config
from decodespec.runtime.stream_events import StreamEventKind
from decodespec.spec import FinishReason

PADDED = VOCAB + 7  # a model vocabulary padded past the tokenizer's (ids 97..103 decode to nothing)
INF_LEN, PAD_LEN = 3, 4  # prompts of these lengths get +inf logits / an undecodable argmax


class PoisonModel:
    """The tiny model with a padded vocabulary: a sequence whose prompt has INF_LEN tokens gets
    logits with a +inf, one with PAD_LEN tokens an undecodable id as its argmax; the padding
    columns of every other row are -1e9 (never chosen)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.context_limit = inner, inner.name, inner.context_limit
        self.vocab_size, self.device = PADDED, inner.device

    def _pad(self, rows: torch.Tensor, caches: Sequence[Any]) -> torch.Tensor:
        out = torch.full((rows.shape[0], PADDED), -1e9)
        out[:, :VOCAB] = rows
        for b, c in enumerate(caches):
            if c.prompt_length == INF_LEN:
                out[b, 5] = float("inf")
            elif c.prompt_length == PAD_LEN:
                out[b, VOCAB + 3] = 1e9
        return out

    def prefill(self, prompt_ids: Sequence[int]) -> Any:
        logits, cache = self.inner.prefill(prompt_ids)
        return self._pad(logits.view(1, -1), [cache])[0], cache

    def decode_one(self, caches: Sequence[Any], tokens: Sequence[int]) -> Any:
        return self._pad(torch.stack(list(self.inner.decode_one(caches, tokens))), caches)


def _boom_at(n: int):
    """A content policy that raises on its n-th call (a policy's own bug)."""
    calls = [0]

    def policy(so_far: bytes, chunk: bytes) -> bool:
        calls[0] += 1
        if calls[0] == n:
            raise ZeroDivisionError("the policy divided by zero")
        return False

    return policy


def _prompt(n: int) -> list[int]:
    return [40 + i for i in range(n)]


def test_sampling_logits_with_inf_is_a_named_error_not_an_index_error():
    """§4.3 choose: +inf leaves no distribution; the sampler says so (D20) instead of IndexError."""
    from decodespec.runtime.sampling import Sampler, SamplingError, SamplingParams

    logits = torch.zeros(8)
    logits[3] = float("inf")
    with pytest.raises(SamplingError, match="no finite maximum"):
        Sampler(SamplingParams(temperature=1.0, seed=1), 8).choose(logits)
    assert Sampler(SamplingParams(), 8).choose(logits) == 3  # greedy: the argmax is defined


def test_each_faulty_request_fails_alone_while_the_others_finish():
    """+inf logits, a raising content policy and a raising grammar each end their own
    request FAILED with model_error naming the cause; 6 other requests in the same batch finish."""
    engine = Engine(PoisonModel(tiny_model()), ascii_tokenizer())
    good = [engine.submit(Request(_prompt(6 + i), max_output_tokens=12, temperature=0.8, seed=i)) for i in range(6)]
    inf = engine.submit(Request(_prompt(INF_LEN), max_output_tokens=12, temperature=0.8, seed=1))
    policy = engine.submit(Request(_prompt(7), max_output_tokens=12, content_policy=_boom_at(3)))
    engine.run_until_idle()
    assert [r.state for r in good] == ["FINISHED"] * 6
    assert inf.state == "FAILED" and inf.reason is FinishReason.MODEL_ERROR and "no finite maximum" in inf.error
    assert policy.state == "FAILED" and "ZeroDivisionError: the policy divided by zero" in policy.error
    for run in (inf, policy):  # the stream's terminal event carries the cause
        last = run.stream.events[-1]
        assert last.kind is StreamEventKind.FAILED and last.error == run.error
    for run in [*good, inf, policy]:
        assert check_trace(run.trace, tokenizer=ascii_tokenizer()) == []


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_an_id_the_tokenizer_cannot_decode_is_never_chosen(temperature):
    """D20: a padded vocabulary's ids are masked from selection (greedy and sampled, batched and
    not); the request runs as if they did not exist."""
    engine = Engine(PoisonModel(tiny_model()), ascii_tokenizer())
    runs = [engine.submit(Request(_prompt(PAD_LEN), max_output_tokens=10, temperature=temperature, seed=3)),
            engine.submit(Request(_prompt(9), max_output_tokens=10, temperature=temperature, seed=4))]
    engine.run_until_idle()
    for run in runs:
        assert run.state == "FINISHED", run.error
        assert all(t < VOCAB for t in run.tokens)
    alone = generate(Request(_prompt(PAD_LEN), max_output_tokens=10, temperature=temperature, seed=3),
                     model=PoisonModel(tiny_model()), tokenizer=ascii_tokenizer())
    assert alone.state.value == "FINISHED" and alone.tokens == tuple(runs[0].tokens)


def test_a_policy_that_raises_on_the_flushed_tail_fails_alone():
    """D20, D23: the drain's own code raising (the content policy judging the flushed stop prefix
    "Q") ends that request FAILED by the DRAINING model_error row; a request beside it finishes."""
    tok = ByteTableTokenizer({0: b"a", 1: b"b", 2: b"Q", 3: b""}, eos_id=3)
    engine = Engine(ScriptedModel([0, 1, 2, 0], vocab_size=4), tok)
    run = engine.submit(Request([0], max_output_tokens=3, stop=["QZ"], content_policy=_boom_at(3)))
    other = engine.submit(Request([0, 1], max_output_tokens=3, stop=["QZ"]))
    engine.run_until_idle()
    assert other.state == "FINISHED" and other.output == b"abQ"
    assert run.state == "FAILED" and "ZeroDivisionError" in run.error and run.output == b"ab"
    assert check_trace(run.trace, tokenizer=tok) == []


class _Bookkeeping(Exception):
    pass


def test_an_engine_that_cannot_go_on_ends_every_live_request_and_says_why(caplog):
    """D21: an exception in the Engine's own step (not one request's) ends every live request with
    its terminal event at once, is logged, and later submits are refused with EngineFailed."""
    engine = Engine(tiny_model(), ascii_tokenizer(), poll_s=0.001)
    runs = [engine.submit(Request(_prompt(4 + i), max_output_tokens=100)) for i in range(3)]
    steps = [0]
    real = engine._fit_budget

    def broken(ready):
        steps[0] += 1
        if steps[0] == 3:
            raise _Bookkeeping("the scheduler's own bug")
        return real(ready)

    engine._fit_budget = broken
    with caplog.at_level(logging.CRITICAL, logger="decodespec.engine"):
        engine.start()
        deadline = time.monotonic() + 30
        while engine.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        engine._thread.join(30)
    assert isinstance(engine.failure, _Bookkeeping)
    for run in runs:
        assert run.state == "FAILED" and "the scheduler's own bug" in run.error
        last = run.stream.events[-1]
        assert last.terminal and last.kind is StreamEventKind.FAILED
    assert engine.stats().live_requests == 0
    assert any("the engine failed" in r.getMessage() for r in caplog.records)
    with pytest.raises(EngineFailed, match="scheduler's own bug"):
        engine.submit(Request(_prompt(4), max_output_tokens=2))
    engine.stop()


def test_the_server_under_faults_keeps_serving_the_others():
    """A stream with +inf logits, a prompt with an undecodable id and 16 other
    streams at once: the poisoned stream ends with an error event naming the cause, the bad prompt
    is a 400 JSON, and all 16 finish with [DONE]."""
    engine = Engine(PoisonModel(tiny_model()), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name="tiny")) as url:
        outcomes: dict[str, str] = {}

        def stream(name: str, prompt: list[int], temperature: float) -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "stream": True, "temperature": temperature,
                    "seed": 7}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                lines = list(r.iter_lines())
            outcomes[name] = "done" if "data: [DONE]" in lines else next(
                (ln for ln in lines if "model_error" in ln), "\n".join(lines[-3:]))

        threads = [threading.Thread(target=stream, args=(f"ok{i}", _prompt(6 + i % 5), 0.7)) for i in range(16)]
        threads.append(threading.Thread(target=stream, args=("inf", _prompt(INF_LEN), 0.7)))
        for t in threads:
            t.start()
        bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [1, VOCAB + 2], "max_tokens": 4},
                         timeout=30)
        for t in threads:
            t.join(60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
        assert "no finite maximum" in outcomes.pop("inf")
        assert outcomes == {f"ok{i}": "done" for i in range(16)}
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_failed_engine_makes_health_503_and_new_requests_503_json():
    """D21: after the engine failed, /health says so and a completion, of one choice or of n (D34),
    is a 503 JSON error that says the engine failed."""
    engine = Engine(tiny_model(), ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name="tiny")) as url:
        engine.failure = _Bookkeeping("gone")
        h = httpx.get(f"{url}/health")
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
        n = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2},
                       timeout=30)
    assert h.status_code == 503 and h.json()["status"] == "failed"
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    assert n.status_code == 503 and n.json()["error"]["code"] == "engine_failed", n.text


def test_the_reference_server_shuts_down_when_its_engine_fails():
    """D21: the server's tick sees the engine's failure and exits (the CLI then exits 1)."""
    import asyncio

    engine = Engine(tiny_model(), ascii_tokenizer())
    server = reference_server(uvicorn_config(create_app(engine, manage_engine=False)), engine, 1.0)
    asyncio.run(server.on_tick(1))
    assert not server.should_exit
    engine.failure = _Bookkeeping("gone")
    asyncio.run(server.on_tick(2))
    assert server.should_exit


class _StuckModel:
    """The tiny model whose decode blocks until released (a kernel that never returns)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.context_limit = inner, inner.name, inner.context_limit
        self.vocab_size, self.device = inner.vocab_size, inner.device
        self.release = threading.Event()

    def prefill(self, prompt_ids: Sequence[int]) -> Any:
        return self.inner.prefill(prompt_ids)

    def decode_one(self, caches: Sequence[Any], tokens: Sequence[int]) -> Any:
        self.release.wait(30)
        return self.inner.decode_one(caches, tokens)


def test_health_reports_a_step_that_never_returns():
    """D21 (the watchdog): with a decode call that does not return, /health turns 503 "stalled"
    once the step has run past the bound, and the gauge shows how long; it recovers after."""
    model = _StuckModel(tiny_model())
    engine = Engine(model, ascii_tokenizer(), poll_s=0.001)
    with serve_in_thread(create_app(engine, model_name="tiny", watchdog_s=0.3)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        engine.submit(Request(_prompt(4), max_output_tokens=2))
        deadline = time.monotonic() + 20
        while engine.step_running_s < 0.5 and time.monotonic() < deadline:
            time.sleep(0.02)
        h = httpx.get(f"{url}/health")
        metrics = httpx.get(f"{url}/metrics").text
        model.release.set()
    assert h.status_code == 503 and h.json()["status"] == "stalled", h.text
    gauge = re.search(r"^decodespec_engine_step_seconds ([0-9.]+)$", metrics, re.M)
    assert gauge and float(gauge.group(1)) > 0.3, metrics[-400:]
    assert engine.step_running_s == 0.0


def test_generate_contains_a_raising_policy_too():
    """D20 in the single-path loop: generate() returns the FAILED result instead of raising."""
    res = generate(Request(_prompt(5), max_output_tokens=6, content_policy=_boom_at(2)),
                   model=tiny_model(), tokenizer=ascii_tokenizer())
    assert res.state.value == "FAILED" and "ZeroDivisionError" in res.error
