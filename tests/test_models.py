"""Models behind the protocol: TinyLM, ScriptedModel, HFModel and the KV cache (§4.2, §4.4)."""

from __future__ import annotations

import pytest
import torch

from decodespec.runtime.models import (
    CacheError,
    HFModel,
    KVCache,
    Model,
    ScriptedModel,
    ScriptExhausted,
    TinyLM,
    TinyLMConfig,
)
from decodespec.runtime.tinylm import ASSETS

SMALL = TinyLMConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=96, context_limit=96)


@pytest.fixture(scope="module")
def small() -> TinyLM:
    model = TinyLM(SMALL)
    with torch.no_grad():  # a non-trivial random init: larger weights give peaked, varied logits
        for p in model.parameters():
            p.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def default() -> TinyLM:
    return TinyLM.default()


def _greedy_cached(model: TinyLM, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    logits, cache = model.prefill(prompt)
    out, seen = [], [logits]
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model.decode_one([cache], [out[-1]])[0]
        seen.append(logits)
    return out, seen


@pytest.mark.parametrize("which", ["small", "default"])
def test_cached_greedy_equals_full_recompute_token_for_token(which, request) -> None:
    """§4.2/§4.4: decode_one on the cache gives the logits a full no-cache forward gives, 40 steps."""
    model = request.getfixturevalue(which)
    prompt = [5, 17, 3, 42, 8] if which == "small" else list(range(20, 32))
    out, seen = _greedy_cached(model, prompt, 40)
    full = model.forward_full(prompt + out)
    for t, logits in enumerate(seen):
        ref = full[len(prompt) - 1 + t]
        assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), f"step {t}"
    assert out == [int(full[len(prompt) - 1 + t].argmax()) for t in range(40)]
    assert len(set(out)) > 3  # the run is not a constant token: the comparison has teeth


def test_batched_decode_over_different_lengths_equals_decoding_alone(small) -> None:
    """§4.4: an active batch whose caches have different lengths gives each row its solo logits."""
    prompts = [[1, 2, 3], [9] * 11, [4], [7, 8, 9, 10, 11, 12, 13]]
    logits, caches = small.prefill_batch(prompts)
    solo = [small.prefill(p) for p in prompts]
    for b, (sl, _) in enumerate(solo):
        assert torch.allclose(logits[b], sl, atol=1e-5)
    for step in range(6):
        toks = [(b * 13 + step * 7) % SMALL.vocab_size for b in range(len(prompts))]
        batched = small.decode_one(caches, toks)
        for b, (_, cache) in enumerate(solo):
            alone = small.decode_one([cache], [toks[b]])[0]
            assert torch.allclose(batched[b], alone, atol=1e-4, rtol=1e-4), (step, b)
        assert [c.length for c in caches] == [len(p) + step + 1 for p in prompts]


def test_a_subset_batch_leaves_the_other_caches_untouched(small) -> None:
    """§4.4: only the active batch's caches grow; a sequence left out keeps its length."""
    _, caches = small.prefill_batch([[1, 2], [3, 4, 5]])
    small.decode_one(caches[1:], [6])
    assert [c.length for c in caches] == [2, 4]


def test_cache_grows_by_two_l_hkv_dh_scalars_per_token(small) -> None:
    """§4.4: each processed token adds exactly 2·L·H_kv·d_h scalars to the logical cache."""
    per_token = 2 * SMALL.n_layers * SMALL.n_kv_heads * SMALL.head_dim
    logits, cache = small.prefill([3, 1, 4, 1, 5, 9])
    assert cache.numel_per_token == per_token
    assert cache.numel() == 6 * per_token
    assert cache.nbytes() == 6 * per_token * 4
    for step in range(20):
        before = cache.numel()
        logits = small.decode_one([cache], [int(logits.argmax())])[0]
        assert cache.numel() - before == per_token
        assert cache.length == 7 + step
    k, v = cache.keys_values()
    assert k.numel() + v.numel() == cache.numel()


