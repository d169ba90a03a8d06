"""The adapter contract (properties/conformance/contract.py): an in-house engine with a Python API,
plugged in through the contract alone, is judged on a whole set of forced checkpoints in one run as
an HTTP engine is (§4.3-§4.10): the departure check (D27), the max_tokens sweep, the chat channels,
the count rule for n > 1 and per-chunk token alignment (D59); what it does not show is not checked.

The engine is examples/my_engine.py as written (the adapter docs/engine-authors.md shows) over
tests/contract_engine/my_llm.py, a small greedy engine on transformers' Llama that imports nothing of
decodespec; its `BUGS` break one behaviour at a time.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from decodespec.cli import main
from decodespec.properties.conformance import contract, load_cases
from decodespec.properties.conformance.checkpoints import build_checkpoints, checkpoint_folders, with_chat
from decodespec.properties.conformance.module_set import run_module_set
from decodespec.properties.conformance.runner import Verdict

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "my_engine.py"
ENGINE = REPO / "tests" / "contract_engine" / "my_llm.py"
# One case or two per tokenizer kind, each with its chat variants: every group of a full build.
PICKED = ("stop/cross-token/001", "finish/length/001", "stop/n-choices/001", "stream/tokens-aligned/001",
          "finish/min-tokens/001", "stop/cross-token/002", "detok/leading-space/001", "detok/wordpiece/001",
          "chat/reasoning/split-tags/001", "chat/tool-call/text-before/001", "finish/context-limit/001",
          "stop/hold-back/001")


def _public(path: Path) -> set[str]:
    """The module-level names a file defines (assignments, functions, classes) without a leading _."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return {n for n in names if not n.startswith("_")}


def test_the_contract_module_exports_exactly_its_documented_names():
    """One module, versioned: its docstring's list of public names is its __all__, and every other
    name it defines is private."""
    listing = re.search(r"Public names \(`__all__`\): ([^.]+)\.", contract.__doc__ or "")
    assert listing is not None
    documented = set(re.split(r",\s+", listing.group(1))) if listing else set()
    assert set(contract.__all__) == documented == _public(Path(contract.__file__)) - {"__all__"}
    assert re.fullmatch(r"\d+\.\d+", contract.CONTRACT_VERSION)


@pytest.mark.parametrize("path", [EXAMPLE, ENGINE], ids=["example adapter", "test engine"])
def test_the_engine_and_its_adapter_import_only_the_contract(path):
    """No private import: of decodespec, the adapter imports the contract module's public names
    alone, and the engine nothing."""
    imported: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            imported.setdefault("." * node.level + (node.module or ""), set()).update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update({a.name: set() for a in node.names})
    ours = {m: names for m, names in imported.items() if m.startswith(("decodespec", "."))}
    want = {"decodespec.properties.conformance.contract"} if path == EXAMPLE else set()
    assert set(ours) == want
    assert all(names <= set(contract.__all__) for names in ours.values())


def test_the_engine_authors_guide_shows_the_example_adapter_as_it_is():
    """The adapter docs/engine-authors.md shows is examples/my_engine.py, character for character."""
    guide = (REPO / "docs" / "engine-authors.md").read_text(encoding="utf-8")
    assert f"```python\n{EXAMPLE.read_text(encoding='utf-8')}```" in guide


class _Shown:
    """An engine that shows everything of one two-token answer: ids, bytes, logprobs, usage, timings."""

    tokens = (contract.TokenReport(5, b"h", -0.1), contract.TokenReport(6, b"i", -0.2))

    def complete(self, req: contract.Request) -> contract.Answer:
        return contract.Answer((contract.Choice("hi", "stop", tokens=self.tokens),), contract.Usage(3, 2),
                               timings={"total_s": 0.5})

    def stream(self, req: contract.Request):
        yield contract.Chunk("h", tokens=self.tokens[:1])
        yield contract.Chunk("i", finish_reason="stop", tokens=self.tokens[1:])
        yield contract.Chunk(usage=contract.Usage(3, 2))


