"""The conformance cases of the termination fields (§4.3, §4.5, §4.6; DECISIONS D31-D34):
the reference produces what each case file expects, white-box engines that cannot take the
fields say so (n/a), and on a forced checkpoint `decodespec serve`, sent each case's
`inputs.request` in the body beside what http_script sends, answers exactly what the reference
computes for that checkpoint, per choice (n = 2: every choice is the one greedy run)."""

from __future__ import annotations

import json

import httpx
import pytest

from decodespec.properties.conformance import Verdict, adapter_for, load_cases, run_cases
from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.checkpoints import TABLE_GROUP, build_group, reference_result
from decodespec.properties.conformance.http_script import request_body
from decodespec.runtime.openai_schema import OPENAI_FINISH


def _field_cases():
    return [c for c in load_cases() if c.inputs.get("request")]


def test_every_termination_field_has_a_case():
    """min_tokens before, at and after its count with EOS and a stop string,
    ignore_eos, n = 2 with a stop, include_stop_str_in_output, echo into a split character, logit_bias."""
    fields = {k for c in _field_cases() for k in c.inputs["request"]}
    assert {"min_tokens", "ignore_eos", "n", "include_stop_str_in_output", "echo", "logit_bias",
            "skip_special_tokens"} <= fields
    ids = {c.id for c in _field_cases()}
    assert {"finish/min-tokens/001", "finish/min-tokens/002", "finish/min-tokens/003", "stop/min-tokens/001",
            "stop/min-tokens/002", "finish/ignore-eos/001", "stop/n-choices/001", "stop/include-stop/001",
            "detok/echo/001", "finish/logit-bias/001"} <= ids


@pytest.mark.parametrize("case", _field_cases(), ids=lambda c: c.id)
def test_the_reference_produces_each_case_file_expectation(case):
    """The case file's output, reason and state are the reference's own (with the fields mapped as
    decodespec serve maps them), and its trace breaks no invariant."""
    [res] = run_cases(adapter_for("reference"), [case])
    out = res.observed
    want = case.expect
    assert (out["output"], out["finish_reason"], out["state"]) == (
        want.output.decode("utf-8"), want.finish_reason, want.state), res.failures
    assert res.verdict is Verdict.PASS, res.failures  # a kept stop (D33) is no leak


def test_an_engine_without_the_fields_is_na_naming_them():
    """A white-box engine that takes no request fields (transformers generate, DecodeStream) says
    which field it lacks; the case is never passed without them."""
    from decodespec.properties.conformance.adapters.base import missing_capabilities

    class Plain:
        name, capabilities = "plain", frozenset({"forced_script", "byte_table", "eos", "length_limit", "stop_strings"})

    case = next(c for c in load_cases() if c.id == "finish/min-tokens/001")
    assert missing_capabilities(Plain(), case) == "plain cannot run the request field logit_bias; the request field min_tokens"


# ---- over HTTP, on a forced checkpoint of these cases ---------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, app_server):
    from decodespec.runtime.engine import Engine
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.server import create_app
    from decodespec.runtime.tokenizers import HFTokenizer

    cases = [c for c in _field_cases() if "table" in c.tokenizer_spec]
    ck = build_group(TABLE_GROUP, cases, tmp_path_factory.mktemp("forced") / TABLE_GROUP, long=False)
    url = app_server(create_app(Engine(HFModel(ck.folder), HFTokenizer(ck.folder))))
    return ck, OpenAIAdapter(url, checkpoint=ck), cases


def _stream(url: str, body: dict) -> dict[int, tuple[str, list[str]]]:
    """Per choice index: the streamed text and its finish reasons."""
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                    if ch["finish_reason"]:
                        reasons.setdefault(ch["index"], []).append(ch["finish_reason"])
    return {i: (texts[i], reasons.get(i, [])) for i in texts}


@pytest.mark.slow
def test_decodespec_serve_answers_the_reference_on_the_forced_checkpoint(served):
    """Each case's body is http_script's (the program's prompt ids, greedy, max_tokens, stop) plus
    its inputs.request; non-streamed and streamed, every choice must be the reference's run on the
    same checkpoint: its text and its finish_reason, once per choice in the stream."""
    ck, adapter, cases = served
    for case in cases:
        ref = reference_result(case, ck)
        body = {**request_body(adapter, case), **case.inputs["request"]}
        want = (ref.output.decode("utf-8"), OPENAI_FINISH[ref.finish_reason])
        n = case.inputs["request"].get("n", 1)
        r = httpx.post(f"{adapter.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, (case.id, r.text)
        got = [(ch["text"], ch["finish_reason"]) for ch in r.json()["choices"]]
        assert got == [want] * n, case.id
        assert _stream(adapter.url, body) == {i: (want[0], [want[1]]) for i in range(n)}, case.id
