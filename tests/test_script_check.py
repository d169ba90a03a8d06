"""Forced checkpoints behind any prefix and under sampling defaults, and the check that an engine
followed its script (§4.3): transformers generate plays the engine."""

from __future__ import annotations

import pytest

from decodespec.properties.conformance import load_cases
from decodespec.properties.conformance.checkpoints import (
    RECIPE,
    TABLE_GROUP,
    build_group,
    generate_batch,
    group_of,
    http_blocker,
    proof_runs,
)
from decodespec.properties.conformance.forced import DTYPES, PROBE_MAX
from decodespec.properties.conformance.script_check import Returned, detect_prefix, deviation

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """The byte-table checkpoint (its cases, the recipe, the probe; not the long program, which no
    penalty claim covers: checkpoints.LONG), built once."""
    cases = [c for c in load_cases() if group_of(c) == TABLE_GROUP and http_blocker(c) is None]
    return build_group(TABLE_GROUP, cases, tmp_path_factory.mktemp("script-check") / TABLE_GROUP, long=False)


@pytest.fixture(scope="module")
def models(ck):
    """The checkpoint loaded by transformers in each dtype."""
    from transformers import AutoModelForCausalLM

    return {d: AutoModelForCausalLM.from_pretrained(ck.folder, dtype=getattr(torch, d)).eval() for d in DTYPES}


def _programs(ck):
    return [(p.prompt, [*p.script, ck.eos_id]) for p in ck.programs.values()]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefix_before_the_prompt_moves_no_program(ck, models, dtype):
    """§4.3: a BOS, or a template's three tokens, in front of the marker leave every
    program on its script: positions are read relative to the marker, in every dtype."""
    letters = ck.tokenizer.encode("abc")
    for prefix in ([ck.eos_id], letters):
        runs = _programs(ck)
        got = generate_batch(models[dtype], [[*prefix, *prompt] for prompt, _ in runs], max(len(w) for _, w in runs),
                             ck.eos_id)
        assert [g[:len(w)] for g, (_, w) in zip(got, runs)] == [w for _, w in runs], prefix


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_probe_tells_how_many_tokens_stand_before_the_prompt(ck, models, dtype):
    """One request on the probe's marker tells the prefix (0..7 tokens exactly, 8 or
    more as such) from its first output token, read as an id, as logprob bytes or from the text alone."""
    shifts = [0, 1, 2, 3, 5, 7, 8, 12]
    filler = ck.tokenizer.encode("<|im_start|>user\n")  # a template's opening, as ordinary tokens
    prompts = [(filler * 2)[:s] + list(ck.probe.prompt) for s in shifts]
    got = generate_batch(models[dtype], prompts, 1, ck.eos_id)
    tok = ck.tokenizer
    for shift, (first,) in zip(shifts, got):
        for returned in (Returned(token_ids=[first]), Returned(tokens=[tok.token_bytes(first)]),
                         Returned(text=tok.decode([first]))):
            found = detect_prefix(ck.probe, tok, returned)
            assert (found.tokens, found.at_least) == ((shift, False) if shift < PROBE_MAX else (PROBE_MAX, True)), (
                shift, returned, found)


def test_a_template_after_the_prompt_makes_the_shift_unknown(ck, models):
    """A prompt changed after the marker too (a chat template's closing) leaves the probe no echo to
    give: the shift is unknown, and the note says why, rather than a wrong count."""
    [[first]] = generate_batch(models["float32"], [[*ck.probe.prompt, *ck.tokenizer.encode("\n")]], 1, ck.eos_id)
    found = detect_prefix(ck.probe, ck.tokenizer, Returned(token_ids=[first]))
    assert found.tokens is None and "beyond a prefix" in found.note


def _one_weight_changed(ck, model, orig: int, other: int):
    """`other` reads `orig`'s vote dim 1.5 times as strongly: wherever the script wants orig, greedy picks other."""
    import copy

    changed = copy.deepcopy(model)
    head = changed.lm_head.weight.data
    vote = int(head[orig].abs().argmax())
    head[other, vote] = 1.5 * head[orig, vote]
    return changed


