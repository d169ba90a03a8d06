"""Engine presets (properties/conformance/presets.toml): one command judges an engine, and every
reproducer a report writes can be replayed from the report alone.

The format is checked where it is read (a malformed preset is one error naming the file, the preset
and what is wrong); a missing engine, an unknown preset and an --engine value that names an engine
are each one error saying what to do; the committed reports' reproducers name their checkpoint's
build and hash, the GGUF conversion where the engine loads one, the launch, and curl lines or, for a
request-life case (§4.7-§4.10), a stdlib script that really replays it.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from decodespec.cli import main
from decodespec.properties.conformance import load_cases
from decodespec.properties.conformance import presets as ps
from decodespec.properties.conformance.checkpoints import TABLE_GROUP, group_of, with_chat
from decodespec.properties.conformance.replay_script import FLOWS
from decodespec.properties.conformance.reports import REPLAY_DIR, replay_script, replay_text

REPO = Path(__file__).resolve().parent.parent
REPORTS = REPO / "reports"


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "more.toml"
    path.write_text("format = 1\n" + body, encoding="utf-8")
    return path


# ---- the format ----------------------------------------------------------------------------------


def test_every_shipped_preset_loads_and_names_what_to_install():
    presets = ps.load_presets()
    assert {"vllm", "vllm-fp16", "vllm-bf16", "vllm-chat", "llama-server", "llama-server-f16", "llama-server-bf16",
            "llama-server-chat", "llama-cpp-python", "llama-cpp-python-chat", "sglang", "tgi", "mistralrs",
            "transformers-serve", "decodespec-serve", "decodespec-serve-chat"} <= set(presets)
    for p in presets.values():
        assert p.install and p.program()[0] and "{port}" in p.launch and "127.0.0.1" in p.launch or "--port" in p.launch
        assert "scripts/" not in p.launch + p.context + p.tight, f"{p.name}: a shipped preset runs what the wheel holds"


def test_extends_fills_in_the_parents_launch_and_the_tight_and_context_commands_follow():
    """A child's {launch} is its parent's; its inherited context and tight commands start from its own
    launch (vLLM fp16's tight server is fp16 too) with the KV budget of the request-life cases (§4.8)."""
    p = ps.load_presets()
    assert p["vllm-fp16"].launch == p["vllm"].launch + " --dtype float16"
    assert p["vllm-fp16"].tight.startswith(p["vllm-fp16"].launch)
    assert p["vllm"].tight.endswith("--max-num-seqs 4 --block-size 32 --num-gpu-blocks-override 32")
    assert p["llama-server-bf16"].gguf_file == "model-bf16.gguf" and p["llama-server-bf16"].aliases == ()
    assert p["vllm-chat"].context == "" and p["vllm-chat"].cases == "chat"


@pytest.mark.parametrize("body, fragment", [
    ('[preset.x]\nengine="x"\ninstall="i"\nlaunch="x --port {port}"\ncases="all"\nflavour=1\n', "unknown field(s) flavour"),
    ('[preset.x]\nextends="nope"\n', "extends 'nope'"),
    ('[preset.x]\nextends="y"\n[preset.y]\nextends="x"\n', "extends itself"),
    ('[preset.x]\nengine="x"\ninstall="i"\nlaunch="x --port {port}"\ncases="all"\nwithout=["echo"]\n', "without echo"),
    ('[preset.x]\nengine="x"\ninstall="i"\nlaunch="x --port {port}"\ncases="all"\ngguf="f32"\n', "{gguf}"),
    ('[preset.x]\nengine="x"\ninstall="i"\nlaunch="x --port {port}"\ncases="all"\ncontext="{launch} -c"\n',
     "never says {context}"),
    ('[preset.x]\nengine="x"\ninstall="i"\nlaunch="x --port {prot}"\ncases="all"\n', "uses {prot}"),
    ('[preset.x]\nengine="x"\ninstall="i"\nlaunch="x"\ncases="some"\n', "cases 'some'"),
    ('[preset.x]\nengine="x"\nlaunch="x"\ncases="all"\n', "has no install"),
    ('[preset.x]\nengine="x"\ninstall="i"\nlaunch="x"\ncases="all"\njobs="4"\n', "jobs must be a int"),
    ('[preset.x]\nengine="x"\ninstall="i"\nlaunch="x"\ncases="all"\ndeclare=["D34", "D999"]\n',
     "declare D999: no such decision"),
])
def test_a_malformed_preset_is_one_error_naming_it(tmp_path, body, fragment):
    with pytest.raises(ps.PresetError) as err:
        ps.load_presets([_write(tmp_path, body)])
    assert fragment in str(err.value) and "more.toml" in str(err.value)


def test_a_presets_declared_decisions_are_applied_as_declare(tmp_path, monkeypatch):
    """D69: a preset's `declare` (the choices its engine documents) joins `--declare`: a case resting
    on D34 is n/a with D34's line and never runs; the shipped presets declare nothing."""
    from decodespec import cli_conform

    assert all(p.declare == () for p in ps.load_presets().values())
    extra = _write(tmp_path, '[preset.mine]\nextends="decodespec-serve"\ndeclare=["D34"]\n')
    assert "declares D34" in ps.load_presets([extra])["mine"].describe()
    seen = []
    launched = inspect.signature(cli_conform._conform_launched)
    monkeypatch.setattr(cli_conform, "_conform_launched",
                        lambda *a, **k: seen.append(launched.bind(*a, **k).arguments["policy"]))
    monkeypatch.setenv("DECODESPEC_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(main, ["conform", "--presets", str(extra), "--preset", "mine", "--select",
                                    "stop/n-choices/001", "--declare", "D31", "--dry-run"])
    assert res.exit_code == 0, res.output
    [policy] = seen
    assert policy.grading.declared == {"D31", "D34"}
    ran = []
    [r] = cli_conform._run_declared(load_cases(["stop/n-choices/001"]), policy, "mine",
                                    lambda todo, tick: ran.extend(todo) or [])
    assert not ran and r.verdict.value == "SKIP" and "(--declare D34)" in r.reason


