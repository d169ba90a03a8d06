"""A batch of generated examples: compiled into forced checkpoints together, judged on one engine start.

`run_batch(examples, tag, engine, folder)` files each example as a script case (`fuzz/<tag>/NNN`,
strategies.case_of), builds one forced checkpoint per tokenizer group holding all of them
(checkpoints.build_group: one marker per program, as the suite's cases share one), has `engine`
answer every case, and grades the results as one run (runner.grade_run: the same judge, severity
and basis as `decodespec conform`). An engine is one of:

- `Launched`: a server command started once per checkpoint ({model}, {gguf}, {name}, {port}), as
  `conform --launch` and the presets start it (launch.launched), judged by the OpenAI adapter;
- `InProcess`: decodespec serve's app over the checkpoint, with its reasoning and tool-call parsers,
  on uvicorn in a thread of this process;
- `Module`: an engine of your own (`module:factory`, the adapter contract), loaded per checkpoint.

Each says what a run draws for it (`menu`, strategies.Menu): a server loading GGUF files never the
fixtures the converter refuses; chat examples where it serves chat with its parsers (a `Launched`
with `chat`, as the -chat presets start theirs: chat examples only; `InProcess`: both).

The sweep over every max_tokens is off (`sweep=False`): the generated examples draw max_tokens next
to each event of their scripts themselves.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from ..cases import Case, CaseError
from ..checkpoints import Checkpoint, build_group, group_of
from ..grading import DEFAULT_PROFILE
from ..launch import GGUF, launched
from ..runner import CaseResult, Verdict, grade_run, run_cases
from .strategies import COMPLETIONS, Menu, case_of

OnResult = Callable[[CaseResult], None]


class Engine(Protocol):
    """What answers a batch: every case, on the checkpoint it was compiled into."""

    @property
    def label(self) -> str:
        """The engine's name in reports."""

    def __call__(self, cases: Sequence[Case], checkpoints: Sequence[Checkpoint], on_result: OnResult) -> list[CaseResult]:
        ...


def _errors(cases: Sequence[Case], engine: str, why: str, on_result: OnResult) -> list[CaseResult]:
    out = [CaseResult(c, engine, Verdict.ERROR, reason=why) for c in cases]
    for r in out:
        on_result(r)
    return out


@attrs.frozen
class Launched:
    """A server started per checkpoint by `command` (see module), in the environment `env`."""

    command: str
    log_dir: Path
    label: str = "launched"
    without: frozenset[str] = frozenset()
    jobs: int = 1
    model: str | None = None
    gguf: str = GGUF
    env: Mapping[str, str] | None = None
    start_timeout: float = 600.0
    # the checkpoints' folders made servable (a llama.cpp engine's GGUF files: presets.convert_gguf);
    # a folder left out is one the engine's converter refused
    prepare: Callable[[list[Path]], list[Path]] | None = None
    chat: bool = False  # it serves chat with its parsers (a -chat preset): chat examples only

    @property
    def menu(self) -> Menu:
        """Chat examples only where it serves chat, else completions; never a fixture a GGUF converter
        refuses where it loads the GGUF file ({gguf} in its command, or a converter prepares it)."""
        gguf = self.prepare is not None or "{gguf}" in self.command
        return Menu(completions=not self.chat, chat=self.chat).served(gguf)

    def __call__(self, cases: Sequence[Case], checkpoints: Sequence[Checkpoint], on_result: OnResult) -> list[CaseResult]:
        from ..adapters.openai import OpenAIAdapter

        out: list[CaseResult] = []
        ready = set(self.prepare([ck.folder for ck in checkpoints])) if self.prepare else {ck.folder for ck in checkpoints}
        for ck in checkpoints:
            mine = [c for c in cases if c.id in ck.programs]
            if ck.folder not in ready:
                out += _errors(mine, f"launch[{ck.group}]", f"the engine's converter refused the checkpoint {ck.folder} "
                                                          "(its log is beside it)", on_result)
                continue
            try:
                with launched(self.command, ck, self.log_dir / f"{ck.group}.log", timeout_s=self.start_timeout,
                              gguf=self.gguf, env=self.env) as url:
                    name = self.model.format(model=ck.folder, name=ck.group) if self.model else None
                    adapter = OpenAIAdapter(url, model=name, checkpoint=ck, without=self.without, sweep=False,
                                            launch=self.command.replace("{gguf}", f"{{model}}/{self.gguf}"))
                    out += run_cases(adapter, mine, jobs=self.jobs, on_result=on_result)
            except RuntimeError as exc:  # the server did not come up: its cases are ERRORs with its log
                out += _errors(mine, f"launch[{ck.group}]", str(exc), on_result)
        return out


