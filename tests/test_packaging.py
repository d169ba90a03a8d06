"""The wheel holds every module and data file of the checkout, and runs the suite from a fresh
virtual environment on its own (what an engine's CI gets from `pip install decodespec[serve]`)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from _engine_kit import free_port, wait_until_serving

REPO = Path(__file__).resolve().parent.parent
# source folder -> its package's folder in the wheel (setup.py's package-dir)
ROOTS = {folder: pkg.replace(".", "/") for pkg, folder in
         runpy.run_path(str(REPO / "setup.py"), run_name="setup_config")["PACKAGE_DIR"].items()}
CASE = "stop/cross-token/001"
PRESET_CASE = "finish/context-limit/001"  # runs on a server of its own, started with the preset's context command


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from the checkout's files alone: a build/ folder left by an earlier build
    would hide a gap."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    [built] = (tmp / "dist").glob("decodespec-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_the_conformance_data(wheel):
    """A subpackage missing from the wheel would make `decodespec conform` fail to import from an
    installed wheel (the editable install hides it); setup.py derives the list from the folders."""
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"{pkg}/{p.relative_to(REPO / src).as_posix()}" for src, pkg in ROOTS.items()
            for p in (REPO / src).rglob("*.py") if "__pycache__" not in p.parts}
    assert want - names == set()
    assert "decodespec/properties/conformance/report.schema.json" in names
    cases = {p.relative_to(REPO).as_posix() for p in (REPO / "properties/cases").rglob("*.json")}
    assert {f"decodespec/{c}" for c in cases} <= names
    assets = {p.relative_to(REPO).as_posix() for p in (REPO / "runtime/assets").rglob("*") if p.is_file()}
    assert assets and {f"decodespec/{a}" for a in assets} <= names  # the embedded model and tokenizer


def _torch_layer(root: Path) -> Path:
    """A folder holding links to the installed torch distribution only (not decodespec, not its
    other dependencies), so the fresh venv reuses torch's ~700 MB instead of unpacking it again."""
    dist = importlib.metadata.distribution("torch")
    site = Path(dist.locate_file(""))
    layer = root / "torch-layer"
    layer.mkdir()
    for top in sorted({f.parts[0] for f in dist.files or () if f.parts[0] != ".."}):
        (layer / top).symlink_to(site / top)
    return layer


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A venv without the editable install: the wheel with its `serve` extra, pytest (for the plugin)
    and transformers (decodespec serve loads the forced checkpoints with it), installed by pip; torch
    comes from the layer above (pip counts it as installed)."""
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "torch-layer.pth").write_text(f"{_torch_layer(root)}\n")
    subprocess.run([py, "-m", "pip", "install", "-q", f"{wheel}[serve]", "pytest", "transformers"], check=True,
                   timeout=600, cwd=root)
    return env_dir / "bin"


@pytest.mark.slow
def test_a_fresh_venv_runs_the_suite_from_the_wheel_alone(wheel, tmp_path):
    """The CI step of an engine's repository: `pip install decodespec[serve]`, then the CLI lists the
    cases, validates the tables, runs a case in process, says against `decodespec serve` without a
    checkpoint that the case could not run, the pytest plugin runs a case, and
    `conform --preset decodespec-serve` judges decodespec serve in one command
    (checkpoints built from the wheel's cases, a server per checkpoint and one with the case's context
    length, the report written); every import comes from the installed wheel (cwd outside the checkout)."""
    bin_ = _fresh_venv(tmp_path, wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DECODESPEC_SPEC_DIR")}
    env["DECODESPEC_CACHE"] = str(tmp_path / "cache")  # the checkpoints a preset builds
    # no other decodespec on PATH (an activated checkout's): the preset must find the wheel's
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not (Path(p) / "decodespec").exists())

    repo = tmp_path / "engine-repo"  # an engine's repository: no tests of its own collected
    repo.mkdir()

    def run(*cmd: str, status: int = 0) -> str:
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == status, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    where = run(str(bin_ / "python"), "-c", "import decodespec, decodespec.runtime.tinylm as t; "
                "print(decodespec.__file__); print(t.ASSETS)")
    assert all(line.startswith(str(tmp_path / "venv")) for line in where.split()), where
    assert CASE in run(str(bin_ / "decodespec"), "conform", "--list")
    run(str(bin_ / "decodespec"), "spec", "validate")
    run(str(bin_ / "decodespec"), "generate", "Once upon a time", "--max-tokens", "4")  # the embedded model
    run(str(bin_ / "decodespec"), "conform", "--engine", "reference", "--select", CASE)
    port = free_port()
    server = subprocess.Popen([bin_ / "decodespec", "serve", "--port", str(port)], cwd=repo, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until_serving(f"http://127.0.0.1:{port}")
        # without a forced checkpoint the script case cannot run: the run says so and does not pass (exit 3)
        out = run(str(bin_ / "decodespec"), "conform", "--engine", f"openai:http://127.0.0.1:{port}", "--select",
                  CASE, status=3)
        assert "0 of 1 cases ran" in out and "decodespec conform --preset" in out
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    out = run(str(bin_ / "pytest"), "-q", "-p", "no:cacheprovider", "--decodespec-engine=reference",
              f"--decodespec-select={CASE}")
    assert "1 passed" in out
    # the venv is not activated: `decodespec serve` is found beside the Python that runs conform
    run(str(bin_ / "decodespec"), "conform", "--preset", "decodespec-serve", "--select", CASE,
        "--select", PRESET_CASE)
    report = json.loads((repo / "reports" / "decodespec-serve" / "report.json").read_text(encoding="utf-8"))
    verdicts = {c["id"]: c["verdict"] for c in report["cases"]}
    assert verdicts == {CASE: "PASS", PRESET_CASE: "PASS"}, verdicts
    assert (tmp_path / "cache" / "logs" / "decodespec-serve").is_dir()
