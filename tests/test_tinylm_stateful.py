"""A Hypothesis stateful test over the real loop on the embedded TinyLM.

Random prompts, stop sets, limits, seeds, temperatures and fault plans; every trace is checked
against every invariant of spec/invariants.toml. Two rules compare runs with each other: the same
seed gives the same tokens (§4.8: the RNG cursor is part of the step state), and a stop string
taken from an unconstrained run's own output cuts that output exactly before its first occurrence
(§4.6), with no stop byte ever sent.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from decodespec.properties import check_trace
from decodespec.runtime import Fault, FaultPlan, HFTokenizer, Request, TinyLM, generate
from decodespec.runtime.tinylm import ASSETS

pytestmark = pytest.mark.slow

WORDS = ["Once", " upon", " a", " time", " the", " cat", " said", ".", " Mia", " 你好", " 🙂", "\n", " and", " then"]


@functools.cache
def model_and_tokenizer():
    return TinyLM.default(), HFTokenizer(ASSETS)


prompts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map("".join)
faults = st.lists(
    st.builds(
        Fault,
        point=st.sampled_from(["prefill.started", "token.selected", "decode.started", "decode.completed", "response.delta"]),
        step=st.integers(0, 6),
        action=st.sampled_from(["cancel", "deadline", "disconnect"]),
    )
    | st.builds(Fault, point=st.just("decode.started"), step=st.integers(1, 6), action=st.just("model_error"))
    | st.builds(Fault, point=st.just("token.selected"), step=st.integers(1, 6), action=st.just("decoding_error"))
    | st.builds(Fault, point=st.just("response.delta"), step=st.integers(0, 6), action=st.just("transport_error")),
    max_size=2,
)


class LoopMachine(RuleBasedStateMachine):
    clean_runs = Bundle("clean_runs")

    def __init__(self) -> None:
        super().__init__()
        self.model, self.tok = model_and_tokenizer()
        self.last_violations: list = []

    def _run(self, req: Request, plan: FaultPlan | None = None):
        res = generate(req, model=self.model, tokenizer=self.tok, faults=plan)
        self.last_violations = check_trace(res.events, tokenizer=self.tok)
        return res

    @rule(target=clean_runs, prompt=prompts, max_tokens=st.integers(1, 12), seed=st.integers(0, 2**31),
          temperature=st.sampled_from([0.0, 0.7, 1.0]), top_k=st.sampled_from([None, 5, 50]))
    def unconstrained(self, prompt, max_tokens, seed, temperature, top_k):
        req = Request(prompt, max_output_tokens=max_tokens, seed=seed, temperature=temperature, top_k=top_k)
        res = self._run(req)
        assert res.state.value in ("FINISHED", "FAILED")
        return req, res

    @rule(prompt=prompts, stops=st.lists(st.text(alphabet="aetn .\n你🙂", min_size=1, max_size=3), max_size=4),
          max_tokens=st.integers(1, 12), seed=st.integers(0, 2**31), plan=faults)
    def with_stops_and_faults(self, prompt, stops, max_tokens, seed, plan):
        req = Request(prompt, stop=stops, max_output_tokens=max_tokens, seed=seed, temperature=0.8)
        res = self._run(req, FaultPlan(plan))
        for s in stops:
            assert s.encode() not in res.output

    @rule(prev=clean_runs)
    def same_seed_same_tokens(self, prev):
        req, res = prev
        again = self._run(req)
        assert again.tokens == res.tokens and again.output == res.output

    @rule(prev=clean_runs, data=st.data())
    def stop_taken_from_own_output(self, prev, data):
        req, res = prev
        text = res.output.decode("utf-8")
        if res.state.value != "FINISHED" or not text:
            return
        i = data.draw(st.integers(0, len(text) - 1))
        j = data.draw(st.integers(i + 1, min(len(text), i + 4)))
        stop = text[i:j]
        cut = Request(req.prompt, stop=[stop], max_output_tokens=req.max_output_tokens, seed=req.seed,
                      temperature=req.temperature, top_k=req.top_k)
        out = self._run(cut)
        first = res.output.find(stop.encode())
        assert (out.finish_reason, out.output) == ("stop_sequence", res.output[:first])

    @invariant()
    def every_trace_conforms(self):
        assert self.last_violations == [], "\n".join(map(str, self.last_violations))


TestLoopOnTinyLM = LoopMachine.TestCase
TestLoopOnTinyLM.settings = settings(
    max_examples=25, stateful_step_count=8, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