def test_a_request_becomes_a_call_and_its_answer_reads_as_the_api_shows_it():
    """D68: the body the HTTP runner would send is one Request (the case's fields by their OpenAI
    names, the transport's fields left out), and the engine's answer and chunks read back as the
    API's: text, finish reason, token ids and bytes per chunk, usage; every call is recorded with
    its timings. A `cannot` the contract does not know is refused by name."""
    from decodespec.properties.conformance.adapters.inhouse import InHouseAdapter
    from decodespec.properties.conformance.alignment import chunk_reports
    from decodespec.properties.conformance.http_script import returned

    a = InHouseAdapter(_Shown(), checkpoint=None)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "stop": ["x"], "min_tokens": 1,
            "logprobs": 1, "stream_options": {"include_usage": True}}
    log: list = []
    status, data, _ = a.post("/v1/completions", body, log)
    assert status == 200 and data["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}
    assert returned(data["choices"][0]).token_ids == (5, 6)
    [call] = log
    assert json.loads(json.dumps(call["request"])) == {"max_tokens": 4, "prompt": [1, 2, 3], "messages": [], "stop": ["x"],
                               "stop_token_ids": [], "n": 1, "logprobs": True,
                               "fields": {"temperature": 0, "min_tokens": 1}}
    assert call["timings"] == {"total_s": 0.5}
    st = a.stream_body("/v1/completions", {**body, "stream": True}, log=log)
    assert (st.text, st.finish_reasons, st.usage) == ("hi", ["stop"], {"prompt_tokens": 3, "completion_tokens": 2})
    assert [(r.text, r.ids, r.pieces) for r in chunk_reports(st)] == [(b"h", (5,), (b"h",)), (b"i", (6,), (b"i",))]
    with pytest.raises(ValueError, match="'batch'"):
        InHouseAdapter(type("E", (_Shown,), {"cannot": frozenset({"batch"})})(), checkpoint=None)


def test_the_contract_records_each_version():
    """A version step is recorded: the docstring's "Versions:" list ends with CONTRACT_VERSION, and
    the optional fields of 1.1 default to "not said" (an engine of 1.0 runs unchanged)."""
    listed = re.search(r"Versions: (.+?)\n- ", contract.__doc__ or "", re.S)
    assert listed is not None
    assert re.findall(r"(\d+\.\d+), ", listed.group(1))[-1] == contract.CONTRACT_VERSION == "1.1"
    assert contract.Chunk("x").selected is None and contract.Checkpoint(Path("."), "g", 2).context_length is None


class _Holds(_Shown):
    """_Shown, its stream saying the ids selected before each chunk went out: 'h' goes out when
    both tokens are selected (as if held for a stop 'hx')."""

    def stream(self, req: contract.Request):
        yield contract.Chunk("h", tokens=self.tokens[:1], selected=(5, 6))
        yield contract.Chunk("i", finish_reason="stop", tokens=self.tokens[1:], selected=())
        yield contract.Chunk(usage=contract.Usage(3, 2))


def test_the_ids_selected_before_a_chunk_read_as_decodespec_serves_clock():
    """D59: `Chunk.selected` reads as decodespec serve's `decodespec.selected` (the tokens selected
    when the chunk went out, summed per choice), which hold-back is judged from; a stream that does
    not say it shows no such clock."""
    from decodespec.properties.conformance.adapters.inhouse import InHouseAdapter

    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "stream": True}
    said = InHouseAdapter(_Holds(), checkpoint=None).stream_body("/v1/completions", body).timeline()
    assert (said.texts, said.selected) == ((b"h",), (2,))
    assert InHouseAdapter(_Shown(), checkpoint=None).stream_body("/v1/completions", body).timeline().selected is None


@pytest.mark.parametrize("said", ["512", 0, True, 1.5])
def test_a_context_length_that_is_no_positive_int_is_refused_by_name(said):
    """Bad input: an engine's `context_length` is a positive int or None; anything else is refused
    when the engine is loaded, naming the engine, the member and the value."""
    from decodespec.properties.conformance.adapters.inhouse import InHouseAdapter

    with pytest.raises(ValueError, match=rf"_Shown.context_length is {re.escape(repr(said))}; the contract wants"):
        InHouseAdapter(type("_Shown", (_Shown,), {"context_length": said})(), checkpoint=None)


def test_a_bad_context_length_is_an_error_of_that_checkpoints_cases_and_the_run_goes_on(engine, tmp_path,
                                                                                         monkeypatch):
    """D68: an engine loaded on one checkpoint that says a context length that is no positive int
    failed that load: the cases of that checkpoint are ERRORs naming the engine and the value, the
    other checkpoints' cases run; the run is not stopped as a wrong --engine value."""
    import my_engine

    made = my_engine.make

    def make(checkpoint: contract.Checkpoint):  # type: ignore[no-untyped-def]
        got = made(checkpoint)
        if checkpoint.group.endswith("-chatml"):
            got.context_length = -1
        return got

    monkeypatch.setattr(my_engine, "make", make)
    build_checkpoints([c for c in load_cases() if c.id == "stop/cross-token/001"], tmp_path, long=False)
    ids = ("stop/cross-token/001", "chat/stop/cross-token/001", "chat-bos/stop/cross-token/001")
    wanted = [c for c in with_chat(load_cases()) if c.id in ids]
    got = {r.case.id: r for r in run_module_set(wanted, checkpoint_folders(tmp_path), "my_engine:make")}
    bad = got.pop("chat/stop/cross-token/001")
    assert bad.verdict is Verdict.ERROR, bad
    assert "my-engine.context_length is -1; the contract wants a positive int" in bad.reason, bad.reason
    assert {i: r.verdict for i, r in got.items()} == {"stop/cross-token/001": Verdict.PASS,
                                                      "chat-bos/stop/cross-token/001": Verdict.PASS}, got


