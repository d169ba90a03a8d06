"""Run the HTTP cases against a server started per forced checkpoint.

`run_launched(cases, folders, command)` starts `command` once per checkpoint folder, with
`{model}` (the folder), `{gguf}` (its GGUF file, `model.gguf` unless `gguf` names another), `{name}`
(the group) and `{port}` (a free port on 127.0.0.1) filled in, in the environment `env` (by default
this process's; the presets put the Python running decodespec last on PATH, presets.engine_path);
waits for /v1/models; runs the cases compiled into that checkpoint (and the black-box recipes on
the first whose chat endpoint takes a message as it is); then stops the server by its PID (its
process group) and moves on. `model`, when given, is the model name requests carry (the same fields
are filled in; by default the first of /v1/models). A server that does not come up turns its cases
into ERRORs carrying the tail of its log, never FAILs. One list of results comes back, in case
order, for one report. The engine presets (presets.py) give the commands for `decodespec conform
--preset`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from .adapters.openai import OpenAIAdapter
from .cases import Case, CaseKind
from .checkpoints import Checkpoint, group_of, http_blocker, served_context
from .life import RECIPES as LIFE_RECIPES
from .runner import CaseResult, Verdict, run_cases
from .wire import whole_answer

TIGHT = -1  # the run of the tight server, among the runs by context length
GGUF = "model.gguf"  # a checkpoint's GGUF file, unless the run names another


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-n:]
    except OSError:
        return ""


@contextlib.contextmanager
def launched(command: str, ckpt: Checkpoint, log: Path, *, timeout_s: float = 600.0,
             on_start: Callable[[int], None] | None = None, gguf: str = GGUF,
             env: Mapping[str, str] | None = None) -> Iterator[str]:
    """Start the server for `ckpt`, yield its URL once /v1/models answers, stop it by PID after.
    `on_start` gets the PID, which leads the server's own process group, once it answers."""
    port = free_port()
    cmd = command.format(model=ckpt.folder, gguf=ckpt.folder / gguf, name=ckpt.group, port=port)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", cmd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else dict(env))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before answering; "
                                   f"log {log}: ...{_tail(log)}")
            with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=url) as c:
                if whole_answer(c, "GET", "/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no answer on {url}/v1/models within {timeout_s:.0f} s; log {log}: ...{_tail(log)}")
            time.sleep(0.5)
        if on_start is not None:
            on_start(proc.pid)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the PID we started leads its own process group
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _refusal(folders: Sequence[Path], group: str) -> str:
    """Why a checkpoint was left out, when the engine's converter refused it (scripts/peers/conform.sh
    keeps the converter's log as <group>/convert-<type>.log beside the served checkpoints; a group
    that was served is not asked)."""
    for root in {f.parent for f in folders}:
        for log in sorted((root / group).glob("convert*.log")):
            lines = [ln for ln in _tail(log, 4000).splitlines() if ln.strip()]
            cause = next((ln for ln in reversed(lines) if "rror" in ln or "refuse" in ln), lines[-1] if lines else "")
            return f": the engine's converter refused it ({cause.strip()[:300]}; {log})"
    return ""


def run_launched(cases: Sequence[Case], folders: Sequence[Path], command: str, *, log_dir: Path,
                 without: frozenset[str] = frozenset(), jobs: int = 1, model: str | None = None,
                 timeout_s: float = 600.0, on_result: Callable[[CaseResult], None] | None = None,
                 context_command: str | None = None, tight_command: str | None = None,
                 read_timeout: float | None = None, gguf: str = GGUF,
                 env: Mapping[str, str] | None = None) -> list[CaseResult]:
    """Every case, run on the server of the checkpoint it was compiled into (see module). A case
    with a context limit runs on a server of its own, started with `context_command` ({context}
    filled in as well); a case that asks for the tight server (`"server": "tight"`: concurrency
    limited, KV budget too small for the load) runs, one at a time, on one started with
    `tight_command`; without the command either is n/a with the reason. On every server the
    request-life cases (life.RECIPES: they load it and time it) run one at a time after the others,
    so no case runs beside them and none of them beside another. `timeout_s` bounds each server's
    start; `read_timeout`, when given, is its adapter's wait for a whole answer or a stream's next event.
    `gguf` and `env` are launched's; a reproducer names the command with {gguf} spelt {model}/FILE, so
    that it says which file of the checkpoint the engine loads."""
    ckpts = [Checkpoint.load(f) for f in folders]
    # The black-box cases send messages of their own: on the first checkpoint whose chat endpoint takes
    # a message as it is (no chat group's template to wrap it), whatever order the folders came in.
    host = next((ck for ck in ckpts if not ck.chat), ckpts[0] if ckpts else None)
    done: dict[str, CaseResult] = {}
    for ck in ckpts:
        mine = [c for c in cases if c.id in ck.programs or (ck is host and c.kind is CaseKind.BLACKBOX)]
        tight = [c for c in mine if c.inputs.get("server") == "tight"]
        mine = [c for c in mine if c not in tight]
        runs: list[tuple[str, int | None, list[Case]]] = [(command, None, [c for c in mine if "context_limit" not in c.inputs])]
        limits = sorted({n for c in mine if (n := served_context(c, ck)) is not None})
        if context_command:
            runs += [(context_command.replace("{context}", str(n)), n,
                      [c for c in mine if served_context(c, ck) == n]) for n in limits]
        else:
            runs[0][2].extend(c for c in mine if "context_limit" in c.inputs)  # the adapter says why not
        runs += [(tight_command, TIGHT, tight)] if tight_command else []
        if not tight_command:
            runs[0][2].extend(tight)  # the recipe says why not
        for cmd, context, todo in runs:
            if not todo:
                continue
            suffix = "-tight" if context == TIGHT else "" if context is None else f"-context-{context}"
            log = log_dir / f"{ck.group}{suffix}.log"
            timeout: dict[str, Any] = {} if read_timeout is None else {"timeout": read_timeout}
            try:
                with launched(cmd, ck, log, timeout_s=timeout_s, gguf=gguf, env=env) as url:
                    name = model.format(model=ck.folder, name=ck.group) if model else None
                    adapter = OpenAIAdapter(url, model=name, checkpoint=ck, without=without,
                                            launch=cmd.replace("{gguf}", f"{{model}}/{gguf}"),
                                            context=None if context == TIGHT else context, tight=context == TIGHT,
                                            **timeout)
                    side = [c for c in todo if c.recipe not in LIFE_RECIPES and context != TIGHT]
                    alone = [c for c in todo if c not in side]
                    for r in [*run_cases(adapter, side, jobs=jobs, on_result=on_result),
                              *run_cases(adapter, alone, jobs=1, on_result=on_result)]:
                        done[r.case.id] = r
            except RuntimeError as exc:
                for c in todo:
                    done[c.id] = r = CaseResult(c, f"launch[{ck.group}]", Verdict.ERROR, reason=str(exc))
                    if on_result is not None:
                        on_result(r)
    # Cases no checkpoint holds: the first adapter's reason (fault injection, internal events, ...).
    for c in cases:
        if c.id not in done:
            why = http_blocker(c)
            done[c.id] = r = CaseResult(c, "launch", Verdict.SKIP, reason=f"cannot run over HTTP: {why}" if why else
                                        f"compiled into the {group_of(c)} checkpoint, which this run did not serve"
                                        + _refusal(folders, group_of(c)))
            if on_result is not None:
                on_result(r)
    return [done[c.id] for c in cases]
