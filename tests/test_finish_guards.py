"""Finish-check guards (§4.3, §4.6; DECISIONS D31): `ignore_eos` and `min_tokens` are
declared in spec/lifecycle.toml ([finish_guards], named by the eos check's `unless`), validated
by the loader, run by the runtime from the table (a guarded EOS is a token like any other: no
bytes under skip_special_tokens, decoded, the loop goes on), implemented once more in the checker
model and checked both ways there, drawn on the lifecycle diagram; the sampler holds back EOS and
the one-id stops until min_tokens, and a stop string still ends the run at any token."""

from __future__ import annotations

import pytest

from decodespec.machine.checker import check
from decodespec.machine.checker_model import FINISH_GUARDS as MODEL_GUARDS
from decodespec.machine.checker_model import Model, ModelConfig
from decodespec.machine.diagrams import to_dot, to_mermaid
from decodespec.properties import check_trace
from decodespec.runtime import ByteTableTokenizer, Request, ScriptedModel, generate
from decodespec.runtime.finish import FINISH_GUARDS, finish_guard
from decodespec.spec import FinishReason, load_spec
from decodespec.spec.loader import SPEC_DIR, SpecError, load_text

# 1 "x", 2 "A", 3 "B", 4 "Z", 9 "Q", 5 EOS (its table bytes "</s>"), 6 a one-id stop "S"
TOK = ByteTableTokenizer({1: b"x", 2: b"A", 3: b"B", 4: b"Z", 5: b"</s>", 6: b"S", 9: b"Q"}, eos_id=5)
EOS = 5
LIFECYCLE = (SPEC_DIR / "lifecycle.toml").read_text(encoding="utf-8")


def _run(script, **kw):
    res = generate(Request([1], **kw), model=ScriptedModel(script, vocab_size=10), tokenizer=TOK)
    bad = check_trace(res.trace, tokenizer=TOK)
    assert bad == [], [str(v) for v in bad]
    return res


# ---- the table ----------------------------------------------------------------------------------


def test_the_eos_check_names_both_guards_in_the_table():
    table = load_spec("lifecycle")
    eos = next(c for c in table.finish_checks if c.event == "eos")
    assert eos.unless == ("ignore_eos", "min_tokens") and set(table.finish_guards) == {"ignore_eos", "min_tokens"}
    assert all(g.anchor.startswith("§4.") for g in table.finish_guards.values())


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda t: t.replace('unless = ["ignore_eos", "min_tokens"]', 'unless = ["ignore_eos", "no_such"]'),
     "'unless' names 'no_such', which \\[finish_guards\\] does not declare"),
    (lambda t: t.replace('unless = ["ignore_eos", "min_tokens"]', 'unless = ["ignore_eos", "ignore_eos"]'),
     "guard 'ignore_eos' is listed twice"),
    (lambda t: t.replace('unless = ["ignore_eos", "min_tokens"]', 'unless = "ignore_eos"'),
     "'unless' is a list of guard names"),
    (lambda t: t.replace('event = "length"\nanchor = "§4.3"\n', 'event = "length"\nanchor = "§4.3"\nunless = ["min_tokens"]\n', 1),
     "'unless' guards only a check whose token is not text .* 'length' is a condition"),
    (lambda t: t.replace('ignore_eos = { anchor = "§4.6",', 'ignore_eos = { when = 1, anchor = "§4.6",'),
     "finish_guards.ignore_eos: unknown key 'when'"),
    (lambda t: t.replace('min_tokens = { anchor = "§4.3", ', 'min_tokens = { '), "finish_guards.min_tokens: missing 'anchor'"),
])
def test_a_bad_guard_is_refused_naming_it(edit, problem):
    with pytest.raises(SpecError, match=problem):
        load_text(edit(LIFECYCLE), "lifecycle.toml")


def test_a_guard_no_check_names_is_allowed_as_an_unused_action_is():
    """A table edit may take a guard off a check (the seeded bugs of tests/test_seeded_table_bugs.py)."""
    table = load_text(LIFECYCLE.replace('unless = ["ignore_eos", "min_tokens"]', 'unless = ["ignore_eos"]'), "lifecycle.toml")
    assert table.finish_checks[0].unless == ("ignore_eos",) and "min_tokens" in table.finish_guards


def test_the_diagrams_draw_the_checks_with_their_guards():
    table = load_spec("lifecycle")
    assert "1. eos  unless ignore_eos, min_tokens" in to_dot(table)
    assert "1. eos  unless ignore_eos, min_tokens" in to_mermaid(table)
    assert "unless" not in to_dot(load_spec("stream"))


# ---- one implementation each, checked both ways -------------------------------------------------


def test_the_runtime_and_the_model_implement_exactly_the_declared_guards():
    table = load_spec("lifecycle")
    assert set(FINISH_GUARDS) == set(MODEL_GUARDS) == set(table.finish_guards)
    with pytest.raises(RuntimeError, match="implemented but not declared \\['min_tokens'\\]"):
        finish_guard(table.finish_checks, {"ignore_eos": table.finish_guards["ignore_eos"]})
    extra = load_text(LIFECYCLE.replace('min_tokens = { anchor', 'stop_first = { anchor = "§4.6" }\nmin_tokens = { anchor'),
                      "lifecycle.toml")
    with pytest.raises(ValueError, match="declared without an implementation \\['stop_first'\\]"):
        Model({"lifecycle": extra})


