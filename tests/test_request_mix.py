"""Any mix of a request's options, on the embedded TinyLM, gives a trace that passes every monitor
(§4.3-§4.10): stops (kept or not, string or token ids), echo, EOS guards, the UTF-8 guard, special
tokens, logprobs, logit bias, a tool-call token, a content policy, a small stream cap, and a fault.
Each option has tests of its own; this one is for the mixes nobody wrote down. It found an echo that
never went out counted as -4 returned bytes (D7, D33)."""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodespec.properties import check_trace
from decodespec.runtime import Fault, FaultPlan, HFTokenizer, Request, TinyLM, generate
from decodespec.runtime.tinylm import ASSETS

WORDS = ["Once", " upon", " a", " time", " the", " cat", " said", ".", " Mia", " 你好", " 🙂", "\n", " and", " then"]


@functools.cache
def model_and_tokenizer():
    return TinyLM.default(), HFTokenizer(ASSETS)


faults = st.lists(
    st.builds(Fault, point=st.sampled_from(["prefill.started", "token.selected", "decode.started", "response.delta"]),
              step=st.integers(0, 6), action=st.sampled_from(["cancel", "deadline", "disconnect"]))
    | st.builds(Fault, point=st.just("response.delta"), step=st.integers(0, 6), action=st.just("transport_error"))
    | st.builds(Fault, point=st.just("decode.started"), step=st.integers(1, 6), action=st.just("model_error"))
    | st.builds(Fault, point=st.just("token.selected"), step=st.integers(1, 6), action=st.just("decoding_error")),
    max_size=1,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map("".join),
       stop=st.lists(st.text(alphabet="aetn .\n你🙂,", min_size=1, max_size=3), max_size=3),
       stop_ids=st.lists(st.lists(st.integers(1, 400), min_size=1, max_size=2), max_size=2),
       max_tokens=st.integers(1, 10), seed=st.integers(0, 2**20), temperature=st.sampled_from([0.0, 0.8, 1.5]),
       min_tokens=st.integers(0, 4), ignore_eos=st.booleans(), keep_stop=st.booleans(), echo=st.booleans(),
       utf8_guard=st.booleans(), skip_special=st.booleans(), logprobs=st.sampled_from([None, 0, 2]),
       bias=st.dictionaries(st.integers(1, 400), st.sampled_from([-100.0, 5.0]), max_size=2),
       tool_ids=st.lists(st.integers(1, 400), max_size=2), refused=st.sampled_from([None, b"a", "你".encode()]),
       cap=st.sampled_from([256, 1]), plan=faults)
def test_every_mix_of_request_options_gives_a_conforming_trace(prompt, stop, stop_ids, max_tokens, seed, temperature,
                                                               min_tokens, ignore_eos, keep_stop, echo, utf8_guard,
                                                               skip_special, logprobs, bias, tool_ids, refused, cap,
                                                               plan):
    model, tok = model_and_tokenizer()
    req = Request(prompt, stop=stop, stop_token_ids=stop_ids, max_output_tokens=max_tokens, seed=seed,
                  temperature=temperature, min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos,
                  include_stop_str_in_output=keep_stop, echo=echo, utf8_guard=utf8_guard,
                  skip_special_tokens=skip_special, logprobs=logprobs, logit_bias=bias,
                  finish_tokens={"tool_call": tool_ids} if tool_ids else {},
                  content_policy=None if refused is None else (lambda so_far, new: refused in so_far + new),
                  policy="pause" if cap > 1 else "fail", max_buffer_events=cap)
    res = generate(req, model=model, tokenizer=tok, faults=FaultPlan(plan))
    violations = check_trace(res.events, tokenizer=tok)
    assert violations == [], [str(v) for v in violations]
    assert res.usage.returned_bytes >= 0