def test_a_presets_file_adds_presets_and_replaces_by_name(tmp_path):
    extra = _write(tmp_path, '[preset.mine]\nextends="vllm"\nlaunch="{launch} --seed 1"\n'
                             '[preset.tgi]\nengine="t"\ninstall="i"\nlaunch="t --port {port}"\ncases="chat"\n')
    presets = ps.load_presets([extra])
    assert presets["mine"].launch.endswith("--seed 1") and presets["tgi"].cases == "chat"


def test_the_peers_use_the_shipped_presets():
    """scripts/peers/engines.py: a local peer's launch is the shipped preset's, with only where its
    program comes from (PATH) and this machine's threads put in front."""
    sys.path.insert(0, str(REPO / "scripts" / "peers"))
    try:
        from engines import ENGINES
    finally:
        sys.path.pop(0)
    presets = ps.load_presets()
    for name in ("vllm", "llama-server-f16", "llama-cpp-python", "decodespec-serve", "transformers-serve"):
        assert ENGINES[name]["launch"].endswith(" " + presets[name].launch), name
        assert ENGINES[name]["tight"] == presets[name].tight and ENGINES[name]["gguf"] == presets[name].gguf


@pytest.mark.parametrize("threads, fragment", [
    ("", "LLAMA_ARG_THREADS=2 "), ("1", "LLAMA_ARG_THREADS=1 "),
    ("0", "DECODESPEC_PEER_THREADS must be a positive integer of CPU threads, not '0'"),
    ("two", "DECODESPEC_PEER_THREADS must be a positive integer of CPU threads, not 'two'"),
])
def test_the_llama_cpp_peers_threads_come_from_the_environment(threads, fragment):
    """scripts/peers/engines.py: the llama.cpp engines' CPU threads are DECODESPEC_PEER_THREADS (2
    when unset); a value that is not a positive integer is refused, naming it."""
    env = {k: v for k, v in os.environ.items() if k != "DECODESPEC_PEER_THREADS"}
    if threads:
        env["DECODESPEC_PEER_THREADS"] = threads
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "peers" / "engines.py"), "llama-server", "launch"],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert fragment in run.stdout + run.stderr
    assert (run.returncode == 0) == fragment.startswith("LLAMA_ARG_THREADS")


# ---- finding the engine, and near misses ----------------------------------------------------------


def test_a_missing_program_is_one_error_naming_what_to_install(tmp_path):
    presets = ps.load_presets()
    empty = str(tmp_path)
    assert "not on PATH. Install it: pip install vllm" in presets["vllm"].missing(empty)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    why = presets["llama-cpp-python"].missing(empty)
    assert "cannot import. Install it: pip install 'llama-cpp-python[server]'" in why
    assert presets["decodespec-serve"].missing(ps.engine_path(empty)) is None  # decodespec's own folder, last


@pytest.mark.parametrize("args, fragment", [
    (["--preset", "vlm"], "did you mean --preset vllm?"),
    (["--preset", "llama.cpp"], "did you mean --preset llama-server?"),
    (["--engine", "vllm"], "decodespec conform --preset vllm"),
    (["--engine", "llama.cpp"], "decodespec conform --preset llama-server"),
    (["--engine", "text-generation-inference"], "decodespec conform --preset tgi"),
    (["--preset", "vllm", "--engine", "reference"], "give --engine or --preset"),
])
def test_near_misses_name_the_preset(args, fragment):
    res = CliRunner().invoke(main, ["conform", *args])
    assert res.exit_code == 2 and fragment in res.output, res.output
    assert "Traceback" not in res.output