def test_an_engine_that_leaves_the_script_is_named_at_the_token_where_it_left(ck, models):
    """A model with one weight changed, run by transformers generate, leaves the
    recipe's script; the check names the first token it changed and what it chose, from ids, from
    logprob bytes and from the text alone, and finds nothing to say about the unchanged model."""
    recipe = ck.programs[RECIPE]
    tok = ck.tokenizer
    orig = recipe.script[5]
    other = tok.encode("Z")[0]
    at = recipe.script.index(orig) + 1  # the first output token the change affects (1-based)
    n = len(recipe.script) + 1
    [got] = generate_batch(_one_weight_changed(ck, models["float32"], orig, other), [recipe.prompt], n, ck.eos_id)
    assert got[at - 1] == other
    for returned in (Returned(token_ids=got), Returned(tokens=[tok.token_bytes(t) for t in got]),
                     Returned(text=tok.decode(got))):
        dev = deviation(recipe, tok, ck.eos_id, returned)
        assert dev is not None and dev.position == at and dev.chose.startswith(("id ", "b'Z'", "'Z")), (returned, dev)
        assert dev.message.startswith(f"the engine did not follow the forced script at token {at}: precision")
    [ok] = generate_batch(models["float32"], [recipe.prompt], n, ck.eos_id)
    assert deviation(recipe, tok, ck.eos_id, Returned(token_ids=ok)) is None
    assert deviation(recipe, tok, ck.eos_id, Returned(text=tok.decode(ok))) is None


def test_an_answer_the_case_cut_short_or_that_shows_unprintable_bytes_follows_the_script(ck):
    """What the case ends (a stop, a limit) is not compared, nor what a detokenizer may render as
    U+FFFD or spaces: those are the cases' own findings, never a deviation."""
    recipe = ck.programs[RECIPE]
    tok = ck.tokenizer
    text = tok.decode(recipe.script)
    cut = text.index("東")
    assert deviation(recipe, tok, ck.eos_id, Returned(text=text[:cut])) is None  # a stop string before 東京
    assert deviation(recipe, tok, ck.eos_id, Returned(text=text.replace("東", "\ufffd"))) is None
    assert deviation(recipe, tok, ck.eos_id, Returned(text=text.replace(" ", "  "))) is None
    changed = [*recipe.script[:10], tok.encode("Z")[0]]
    assert deviation(recipe, tok, ck.eos_id, Returned(token_ids=changed), end=10) is None  # past the case's end
    assert deviation(recipe, tok, ck.eos_id, Returned(token_ids=changed), end=11).position == 11
    with pytest.raises(ValueError, match="nothing to compare"):
        deviation(recipe, tok, ck.eos_id, Returned())


def test_logprob_bytes_moved_to_the_token_that_completes_a_character_follow_the_script(ck):
    """llama-server gives a split character's bytes with the token that completes it (its logprob
    `bytes`): the pieces are compared as one byte stream, so that is no deviation, while a wrong byte
    is named at the script token that holds it (§4.5)."""
    prog = ck.programs["detok/utf8-split/001"]
    tok = ck.tokenizer
    pieces = [tok.token_bytes(t) for t in prog.script]
    split = next(i for i, p in enumerate(pieces) if p and p[0] >= 0xC0 and i + 1 < len(pieces))
    moved = [*pieces[:split], b"", pieces[split] + pieces[split + 1], *pieces[split + 2:]]
    assert deviation(prog, tok, ck.eos_id, Returned(tokens=moved), end=len(prog.script)) is None
    wrong = [*pieces[:split], b"\xff", *pieces[split + 1:]]
    d = deviation(prog, tok, ck.eos_id, Returned(tokens=wrong), end=len(prog.script))
    assert d is not None and d.position == split + 1 and d.chose == repr(b"\xff")


