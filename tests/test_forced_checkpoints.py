"""Forced-script checkpoints: weights by construction, proof by transformers, and the
script cases over HTTP against `decodespec serve` on them, with seeded bugs caught (§4.3-§4.7)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from decodespec.cli import main
from decodespec.properties.conformance import CaseError, Verdict, load_cases, run_cases
from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.cases import CaseKind
from decodespec.properties.conformance.checkpoints import (
    FORMAT,
    MANIFEST,
    RECIPE,
    TABLE_GROUP,
    Checkpoint,
    build_checkpoints,
    byte_table_tokenizer,
    merged_table,
    prove,
    served_context,
)
from decodespec.properties.conformance.forced import Program, ProgramError, check_margins, forced_llama
from decodespec.properties.conformance.life import RECIPES as LIFE_RECIPES
from decodespec.properties.conformance.runner import judge
from decodespec.properties.mutants import MUTANTS

torch = pytest.importorskip("torch")


def _greedy(config, state, prompt, n):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


ANCHOR = 45


def test_forced_weights_follow_scripts_where_tokens_recur_with_other_successors():
    """§4.3: greedy follows each script exactly, then EOS, although 5 is followed by 5, 6 and 7 in turn,
    marker and anchor alone are a prompt, and the 56-step script shares its tokens with the others."""
    eos = 9
    progs = [Program("a", 40, [40, ANCHOR, 1], [5, 5, 6, 5, 7]), Program("b", 41, [41, ANCHOR, 5], [7, 5, eos]),
             Program("c", 42, [42, ANCHOR], [*range(10, 40), *range(10, 36)])]
    config, state = forced_llama(progs, 50, eos, ANCHOR)
    margins = check_margins(state, config, progs, eos)  # every step, with each dtype's rounding
    assert set(margins) == {"float32", "bfloat16", "float16"} and all(m.logit > 5 for m in margins.values())
    for p in progs:
        assert _greedy(config, state, p.prompt, len(p.script) + 1) == [*p.script, eos]


def test_a_prompt_of_no_program_chooses_eos():
    """Positions no program votes at fall to EOS: an unknown prompt ends at once, not on noise."""
    config, state = forced_llama([Program("a", 40, [40, ANCHOR, 1], [5, 6])], 50, 9, ANCHOR)
    assert _greedy(config, state, [1, 2, 3], 2) == [9, 9]


@pytest.mark.parametrize("programs, message", [
    ([Program("a", 40, [1, 40, ANCHOR], [5])], "must start with its marker"),
    ([Program("a", 40, [40, 1], [5])], "then the anchor"),
    ([Program("a", 40, [40, ANCHOR], [41]), Program("b", 41, [41, ANCHOR], [5])], "stand inside its prompt"),
    ([Program("a", 40, [40, ANCHOR], [99])], "outside the vocabulary"),
    ([Program("a", 40, [40, ANCHOR], [5]), Program("b", 40, [40, ANCHOR], [6])], "also a's"),
    ([Program("a", 40, [40, ANCHOR], [5] * 511)], "exceed the context of 512"),
])
def test_programs_that_cannot_share_a_checkpoint_are_refused_by_name(programs, message):
    with pytest.raises(ProgramError, match=message):
        forced_llama(programs, 50, 9, ANCHOR)


@pytest.mark.parametrize("manifest, words", [
    ("{bad", "not JSON"),
    ("[1]", "a JSON list where the manifest is an object"),
    ('{"format": "decodespec-forced/1"}', "format 'decodespec-forced/1', expected"),
    (f'{{"format": "{FORMAT}", "cases": {{"x": 3}}}}', f"not a {FORMAT} manifest"),
])
def test_a_broken_checkpoint_manifest_is_one_error_naming_it(tmp_path, manifest, words):
    """A manifest cut, edited or of another format is refused by its path wherever a checkpoint is
    read (the loader, `checkpoints list`, `conform --launch`, `conform --checkpoint`): no traceback,
    and no server is started for it."""
    (tmp_path / MANIFEST).write_text(manifest)
    with pytest.raises(CaseError, match=str(tmp_path / MANIFEST)):
        Checkpoint.load(tmp_path)
    for args in (["checkpoints", "list", str(tmp_path)],
                 ["conform", "--launch", "false {model} {port}", "--checkpoint", str(tmp_path)],
                 ["conform", "--engine", "openai:http://127.0.0.1:9", "--checkpoint", str(tmp_path)]):
        out = CliRunner().invoke(main, args)
        said = " ".join(out.output.split())
        assert out.exit_code in (1, 2) and words in said and "Traceback" not in out.output, (args, said)


def test_compiled_byte_table_keeps_every_id_and_its_bytes(tmp_path):
    """The case's own ids and bytes survive compilation (incl. invalid UTF-8 pieces), EOS is special."""
    from decodespec.runtime.tokenizers import HFTokenizer

    cases = [c for c in load_cases() if c.tokenizer_spec.get("table")]
    table, eos = merged_table(cases)
    tok = byte_table_tokenizer(table, eos, ["<|m|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path, eos_id=eos)
    for tid, data in table.items():
        assert hf.token_bytes(tid) == data, tid
    assert eos in hf.special_ids and hf.decode_bytes([103, eos, 104]) == b"EF"


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    """Every group's checkpoint, built once and proved with transformers generate (the chat groups:
    tests/test_chat_conformance.py; the long program: tests/test_request_life.py)."""
    plain = [c for c in load_cases() if not c.id.startswith("chat/")]
    built = build_checkpoints(plain, tmp_path_factory.mktemp("forced"), chat=False, long=False)
    return {c.group: c for c in built}


def test_every_checkpoint_is_proved_by_transformers_generate_and_checked_in_every_dtype(forced):
    """No engine is judged on an unproved checkpoint: every program (recipe included) and the prefix
    probe are followed exactly by transformers; every checkpoint's margins were checked with each
    dtype's rounding when it was built, and one is proved in float32, bfloat16 and float16 as engines
    serve them (`decodespec checkpoints build` proves all in all three)."""
    assert set(forced) == {TABLE_GROUP, "byte_level_bpe", "sentencepiece_byte_fallback", "wordpiece"}
    for ck in forced.values():
        assert RECIPE in ck.programs
        assert "followed exactly" in prove(ck, ("float32",))
        assert set(ck.margins) == {"float32", "bfloat16", "float16"}
        assert all(m["logit"] > 20 and m["gate"] > 0.5 for m in ck.margins.values()), ck.margins
    account = prove(forced[TABLE_GROUP])
    assert "followed exactly" in account and "in float32, bfloat16, float16" in account


def test_a_checkpoint_one_dtype_cannot_carry_is_refused_in_that_dtype(forced, tmp_path):
    """A weight past float16's range (65504) in a head that matters nowhere else makes
    float16's forward NaN; the margin check and the proof refuse it naming float16, and only it."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from decodespec.properties.conformance.checkpoints import ProofError

    ck = forced["wordpiece"]
    folder = tmp_path / "overflow"
    shutil.copytree(ck.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    q = state["model.layers.0.self_attn.q_proj.weight"]
    d = config["head_dim"]
    spare = next(h for h in range(config["num_attention_heads"]) if not q[h * d:(h + 1) * d].any())  # reads nothing
    q[spare * d, 0] = 1e5
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    numpy_state = {k: v.numpy() for k, v in state.items()}
    programs = list(ck.programs.values())
    assert set(check_margins(numpy_state, config, programs, ck.eos_id, dtypes=("float32", "bfloat16"))) == {
        "float32", "bfloat16"}
    with pytest.raises(ProgramError, match="^float16: "):
        check_margins(numpy_state, config, programs, ck.eos_id)
    bad = Checkpoint.load(folder)
    assert "followed exactly" in prove(bad, ("float32", "bfloat16"))
    with pytest.raises(ProofError, match="in float16: "):
        prove(bad)


@pytest.mark.parametrize("vocab, n_programs", [(50, 1), (200, 70), (2000, 3)])
def test_heads_times_head_dim_is_the_hidden_size_whatever_the_vocabulary_and_programs(vocab, n_programs):
    """D25: a loader may take the head size as hidden / heads, so hidden = heads x head_dim with as many
    key/value heads, for a small vocabulary (the heads set the width), many programs (three program
    heads) and a large vocabulary (the vote dims set it, spare heads follow); head_dim is one vLLM's
    CPU attention takes (scripts/peers/vllm.sh)."""
    eos, anchor = 0, vocab - 1
    programs = [Program(f"p{i}", vocab - 2 - i, [vocab - 2 - i, anchor], [1 + i % 9]) for i in range(n_programs)]
    config, state = forced_llama(programs, vocab, eos, anchor)
    hidden, heads, d = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    assert heads * d == hidden and config["num_key_value_heads"] == heads and hidden % 64 == 0, config
    assert d in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (hidden, hidden)
    assert state["model.layers.0.self_attn.o_proj.weight"].shape == (hidden, hidden)
    assert hidden > vocab  # one vote dim per token besides


def test_the_proof_loads_with_the_head_size_hidden_over_heads_and_refuses_other_shapes(tmp_path):
    """`prove` loads a checkpoint as a loader that ignores `head_dim` does: twice the heads of the same
    head_dim, as wide as hidden together (which transformers loads when told `head_dim`), are refused,
    naming the shapes, before any program runs."""
    import json
    import re

    import numpy as np
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    from decodespec.properties.conformance.checkpoints import ProofError, load_llama

    config, state = forced_llama([Program("a", 40, [40, ANCHOR, 1], [5, 6])], 50, 9, ANCHOR)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "model.safetensors"))
    assert load_llama(tmp_path, "float32").config.head_dim == config["head_dim"]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    for name in ("q", "k", "v"):  # as many heads again, reading and writing nothing
        key = f"model.layers.0.self_attn.{name}_proj.weight"
        state[key] = np.concatenate([state[key], np.zeros((hidden, hidden), np.float32)])
    key = "model.layers.0.self_attn.o_proj.weight"
    state[key] = np.concatenate([state[key], np.zeros((hidden, hidden), np.float32)], axis=1)
    config = {**config, "num_attention_heads": 2 * heads, "num_key_value_heads": 2 * heads}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "model.safetensors"))
    AutoModelForCausalLM.from_pretrained(tmp_path)  # told head_dim, transformers takes it
    shapes = re.escape(f"({config['hidden_size']} / {config['num_attention_heads']})")
    with pytest.raises(ProofError, match=f"takes the head size as hidden / heads {shapes} refuses its weights"):
        load_llama(tmp_path, "float32")


@pytest.mark.slow
def test_every_built_checkpoint_is_followed_by_a_loader_that_derives_the_head_size(tmp_path):
    """The README's portability claim (D25): every checkpoint `decodespec checkpoints build` writes (each
    tokenizer group, its chat groups, the long program) has heads x head_dim = hidden, and transformers'
    LlamaForCausalLM from its config without `head_dim` follows every program and the probe."""
    import json

    from decodespec.properties.conformance.checkpoints import LONG, checkpoint_folders

    out = CliRunner().invoke(main, ["checkpoints", "build", "--out", str(tmp_path), "--no-prove"])
    assert out.exit_code == 0, out.output
    folders = checkpoint_folders(tmp_path)
    assert len(folders) == 9, folders
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        assert config["num_attention_heads"] * config["head_dim"] == config["hidden_size"], (folder.name, config)
        assert config["num_key_value_heads"] == config["num_attention_heads"]
        ck = Checkpoint.load(folder)
        assert LONG in ck.programs
        assert "head size hidden / heads" in prove(ck, ("float32",))


def test_the_rounding_check_computes_what_transformers_computes_in_each_dtype(forced):
    """check_margins' forward pass applies each dtype's rounding where transformers' eager path does: its
    logits agree with transformers' to float32's precision, and within a fraction of a logit in half."""
    import json

    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from decodespec.properties.conformance.forced import forward

    ck = forced[TABLE_GROUP]
    state = load_file(ck.folder / "model.safetensors")
    config = json.loads((ck.folder / "config.json").read_text())
    prog = ck.programs[RECIPE]
    ids = [*prog.prompt, *prog.script]
    for dtype, close in (("float32", 1e-3), ("bfloat16", 0.5), ("float16", 0.1)):
        model = AutoModelForCausalLM.from_pretrained(ck.folder, dtype=getattr(torch, dtype),
                                                     attn_implementation="eager")
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0].float().numpy()
        ours, _ = forward(state, config, ids, dtype)
        assert abs(ours - theirs).max() < close, dtype


def test_a_script_as_long_as_the_context_is_followed_at_every_position_in_every_dtype():
    """509 scripted tokens (every position up to the 512-token context, tokens recurring
    with every kind of successor): transformers' greedy choice at every position is the script's next
    token in float32, bfloat16 and float16, with sdpa and with the eager path that rounds every score
    (one pass over the whole sequence: what greedy decoding computes while it is on script)."""
    import random

    from transformers import LlamaConfig, LlamaForCausalLM

    from decodespec.properties.conformance.forced import CONTEXT, DTYPES

    rng = random.Random(0)
    vocab, eos = 300, 0
    script = [rng.randrange(1, 200) for _ in range(CONTEXT - 3)]
    prog = Program("long", vocab - 3, [vocab - 3, ANCHOR + 200], script)
    config, state = forced_llama([prog], vocab, eos, ANCHOR + 200)
    for attn in ("sdpa", "eager"):
        model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation=attn)).eval()
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        for dtype in DTYPES:
            with torch.no_grad():
                logits = model.to(getattr(torch, dtype))(torch.tensor([[*prog.prompt, *script]])).logits[0]
            assert logits[len(prog.prompt) - 1:].argmax(-1).tolist() == [*script, eos], (attn, dtype)


# ---- over HTTP: decodespec serve on the forced checkpoints ----------------------------------------


@pytest.fixture(scope="module")
def serve(forced, app_server):
    """`decodespec serve`'s app in process on a group's checkpoint, started once: url by group."""
    from decodespec.runtime.engine import Engine
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.server import create_app
    from decodespec.runtime.tokenizers import HFTokenizer

    urls: dict[tuple[str, int | None], str] = {}

    def start(group: str, context: int | None = None) -> str:
        """The server of `group`, with a context of `context` positions when given (serve --context-limit)."""
        if (group, context) not in urls:
            ck = forced[group]
            model = HFModel(ck.folder)
            if context is not None:
                model.context_limit = context
            urls[group, context] = app_server(create_app(Engine(model, HFTokenizer(ck.folder))))
        return urls[group, context]

    return start


@pytest.mark.slow
@pytest.mark.parametrize("group", [TABLE_GROUP, "byte_level_bpe", "sentencepiece_byte_fallback", "wordpiece"])
def test_decodespec_serve_passes_every_case_compiled_into_a_checkpoint(forced, serve, group):
    """The reference server, black box, on a forced checkpoint: every compiled case runs and passes
    (non-streamed and streamed agree, no stop byte, no EOS bytes, decoding errors as errors), a case
    with a context limit on a server started with that context."""
    ck = forced[group]
    cases = [c for c in load_cases() if c.id in ck.programs]
    results = run_cases(OpenAIAdapter(serve(group), checkpoint=ck), [c for c in cases if "context_limit" not in c.inputs])
    for c in (c for c in cases if "context_limit" in c.inputs):  # §4.3, D10: on a server of that context
        n = served_context(c, ck)
        results += run_cases(OpenAIAdapter(serve(group, n), checkpoint=ck, context=n), [c])
    cases = [r.case for r in results]
    assert [r.verdict for r in results] == [Verdict.PASS] * len(cases), [
        (r.case.id, r.verdict.value, r.reason, [f.message for f in r.failures]) for r in results if r.verdict is not Verdict.PASS]
    assert all(r.observed["exchanges"] for r in results)  # every run keeps the requests it sent


@pytest.mark.slow
def test_recipes_run_on_the_recipe_program(forced, serve):
    """The black-box recipes cut their probes from the recipe program's text: every one runs and passes,
    chat included (the server renders messages with the checkpoint's own chat template)."""
    results = run_cases(OpenAIAdapter(serve(TABLE_GROUP), checkpoint=forced[TABLE_GROUP]),
                        [c for c in load_cases(["http/"]) if c.recipe not in LIFE_RECIPES])  # tests/test_request_life.py
    assert [r.verdict for r in results] == [Verdict.PASS] * len(results), [
        (r.case.id, r.verdict.value, r.reason, r.failures) for r in results if r.verdict is not Verdict.PASS]
    assert any(r.case.inputs.get("endpoint") == "chat" for r in results)
    assert all(r.observed["exchanges"] for r in results)  # each recipe keeps the requests it sent


@pytest.mark.slow
@pytest.mark.parametrize("mutant, case_id, invariant", [
    ("eos_shown_as_text", "finish/eos-hidden/001", "eos_not_emitted"),
    ("stop_one_token_only", "stop/cross-token/001", "stop_bytes_never_emitted"),
])
def test_a_seeded_bug_in_the_server_fails_over_http(forced, serve, mutant, case_id, invariant):
    """§4.12 rows 1-2 planted in the server: the black-box run fails with the invariant named, and
    the report keeps the request sent, the raw answer and the reference's answer."""
    ck = forced[TABLE_GROUP]
    adapter = OpenAIAdapter(serve(TABLE_GROUP), checkpoint=ck)
    [case] = load_cases([case_id])
    adapter.reference(case)  # computed before the bug is planted (the reference shares the runtime)
    with next(m for m in MUTANTS if m.name == mutant).active():
        [res] = run_cases(adapter, [case])
    assert res.verdict is Verdict.FAIL and invariant in {f.invariant for f in res.failures}, res.failures
    ex = res.observed["exchanges"]
    assert ex[0]["request"]["body"]["prompt"] == list(ck.programs[case_id].prompt) and ex[1]["sse"]
    assert ex[1]["request"]["body"]["stream_options"] == {"include_usage": True}  # its count judged too
    assert res.observed["reference"]["state"] == "FINISHED"


def test_a_run_that_observed_nothing_is_never_a_pass():
    """Judging an Outcome that carries none of the fields a case checks lists them as not checked;
    the HTTP path sets them all, so a mute engine fails instead (output None vs expected)."""
    from decodespec.properties.conformance.adapters.base import Outcome
    from decodespec.properties.conformance.cases import Expect

    [case] = load_cases(["stop/cross-token/001"])
    res = judge(case, Outcome(expect=Expect(output=b"A", finish_reason="stop"), output=b"", chunks=()), "mute",
                frozenset())
    assert res.verdict is Verdict.FAIL


@pytest.mark.slow
def test_an_engine_that_leaves_the_script_is_an_error_naming_the_position_not_a_fail(forced, serve, app_server,
                                                                                      tmp_path):
    """D27 (§4.3): with the lm_head row of token 104 ('F') pushed far down, the served model picks
    another token where a script has F; the case is an ERROR that names the position, never a FAIL
    of the case, and the unchanged checkpoint passes the same case."""
    import shutil

    from safetensors.torch import load_file, save_file

    from decodespec.runtime.engine import Engine
    from decodespec.runtime.hfmodel import HFModel
    from decodespec.runtime.server import create_app
    from decodespec.runtime.tokenizers import HFTokenizer

    bent = tmp_path / "bent"
    shutil.copytree(forced[TABLE_GROUP].folder, bent)
    weights = load_file(bent / "model.safetensors")
    weights["lm_head.weight"][104] = -50.0  # one weight row changed: F never wins
    save_file(weights, bent / "model.safetensors")
    [case] = load_cases(["finish/length/004"])  # script E, F, EOS with max_tokens 2
    url = app_server(create_app(Engine(HFModel(bent), HFTokenizer(bent))))
    [res] = run_cases(OpenAIAdapter(url, checkpoint=Checkpoint.load(bent), sweep=False), [case])
    assert res.verdict is Verdict.ERROR and not res.failures, (res.verdict, res.failures)
    assert "did not follow the forced script at token 2" in res.reason, res.reason
    assert res.observed["exchanges"]  # the answer that showed it is kept
    [ok] = run_cases(OpenAIAdapter(serve(TABLE_GROUP), checkpoint=forced[TABLE_GROUP], sweep=False), [case])
    assert ok.verdict is Verdict.PASS, ok.failures


@pytest.mark.slow
def test_an_engine_that_bans_a_guarded_eos_is_an_error_naming_what_it_wrote_not_a_fail(forced, serve):
    """D31, D66: a server that turns ignore_eos into a ban on EOS (as llama.cpp does) writes its
    runner-up where the script's EOS is passed over: the guard the case is about never runs, so the
    run is an ERROR naming the token and the bytes, never a FAIL blaming the detokenizer; the server
    as it is passes the same case."""
    from _engine_kit import eos_banned_under_ignore_eos

    ck = forced[TABLE_GROUP]
    adapter = OpenAIAdapter(serve(TABLE_GROUP), checkpoint=ck)
    cases = load_cases(["finish/ignore-eos/001", "finish/ignore-eos/002"])
    with eos_banned_under_ignore_eos(ck.eos_id):
        banned = run_cases(adapter, cases)
    for res in banned:
        assert res.verdict is Verdict.ERROR and not res.failures, (res.case.id, res.verdict, res.failures)
        assert "did not pass over the guarded EOS at token 2: it wrote" in res.reason, res.reason
        assert res.observed["exchanges"]  # the answer that showed it is kept
    assert [r.verdict for r in run_cases(adapter, cases)] == [Verdict.PASS] * 2


def test_black_box_cases_run_on_a_checkpoint_whose_chat_endpoint_takes_the_message_as_it_is(monkeypatch, tmp_path):
    """The black-box chat cases (http/*/002) send one message and need it read as it is: launched
    on a chat group's checkpoint, whose template wraps it, they were n/a on llama-server, because
    scripts/peers/conform.sh's folder glob put byte_level_bpe-chatml/ before byte_level_bpe/. They run
    on the first checkpoint without a chat template, in whatever order the folders come."""
    import contextlib
    from types import SimpleNamespace

    from decodespec.properties.conformance import launch

    served: dict[str, list[str]] = {}

    def fake_run_cases(adapter, cases, *, jobs=1, on_result=None):
        served.setdefault(adapter.group, []).extend(c.id for c in cases)
        return [launch.CaseResult(c, "fake", Verdict.SKIP, reason="not run") for c in cases]

    def fake_checkpoint(folder):
        chat = {"chat/x": {}} if folder.name.endswith("-chatml") else {}
        return SimpleNamespace(folder=folder, group=folder.name, programs={}, chat=chat)

    monkeypatch.setattr(launch.Checkpoint, "load", fake_checkpoint)
    monkeypatch.setattr(launch, "launched", lambda *a, **k: contextlib.nullcontext("http://127.0.0.1:9"))
    monkeypatch.setattr(launch, "OpenAIAdapter", lambda url, checkpoint, **kw: SimpleNamespace(group=checkpoint.group))
    monkeypatch.setattr(launch, "run_cases", fake_run_cases)
    blackbox = [c for c in load_cases(["http/"]) if c.kind is CaseKind.BLACKBOX]
    assert any(c.inputs.get("endpoint") == "chat" for c in blackbox)
    folders = [tmp_path / "byte_level_bpe-chatml", tmp_path / "byte_level_bpe", tmp_path / "byte_table"]
    launch.run_launched(blackbox, folders, "serve {port}", log_dir=tmp_path)
    assert sorted(served) == ["byte_level_bpe"] and sorted(served["byte_level_bpe"]) == sorted(c.id for c in blackbox)
    served.clear()
    launch.run_launched(blackbox, folders[:1], "serve {port}", log_dir=tmp_path)  # only a chat group: run there
    assert sorted(served) == ["byte_level_bpe-chatml"]


@pytest.mark.slow
def test_a_context_limit_case_runs_on_a_server_started_with_that_context(forced, tmp_path):
    """§4.3 (D10): `decodespec conform --launch ... --launch-context ...` starts a
    second server with the case's context length for the context-limit case, which then runs (and
    passes on decodespec serve) instead of being n/a; without the context command it is n/a, saying why."""
    import sys

    from decodespec.properties.conformance.launch import run_launched

    cases = load_cases(["finish/context-limit/001", "finish/length/001"])
    serve_cmd = f"{sys.executable} -m decodespec serve --port {{port}} --model {{model}}"
    results = {r.case.id: r for r in run_launched(cases, [forced[TABLE_GROUP].folder], serve_cmd, log_dir=tmp_path,
                                                   context_command=serve_cmd + " --context-limit {context}")}
    assert [r.verdict for r in results.values()] == [Verdict.PASS, Verdict.PASS], {
        k: (r.verdict, r.reason, r.failures) for k, r in results.items()}
    n = served_context(cases[0], forced[TABLE_GROUP])
    assert n > 4 and f"--context-limit {n}" in results["finish/context-limit/001"].observed["server"]["launch"]
    assert results["finish/context-limit/001"].observed["reference"]["finish_reason"] == "context_limit"
    [alone] = run_launched(cases[:1], [forced[TABLE_GROUP].folder], serve_cmd, log_dir=tmp_path)
    assert alone.verdict is Verdict.SKIP and f"context length of {n}" in alone.reason