def test_snapshot_and_restore_continue_bit_identically(small) -> None:
    """§4.8 swap-out: snapshot to CPU, free, restore into the same cache; the next logits are equal."""
    _, cache = small.prefill([2, 7, 1, 8])
    for t in (5, 6, 7):
        small.decode_one([cache], [t])
    snap = cache.snapshot()
    assert snap.k.device.type == "cpu" and snap.length == 7
    reference = [small.decode_one([cache], [t])[0] for t in (11, 12, 13)]
    cache.free()
    assert cache.freed and cache.numel() == 0
    with pytest.raises(CacheError, match="after free"):
        cache.keys_values()
    cache.restore(snap)
    assert cache.length == 7 and cache.prompt_length == 4
    resumed = [small.decode_one([cache], [t])[0] for t in (11, 12, 13)]
    for a, b in zip(reference, resumed):
        assert torch.equal(a, b)


def test_context_limit_is_enforced(small) -> None:
    """§4.3: the cache never holds more than context_limit tokens, prompt included."""
    _, cache = small.prefill(list(range(SMALL.context_limit - 1)))
    small.decode_one([cache], [1])
    assert cache.length == SMALL.context_limit
    with pytest.raises(CacheError, match="context limit"):
        small.decode_one([cache], [1])
    with pytest.raises(CacheError, match="context limit"):
        small.prefill([1] * (SMALL.context_limit + 1))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m: m.prefill([]), ValueError, "at least one"),
        (lambda m: m.prefill([1, 97]), ValueError, "outside"),
        (lambda m: m.prefill_batch([]), ValueError, "at least one"),
        (lambda m: m.decode_one([m.prefill([1])[1]], [1, 2]), ValueError, "one token per cache"),
    ],
)
def test_bad_model_input_is_rejected_clearly(small, call, error, match) -> None:
    """Bad ids or a mismatched batch are refused with a message naming the problem."""
    with pytest.raises(error, match=match):
        call(small)


def test_the_same_cache_twice_in_one_batch_is_rejected(small) -> None:
    """§4.4: each row of the active batch owns its cache; a duplicate would write twice."""
    _, cache = small.prefill([1, 2])
    with pytest.raises(ValueError, match="same cache"):
        small.decode_one([cache, cache], [3, 4])
    assert cache.length == 2


