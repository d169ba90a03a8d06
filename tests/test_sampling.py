"""choose(): greedy, temperature, top-k, top-p and the resumable RNG cursor (§4.2, §4.3, §4.8)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from decodespec.runtime.sampling import Sampler, SamplingError, SamplingParams, choose_batch, greedy_rows

V = 12


def _logits(seed: int, v: int = V) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


# The top-p cut compares a sum of floats with top_p. Where the mass before a token lies within
# this of top_p, rounding (torch's softmax and cumsum against the oracle's own sums) may put it on
# either side, and either answer is right: the oracle allows both there and nowhere else.
_SLACK = 1e-9


def _oracle_allowed(logits: torch.Tensor, temperature: float, top_k: int | None,
                    top_p: float | None) -> tuple[set[int], set[int]]:
    """Independent oracle, plain Python over a list, ranking by (-prob, id): the tokens that must
    be kept and those that may be (they differ only within _SLACK of the top-p boundary)."""
    z = [float(x) / temperature for x in logits.double()]
    m = max(z)
    w = [pow(2.718281828459045, x - m) for x in z]
    total = sum(w)
    ranked = sorted(range(len(w)), key=lambda i: (-w[i], i))
    probs = {i: w[i] / total for i in ranked}
    if top_k is not None:
        ranked = ranked[:top_k]
        s = sum(probs[i] for i in ranked)
        probs = {i: probs[i] / s for i in ranked}
    if top_p is None or top_p >= 1:  # top_p = 1 is the whole distribution, nothing cut
        return set(ranked), set(ranked)
    must, may, before = set(), set(), 0.0
    for i in ranked:  # kept: the mass strictly before the token is below top_p
        if before < top_p - _SLACK:
            must.add(i)
        if before < top_p + _SLACK:
            may.add(i)
        before += probs[i]
    return must, may


def test_greedy_is_argmax_and_ties_go_to_the_lowest_id() -> None:
    """§4.3 choose with temperature 0: argmax; equal maxima pick the lowest id, no RNG drawn."""
    s = Sampler(SamplingParams(temperature=0.0), V)
    logits = torch.zeros(V)
    logits[[3, 7, 9]] = 5.0
    assert s.choose(logits) == 3
    assert s.draws == 0


def test_same_seed_gives_the_same_draws_and_another_seed_differs() -> None:
    """§4.2: the per-request generator is seeded; a rerun with the seed repeats the choices."""
    p = SamplingParams(temperature=1.5, seed=42)
    runs = []
    for params in (p, p, SamplingParams(temperature=1.5, seed=43)):
        s = Sampler(params, V)
        runs.append([s.choose(_logits(i)) for i in range(40)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_seed_none_records_a_fresh_seed_that_replays() -> None:
    """§4.2: a request without a seed gets a random one, recorded so the run can be replayed."""
    a = Sampler(SamplingParams(temperature=1.0), V)
    b = Sampler(SamplingParams(temperature=1.0, seed=a.seed), V)
    assert [a.choose(_logits(i)) for i in range(20)] == [b.choose(_logits(i)) for i in range(20)]


def test_resume_after_snapshot_continues_with_the_same_draws() -> None:
    """§4.8: the RNG cursor is step state; resuming from a snapshot at draw 5 repeats draws 6-10."""
    params = SamplingParams(temperature=1.0, top_k=8, top_p=0.95, seed=7)
    s = Sampler(params, V)
    picks, snap = [], None
    for i in range(10):
        if i == 5:
            snap = s.state()
        picks.append(s.choose(_logits(i)))
    assert snap is not None and snap.draws == 5
    r = Sampler.resume(params, snap)
    assert [r.choose(_logits(i)) for i in range(5, 10)] == picks[5:]
    assert r.draws == 10


@settings(deadline=None, max_examples=150)
@given(
    seed=st.integers(0, 2**31),
    temperature=st.floats(0.05, 3.0),
    top_k=st.one_of(st.none(), st.integers(1, V + 3)),
    top_p=st.one_of(st.none(), st.floats(0.01, 1.0)),
    tied=st.booleans(),
)
@example(seed=0, temperature=0.25, top_k=None, top_p=0.9999999999999999, tied=False)  # boundary rounding
def test_sampled_token_is_within_the_top_k_top_p_set(seed, temperature, top_k, top_p, tied) -> None:
    """§4.3 choose: the kept set is the one an independent top-k/top-p oracle allows (up to
    float rounding at the top-p boundary), and whatever is drawn lies in it."""
    logits = _logits(seed)
    if tied:
        logits = logits.round()  # many equal logits: tie handling at the k / p boundary
    s = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed), V)
    ids, _ = s.allowed(logits)
    must, may = _oracle_allowed(logits, temperature, top_k, top_p)
    assert must <= set(ids.tolist()) <= may
    for _ in range(5):
        assert s.choose(logits) in set(ids.tolist())


def test_top_k_one_is_greedy_under_any_temperature() -> None:
    """§4.3: top_k=1 keeps only the argmax, so sampling equals greedy."""
    s = Sampler(SamplingParams(temperature=2.0, top_k=1, seed=0), V)
    for i in range(20):
        assert s.choose(_logits(i)) == int(_logits(i).argmax())


def test_sampling_follows_the_distribution() -> None:
    """§4.3: with two tokens at probabilities 0.25 / 0.75, the draw frequencies match."""
    logits = torch.full((4,), -1e9)
    logits[1], logits[2] = 0.0, float(torch.log(torch.tensor(3.0)))
    s = Sampler(SamplingParams(temperature=1.0, seed=3), 4)
    picks = [s.choose(logits) for _ in range(4000)]
    assert set(picks) == {1, 2}
    assert abs(picks.count(2) / 4000 - 0.75) < 0.03


def test_choose_batch_uses_each_requests_sampler() -> None:
    """§4.4 active batch: row b is chosen by request b's own sampler and generator."""
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)]
    rows = torch.stack([_logits(i) for i in range(3)])
    got = choose_batch(rows, [Sampler(p, V) for p in params])
    want = [Sampler(p, V).choose(rows[i]) for i, p in enumerate(params)]
    assert got == want


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_bad_sampling_params_are_rejected_naming_the_field(kwargs, field) -> None:
    """Bad request parameters fail before anything starts, with the field named (§4.3 normalize)."""
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kwargs)


