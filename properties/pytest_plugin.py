"""pytest plugin: every conformance case as a test item.

    pytest -p decodespec --decodespec-engine=reference -n 2

The plugin is registered as the `decodespec` pytest11 entry point, so it loads with the package
(`-p decodespec` only loads it early; `-p no:decodespec` turns it off). It does nothing unless
`--decodespec-engine` is given.

Options: `--decodespec-engine` (as `decodespec conform --engine`), `--decodespec-model`,
`--decodespec-select PREFIX` (repeatable), `--decodespec-with-tests` (also collect the project's
own tests: by default, with an engine given, only the conformance items are collected, so an
engine's repository can run the plugin from its root without importing its test suite),
`--decodespec-checkpoint DIR` (openai: the forced checkpoint served; an engine of your own,
`module:factory`: a checkpoint or a whole set `decodespec checkpoints build` wrote, each case run on
the engine the factory loads from its checkpoint, as `decodespec conform --engine module:factory
--checkpoint SET` runs it: module_set.ModuleSet; items are ordered so each engine loads once, and
the chat variants of the cases are collected too), `--decodespec-strict`,
`--decodespec-profile` and `--decodespec-declare DNN` (repeatable), as `decodespec conform`'s
`--profile` and `--declare` (runner.PROFILES, decisions.DECISIONS; D69): each item's verdict is
graded under them, and a case resting on a declared decision is skipped with the decision's line.
A SKIP verdict becomes a pytest skip with its reason; FAIL and ERROR fail the item with the first
violated invariant and the reproducer, except a SHOULD failure, which is an xfail unless strict:
the items fail exactly where `decodespec conform` exits 1 (`runner.unexpected`). A misspelt or
unreachable engine is one usage error. Items are named by case id, so pytest-xdist can shard them.

An item is judged alone, so it cannot know that a field the engine ignored in it is ignored in every
case that could show it. At the session's end the items' results (each kept as report.json keeps a
case, on the item's call report, which pytest-xdist carries to the controller) are graded again as one run
(`RunGrading`: regrade.result_of, runner.grade_run): a field ignored engine-wide is stated once in
the terminal summary, as the report's headline states it (D71), with the failed items that fail only
on it, and when those are all the failures the session's exit status is the run's, 0, as
`decodespec conform`'s. The items still show their own verdicts; nothing is reordered or run again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest

from .conformance import CaseError, EngineSpecError, adapter_for, load_cases, run_case, select_cases
from .conformance.adapters import is_module_engine
from .conformance.cases import Case
from .conformance.decisions import DECISIONS

if TYPE_CHECKING:
    from _pytest._code.code import TerminalRepr
from .conformance.reports import case_json, reproducer
from .conformance.runner import (
    DEFAULT_PROFILE,
    PROFILES,
    CaseResult,
    Verdict,
    counts,
    declared_on,
    declared_reason,
    grade,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("decodespec", "decodespec conformance cases")
    group.addoption("--decodespec-engine", default=None,
                    help="reference | hf:PATH | decode-stream:TOKENIZER_JSON | openai:URL")
    group.addoption("--decodespec-model", default=None, help="model name for openai engines")
    group.addoption("--decodespec-checkpoint", default=None,
                    help="openai engines: the forced checkpoint folder the server serves (its script cases run); "
                         "module:factory engines: a checkpoint or a set of them, the factory called per checkpoint")
    group.addoption("--decodespec-timeout", type=float, default=None,
                    help="openai engines: seconds to wait for a whole answer, or for a stream's next event (default 60)")
    group.addoption("--decodespec-select", action="append", default=[], help="case id prefix (repeatable)")
    group.addoption("--decodespec-with-tests", action="store_true",
                    help="with --decodespec-engine, also collect the project's own tests (default: the cases only)")
    group.addoption("--decodespec-strict", action="store_true",
                    help="SHOULD failures fail their items too (by default they are xfail, as the CLI reports them)")
    group.addoption("--decodespec-profile", choices=list(PROFILES), default=DEFAULT_PROFILE,
                    help="as `decodespec conform --profile`: chapter judges the rules of chapter 4 alone; project "
                         "(the default) also this project's decisions")
    group.addoption("--decodespec-declare", action="append", default=[], choices=list(DECISIONS), metavar="DNN",
                    help="as `decodespec conform --declare`: a decision the engine documents its own choice on; the "
                         "cases resting on it are skipped with the reason (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: a decodespec conformance case")
    if config.getoption("--decodespec-engine", None) and not hasattr(config, "workerinput"):  # the controller
        config.pluginmanager.register(RunGrading(config), "decodespec-run-grading")


RESULT = "decodespec_result"  # the call report's attribute holding the item's case as report.json keeps it


class RunGrading:
    """The items' results graded as one run at the session's end (see module; D71)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.entries: dict[str, dict[str, Any]] = {}  # nodeid -> its case as report.json keeps it
        self.failed: set[str] = set()
        self.lines: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.add(report.nodeid)
        if report.when == "call" and getattr(report, RESULT, None) is not None:
            self.entries[report.nodeid] = getattr(report, RESULT)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from .conformance.checkpoints import with_chat
        from .conformance.engine_wide import ignored_engine_wide
        from .conformance.regrade import result_of
        from .conformance.reports import engine_wide_line
        from .conformance.runner import grade_run
        from .conformance.symptoms import FIELD_BASIS

        if not any(f["basis"]["kind"] == FIELD_BASIS for e in self.entries.values() for f in e["failures"]):
            return  # only a finding resting on an ignored field can make one engine-wide
        opt = self.config.getoption
        engine, profile = opt("--decodespec-engine"), opt("--decodespec-profile")
        cases = {c.id: c for c in with_chat(load_cases())}
        alone = [result_of(e, cases[e["id"]], engine, profile) for e in self.entries.values()]
        if not (wide := ignored_engine_wide(alone)):
            return
        run = dict(zip(self.entries, grade_run(alone, profile, frozenset(opt("--decodespec-declare")))))
        now_pass = sorted(n for n in self.failed & run.keys() if not counts(run[n], strict=opt("--decodespec-strict")))
        self.lines = [engine_wide_line(w.to_json()) for w in wide]
        if now_pass:
            self.lines.append(f"graded as one run, as `decodespec conform` grades it, {len(now_pass)} failed item(s) "
                              f"fail only on it: {', '.join(run[n].case.id for n in now_pass)}")
        if now_pass and exitstatus == pytest.ExitCode.TESTS_FAILED and self.failed <= set(now_pass):
            session.exitstatus = pytest.ExitCode.OK
            self.lines.append("no other item failed: the exit status is the run's, 0")

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.lines:
            terminalreporter.section("decodespec: the items graded as one run (D71)")
            for line in self.lines:
                terminalreporter.write_line(line)