def test_one_token_appended_to_many_caches_equals_an_append_each_and_writes_nothing_when_one_is_full() -> None:
    """§4.4: `append_token` (the batched copy-back of a decode step) leaves each cache as its own
    one-token `append` would; a cache with no room is refused before any cache is written."""
    from decodespec.runtime.kvcache import append_token

    def cache(n: int, limit: int = 8) -> KVCache:
        c = KVCache(n_layers=2, n_kv_heads=3, head_dim=4, max_length=limit, device="cpu")
        c.append(torch.randn(n, 2, 3, 4), torch.randn(n, 2, 3, 4))
        return c

    ks, vs = torch.randn(3, 2, 3, 4), torch.randn(3, 2, 3, 4)
    batched, alone = [cache(n) for n in (1, 5, 7)], []
    for c in batched:
        twin = cache(c.length)
        twin.k[: c.length], twin.v[: c.length] = c.k[: c.length], c.v[: c.length]
        alone.append(twin)
    append_token(batched, ks.unbind(0), vs.unbind(0))
    for i, (c, twin) in enumerate(zip(batched, alone)):
        twin.append(ks[i][None], vs[i][None])
        assert (c.length, c.writes) == (twin.length, twin.writes)
        assert all(map(torch.equal, c.keys_values(), twin.keys_values()))
    full = [cache(2), cache(8)]
    before = [(c.length, c.writes, c.keys_values()[0].clone()) for c in full]
    with pytest.raises(CacheError, match="over the context limit"):
        append_token(full, ks[:2].unbind(0), vs[:2].unbind(0))
    assert [(c.length, c.writes) for c in full] == [b[:2] for b in before]
    assert all(torch.equal(c.keys_values()[0], b[2]) for c, b in zip(full, before))
    with pytest.raises(CacheError, match="shape"):
        append_token([cache(1)], [torch.randn(2, 3, 5)], [torch.randn(2, 3, 5)])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"d_model": 50, "n_heads": 4}, "divisible"),
        ({"n_heads": 4, "n_kv_heads": 3}, "multiple"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_bad_config_is_rejected(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        TinyLMConfig(**{"vocab_size": 10, **kwargs})


def test_save_and_from_pretrained_round_trip(small, tmp_path) -> None:
    """A saved TinyLM reloads with the same config and the same logits."""
    small.save(tmp_path)
    again = TinyLM.from_pretrained(tmp_path)
    assert again.config == small.config
    assert torch.equal(again.forward_full([1, 2, 3]), small.forward_full([1, 2, 3]))
    with pytest.raises(FileNotFoundError, match="config.json"):
        TinyLM.from_pretrained(tmp_path / "missing")


def test_default_checkpoint_is_small_and_self_describing(default) -> None:
    """The embedded default ships in the repo: a few MB, with its tokenizer and EOS id."""
    total = sum(f.stat().st_size for f in ASSETS.iterdir())
    assert total < 8 * 2**20
    assert (ASSETS / "tokenizer.json").is_file()
    assert default.eos_token_id is not None and 0 <= default.eos_token_id < default.vocab_size
    assert default.config.n_heads > default.config.n_kv_heads  # grouped KV heads
    assert isinstance(default, Model)


def test_default_checkpoint_writes_readable_text(default) -> None:
    """The default continues a story prompt with real words and a full stop."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    out, _ = _greedy_cached(default, tok.encode("Once upon a time").ids, 30)
    text = tok.decode(out)
    assert "." in text and " there was a" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tinylm_on_cuda_matches_cpu(small) -> None:
    """TinyLM runs on CUDA through `device=` and agrees with the CPU model."""
    gpu = TinyLM(SMALL, device="cuda")
    gpu.load_state_dict(small.state_dict())
    logits, cache = gpu.prefill([1, 2, 3])
    assert cache.k.device.type == "cuda"
    assert torch.allclose(logits.cpu(), small.prefill([1, 2, 3])[0], atol=1e-4)


# -- ScriptedModel ---------------------------------------------------------------------------


def test_scripted_model_yields_its_script_and_writes_a_real_cache() -> None:
    """§4.11 fixtures: greedy choose on ScriptedModel reproduces the script; the cache grows by 1."""
    script = [101, 102, 7, 0]
    model = ScriptedModel(script)
    assert isinstance(model, Model) and model.vocab_size == 103
    logits, cache = model.prefill([5, 6, 7])
    assert isinstance(cache, KVCache) and cache.length == 3 and cache.numel() == 3 * 2
    got = []
    for t in range(len(script)):
        got.append(int(logits.argmax()))
        if t < len(script) - 1:
            logits = model.decode_one([cache], [got[-1]])[0]
            assert cache.length == 4 + t
    assert got == script


def test_scripted_model_batches_sequences_at_different_steps() -> None:
    """§4.4: each sequence follows the script from its own step, whatever the others' lengths."""
    model = ScriptedModel([10, 11, 12, 13], vocab_size=20)
    _, (a, b) = model.prefill_batch([[1], [1, 2, 3, 4]])
    model.decode_one([a], [10])  # a is one step ahead of b
    logits = model.decode_one([a, b], [11, 10])
    assert logits.argmax(-1).tolist() == [12, 11]
    assert (a.length, b.length) == (3, 5)


def test_scripted_model_raises_past_its_script_without_touching_caches() -> None:
    """A fixture that runs past its script is an error, raised before any cache changes."""
    model = ScriptedModel([3, 4])
    _, cache = model.prefill([1])
    model.decode_one([cache], [3])
    with pytest.raises(ScriptExhausted, match="2 tokens"):
        model.decode_one([cache], [4])
    assert cache.length == 2


def test_scripted_model_survives_snapshot_and_restore() -> None:
    """§4.8: the script position lives in the cache, so a swapped-out sequence resumes in place."""
    model = ScriptedModel([1, 2, 3, 4])
    _, cache = model.prefill([9, 9])
    model.decode_one([cache], [1])
    snap = cache.snapshot()
    cache.free()
    cache.restore(snap)
    assert int(model.decode_one([cache], [2])[0].argmax()) == 3


@pytest.mark.parametrize(
    "args, match",
    [(([],), "non-empty"), (([1, -2],), "non-negative"), (([5], 3), "too small")],
)
def test_scripted_model_bad_arguments(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        ScriptedModel(*args)


# -- HFModel ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    return folder, model


def test_hf_model_greedy_equals_transformers_generate(hf_folder) -> None:
    """HFModel runs a locally built transformers checkpoint; its greedy loop equals `generate`."""
    folder, ref = hf_folder
    model = HFModel(folder)
    assert isinstance(model, Model) and model.context_limit == 128
    prompt = [3, 14, 15, 9, 2]
    logits, cache = model.prefill(prompt)
    out = []
    for _ in range(8):
        out.append(int(logits.argmax()))
        logits = model.decode_one([cache], [out[-1]])[0]
    want = ref.eval().generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert out == want
    assert cache.length == len(prompt) + 8
    assert cache.numel_per_token == 2 * 2 * 2 * 8


def _forward_calls(model: HFModel) -> list[int]:
    """Counts the model's calls (one entry a call): each one, the transformers forward or the lean
    step (D58), looks its tokens up in the input embedding once."""
    calls: list[int] = []
    model.model.get_input_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_hf_model_batch_of_different_lengths_is_one_call_and_equals_alone(hf_folder) -> None:
    """§4.4 on HFModel (D50): prompts of different lengths prefill in one call, and a batch of
    caches of different lengths decodes in one call; every row and every cache match the sequence
    decoded alone (fp32), for several steps, so the padded slots are never read."""
    model = HFModel(hf_folder[0])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    solo = [model.prefill(p) for p in prompts]
    calls = _forward_calls(model)
    logits, caches = model.prefill_batch(prompts)
    assert len(calls) == 1
    assert torch.allclose(logits, torch.stack([s[0] for s in solo]), atol=1e-5)
    for step in range(4):
        tokens = [12 + step + b for b in range(len(prompts))]
        before = len(calls)
        batched = model.decode_one(caches, tokens)
        assert len(calls) == before + 1
        for b, (_, cache) in enumerate(solo):
            assert torch.allclose(batched[b], model.decode_one([cache], [tokens[b]])[0], atol=1e-5)
    for (_, alone), cache in zip(solo, caches):
        assert cache.length == alone.length and cache.prompt_length == alone.prompt_length
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(cache.keys_values(), alone.keys_values()))


def test_hf_model_keeps_its_batch_cache_resident_across_joins_leaves_and_rollbacks(hf_folder, monkeypatch) -> None:
    """§4.4 (D50): the resident batch cache keeps each sequence in its row while its cache is
    unchanged; a sequence that sits out a step keeps its row (a masked gap), one that leaves frees
    it for one that joins, and a cache changed in between (rolled back to an earlier snapshot:
    same object, other contents) is written into its row anew, never reused. Every step equals
    each sequence decoded alone on a model of its own (fp32), and only the first step gathers.
    The buffers are made 7.0 here, not zeros: a column a row attends to before it was written
    would show (the lean step reads every column of the capacity, masked past each row's own)."""
    from decodespec.runtime import hfmodel

    model, alone = HFModel(hf_folder[0]), HFModel(hf_folder[0])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17]]
    _, caches = model.prefill_batch(prompts)
    solo = [alone.prefill(p)[1] for p in prompts]
    gathers, rows_written = [], []  # of `model` only (`alone` gathers each time: its batches are of one)
    gather, write = hfmodel._Slots.gather.__func__, hfmodel._Slots._write
    ours = {id(c): i for i, c in enumerate(caches)}

    def counted_gather(cls, cs, spare=None):
        if id(cs[0]) in ours:
            gathers.append(len(cs))
        return gather(cls, cs, spare)

    def counted_write(self, b, c):
        if id(c) in ours:
            rows_written.append(ours[id(c)])
        return write(self, b, c)

    alloc = hfmodel._Slots._alloc

    def poisoned(shape, dtype, device, zeroed=True, spare=None):
        keys, values, valid = alloc(shape, dtype, device, zeroed, spare)
        return keys.fill_(7.0), values.fill_(7.0), valid

    monkeypatch.setattr(hfmodel._Slots, "_alloc", staticmethod(poisoned))
    monkeypatch.setattr(hfmodel._Slots, "gather", classmethod(counted_gather))
    monkeypatch.setattr(hfmodel._Slots, "_write", counted_write)
    batches = [[0, 1, 2], [0, 1, 2], [0, 2], [0, 1, 2], [0, 1, 3], [0, 1, 3, 4], [0, 1, 3, 4], [1, 3, 4]]
    snaps = None
    for step, batch in enumerate(batches):
        if step == 2:
            snaps = caches[0].snapshot(), solo[0].snapshot()
        if step == 6:  # roll the first sequence back, in the batch and alone
            caches[0].restore(snaps[0])
            solo[0].restore(snaps[1])
        tokens = [20 + step + b for b in batch]
        batched = model.decode_one([caches[b] for b in batch], tokens)
        for row, b in enumerate(batch):
            assert torch.allclose(batched[row], alone.decode_one([solo[b]], [tokens[row]])[0], atol=1e-5), (step, b)
    assert gathers == [3]  # the first step only
    assert rows_written == [0, 1, 2, 3, 4, 0]  # the first gather, two joins (3 into 2's row), the rollback
    # D61: the decoded tokens' K/V stayed in the rows, owed; each cache is paid when it is read (2's
    # already when 3 took its row) and then holds what decoding alone wrote into its own cache
    assert caches[2].owed == 0 and caches[1].owed > 0
    for b, (c, s) in enumerate(zip(caches, solo)):
        assert c.length == s.length, b
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(c.keys_values(), s.keys_values())), b
        assert c.owed == 0


