"""The UTF-8 validity guard (runtime/utf8_guard.py; §4.5, §4.6, DECISIONS D16): a guarded run never
fails on invalid output bytes, and changes nothing in a greedy run that would have succeeded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.properties.monitors import check_trace
from decodespec.runtime import ByteTableTokenizer, Engine, EventKind, Request, ScriptedModel, generate
from decodespec.runtime.errors import RequestError
from decodespec.runtime.utf8_guard import ACCEPT, REJECT, run
from decodespec.spec import FinishReason

# 0 "a", 1 the lead byte of "é", 2 its continuation byte, 3 EOS.
TABLE = {0: b"a", 1: b"\xc3", 2: b"\xa9", 3: b""}
EOS = 3


def _tok() -> ByteTableTokenizer:
    return ByteTableTokenizer(TABLE, eos_id=EOS)


def _run(script: list[int], guard: bool, **kw):
    tok = _tok()
    return generate(Request([0], utf8_guard=guard, **kw), model=ScriptedModel(script, vocab_size=4), tokenizer=tok)


def _is_prefix_of_utf8(data: bytes) -> bool:
    """Some continuation makes `data` valid UTF-8 (the oracle: CPython's strict decoder)."""
    return any(_valid(data + tail) for tail in (b"", b"\x80", b"\x80\x80", b"\x80\x80\x80", b"\xa0\x80", b"\x90\x80\x80",
                                                 b"\xbf", b"\xbf\xbf", b"\xbf\xbf\xbf", b"\x9f\xbf", b"\x8f\xbf\xbf"))


def _valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@given(st.binary(max_size=6))
@settings(max_examples=400, deadline=None)
def test_automaton_accepts_exactly_the_prefixes_of_valid_utf8(data):
    """§4.5: ACCEPT iff the bytes are whole valid UTF-8; REJECT iff no continuation can repair them."""
    state = run(ACCEPT, data)
    assert (state == ACCEPT) == _valid(data)
    assert (state == REJECT) == (not _is_prefix_of_utf8(data))


@pytest.mark.parametrize(("script", "guarded_text"), [
    ([1], "a"),           # a lead byte as the last token the budget allows
    ([2, 2], "aa"),       # a stray continuation byte
    ([1, 3, 3], "é"),     # EOS inside a character
])
def test_guard_never_lets_the_output_become_invalid(script, guarded_text):
    """§4.5 D12 fails these runs; the guard (D16) picks an allowed token instead, and the run ends well."""
    bad = _run(script, False, max_output_tokens=len(script))
    assert bad.state.value == "FAILED" and "decoding_error" in bad.error
    good = _run(script, True, max_output_tokens=len(script))
    assert good.state.value == "FINISHED", good.error
    assert good.text == guarded_text
    assert check_trace(good.trace, tokenizer=_tok()) == []


def test_guard_keeps_a_character_that_the_budget_lets_finish():
    """A lead byte with room for its continuation is allowed (the lookahead counts the budget)."""
    res = _run([1, 2], True, max_output_tokens=2)
    assert res.text == "é" and res.finish_reason is FinishReason.MAX_OUTPUT_TOKENS


def test_an_end_the_sampler_did_not_choose_drops_the_unfinished_character():
    """D16: a grammar (or deadline) that ends a guarded run inside a character drops that
    character, recorded as detok.dropped; unguarded, §4.5's strictness fails the run."""
    assert _run([1, 2], False, max_output_tokens=4, grammar="").state.value == "FAILED"
    res = _run([1, 2], True, max_output_tokens=4, grammar="")
    assert res.state.value == "FINISHED" and res.finish_reason is FinishReason.GRAMMAR_COMPLETE
    assert res.text == ""
    dropped = [e for e in res.trace.events if e.kind is EventKind.DETOK_DROPPED]
    assert [e.data["bytes"] for e in dropped] == [1]
    assert check_trace(res.trace, tokenizer=_tok()) == []


def test_guard_is_refused_for_a_tokenizer_without_a_byte_table():
    class Windowed(ByteTableTokenizer):
        def plan(self, *, skip_special: bool = True):
            return None

    with pytest.raises(RequestError, match="utf8_guard"):
        generate(Request([0], utf8_guard=True), model=ScriptedModel([0], vocab_size=4),
                 tokenizer=Windowed(TABLE, eos_id=EOS))


@pytest.fixture(scope="module")
def embedded():
    from decodespec.cli_generate import load_model_and_tokenizer

    return load_model_and_tokenizer(None)


def test_sampled_runs_on_the_embedded_model_never_fail_when_guarded(embedded):
    """At temperature 1.5 unguarded runs fail on invalid UTF-8; guarded ones never do."""
    model, tok = embedded
    seeds = range(60)

    def outcomes(guard: bool):
        return [generate(Request("Der Bär", max_output_tokens=24, temperature=1.5, seed=s, utf8_guard=guard),
                         model=model, tokenizer=tok) for s in seeds]

    assert any("decoding_error" in r.error for r in outcomes(False))
    for r in outcomes(True):
        assert r.state.value == "FINISHED", r.error
        assert check_trace(r.trace, tokenizer=tok) == []


def test_guard_changes_no_greedy_run_that_succeeds(embedded):
    """For greedy decoding the allowed argmax is the argmax: guarded and unguarded runs agree."""
    model, tok = embedded
    for prompt in ("Der Bär", "The cat", "Ünïcödé", "0123"):
        plain = generate(Request(prompt, max_output_tokens=20), model=model, tokenizer=tok)
        guarded = generate(Request(prompt, max_output_tokens=20, utf8_guard=True), model=model, tokenizer=tok)
        assert plain.state.value == "FINISHED"
        assert guarded.tokens == plain.tokens


def test_engine_batches_respect_the_guard(embedded):
    """The Engine's batch argmax is re-chosen under the guard; sampled rows are masked too."""
    model, tok = embedded
    engine = Engine(model, tok, max_batch=4)
    handles = [engine.submit(Request("Der Bär", max_output_tokens=24, temperature=t, seed=s, utf8_guard=True))
               for s in range(12) for t in (0.0, 1.5)]
    engine.run_until_idle()
    for r in (h.result() for h in handles):
        assert r.state.value == "FINISHED", r.error
        assert check_trace(r.trace, tokenizer=tok) == []
