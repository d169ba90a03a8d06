"""`decodespec generate`, `serve` and every command that writes end bad input with one specific
error, before any work starts: nothing is generated, no file is half-written, no
traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _engine_kit import free_port, wait_until_serving
from click.testing import CliRunner

from decodespec.cli import main


@pytest.mark.parametrize("args, words", [
    (["--device", "banana", "hi"], "'banana' is not a torch device"),
    (["--events", "Once upon a time"], "--events took 'Once upon a time' as its file and no PROMPT is left"),
    ([""], "encodes to no tokens"),
    (["--events", "/nonexistent-dir/trace.jsonl", "hi"], "cannot write '/nonexistent-dir/trace.jsonl'"),
])
def test_generate_refuses_bad_input_with_one_clear_error(args, words):
    out = CliRunner().invoke(main, ["generate", *args])
    assert out.exit_code == 2, out.output
    assert words in " ".join(out.output.split()) and "Traceback" not in out.output and "FAILED" not in out.output


@pytest.mark.parametrize("command, option", [
    (["conform", "--engine", "reference", "--select", "stop/cross-token/001"], "--report"),
    (["checkpoints", "build", "--group", "byte_table"], "--out"),
    (["diagrams"], "--out"),
    (["check", "--requests", "1"], "--draw"),
    (["bench", "stop", "--quick"], "--json"),
])
def test_a_path_a_command_cannot_write_is_refused_before_its_work(tmp_path, command, option):
    """A report, checkpoint, diagram or result path under a file is refused at once, naming why; the
    run it would have ended (a conformance run, a build, a benchmark) never starts and leaves nothing."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "out" / ("results.json" if option == "--json" else "")
    out = CliRunner().invoke(main, [*command, option, str(target)])
    assert out.exit_code == 2, out.output
    said = " ".join(out.output.split())
    assert f"Invalid value for '{option}'" in said and f"{blocker} is not a folder" in said, said
    assert "Traceback" not in out.output and list(tmp_path.iterdir()) == [blocker]


def _broken(folder, how):
    """A copy of the embedded model's folder, broken one way."""
    import shutil

    from decodespec.runtime.tinylm import ASSETS

    shutil.copytree(ASSETS, folder)
    if how == "config not JSON":
        (folder / "config.json").write_text("{bad")
    elif how == "weights cut":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:1000])
    elif how == "no tokenizer":
        (folder / "tokenizer.json").unlink()
    elif how == "unknown architecture":
        (folder / "config.json").write_text('{"model_type": "no-such-architecture"}')
    return folder


@pytest.mark.parametrize("how, words", [
    ("config not JSON", "config.json is not JSON"),
    ("weights cut", "cannot be loaded: Error while deserializing header"),
    ("no tokenizer", "cannot be loaded: folder"),
    ("unknown architecture", "cannot be loaded: The checkpoint you are trying to load has model type"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_broken_model_folder_is_one_error_naming_what_is_wrong(tmp_path, command, how, words):
    """--model: a folder that cannot be loaded is a usage error that says why; no request runs and no
    server starts."""
    folder = _broken(tmp_path / "model", how)
    out = CliRunner().invoke(main, [command, "--model", str(folder), *(["hi"] if command == "generate" else [])])
    said = " ".join(out.output.split())
    assert out.exit_code == 2 and f"Invalid value for --model: {folder}: {words}" in said, said
    assert "Traceback" not in out.output


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_dtype_not_offered_is_refused_naming_the_choices(command):
    out = CliRunner().invoke(main, [command, "--dtype", "half", *(["hi"] if command == "generate" else [])])
    said = " ".join(out.output.split())
    assert out.exit_code == 2 and "'half' is not one of 'float32', 'bfloat16', 'float16'" in said, said


def test_generate_on_cuda_without_cuda_says_what_is_missing():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = CliRunner().invoke(main, ["generate", "--device", "cuda", "hi"])
    assert out.exit_code == 2 and ("CPU build without CUDA" in out.output or "no such CUDA device" in out.output)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_generate_runs_in_half_precision(dtype):
    """`--dtype` runs the model's weights, cache and arithmetic in that type; the loop is the same."""
    out = CliRunner().invoke(main, ["generate", "--max-tokens", "4", "--dtype", dtype, "Once upon a time"])
    assert out.exit_code == 0, out.output
    assert "FINISHED max_output_tokens; 4 selected" in out.output


def test_generate_writes_the_trace_where_asked(tmp_path):
    path = tmp_path / "trace.jsonl"
    out = CliRunner().invoke(main, ["generate", "--max-tokens", "3", "--events", str(path), "Once"])
    assert out.exit_code == 0, out.output
    assert path.read_text().count("\n") >= 3 and '"request.created"' in path.read_text()


def test_serve_logs_each_request_at_info_and_not_at_warning():
    """`serve --log-level info` logs every request (method, path, status); warning is quiet."""
    for level, logged in (("info", True), ("warning", False)):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "decodespec", "serve", "--port", str(port), "--log-level", level],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_until_serving(f"http://127.0.0.1:{port}")
        finally:
            proc.terminate()
            text = proc.communicate(timeout=30)[0]
        assert ('"GET /v1/models HTTP/1.1" 200' in text) is logged, text[-600:]


@pytest.mark.slow
def test_sigterm_ends_the_server_within_its_shutdown_bound():
    """D5: with a streaming client still connected and reading slowly (its connection
    open past the signal), SIGTERM ends the server within --shutdown-timeout plus slack."""
    import signal
    import threading
    import time

    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "decodespec", "serve", "--port", str(port), "--shutdown-timeout", "2",
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    reading = threading.Event()
    try:
        wait_until_serving(url)

        def slow_client() -> None:
            body = {"model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], "prompt": "Once upon a time",
                    "max_tokens": 200, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        reading.set()
                        time.sleep(0.2)
            except httpx.HTTPError:
                pass

        threading.Thread(target=slow_client, daemon=True).start()
        assert reading.wait(30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 2 + 8
    finally:
        if proc.poll() is None:
            proc.kill()