def test_the_resident_batch_reuses_the_buffers_it_let_go_and_zeroes_them(hf_folder) -> None:
    """D63: the buffers a resident batch lets go (moved when it grew, or gathered afresh) are kept
    and the next ones are made on them (no fresh pages to fault in), zeroed where fresh ones would
    be; a batch on reused buffers decodes as one on new ones, and what a cache owed is paid first."""
    from decodespec.runtime.hfmodel import _Spare

    spare = _Spare(keep=2)
    big, small = torch.ones(4, 8), torch.ones(2, 3)
    spare.give(big, small, torch.ones(1))
    assert [t.numel() for t in spare.free] == [32, 6]  # the largest two
    got = spare.take((3, 2), torch.float32, torch.device("cpu"), zeroed=True)
    assert got.data_ptr() == small.data_ptr() and got.eq(0).all() and big.eq(1).all()  # smallest that fits
    assert spare.take((5, 5), torch.float32, torch.device("cpu"), zeroed=False).data_ptr() == big.data_ptr()
    assert spare.take((3,), torch.float32, torch.device("cpu"), zeroed=True).data_ptr() not in (big.data_ptr(),
                                                                                               small.data_ptr())
    model, alone = HFModel(hf_folder[0]), HFModel(hf_folder[0])
    first = [list(range(1, 31)), [4, 5], [6, 7, 8, 9]]  # a long row: the next small batch is gathered afresh
    _, caches = model.prefill_batch(first)
    for step in range(3):
        model.decode_one(caches, [10 + step] * 3)
    before = {model._slots.keys.data_ptr(), model._slots.values.data_ptr()}
    _, fresh = model.prefill_batch([[11, 12], [13]])  # a new batch: the old one's rows are let go
    solo = [alone.prefill(p)[1] for p in ([11, 12], [13])]
    out = model.decode_one(fresh, [20, 21])
    assert {model._slots.keys._base.data_ptr(), model._slots.values._base.data_ptr()} == before
    for row, (c, t) in enumerate(zip(solo, [20, 21])):
        assert torch.allclose(out[row], alone.decode_one([c], [t])[0], atol=1e-5)
    assert all(c.owed == 0 and c.length == len(p) + 3 for c, p in zip(caches, first))  # paid when let go