def test_the_runtime_guard_is_composed_from_the_table_with_the_requests_features():
    checks, guards = load_spec("lifecycle").finish_checks, load_spec("lifecycle").finish_guards
    assert finish_guard(checks, guards, frozenset()) is None  # a plain request pays nothing
    ignore_eos, min_tokens = FINISH_GUARDS["ignore_eos"][0], FINISH_GUARDS["min_tokens"][0]
    assert finish_guard(checks, guards).rules == (("eos", (ignore_eos, min_tokens)),)
    assert finish_guard(checks, guards, frozenset({"min_tokens"})).rules == (("eos", (min_tokens,)),)


def test_the_runtime_follows_a_guard_taken_off_beside_the_shipped_table():
    """The table decides: with ignore_eos taken off the eos check, an ignore_eos request ends at EOS;
    under the shipped table, run after it, the same request goes on to its length."""
    edited = load_text(LIFECYCLE.replace('unless = ["ignore_eos", "min_tokens"]', 'unless = ["min_tokens"]'),
                       "lifecycle.toml")
    r = generate(Request([1], ignore_eos=True, max_output_tokens=4), model=ScriptedModel([2, EOS, 2, EOS], vocab_size=10),
                 tokenizer=TOK, lifecycle=edited)
    assert (r.finish_reason, r.output) == (FinishReason.EOS, b"A")
    assert _run([2, EOS, 2, EOS], ignore_eos=True, max_output_tokens=4).finish_reason is FinishReason.MAX_OUTPUT_TOKENS


def test_the_checker_explores_guarded_requests_and_finds_the_witnesses():
    """check(1) runs requests that set each guard's field (one policy): no violation, and a
    guarded EOS that is decoded and ends another way is reached."""
    report = check(1)
    assert report.ok and {"guarded_eos_then_length", "ignored_eos_decoded"} <= set(report.witnesses)
    plain = check(1, config=ModelConfig())
    assert plain.states < report.states and "ignored_eos_decoded" not in plain.witnesses


# ---- what the guards do ---------------------------------------------------------------------------


def test_ignore_eos_makes_eos_a_token_without_bytes_that_is_decoded():
    res = _run([2, EOS, 3, EOS], ignore_eos=True, max_output_tokens=4)
    assert res.output == b"AB" and res.tokens == (2, EOS, 3, EOS)
    assert res.usage.selected_tokens == 4 and res.usage.processed_tokens == 3  # the first EOS was decoded
    assert [e.data["eos"] for e in res.events if e.kind == "token.selected"] == [False] * 4


def test_without_skip_special_tokens_an_eos_that_ends_nothing_is_text():
    assert _run([2, EOS, 3], ignore_eos=True, skip_special_tokens=False, max_output_tokens=3).output == b"A</s>B"


@pytest.mark.parametrize(("script", "min_tokens", "output", "reason"), [
    ([2, EOS, 3, 4, EOS], 3, b"AQBZ", "eos"),  # EOS as token 2 < 3 held back: Q (bias) instead
    ([2, 3, EOS, 4, EOS], 3, b"ABQZ", "eos"),  # EOS as token 3 = min_tokens: still held back
    ([2, 3, EOS], 2, b"AB", "eos"),  # EOS as token 3, right after min_tokens: ends the run
])
def test_min_tokens_holds_eos_back_through_the_mask_up_to_its_count(script, min_tokens, output, reason):
    """vLLM's and SGLang's rule: min_tokens tokens come before EOS can be chosen."""
    res = _run(script, min_tokens=min_tokens, logit_bias={9: 5.0}, max_output_tokens=8)
    assert (res.output, res.finish_reason.value) == (output, reason)


def test_min_tokens_holds_back_a_one_id_stop_and_not_a_stop_string():
    """D31: the stop ids are masked like EOS; a stop string ends the run before min_tokens, its
    bytes never sent (stop_bytes_never_emitted)."""
    res = _run([2, 6, 3, 6], stop_token_ids=[[6]], min_tokens=2, logit_bias={9: 5.0}, max_output_tokens=4)
    assert res.output == b"AQB" and res.finish_reason is FinishReason.STOP_SEQUENCE and res.tokens[:2] == (2, 9)
    res = _run([2, 3, 4, 2], stop=["B"], min_tokens=3, max_output_tokens=4)
    assert res.output == b"A" and res.finish_reason is FinishReason.STOP_SEQUENCE


def test_where_the_mask_would_leave_nothing_the_table_guard_decides():
    """Only EOS is finite: the sampler keeps it (nothing else can be chosen) and the eos check's
    guard makes it a token like any other: the run ends by length, not eos."""
    import torch

    class OnlyEos(ScriptedModel):
        def _logits(self, caches):
            out = torch.full((len(caches), self.vocab_size), float("-inf"))
            out[:, EOS] = 1.0
            return out

    res = generate(Request([1], min_tokens=2, max_output_tokens=2), model=OnlyEos([EOS, EOS], vocab_size=10), tokenizer=TOK)
    assert res.tokens == (EOS, EOS) and res.finish_reason is FinishReason.MAX_OUTPUT_TOKENS and res.output == b""
    assert check_trace(res.trace, tokenizer=TOK) == []