def test_bad_logits_are_rejected() -> None:
    """choose() refuses NaN logits and a wrong vocabulary size instead of picking garbage."""
    s = Sampler(SamplingParams(temperature=1.0, seed=0), V)
    with pytest.raises(SamplingError, match="NaN"):
        s.choose(torch.full((V,), float("nan")))
    with pytest.raises(SamplingError, match="shape"):
        s.choose(torch.zeros(V + 1))


def test_greedy_rows_equal_each_rows_own_greedy_choice() -> None:
    """§4.4 batch, §4.3 greedy: the batch's one reduction picks what Sampler.choose picks per row,
    ties (lowest id) and -inf included; sampled rows and NaN rows are left to Sampler.choose."""
    rows = torch.stack([_logits(i) for i in range(5)])
    rows[1] = 0.0  # all tied: the lowest id wins
    rows[2, :] = float("-inf")
    rows[2, 7] = 1.0
    rows[3, 4] = float("nan")
    params = [SamplingParams(), SamplingParams(), SamplingParams(), SamplingParams(),
              SamplingParams(temperature=1.0, seed=9)]
    samplers = [Sampler(p, V) for p in params]
    got = greedy_rows(rows, samplers)
    assert got[:3] == [Sampler(p, V).choose(rows[i]) for i, p in enumerate(params[:3])] and got[1] == 0
    assert got[3:] == [None, None]
    assert all(s.draws == 0 for s in samplers)  # nothing was drawn


def test_greedy_rows_leave_a_batch_of_the_wrong_shape_to_choose() -> None:
    """A batch that is not [B, vocab] gets no pick, so choose() raises its precise shape error."""
    samplers = [Sampler(SamplingParams(), V) for _ in range(2)]
    assert greedy_rows(torch.zeros(2, V + 1), samplers) == [None, None]
    assert greedy_rows(torch.zeros(3, V), samplers) == [None, None]
    assert greedy_rows(torch.zeros(V), samplers) == [None, None]
    other = [Sampler(SamplingParams(), V), Sampler(SamplingParams(), V + 1)]
    assert greedy_rows(torch.zeros(2, V), other) == [0, None]  # only that row is left to choose()