class ConformanceFailure(Exception):
    """A case failed on the engine; carries the text pytest shows."""


class CaseItem(pytest.Item):
    """One case on the engine named by --decodespec-engine, run by `run` (the engine's adapter, or
    the ModuleSet of an engine of your own on a checkpoint set)."""

    def __init__(self, *, case: Case, engine: str, run: Callable[[Case], CaseResult], strict: bool = False,
                 profile: str = DEFAULT_PROFILE, declared: frozenset[str] = frozenset(), **kw: Any) -> None:
        super().__init__(**kw)
        self.case = case
        self.engine = engine
        self.run = run
        self.strict = strict
        self.profile, self.declared = profile, declared
        self.result: dict[str, Any] | None = None  # the case as report.json keeps it, once run
        self.add_marker(pytest.mark.conformance)

    def runtest(self) -> None:
        if own := declared_on(self.case, self.declared):
            pytest.skip(declared_reason(own))
        res = grade(self.run(self.case), self.profile, self.declared)
        self.result = case_json(res)  # graded with the others at the session's end (RunGrading)
        if res.verdict is Verdict.SKIP:
            pytest.skip(res.reason)
        if res.verdict is not Verdict.PASS:
            if not counts(res, strict=self.strict):  # a SHOULD failure: reported, not failing (as the CLI)
                pytest.xfail(f"SHOULD failure: {res.first_invariant}: {res.failures[0].message}")
            lines = [f"{self.case.id} ({self.case.grade.value}, {self.case.anchor}) {res.verdict.value} on {self.engine}"]
            lines += [f"  {f.invariant}: {f.message}" for f in res.failures] or [f"  error: {res.reason}"]
            lines += ["reproducer:", json.dumps(reproducer(res), ensure_ascii=False, indent=1)]
            raise ConformanceFailure("\n".join(lines))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str | TerminalRepr:
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.case.path or "", 0, f"conformance {self.case.id}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A case item's call report carries its result (RESULT), for RunGrading on the controller."""
    report = yield
    if isinstance(item, CaseItem) and call.when == "call":
        setattr(report, RESULT, item.result)
    return report


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """With an engine and without --decodespec-with-tests, no test file is collected (or imported)."""
    if config.getoption("--decodespec-engine") and not config.getoption("--decodespec-with-tests"):
        return collection_path.is_file()
    return None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    engine = config.getoption("--decodespec-engine")
    if not engine:
        return
    model = config.getoption("--decodespec-model")
    checkpoint = config.getoption("--decodespec-checkpoint")
    timeout = config.getoption("--decodespec-timeout")
    every = load_cases()
    try:  # a misspelt or unreachable engine is one usage error, not one failure per case
        run, order, every = _runner(engine, model, checkpoint, timeout, every)
    except (EngineSpecError, CaseError, RuntimeError) as exc:  # RuntimeError: the HTTP adapter's ServerError
        raise pytest.UsageError(f"--decodespec-engine={engine}: {exc}") from None
    strict = config.getoption("--decodespec-strict")
    profile, declared = config.getoption("--decodespec-profile"), frozenset(config.getoption("--decodespec-declare"))
    try:
        selected = select_cases(every, config.getoption("--decodespec-select"))
    except CaseError as exc:
        raise pytest.UsageError(f"--decodespec-select: {exc}") from None
    for case in order(selected):
        items.append(CaseItem.from_parent(session, name=f"{engine}::{case.id}", case=case, engine=engine, run=run,
                                          strict=strict, profile=profile, declared=declared))


def _runner(engine: str, model: str | None, checkpoint: str | None, timeout: float | None,
            every: list[Case]) -> tuple[Callable[[Case], CaseResult], Callable[[list[Case]], list[Case]], list[Case]]:
    """What runs a case on the engine, the order to collect the items in, and the cases to select
    from: an engine of your own on checkpoints runs as a ModuleSet (its chat variants too, as
    `decodespec conform --checkpoint` runs them); any other on its one adapter, prechecked."""
    if checkpoint is not None and is_module_engine(engine):
        from .conformance.checkpoints import MANIFEST, checkpoint_folders, with_chat
        from .conformance.module_set import ModuleSet

        folders = checkpoint_folders(checkpoint)
        if not folders:
            raise EngineSpecError(f"--decodespec-checkpoint={checkpoint} holds no forced checkpoint ({MANIFEST}; "
                                  "`decodespec checkpoints build`)")
        engines = ModuleSet(engine, folders)
        return engines.run, engines.order, with_chat(every)
    adapter = adapter_for(engine, model=model, checkpoint=checkpoint, timeout=timeout)
    if callable(getattr(adapter, "precheck", None)):
        adapter.precheck()  # only HTTP adapters have one (httpx is imported with them)
    return partial(run_case, adapter), list, every