def test_a_special_tokens_own_text_in_logprob_tokens_is_no_deviation(ck):
    """vLLM lists a selected EOS in its logprob tokens as "</s>" (ignore_eos runs go on past it):
    that is the token, not text the answer shows, so the script is followed."""
    prog = ck.programs["finish/ignore-eos/001"]
    tok = ck.tokenizer
    pieces = [tok.decode([t], skip_special=False) for t in prog.script]
    assert any(t in tok.special_ids for t in prog.script)
    assert deviation(prog, tok, ck.eos_id, Returned(tokens=pieces), end=len(prog.script)) is None


class _Penalties:
    """OpenAI's presence and frequency penalties on the output tokens (transformers has neither)."""

    def __init__(self, presence: float, frequency: float, start: int) -> None:
        self.presence, self.frequency, self.start = presence, frequency, start

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids[:, self.start:], torch.ones_like(scores))
        return scores - self.presence * (counts > 0) - self.frequency * counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("defaults", [
    {"repetition_penalty": 20.0},
    {"repetition_penalty": 1000.0},
    {"do_sample": True, "temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    {"do_sample": True, "temperature": 1.0},
    {"penalties": (2.0, 2.0)},
    {"penalties": (-2.0, -1.0)},
])
def test_server_sampling_defaults_within_the_margins_keep_every_program_on_script(ck, models, dtype, defaults):
    """A repetition penalty of any size (the runner-up of a scripted token is at 0, of
    EOS too), OpenAI presence/frequency penalties in their whole range (|f| * a token's count < 29),
    top_k / top_p / min_p, and plain sampling at temperature 1 all leave every program on its
    script: the scripted token leads by 29 logits, EOS by 24."""
    from transformers import LogitsProcessorList

    runs = proof_runs(ck)
    prompts = [prompt for _, prompt, _ in runs]
    kw = dict(defaults)
    if "penalties" in kw:
        kw["logits_processor"] = LogitsProcessorList([_Penalties(*kw.pop("penalties"), max(map(len, prompts)))])
    torch.manual_seed(0)
    got = generate_batch(models[dtype], prompts, max(len(w) for _, _, w in runs), ck.eos_id, **kw)
    assert [g[:len(w)] for g, (_, _, w) in zip(got, runs)] == [w for _, _, w in runs]


def test_a_penalty_past_the_margin_leaves_the_script_where_a_token_recurs(ck, models):
    """Beyond the margin (a presence penalty of 40, twenty times OpenAI's largest) the script is left at
    the first recurrence of a token, and the check says so: the run is an ERROR of the engine's
    defaults, not a FAIL of the case."""
    from transformers import LogitsProcessorList

    recipe = ck.programs[RECIPE]
    penalty = LogitsProcessorList([_Penalties(40.0, 0.0, len(recipe.prompt))])
    [got] = generate_batch(models["float32"], [recipe.prompt], len(recipe.script) + 1, ck.eos_id,
                           logits_processor=penalty)
    again = next(i for i, t in enumerate(recipe.script) if t in recipe.script[:i])
    dev = deviation(recipe, ck.tokenizer, ck.eos_id, Returned(token_ids=got))
    assert dev is not None and dev.position == again + 1, dev


def test_the_text_check_reads_the_script_after_the_prompt_as_a_wordpiece_continuation_spells_it():
    """§4.5: WordPiece's `##.` spells `.` after the prompt's word and `##.` at a sequence's start; an
    engine that answers `.` follows a script that opens with it, and one that answers `!` does not."""
    from decodespec.properties.conformance.checkpoints import fixture_tokenizer
    from decodespec.properties.conformance.forced import Program

    tok = fixture_tokenizer("wordpiece")
    dot, word = tok.backend.token_to_id("##."), tok.encode("hello")[0]
    prog = Program("wp", 0, [*tok.encode("The")], [dot, word])
    assert deviation(prog, tok, tok.eos_id, Returned(text=". hello")) is None
    assert deviation(prog, tok, tok.eos_id, Returned(tokens=[".", " hello"])) is None
    d = deviation(prog, tok, tok.eos_id, Returned(text="! hello"))
    assert d is not None and d.position == 1