@attrs.frozen
class InProcess:
    """decodespec serve's app on each checkpoint, on uvicorn in a thread (runtime.in_thread)."""

    label: str = "decodespec-serve-in-process"
    jobs: int = 4
    menu: Menu = Menu(chat=True)

    def __call__(self, cases: Sequence[Case], checkpoints: Sequence[Checkpoint], on_result: OnResult) -> list[CaseResult]:
        from ....runtime.engine import Engine as RefEngine
        from ....runtime.hfmodel import HFModel
        from ....runtime.in_thread import serve_in_thread
        from ....runtime.server import create_app
        from ....runtime.tokenizers import HFTokenizer
        from ..adapters.openai import OpenAIAdapter

        out: list[CaseResult] = []
        for ck in checkpoints:
            app = create_app(RefEngine(HFModel(ck.folder), HFTokenizer(ck.folder)), reasoning_parser=True,
                             tool_parser=True)
            with serve_in_thread(app) as url:
                adapter = OpenAIAdapter(url, checkpoint=ck, sweep=False)
                out += run_cases(adapter, [c for c in cases if c.id in ck.programs], jobs=self.jobs, on_result=on_result)
        return out


@attrs.frozen
class Module:
    """An engine of your own (`module:factory`), loaded once per checkpoint (module_set.ModuleSet)."""

    spec: str
    label: str = "module"
    jobs: int = 1
    menu: Menu = COMPLETIONS  # the adapter contract's engines answer no chat request

    def __call__(self, cases: Sequence[Case], checkpoints: Sequence[Checkpoint], on_result: OnResult) -> list[CaseResult]:
        from ..module_set import ModuleSet

        engines = ModuleSet(self.spec, [ck.folder for ck in checkpoints])
        out: list[CaseResult] = []
        for i, ck in enumerate(engines.checkpoints):
            mine = [c for c in cases if c.id in ck.programs]
            got = engines.engine((i, None))
            if isinstance(got, str):  # the factory raised on this checkpoint
                out += _errors(mine, f"{self.spec}[{ck.group}]", got, on_result)
                continue
            if hasattr(got, "sweep"):
                got.sweep = False
            out += run_cases(got, mine, jobs=self.jobs, on_result=on_result)
        return out


def menu_of(engine: Engine) -> Menu:
    """What a run draws for `engine` (see module): its `menu`, or every completions example where it has none."""
    return getattr(engine, "menu", None) or COMPLETIONS


def compile_batch(cases: Sequence[Case], folder: Path) -> list[Checkpoint]:
    """One forced checkpoint per tokenizer group of `cases`, under `folder` (replaced)."""
    groups: dict[str, list[Case]] = {}
    for c in cases:
        groups.setdefault(group_of(c), []).append(c)
    shutil.rmtree(folder, ignore_errors=True)
    return [build_group(g, cs, folder / g, long=False) for g, cs in sorted(groups.items())]


@attrs.frozen
class Batch:
    """A judged batch: each example's case and graded result, in the examples' order."""

    cases: tuple[Case, ...]
    results: tuple[CaseResult, ...]
    inputs: tuple[Mapping[str, Any], ...]


def run_batch(examples: Sequence[Mapping[str, Any]], tag: str, engine: Engine, folder: Path, *,
              profile: str = DEFAULT_PROFILE, declared: frozenset[str] = frozenset(),
              on_result: OnResult = lambda r: None) -> Batch:
    """Compile `examples` (case ids `fuzz/<tag>/NNN`) into checkpoints under `folder`, run them on
    `engine` and grade the results as one run (see module). An example the case format refuses is
    an error of the generator, raised."""
    if len(examples) > 999:
        raise CaseError(f"a batch holds at most 999 examples (case ids fuzz/{tag}/NNN), got {len(examples)}")
    cases = [case_of(f"fuzz/{tag}/{i + 1:03d}", ex) for i, ex in enumerate(examples)]
    results = judge_cases(cases, engine, folder, profile=profile, declared=declared, on_result=on_result)
    return Batch(tuple(cases), tuple(results), tuple(examples))


def judge_cases(cases: Sequence[Case], engine: Engine, folder: Path, *, profile: str = DEFAULT_PROFILE,
                declared: frozenset[str] = frozenset(), on_result: OnResult = lambda r: None) -> list[CaseResult]:
    """`cases` compiled into checkpoints under `folder` (compile_batch), answered by `engine` and
    graded as one run, in the cases' order."""
    checkpoints = compile_batch(cases, folder)
    got = {r.case.id: r for r in engine(cases, checkpoints, on_result)}
    graded = {r.case.id: r for r in grade_run([got[c.id] for c in cases], profile, declared)}
    return [graded[c.id] for c in cases]
