"""What the output holds (§4.5, §4.6; DECISIONS D33): include_stop_str_in_output ends the
output with the winning stop string's own bytes, across tokens, and the bytes after it are still
never sent; echo puts the prompt's bytes first by the batch decode's rules,
a prompt ending inside a character completed by the output's first bytes, and a stop never matches
across the boundary; usage counts the completion only. Every trace passes the monitors."""

from __future__ import annotations

import pytest

from decodespec.properties import check_trace
from decodespec.runtime import ByteTableTokenizer, Engine, Fault, FaultPlan, Request, ScriptedModel, generate
from decodespec.spec import FinishReason

TOK = ByteTableTokenizer({1: b"> ", 2: b"AB", 3: b"CD", 4: b"E", 5: b"</s>", 11: bytes.fromhex("e4b8"),
                          12: bytes.fromhex("ad"), 13: b"x"}, eos_id=5)


def _run(script, prompt=(1,), **kw):
    res = generate(Request(list(prompt), **kw), model=ScriptedModel(script, vocab_size=14), tokenizer=TOK)
    bad = check_trace(res.trace, tokenizer=TOK)
    assert bad == [], [str(v) for v in bad]
    return res


def _deltas(res):
    return [bytes(e.data["bytes"]) for e in res.events if e.kind == "response.delta"]


@pytest.mark.parametrize(("stop", "script", "output"), [
    (["BC"], [2, 3, 4], b"ABC"),  # across tokens: the D after the match is never sent
    (["E"], [2, 4, 3], b"ABE"),
    (["CD", "BC"], [2, 3, 4], b"ABC"),  # the earliest end wins (D3), and that one is kept
])
def test_a_kept_stop_ends_the_output_and_nothing_after_it_is_sent(stop, script, output):
    res = _run(script, stop=stop, include_stop_str_in_output=True, max_output_tokens=3)
    assert res.output == output and res.finish_reason is FinishReason.STOP_SEQUENCE
    assert b"".join(_deltas(res)) == output
    plain = _run(script, stop=stop, max_output_tokens=3)
    assert res.output == plain.output + res.stop.encode()


def test_echo_puts_the_prompt_first_through_the_detokenizer():
    res = _run([2, 4], echo=True, max_output_tokens=2)
    assert res.output == b"> ABE" and _deltas(res)[0] == b"> "
    assert res.usage.returned_bytes == 3 and res.usage.returned_tokens == 2  # the echo is no token's


def test_echo_of_a_prompt_ending_inside_a_character_is_completed_by_the_output():
    """D12, D33: the prompt's bytes e4 b8 go out first; the output's first token ad completes the
    character; together one valid text, the character once."""
    res = _run([12, 4], prompt=(1, 11), echo=True, max_output_tokens=2)
    assert res.output.decode("utf-8") == "> \u4e2dE"
    assert _deltas(res)[0] == b"> " + bytes.fromhex("e4b8")
    assert _run([12, 4], prompt=(1, 11), max_output_tokens=2).output == bytes.fromhex("ad") + b"E"


def test_a_stop_never_matches_across_the_echoed_prompt():
    """D3: stops match the output only; the echoed '> ' holds the stop '>' and nothing ends."""
    res = _run([2, 4], echo=True, stop=[">"], max_output_tokens=2)
    assert res.output == b"> ABE" and res.finish_reason is FinishReason.MAX_OUTPUT_TOKENS


def test_echo_is_sent_once_when_the_engine_recomputes_a_preempted_prefill():
    engine = Engine(ScriptedModel([2, 3, 4, 2, 3, 4], vocab_size=14), TOK, preemption="recompute")
    run = engine.submit(Request([1], echo=True, max_output_tokens=6))
    engine.run_until_idle()
    assert run.result().output == b"> ABCDEABCDE"


@pytest.mark.parametrize("fault", ["deadline", "transport_error"])
def test_a_request_that_ends_before_its_prefill_still_echoes_or_returns_nothing(fault):
    """D33: a deadline observed in the queue completes the request, and the completed output still
    opens with the echo (no prefill ran, the prompt's bytes need none); an echo whose send fails
    returned nothing: usage counts 0 bytes, never less (§4.10, D7)."""
    plan = [Fault("response.delta", 0, "transport_error")] if fault == "transport_error" else []
    res = generate(Request([1], echo=True, deadline_s=0.0 if fault == "deadline" else None, max_output_tokens=2),
                   model=ScriptedModel([2, 4], vocab_size=14), tokenizer=TOK, faults=FaultPlan(plan))
    assert check_trace(res.trace, tokenizer=TOK) == []
    if fault == "deadline":
        assert (res.output, res.finish_reason, res.usage.selected_tokens) == (b"> ", FinishReason.DEADLINE_EXCEEDED, 0)
    else:
        assert (res.output, res.finish_reason) == (b"", FinishReason.TRANSPORT_ERROR)
    assert res.usage.returned_bytes == 0 and res.usage.returned_tokens == 0