# ---- the request's shaping of the logits (DECISIONS D32) -------------------------------------------


def _shaped_oracle(logits, history, prompt, *, bias=(), rep=1.0, freq=0.0, pres=0.0):
    """Plain Python: bias added; a logit of a token seen (prompt or output) divided by rep when
    positive, multiplied when not; minus freq per occurrence in the output and pres once present."""
    z = [float(x) for x in logits]
    for t, b in bias:
        z[t] += b
    seen = set(prompt) | set(history)
    for t in range(len(z)):
        if t in seen and rep != 1:
            z[t] = z[t] / rep if z[t] > 0 else z[t] * rep
        n = history.count(t)
        z[t] -= freq * n + (pres if n else 0.0)
    return z


@given(seed=st.integers(0, 10_000), rep=st.floats(0.5, 2.0), freq=st.floats(-2, 2), pres=st.floats(-2, 2),
       history=st.lists(st.integers(0, V - 1), max_size=8), prompt=st.lists(st.integers(0, V - 1), max_size=4),
       bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=3))
@settings(max_examples=60, deadline=None)
def test_shaping_follows_the_openai_and_vllm_definitions(seed, rep, freq, pres, history, prompt, bias):
    """D32: logit bias, repetition penalty (prompt and output), frequency and presence penalties
    (output only), in that order, against an independent oracle."""
    logits = _logits(seed)
    params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                            logit_bias=tuple(sorted(bias.items())))
    got = Sampler(params, V, history=history, prompt=prompt).shape(logits).tolist()
    want = _shaped_oracle(logits.double().tolist(), history, prompt, bias=tuple(bias.items()), rep=rep, freq=freq,
                          pres=pres)
    assert got == pytest.approx(want, abs=1e-9)


def test_a_logit_bias_changes_the_greedy_choice_and_the_batch_argmax_stays_out_of_it() -> None:
    logits = torch.zeros(V)
    logits[3] = 2.0
    biased = Sampler(SamplingParams(logit_bias=((7, 5.0),)), V)
    assert biased.choose(logits) == 7 and not biased.greedy
    plain = Sampler(SamplingParams(), V)
    assert greedy_rows(torch.stack([logits, logits]), [plain, biased]) == [3, None]
    assert choose_batch(torch.stack([logits, logits]), [plain, biased]) == [3, 7]


def test_min_tokens_masks_its_ids_until_the_count_unless_nothing_would_be_left() -> None:
    history: list[int] = []
    s = Sampler(SamplingParams(min_tokens=2, min_tokens_ids=(5,)), V, history=history)
    logits = torch.zeros(V)
    logits[5], logits[2] = 9.0, 1.0
    assert s.choose(logits) == 2
    history += [2, 2]
    assert s.choose(logits) == 5  # two chosen: EOS may come
    only = torch.full((V,), float("-inf"))
    only[5] = 0.0
    assert Sampler(SamplingParams(min_tokens=2, min_tokens_ids=(5,)), V).choose(only) == 5


def test_min_p_keeps_the_tokens_within_its_share_of_the_top_probability() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08] + [1e-6] * (V - 4)))
    ids, probs = Sampler(SamplingParams(temperature=1.0, min_p=0.2), V).allowed(logits)
    assert sorted(ids.tolist()) == [0, 1, 2]  # 0.08 < 0.2 * 0.5
    assert float(probs.sum()) == pytest.approx(1.0)


def test_a_scored_sampler_sums_the_log_probabilities_of_its_choices() -> None:
    """D34 (best_of): the sum of log softmax(shaped logits) at each chosen token."""
    s = Sampler(SamplingParams(temperature=1.0, seed=3, score=True), V)
    total = 0.0
    for i in range(5):
        lg = _logits(i)
        tok = s.choose(lg)
        total += float(torch.log_softmax(lg.double(), -1)[tok])
    assert s.logprob_sum == pytest.approx(total) and not s.greedy


def test_bad_shaping_parameters_are_refused_by_name() -> None:
    with pytest.raises(SamplingError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(SamplingError, match="min_p must be None or in \\[0, 1\\]"):
        SamplingParams(min_p=2)
    with pytest.raises(SamplingError, match="outside the vocabulary"):
        Sampler(SamplingParams(logit_bias=((V, 1.0),)), V)