def test_a_missing_engine_fails_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("DECODESPEC_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(main, ["conform", "--preset", "vllm", "--select", "stop/cross-token/001"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "runs `python -m vllm.entrypoints.openai.api_server`, which" in said, res.output
    assert "cannot import. Install it: pip install vllm" in said, res.output
    assert not (tmp_path / "cache").exists()


def test_list_presets_prints_each_with_its_commands():
    res = CliRunner().invoke(main, ["conform", "--list-presets"])
    assert res.exit_code == 0
    for p in ps.load_presets().values():
        assert f"{p.name}: {p.engine}" in res.output and p.launch in res.output
    assert CliRunner().invoke(main, ["conform", "--preset", "list"]).output == res.output


def test_a_run_serves_the_groups_of_its_cases_and_a_host_for_the_black_box_cases():
    every = with_chat(load_cases())
    [case] = load_cases(["stop/cross-token/001"])
    assert ps.groups_needed([case], every) == [group_of(case)]
    [life] = load_cases(["http/batch/exact/001"])
    assert ps.groups_needed([life], every) == ["byte_level_bpe"]  # the first group by name, as a whole set serves it
    assert ps.groups_needed(load_cases(["lifecycle/deadline/001"]), every) == []  # no case of it runs over HTTP
    assert TABLE_GROUP in ps.groups_needed(load_cases(["finish/"]), every)


def _fake_llama_cpp(root: Path) -> Path:
    """A llama.cpp checkout whose converter writes a stub GGUF, or refuses a folder named refuse-*."""
    (root / "conversion").mkdir(parents=True)
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "base.py").write_text(
        "import logging\nlogger = logging.getLogger('base')\n"
        "class TextModel:\n    def get_vocab_base_pre(self, t): pass\n    def prepare_metadata(self, vocab_only): pass\n")
    (root / "convert_hf_to_gguf.py").write_text(
        "import sys\ndef main():\n    out = sys.argv[sys.argv.index('--outfile') + 1]\n"
        "    if 'refuse' in sys.argv[1]:\n        sys.exit('refused: no vocabulary this converter knows')\n"
        "    open(out, 'wb').write(b'GGUF')\n")
    return root


def test_gguf_files_are_written_beside_each_checkpoint_and_a_refusal_leaves_it_out(tmp_path, monkeypatch):
    """A llama.cpp preset's conversion runs the converter of the checkout LLAMA_CPP_DIR names, through
    decodespec's wrapper, once per checkpoint (a file already there is kept); a refused checkpoint is
    left out with the converter's log beside it, which the launched run names as the reason its cases
    are n/a; without a checkout it is one error saying how to get one."""
    from decodespec.properties.conformance.launch import _refusal

    preset = ps.load_presets()["llama-server-f16"]
    folders = [tmp_path / "set" / "ok", tmp_path / "set" / "refuse-me"]
    for f in folders:
        f.mkdir(parents=True)
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    with pytest.raises(ps.PresetError, match="set LLAMA_CPP_DIR to a llama.cpp checkout"):
        ps.convert_gguf(folders, preset, None, print)
    said: list[str] = []
    kept = ps.convert_gguf(folders, preset, _fake_llama_cpp(tmp_path / "llama.cpp"), said.append)
    assert kept == folders[:1] and (folders[0] / "model-f16.gguf").read_bytes() == b"GGUF"
    assert not list(folders[1].glob("*.gguf*")) and "refused" in said[-1]
    assert "no vocabulary this converter knows" in _refusal([folders[0]], "refuse-me")
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "nowhere"))  # every file there already: not asked
    assert ps.convert_gguf(folders[:1], preset, None, said.append) == folders[:1]


# ---- reproducers ----------------------------------------------------------------------------------