def test_a_cache_that_owes_is_paid_before_it_is_read_or_changed_and_never_once_freed() -> None:
    """§4.4, D61: `owe` counts tokens whose K/V a model still holds; the writer pays them into the
    cache before anything reads or changes what it stores (read, snapshot, append, another
    writer's debt), once; a cache freed while it owes is never written; restore drops the debt."""
    paid: list[tuple[int, int]] = []

    def writer(cache: KVCache, start: int) -> None:
        paid.append((start, cache.length))
        cache.k[start : cache.length] = 1.0
        cache.v[start : cache.length] = 2.0

    def cache(n: int = 2) -> KVCache:
        c = KVCache(n_layers=1, n_kv_heads=1, head_dim=2, max_length=8, device="cpu")
        c.append(torch.zeros(n, 1, 1, 2), torch.zeros(n, 1, 1, 2))
        return c

    for read in (lambda c: c.keys_values(), lambda c: c.snapshot(), lambda c: c.reserve(1),
                 lambda c: c.append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)),
                 lambda c: c.owe(1, lambda c, start: None)):
        paid.clear()
        c = cache()
        c.owe(1, writer)
        c.owe(2, writer)
        assert (c.length, c.owed, c.numel()) == (5, 3, 5 * 4) and paid == []
        read(c)
        assert paid == [(2, 5)], read
        k, _ = c.keys_values()
        assert k[:2].eq(0).all() and k[2:5].eq(1).all()
    freed = cache()
    freed.owe(3, writer)
    paid.clear()
    freed.free()
    assert paid == [] and freed.owed == 0
    restored = cache()
    snap = restored.snapshot()
    restored.owe(1, writer)
    restored.restore(snap)
    assert paid == [] and (restored.length, restored.owed) == (2, 0)
    with pytest.raises(CacheError, match="over the context limit"):
        cache(7).owe(2, writer)


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    """A tiny Qwen2 checkpoint: biases on q/k/v, a family of the lean step (D58)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, use_sliding_window=False,
    )
    torch.manual_seed(1)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_model_lean_step_equals_the_transformers_forward_on_the_same_batch(family, request) -> None:
    """§4.4, D58: a batch of two or more rows of a Llama or Qwen2 checkpoint takes the lean step
    (the transformers forward is not called), and its logits and its new keys and values equal
    those of transformers' own padded forward on the same resident rows (fp32, grouped K/V heads:
    4 query heads on 2; Qwen2's q/k/v biases), step after step, with a row sitting out and one
    joining."""
    folder = request.getfixturevalue("hf_folder")[0] if family == "llama" else request.getfixturevalue("qwen2_folder")
    lean, plain = HFModel(folder), HFModel(folder)
    assert lean.lean_unsupported is None and lean._lean is not None
    plain._lean = None  # the transformers path, for the comparison
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    _, lean_caches = lean.prefill_batch(prompts)
    _, plain_caches = plain.prefill_batch(prompts)
    hf_calls = []
    lean.model.register_forward_pre_hook(lambda *_: hf_calls.append(1))
    for step, batch in enumerate([[0, 1, 2], [0, 2], [0, 1, 2, 3], [1, 2, 3]]):
        tokens = [30 + step + b for b in batch]
        got = lean.decode_one([lean_caches[b] for b in batch], tokens)
        want = plain.decode_one([plain_caches[b] for b in batch], tokens)
        assert torch.allclose(got, want, atol=1e-5), step
    assert hf_calls == []
    for a, b in zip(lean_caches, plain_caches):
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.keys_values(), b.keys_values()))


@pytest.mark.parametrize("arch, why", [("gpt2", "'gpt2' is not one of"), ("mistral", "sliding-window")])
def test_hf_model_without_a_lean_step_says_why_and_batches_through_transformers(arch, why, tmp_path) -> None:
    """D58: a checkpoint outside the known families (GPT-2), or of one with a sliding window
    (Mistral's default), keeps the transformers forward for every batch, names why, and still
    decodes a batch as each sequence alone."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                     n_positions=64))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, sliding_window=16))
    model.save_pretrained(tmp_path)
    model = HFModel(tmp_path)
    assert model._lean is None and why in model.lean_unsupported
    _, caches = model.prefill_batch([[1, 2, 3], [4, 5]])
    solo = [model.prefill(p)[1] for p in ([1, 2, 3], [4, 5])]
    for step in range(3):
        batched = model.decode_one(caches, [6 + step, 7 + step])
        for b, cache in enumerate(solo):
            assert torch.allclose(batched[b], model.decode_one([cache], [6 + step + b])[0], atol=1e-5)


def test_hf_model_computes_a_batch_of_one_alone(hf_folder) -> None:
    """§4.4, D50: a lone sequence is the plain call (no mask, no other row), whatever batch the
    resident cache held before, so from the same cache contents its logits are bit for bit those
    of a model that only ever saw it."""
    model, alone = HFModel(hf_folder[0]), HFModel(hf_folder[0])
    _, caches = model.prefill_batch([[1, 2, 3], [4, 5, 6, 7]])
    model.decode_one(caches, [8, 9])  # the resident cache now holds a batch of two
    _, solo = alone.prefill_batch([[1]])
    solo[0].restore(caches[0].snapshot())  # the same contents, on a model that never batched
    for step in range(4):
        out = model.decode_one([caches[0]], [10 + step])
        assert torch.equal(out, alone.decode_one(solo, [10 + step])), step


def _hf_requests(n: int) -> list:
    from decodespec.runtime import Request

    return [Request(list(range(1 + i % 4, 4 + i)), max_output_tokens=10, request_id=f"h{i}") for i in range(n)]


@pytest.mark.parametrize("preemption", [None, "swap", "recompute"])
def test_hf_engine_batch_invariant_equals_generate_bit_for_bit(hf_folder, preemption) -> None:
    """§4.4, §4.8 (D50): with batch_invariant the Engine makes HFModel's one-sequence calls only,
    so batching, swap and recompute change no token of generate()'s; the default mode batches
    (fewer forward calls than decoded tokens) and, in fp32 on this model, keeps the tokens too."""
    from decodespec.properties import check_trace
    from decodespec.runtime import ByteTableTokenizer, Engine, generate

    model = HFModel(hf_folder[0])
    tok = ByteTableTokenizer({i: bytes([33 + i]) for i in range(64)})
    reqs = _hf_requests(8)
    ref = {r.request_id: generate(r, model=model, tokenizer=tok).tokens for r in reqs}
    budget = {} if preemption is None else {"cache_budget_tokens": 40, "preemption": preemption}
    calls = _forward_calls(model)
    for invariant in (True, False):
        calls.clear()
        eng = Engine(model, tok, max_batch=4, batch_invariant=invariant, **budget)
        runs = [eng.submit(r) for r in reqs]
        eng.run_until_idle()
        assert {r.request.request_id: r.result().tokens for r in runs} == ref
        decoded = eng.stats().decode_tokens_total
        assert (len(calls) >= decoded) if invariant else (len(calls) < decoded / 2)
        if preemption is not None:
            assert eng.stats().preemptions_total > 0
        for run in runs:
            assert check_trace(run.trace.events, tokenizer=tok) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_models_run_in_half_precision(hf_folder, dtype) -> None:
    """TinyLM and HFModel load in `dtype`: weights and cache in it; each decode step's
    logits are the last row of a plain recompute in the same dtype, to its precision (§4.4)."""
    want = getattr(torch, dtype)
    for model in (TinyLM.default(dtype=dtype), HFModel(hf_folder[0], dtype=dtype)):
        assert all(p.dtype is want for p in (model.parameters() if isinstance(model, TinyLM)
                                             else model.model.parameters()))
        prompt = [3, 14, 15, 9, 2]
        logits, cache = model.prefill(prompt)
        assert cache.keys_values()[0].dtype is want
        ids = list(prompt)
        for _ in range(3):
            ids.append(int(logits.argmax()))
            logits = model.decode_one([cache], [ids[-1]])[0]
        full = (model.forward_full(ids) if isinstance(model, TinyLM)
                else model.model(torch.tensor([ids])).logits[0])[-1]
        assert torch.allclose(logits.float(), full.float(), atol=0.1, rtol=0.05), (type(model).__name__, dtype)


def test_a_dtype_not_offered_is_a_clear_error(hf_folder) -> None:
    for load in (lambda: TinyLM.default(dtype="half"), lambda: HFModel(hf_folder[0], dtype="half")):
        with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'half'"):
            load()


def test_hf_model_missing_folder_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFModel(tmp_path / "nowhere")