def test_a_contract_factory_without_a_checkpoint_is_one_clear_error(engine):
    """The factory loads a forced checkpoint: without --checkpoint the run stops before any case
    (exit 2) saying so, rather than with the factory's TypeError."""
    run = CliRunner().invoke(main, ["conform", "--engine", "my_engine:make", "--select", "stop/cross-token/001"])
    assert run.exit_code == 2 and "pass --checkpoint DIR" in " ".join(run.output.split()), run.output


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A checkpoint set as `decodespec checkpoints build` writes it (every tokenizer group, plain and
    chat), holding the picked cases and their chat variants."""
    out = tmp_path_factory.mktemp("set")
    built = build_checkpoints([c for c in load_cases() if c.id in PICKED], out, long=False)
    return out, sorted({i for ck in built for i in ck.programs if "/" in i})


@pytest.fixture
def engine(monkeypatch):
    """examples/my_engine.py importable as `my_engine:make`, over my_llm; its BUGS, to plant one."""
    names = ("my_engine", "my_llm", "no_stream", "broken")
    for name in names:  # a module of that name another test imported is not the example
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    monkeypatch.syspath_prepend(str(ENGINE.parent))
    import my_llm

    yield my_llm.BUGS
    my_llm.BUGS.clear()
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def whole(ckpts, tmp_path_factory):
    """One `decodespec conform --engine my_engine:make --checkpoint SET` run: its exit code, output
    and report.json."""
    folder, ids = ckpts
    out = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLE.parent))
        mp.syspath_prepend(str(ENGINE.parent))
        run = CliRunner().invoke(main, ["conform", "--engine", "my_engine:make", "--checkpoint", str(folder),
                                        *(a for i in ids for a in ("--select", i)), "--report", str(out)])
    sys.modules.pop("my_engine", None)
    sys.modules.pop("my_llm", None)
    return run, json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None


@pytest.mark.slow
def test_the_example_adapter_runs_as_written_on_a_whole_set_in_one_run(ckpts, whole):
    """One invocation loads the engine once per checkpoint and writes one report, which records the
    contract version: the cases of every group run, the engine's passes include the request fields
    it was sent (min_tokens, logit_bias, n), chat channels and per-chunk tokens, and its one kind of
    failure (a leading space its decode drops: SHOULD) is the engine's own. The context-limit cases
    run on the engine loaded with the context they need (D10), and hold-back is judged from the ids
    each chunk says were selected before it went out (D59)."""
    run, report = whole
    assert run.exit_code == 0, run.output
    assert report["contract"] == contract.CONTRACT_VERSION
    verdicts = {c["id"]: c["verdict"] for c in report["cases"]}
    assert set(verdicts) == set(ckpts[1]) and "SKIP" not in verdicts.values()
    groups = {c["id"]: c for c in report["cases"]}
    for case in ("stop/cross-token/001", "finish/min-tokens/001", "stop/n-choices/001", "stream/tokens-aligned/001",
                 "chat/reasoning/split-tags/001", "chat/tool-call/text-before/001", "chat-bos/finish/length/001",
                 "stop/cross-token/002", "chat/stop/cross-token/002", "finish/context-limit/001",
                 "chat/finish/context-limit/001", "stop/hold-back/001", "chat-bos/stop/hold-back/001"):
        assert verdicts[case] == "PASS", groups[case]
    assert not [c for c in report["cases"] if any("hold-back" in n for n in c["not_checked"])]
    assert {i for i, v in verdicts.items() if v == "FAIL"} == {
        "detok/leading-space/001", "chat/detok/leading-space/001", "detok/wordpiece/001", "chat/detok/wordpiece/001"}
    assert groups["detok/wordpiece/001"]["lead_symptom"] == "bytes left out mid-text"


# One behaviour broken per kind of finding: the case that shows it, its verdict, and what its lead
# (an ERROR's reason, a FAIL's first finding as "invariant: message") says.
PLANTED = {
    "departure": ("stop/cross-token/001", Verdict.ERROR, "did not follow the forced script at token 2"),
    "sweep": ("finish/length/001", Verdict.FAIL, ": at max_tokens=1: "),
    "channels": ("chat/reasoning/split-tags/001", Verdict.FAIL, "think_tags_never_text: "),
    # the count of n choices and per-chunk tokens rest on decisions (D34, D59): they differ, not fail the chapter
    "n": ("stop/n-choices/001", Verdict.DIFFERS, "usage_consistent: usage.completion_tokens is 2, one choice's count"),
    "alignment": ("stream/tokens-aligned/001", Verdict.DIFFERS, "stream_tokens_aligned: "),
    "context": ("chat/finish/context-limit/001", Verdict.FAIL, "script text past the context limit (D10"),
    # a stop prefix sent early is a stream-shape finding (D69): listed with the pass, not failing it
    "holdback": ("stop/hold-back/001", Verdict.PASS, "stop_prefix_held: with 1 token(s) selected the stream had "
                                                     "sent 2 bytes; the reference still held b'B'"),
}


def _run(ckpts, *ids: str, engine: str = "my_engine:make"):
    """The cases `ids` (chat variants too) through run_module_set on every checkpoint of the set."""
    wanted = [c for c in with_chat(load_cases()) if c.id in ids]
    return {r.case.id: r for r in run_module_set(wanted, checkpoint_folders(ckpts[0]), engine)}


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(PLANTED))
def test_one_broken_behaviour_leads_its_case(ckpts, whole, engine, bug):
    """The case passes on the engine as it is (the whole run) and, with one behaviour broken, is
    judged by the check that behaviour concerns: an ERROR naming the position for a departure
    (D27), the sweep's limit (§4.3), the channel's tags (D45), the per-choice count (D34), the token
    alignment (D59), tokens past the context the engine says it runs with (D10), a stop prefix sent
    before the tokens that rule it out were selected (§4.6, from `Chunk.selected`)."""
    case, verdict, lead = PLANTED[bug]
    passed = {c["id"]: c for c in whole[1]["cases"]}[case]
    assert passed["verdict"] == "PASS" and not passed["lead_symptom"], passed
    engine.add(bug)
    res = _run(ckpts, case)[case]
    assert res.verdict is verdict and res.lead is not None or verdict is Verdict.ERROR, (res.reason, res.failures)
    said = res.reason if verdict is Verdict.ERROR else f"{res.lead.invariant}: {res.lead.message}"
    assert lead in said, said


@pytest.mark.slow
def test_what_the_engine_does_not_show_or_take_is_not_judged(ckpts, engine, monkeypatch):
    """An engine that declares it cannot stream nor be swept, and takes no logit_bias: its pass is
    partial (the stream not shown), `complete` is called at the case's own limit only, per-chunk
    alignment is n/a (nothing per chunk), and a case whose request holds logit_bias is n/a naming it."""
    import my_engine

    monkeypatch.setattr(my_engine.MyEngine, "cannot", frozenset({"stream", "sweep"}), raising=False)
    monkeypatch.setattr(my_engine, "TAKES", tuple(t for t in my_engine.TAKES if t != "logit_bias"))
    got = _run(ckpts, "stop/cross-token/001", "stream/tokens-aligned/001", "finish/min-tokens/001")
    plain = got["stop/cross-token/001"]
    assert plain.verdict is Verdict.PASS and "stream (not shown)" in plain.not_checked
    calls = plain.observed["exchanges"]
    assert {e["call"] for e in calls} == {"complete"} and {e["request"]["max_tokens"] for e in calls} == {8}
    assert got["stream/tokens-aligned/001"].verdict is Verdict.SKIP
    assert "reports no logprobs or token ids with a stream" in got["stream/tokens-aligned/001"].reason
    assert got["finish/min-tokens/001"].verdict is Verdict.SKIP
    assert "cannot take the request: the request field(s) ['logit_bias']" in got["finish/min-tokens/001"].reason


@pytest.mark.slow
def test_without_its_context_length_or_selected_ids_the_engine_is_told_what_was_not_judged(ckpts, engine, monkeypatch):
    """The optional fields of contract 1.1 left out: an engine that does not say the context it runs
    with has its context-limit cases n/a naming where it would say it (D10, as a server that answers
    no /props); a stream whose chunks do not say the ids selected before them, and whose token
    reports go with their text, has hold-back listed as not checked with the reason (D59)."""
    import my_engine

    made = my_engine.make

    class Mute:  # the example's engine, its context_length left out
        name = "mute"

        def __init__(self, checkpoint: contract.Checkpoint) -> None:
            self.complete = made(checkpoint).complete

    monkeypatch.setattr(my_engine, "make", Mute)
    ctx = _run(ckpts, "finish/context-limit/001")["finish/context-limit/001"]
    assert ctx.verdict is Verdict.SKIP and "mute does not say the context length it runs with (mute.context_length)" \
        in ctx.reason, ctx.reason
    monkeypatch.setattr(my_engine, "make", made)
    monkeypatch.setattr(my_engine, "Chunk", lambda **kw: contract.Chunk(**{**kw, "selected": None}))
    held = _run(ckpts, "stop/hold-back/001")["stop/hold-back/001"]
    assert held.verdict is Verdict.PASS and held.not_checked == (
        "hold-back (the engine reports each token only with its text, which does not show when a held token was "
        "selected)",), held.not_checked


@pytest.mark.slow
def test_the_pytest_plugin_judges_a_module_engine_on_a_whole_set_in_one_session(ckpts, tmp_path):
    """`pytest --decodespec-engine my_engine:make --decodespec-checkpoint SET` runs as `decodespec
    conform` does with the same values (module_set.ModuleSet): the cases of every checkpoint of the
    set in one session, chat variants too, the context-limit case on the engine loaded with its
    context; the items ordered so that each engine (checkpoint, context length) loads once; a
    SHOULD failure an xfail."""
    (tmp_path / "conftest.py").write_text(  # counts the engine's loads, in the plugin's pytest process
        "import os\nimport my_llm\nLOADS = []\nload = my_llm.LLM.__init__\n"
        "def counted(self, folder, max_model_len=None):\n"
        "    LOADS.append((os.path.basename(folder), max_model_len))\n"
        "    load(self, folder, max_model_len)\n"
        "my_llm.LLM.__init__ = counted\n"
        "def pytest_terminal_summary(terminalreporter):\n"
        "    terminalreporter.write_line(f'loads: {LOADS!r}')\n")
    # in id order the byte_table checkpoint's cases are split by stop/cross-token/002's (another group)
    picked = ("stop/cross-token/001", "stop/cross-token/002", "stop/hold-back/001", "finish/context-limit/001",
              "detok/leading-space/001")
    ids = [i for i in ckpts[1] if i.endswith(picked)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (EXAMPLE.parent, ENGINE.parent, tmp_path)))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          "--decodespec-engine=my_engine:make", f"--decodespec-checkpoint={ckpts[0]}",
                          *(f"--decodespec-select={i}" for i in ids), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    out = run.stdout
    assert run.returncode == 0, out[-2000:] + run.stderr[-2000:]
    xfailed = [i for i in ids if i.endswith("detok/leading-space/001")]
    assert f"{len(ids) - len(xfailed)} passed, {len(xfailed)} xfailed" in out, out[-2000:]
    loads = ast.literal_eval(out[out.index("loads: ") + len("loads: "):].splitlines()[0])
    assert len(loads) == len(set(loads)), loads
    assert len({folder for folder, _ in loads}) >= 3 and any(context for _, context in loads), loads


@pytest.mark.slow
def test_an_engine_that_fails_to_load_is_an_error_of_the_run_never_na(ckpts, engine, tmp_path, monkeypatch):
    """A factory that raises makes every case of that checkpoint an ERROR carrying what it raised,
    and the run exits 1: never "0/0 pass" with every case n/a."""
    (tmp_path / "broken.py").write_text("def make(checkpoint):\n    raise RuntimeError('out of memory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ids = [i for i in ckpts[1] if "stop/cross-token/" in i]  # five, on five checkpoints
    run = CliRunner().invoke(main, ["conform", "--engine", "broken:make", "--checkpoint", str(ckpts[0]),
                                    *(a for i in ids for a in ("--select", i)), "--report", str(tmp_path / "r")])
    assert run.exit_code == 1, run.output
    cases = json.loads((tmp_path / "r" / "report.json").read_text())["cases"]
    assert {c["verdict"] for c in cases} == {"ERROR"} and len(cases) == 5
    assert all("the factory raised on checkpoint" in c["reason"] and "RuntimeError: out of memory" in c["reason"]
               for c in cases)
    assert ("5 of 5 cases ran; no findings; 0 pass (0%), 0 fail the chapter, 0 differ on a decision or an ignored "
            "field, 5 error") in " ".join(run.output.split())