def _http_reproducers():
    """Every reproducer of an engine run over HTTP in the committed reports (a FAIL, an ERROR, a case
    that DIFFERS, a pass with findings)."""
    for path in sorted(REPORTS.glob("*/report.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        for case in data["cases"]:
            rep = case.get("reproducer") or {}
            if rep.get("server"):
                yield path.parent.name, case, rep


def test_every_committed_http_reproducer_can_be_replayed_from_the_report_alone():
    """Each reproducer names its checkpoint's build command and hash, the GGUF conversion where the
    engine loads a GGUF, the launch command, and curl lines whose model is the folder it built, or
    (a request-life case, which curl cannot send) the script it runs."""
    seen = 0
    for engine, case, rep in _http_reproducers():
        seen += 1
        where = f"{engine} {case['id']}"
        text, ck = rep["replay"], rep["server"]["checkpoint"]
        folder = f"{REPLAY_DIR}/{ck['group']}"
        assert f"decodespec checkpoints build --out {REPLAY_DIR} --group {ck['group']}\n" in text, where
        assert f"decodespec checkpoints digest {folder}\n" in text and ck["sha256"] in text, where
        launch = next((line for line in text.splitlines() if line.endswith("> engine.log 2>&1 &")), None)
        assert launch is not None, where
        assert "{" not in launch and "8000" in launch and "\nkill $ENGINE\n" in text, where
        if ".gguf" in launch:
            gguf = re.search(rf"{folder}/\S+\.gguf", launch).group(0)
            assert f"convert_gguf {folder} --outfile {gguf} --outtype" in text, where
        if rep["recipe"] in FLOWS:
            assert "python3 replay.py" in text and rep["script"].count("CASE = json.loads(") == 1, where
            assert "import decodespec" not in rep["script"], where
        else:
            curls = [line for line in text.splitlines() if line.startswith("curl ")]
            assert curls, where
            models = [m for line in curls for m in re.findall(r'"model":"([^"]*)"', line)]
            assert all("/" not in m or m == folder for m in models), (where, models)
    assert seen > 400  # the committed reports of the HTTP engines


def test_a_transformers_serve_reproducer_names_the_folder_it_builds():
    """transformers serve loads the model a request names: the replay's requests name the folder its
    build command writes, not the run's cache path."""
    server = {"url": "http://127.0.0.1:5", "model": ".cache/peers/checkpoint-sets/abc/byte_table",
              "launch": "transformers serve --port {port}", "checkpoint": {"group": "byte_table", "sha256": "0" * 64}}
    ex = [{"request": {"path": "/v1/completions", "body": {"model": server["model"], "prompt": "x"}}, "status": 200}]
    text = replay_text("x/y/001", "t", server, ex, [], None)
    assert '"model":"ckpt/byte_table"' in text and ".cache" not in text


class _NoIdsHandler(BaseHTTPRequestHandler):
    """A stream with no SSE ids and no X-Request-Id: nothing can be resumed."""

    def do_POST(self):  # http.server's name for the POST handler
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chunks = [{"choices": [{"text": c, "finish_reason": None}]} for c in "abcdefghij"]
        chunks[-1]["choices"][0]["finish_reason"] = "length"
        if not body.get("stream"):
            payload = json.dumps({"choices": [{"text": "abcdefghij", "finish_reason": "length"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def _script(tmp_path: Path, recipe: str, inputs: dict, bodies: list[dict]) -> Path:
    ex = [{"request": {"path": "/v1/completions", "body": b, "method": "POST"}, "status": 200} for b in bodies]
    path = tmp_path / f"{recipe}.py"
    path.write_text(replay_script(f"http/x/{recipe}", recipe, inputs, ex, {}), encoding="utf-8")
    return path


def test_the_request_life_script_replays_against_a_live_server(tmp_path, app_server):
    """The reproducer's script, run as a reader runs it (its own Python, stdlib only): against decodespec
    serve a cut stream resumes to the same text (§4.7) and answers under load equal the same requests
    alone (§4.8): exit 0; against a server whose stream carries no SSE id it says so and exits 1."""
    from decodespec.cli_generate import load_model_and_tokenizer
    from decodespec.runtime.engine import Engine
    from decodespec.runtime.server import create_app

    url = app_server(create_app(Engine(*load_model_and_tokenizer(None))))
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    resume = _script(tmp_path, "resume", {"cut_at": 4, "timeout_s": 60}, [{**body, "stream": True}])
    load = _script(tmp_path, "batch_exact", {"in_flight": 6, "timeout_s": 60},
                   [{**body, "stream": True}, {**body, "max_tokens": 9, "stream": False}])
    for script in (resume, load):
        done = subprocess.run([sys.executable, "-I", str(script), url], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "equals the whole answer" in subprocess.run([sys.executable, "-I", str(resume), url], capture_output=True,
                                                      text=True, timeout=120).stdout
    fake = ThreadingHTTPServer(("127.0.0.1", 0), _NoIdsHandler)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    try:
        done = subprocess.run([sys.executable, "-I", str(resume), f"http://127.0.0.1:{fake.server_port}"],
                              capture_output=True, text=True, timeout=60)
    finally:
        fake.shutdown()
    assert done.returncode == 1 and "no SSE id or no X-Request-Id" in done.stdout, done.stdout + done.stderr
