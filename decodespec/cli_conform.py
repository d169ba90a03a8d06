"""`decodespec conform`: run the conformance cases against an engine and write its reports.

    decodespec conform --engine reference
    decodespec conform --engine hf:.cache/peers/checkpoints --report reports/hf-generate
    decodespec conform --engine openai:http://127.0.0.1:8000 --model tiny --select http/
    decodespec conform --engine reference --dry-run --select stop/
    decodespec conform --engine my_engine:make --checkpoint ckpts --report reports/my-engine
    decodespec conform --preset vllm                  # build the checkpoints, start vLLM on each, judge it
    decodespec conform --list-presets

Exit status (the same rule as the pytest plugin's, `runner.unexpected`): 1 when a case ends in
ERROR (the run could not judge it) or a MUST case FAILs the chapter or (under the default profile)
DIFFERS on a project decision or an ignored field, unless --expect FILE lists its id as a known
failure; SHOULD cases and stream-shape or wire findings fail the run only with --strict. 3 when
most cases could not run (no forced checkpoint, ...): the run did not judge the engine, whatever
the rest says, unless --partial-ok. An --expect file naming a case that does not exist is refused
before anything runs. 2 for bad usage: an unknown or unreachable engine, a bad file.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import click
from rich.console import Console
from rich.table import Table as RichTable

from .checkout import default_diagrams_dir
from .cli_paths import output_folder
from .properties.conformance.decisions import DECISIONS
from .properties.conformance.grading import DEFAULT_PROFILE, PROFILES
from .properties.conformance.without import WITHOUT

_STYLE = {"PASS": "green", "FAIL": "red", "DIFFERS": "yellow", "ERROR": "bold red", "SKIP": "dim"}
_MARK = {"PASS": ".", "FAIL": "F", "DIFFERS": "D", "ERROR": "E", "SKIP": "s"}
PARTIAL_RUN_EXIT = 3

if TYPE_CHECKING:
    from .properties.conformance.adapters.base import Adapter
    from .properties.conformance.cases import Case
    from .properties.conformance.presets import Preset
    from .properties.conformance.reports import Grading


class Ticker:
    """Progress as pytest shows it, on stderr while the run goes: one mark a case (. pass, F fail,
    D differs on a decision, E error, s n/a, w a pass with stream-shape or wire findings), a bar and
    the count at each line's end."""

    def __init__(self, total: int, label: str, width: int = 50) -> None:
        self.total, self.done, self.width = total, 0, width
        self.t0 = time.monotonic()
        self._lock = threading.Lock()  # run_cases calls it from its worker threads
        sys.stderr.write(f"conform {label}: {total} case(s)\n")
        sys.stderr.flush()

    def __call__(self, r) -> None:
        with self._lock:
            self._tick(r)

    def _tick(self, r) -> None:
        self.done += 1
        mark = "w" if r.verdict.value == "PASS" and r.failures else _MARK[r.verdict.value]
        sys.stderr.write(mark)
        if self.done % self.width == 0 or self.done == self.total:
            filled = round(20 * self.done / self.total)
            sys.stderr.write(f" [{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} "
                             f"{time.monotonic() - self.t0:.0f} s\n")
        sys.stderr.flush()


def report_name(engine: str) -> str:
    """A folder name for an engine spec: 'reference', 'hf-checkpoints', 'openai-127.0.0.1-8000'."""
    kind, _, arg = engine.partition(":")
    tail = Path(arg.rstrip("/")).name if kind in ("hf", "decode-stream") else re.sub(r"^https?://", "", arg)
    return re.sub(r"[^A-Za-z0-9.]+", "-", f"{kind}-{tail}" if tail else kind).strip("-")


@click.command()
@click.option("--engine", default=None, help="reference | hf:PATH | decode-stream:TOKENIZER_JSON | openai:URL | "
                                             "module:factory (an in-house engine through the adapter contract, "
                                             "decodespec.properties.conformance.contract)")
@click.option("--preset", default=None, metavar="NAME",
              help="Judge an engine in one command: build (or reuse) this project's forced checkpoints, start the "
                   "engine found on PATH on each as the preset says, run its cases, write reports/NAME "
                   "(--list-presets).")
@click.option("--list-presets", "list_presets", is_flag=True, help="Print the engine presets and their commands.")
@click.option("--presets", "presets_files", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="More presets, in presets.toml's format (a name already known is replaced).")
@click.option("--llama-cpp", "llama_cpp", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="With a llama.cpp preset: the llama.cpp checkout whose convert_hf_to_gguf.py writes the GGUF files "
                   "(default: $LLAMA_CPP_DIR).")
@click.option("--model", default=None, help="Model name for openai engines (default: the first of /v1/models).")
@click.option("--select", "select", multiple=True, help="Only cases whose id starts with this prefix (repeatable).")
@click.option("--cases-of", "cases_of", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Only the cases of this report.json, by exact id: a report re-run on its own snapshot's cases "
                   "(with --select, both apply). An id the suite no longer has is refused.")
@click.option("--list", "list_only", is_flag=True, help="List the selected cases with their descriptions; no engine needed.")
@click.option("--dry-run", is_flag=True, help="List the selected cases (and whether the engine can run them); run nothing.")
@click.option("--expect", "expect_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Known failures, one case id a line (# comments): they do not fail the run. Unknown ids are refused.")
@click.option("--strict", is_flag=True, help="SHOULD failures, and stream-shape and wire findings, fail the run too "
                                             "(by default they are reported only).")
@click.option("--profile", type=click.Choice(list(PROFILES)), default=DEFAULT_PROFILE, show_default=True,
              help="chapter: judge the rules of chapter 4 alone (findings that rest on a project decision or an "
                   "ignored request field fail no case); project: also this project's decisions, reported apart.")
@click.option("--declare", "declared", multiple=True, type=click.Choice(list(DECISIONS)), metavar="DNN",
              help="A decision of spec/DECISIONS.md on which the engine documents its own choice: the cases that "
                   "rest on it are n/a with the reason, and its findings elsewhere weigh nothing (repeatable).")
@click.option("--partial-ok", is_flag=True,
              help="Accept a run in which most cases could not run (by default it exits 3: it did not judge the engine).")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              callback=output_folder,
              help="Write report.json, junit.xml, report.md, report.html into this folder.")
@click.option("--name", default=None, help="Engine name shown in reports (default: derived from --engine).")
@click.option("--worker", "workers", multiple=True, metavar="NAME",
              help="The engine is a gateway (a router, a proxy): a report of its worker judged directly, by its "
                   "folder beside --report's (reports/vllm for reports/vllm-router); each finding is marked the "
                   "worker's or the gateway's own (repeatable; default: the preset's `worker`).")
@click.option("--checkpoint", "checkpoints", type=click.Path(exists=True, file_okay=False, path_type=Path), multiple=True,
              help="openai: the forced checkpoint folder the server serves (`decodespec checkpoints build`), so its "
                   "script cases run over HTTP. module:factory and --launch: checkpoint folders, or a folder of "
                   "them; the factory is called (the server started) once per checkpoint, one report for all.")
@click.option("--launch", default=None, metavar="CMD",
              help="Start a server per checkpoint with CMD ({model}, {gguf}, {name}, {port} filled in), run its "
                   "cases, stop it by PID; one report for all (see scripts/peers/).")
@click.option("--launch-context", "launch_context", default=None, metavar="CMD",
              help="With --launch: the command that starts the server with a context length of {context} tokens "
                   "(the other fields as --launch), for the cases with a context limit (§4.3, D10).")
@click.option("--launch-tight", "launch_tight", default=None, metavar="CMD",
              help="With --launch: the command that starts the server with its concurrency limited and a KV budget "
                   "too small for the load (the other fields as --launch), for the cases that ask for it (§4.8-§4.10: "
                   "preemption, a disconnect that frees its place).")
@click.option("--launch-timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds a launched server may take to answer /v1/models.")
@click.option("--timeout", "read_timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="openai engines: seconds to wait for a whole answer, or for a stream's next event (default 60); "
                   "past it the case ends in ERROR.")
@click.option("--without", "without", multiple=True, type=click.Choice(list(WITHOUT)),
              help="openai only: a request field or a parser the server does not have (its cases are skipped).")
@click.option("-j", "--jobs", default=None, type=click.IntRange(1, 64),
              help="Cases run at once (threads; default 1, or the preset's).")
def conform(engine: str, preset: str | None, list_presets: bool, presets_files: tuple[Path, ...], llama_cpp: Path | None,
            model: str | None, select: tuple[str, ...], cases_of: Path | None, list_only: bool, dry_run: bool,
            expect_file: Path | None, strict: bool, profile: str, declared: tuple[str, ...], partial_ok: bool,
            report_dir: Path | None, name: str | None, workers: tuple[str, ...],
            checkpoints: tuple[Path, ...], launch: str | None, launch_context: str | None, launch_tight: str | None,
            launch_timeout: float, read_timeout: float | None,
            without: tuple[str, ...],
            jobs: int | None) -> None:
    """Run the conformance cases (§4.3-§4.10) against ENGINE and report per case."""
    console = Console(width=120)
    t0 = time.monotonic()
    if list_presets or preset == "list":
        click.echo("\n".join(p.describe() for p in _presets(presets_files).values()))
        return
    chosen = None
    if preset is not None:
        _refuse_given({"--engine": engine, "--launch": launch, "--launch-context": launch_context,
                       "--launch-tight": launch_tight}, "--preset starts the engine itself: give {hint} or --preset")
        chosen = _find_preset(preset, presets_files)
    every, cases = _selected(select, cases_of, checkpoints, chosen)
    if list_only:
        return _print_cases(cases, console)
    policy = _policy(expect_file, every, strict, partial_ok, profile, declared,
                     workers or (chosen.worker if chosen else ()), _report_folder(report_dir, name, chosen, engine))
    if chosen is not None:
        return _conform_preset(chosen, cases, every, checkpoints, llama_cpp, frozenset(without), jobs, model, name,
                               report_dir, (launch_timeout, read_timeout), policy, dry_run, console, t0)
    jobs = jobs or 1
    if launch is None:
        _refuse_given({"--launch-context": launch_context, "--launch-tight": launch_tight}, "{hint} goes with --launch")
    else:
        if engine is not None:
            raise click.BadParameter("give either --engine or --launch", param_hint="--launch")
        folders = _checkpoint_folders(checkpoints)
        return _conform_launched(cases, folders, launch, (launch_context, launch_tight), (launch_timeout, read_timeout),
                                 frozenset(without), jobs,
                                 model, name or "launched", report_dir, policy, dry_run, console, t0,
                                 log_dir=Path(".cache/peers/logs") / (name or "launched"))
    if engine is None:
        raise click.UsageError("--engine is required (or --preset NAME, or --launch CMD with --checkpoint)")
    _conform_engine(engine, cases, checkpoints, model, frozenset(without), read_timeout, presets_files, jobs,
                    name or report_name(engine), report_dir, policy, dry_run, console, t0)


def _refuse_given(options: dict[str, object], why: str) -> None:
    """Refuse the first of these options (hint -> value) that was given, saying `why` ({hint} filled in)."""
    for hint, given in options.items():
        if given is not None:
            raise click.BadParameter(why.format(hint=hint), param_hint=hint)


def _selected(select: tuple[str, ...], cases_of: Path | None, checkpoints: tuple[Path, ...],
              chosen: Preset | None) -> tuple[list[Case], list[Case]]:
    """Every case (with the chat variants where forced checkpoints run) and the ones to run: by
    --select prefix, by --cases-of report, by what the preset runs."""
    from .properties.conformance import CaseError, load_cases, select_cases

    every = load_cases()
    if checkpoints or chosen:  # chat variants run on forced checkpoints (whose module loads torch: not for --list)
        from .properties.conformance.checkpoints import with_chat

        every = with_chat(every)
    try:
        cases = select_cases(every, select)
    except CaseError as exc:
        hint = " (the chat variants of the cases run with --checkpoint)" if not checkpoints and "'chat" in str(exc) else ""
        raise click.BadParameter(f"{exc}{hint}", param_hint="--select") from None
    if cases_of is not None:
        ids = _report_ids(cases_of, every, checkpoints)
        cases = [c for c in cases if c.id in ids]
    if chosen is not None:
        cases = [c for c in cases if chosen.runs(c)]
    return every, cases


def _report_ids(report: Path, every: list[Case], checkpoints: tuple[Path, ...]) -> set[str]:
    """The case ids of a report.json (--cases-of), each one the suite still has."""
    from .properties.conformance import CaseError
    from .properties.conformance.reports import case_ids_of

    try:
        ids = case_ids_of(report)
    except CaseError as exc:
        raise click.BadParameter(str(exc), param_hint="--cases-of") from None
    if gone := sorted(set(ids) - {c.id for c in every}):
        more = f" and {len(gone) - 5} more" if len(gone) > 5 else ""
        raise click.BadParameter(f"{report}: the suite has no case {', '.join(map(repr, gone[:5]))}{more}"
                                 f"{'' if checkpoints else ' (chat variants run with --checkpoint)'}",
                                 param_hint="--cases-of")
    return set(ids)


def _print_cases(cases: list[Case], console: Console) -> None:
    """--list: the selected cases with their section, grade, invariant and description."""
    table = RichTable(title=f"{len(cases)} case(s)")
    for col in ("case", "§", "grade", "invariant", "description"):
        table.add_column(col, overflow="fold")
    for c in cases:
        table.add_row(c.id, c.anchor, c.grade.value, c.invariant, c.description)
    console.print(table)


def _report_folder(report_dir: Path | None, name: str | None, chosen: Preset | None, engine: str | None) -> Path:
    """Where the run's reports go: --report, else reports/ and the engine's name (--name, the
    preset's, or the one derived from --engine)."""
    return report_dir or Path("reports") / (name or (chosen.name if chosen else report_name(engine or "launched")))


def _policy(expect_file: Path | None, every: list[Case], strict: bool, partial_ok: bool, profile: str,
            declared: tuple[str, ...], workers: tuple[str, ...], folder: Path) -> Policy:
    """What fails the run: the --expect file's known failures (each id a case), --strict,
    --partial-ok, the grading; a gateway's worker reports must be beside `folder` already."""
    from .properties.conformance import CaseError
    from .properties.conformance.reports import Grading, worker_reports
    from .properties.conformance.runner import read_expectations

    known: frozenset[str] = frozenset()
    if expect_file is not None:
        try:
            known = read_expectations(expect_file.read_text(encoding="utf-8"), known=(c.id for c in every))
        except CaseError as exc:
            raise click.BadParameter(f"{expect_file}: {exc}", param_hint="--expect") from None
    policy = Policy(known, strict, partial_ok, Grading(profile, frozenset(declared)), workers)
    if policy.workers:
        try:
            worker_reports(folder, policy.workers)
        except CaseError as exc:
            raise click.BadParameter(f"{exc} (judge the worker directly first)", param_hint="--worker") from None
    return policy


def _conform_engine(engine: str, cases: list[Case], checkpoints: tuple[Path, ...], model: str | None,
                    without: frozenset[str], read_timeout: float | None, presets_files: tuple[Path, ...], jobs: int,
                    label: str, report_dir: Path | None, policy: Policy, dry_run: bool, console: Console,
                    t0: float) -> None:
    """--engine: an engine of your own loaded once per checkpoint, or one adapter (at most one
    checkpoint, the one an openai server serves)."""
    from .properties.conformance import run_cases
    from .properties.conformance.adapters import is_module_engine

    if checkpoints and is_module_engine(engine):  # an engine of your own: loaded once per checkpoint
        return _conform_module(cases, engine, _checkpoint_folders(checkpoints), jobs, label,
                               report_dir, policy, dry_run, console, t0)
    adapter = _adapter(engine, checkpoints, model, without, read_timeout, presets_files, precheck=not dry_run)
    if dry_run:
        return _print_plan(cases, adapter, label, console)
    results = _run_declared(cases, policy, label, lambda todo, tick: run_cases(adapter, todo, jobs=jobs, on_result=tick))
    _finish(results, label, report_dir, policy, console, t0)


def _adapter(engine: str, checkpoints: tuple[Path, ...], model: str | None, without: frozenset[str],
             read_timeout: float | None, presets_files: tuple[Path, ...], *, precheck: bool) -> Adapter:
    """The adapter --engine names (a preset's name suggested where it names an engine), its server
    checked first where it has a precheck and the run is not a dry run."""
    from .properties.conformance import EngineSpecError, adapter_for
    from .properties.conformance.adapters.openai import ServerError

    if len(checkpoints) > 1:
        raise click.BadParameter("one --checkpoint per served engine (several only with --launch or a "
                                 "module:factory engine)", param_hint="--checkpoint")
    try:
        adapter = adapter_for(engine, model=model, checkpoint=str(checkpoints[0]) if checkpoints else None,
                              without=without, timeout=read_timeout)
    except EngineSpecError as exc:
        raise click.BadParameter(f"{exc}{_preset_hint(engine, presets_files)}", param_hint="--engine") from None
    if precheck and callable(getattr(adapter, "precheck", None)):
        try:
            adapter.precheck()
        except ServerError as exc:
            raise click.BadParameter(str(exc), param_hint="--engine") from None
    return adapter


def _print_plan(cases: list[Case], adapter: Adapter, label: str, console: Console) -> None:
    """--dry-run: the selected cases and whether the engine can run each."""
    table = RichTable(title=f"{len(cases)} case(s) for {label}")
    for col in ("case", "anchor", "grade", "description", "runs here"):
        table.add_column(col, overflow="fold")
    for c in cases:
        table.add_row(c.id, c.anchor, c.grade.value, c.description,
                      adapter.unsupported(c) and f"SKIP: {adapter.unsupported(c)}" or "yes")
    console.print(table)


def _checkpoint_folders(given: tuple[Path, ...]) -> list[Path]:
    """Checkpoint folders from --checkpoint values: each a checkpoint, or a folder of them."""
    from .properties.conformance import CaseError
    from .properties.conformance.checkpoints import MANIFEST, Checkpoint, checkpoint_folders

    if not given:
        raise click.UsageError("--launch needs --checkpoint (build them with `decodespec checkpoints build`)")
    out: list[Path] = []
    for g in given:
        found = checkpoint_folders(g)
        if not found:
            raise click.BadParameter(f"{g} holds no forced checkpoint ({MANIFEST})", param_hint="--checkpoint")
        for f in found:  # each one read now: a broken manifest stops the run before any server starts
            try:
                Checkpoint.load(f)
            except CaseError as exc:
                raise click.BadParameter(str(exc), param_hint="--checkpoint") from None
        out += found
    return out


def _conform_module(cases, engine, folders, jobs, label, report_dir, policy, dry_run, console, t0) -> None:
    from .properties.conformance import EngineSpecError
    from .properties.conformance.checkpoints import Checkpoint
    from .properties.conformance.module_set import run_module_set

    if dry_run:
        for f in folders:
            ck = Checkpoint.load(f)
            console.print(f"{f}: {sum(c.id in ck.programs for c in cases)} case(s); engine: {engine}")
        return
    try:
        results = _run_declared(cases, policy, label,
                                lambda todo, tick: run_module_set(todo, folders, engine, jobs=jobs, on_result=tick))
    except EngineSpecError as exc:
        raise click.BadParameter(str(exc), param_hint="--engine") from None
    _finish(results, label, report_dir, policy, console, t0)


def _conform_launched(cases, folders, launch, extra_launch, timeouts, without, jobs, model, label, report_dir,
                      policy, dry_run, console, t0, *, log_dir: Path, gguf: str | None = None,
                      env: dict[str, str] | None = None) -> None:
    from .properties.conformance.checkpoints import Checkpoint
    from .properties.conformance.launch import GGUF, run_launched

    if dry_run:
        for f in folders:
            ck = Checkpoint.load(f)
            console.print(f"{f}: {sum(c.id in ck.programs for c in cases)} case(s); server: {launch}")
        return
    results = _run_declared(cases, policy, label, lambda todo, tick: run_launched(
        todo, folders, launch, log_dir=log_dir, without=without, jobs=jobs, model=model, timeout_s=timeouts[0],
        read_timeout=timeouts[1], on_result=tick, context_command=extra_launch[0], tight_command=extra_launch[1],
        gguf=gguf or GGUF, env=env))
    _finish(results, label, report_dir, policy, console, t0)


def _presets(files: tuple[Path, ...]):
    from .properties.conformance.presets import PresetError, load_presets

    try:
        return load_presets(files)
    except PresetError as exc:
        raise click.BadParameter(str(exc), param_hint="--presets") from None


def _find_preset(name: str, files: tuple[Path, ...]):
    from .properties.conformance.presets import PresetError, find

    try:
        return find(_presets(files), name)
    except PresetError as exc:
        raise click.BadParameter(str(exc), param_hint="--preset") from None


def _preset_hint(engine: str, files: tuple[Path, ...]) -> str:
    """For an --engine value that names an engine rather than an adapter: the preset that judges it."""
    from .properties.conformance.presets import suggest

    presets = _presets(files)
    near = suggest(presets, engine.partition(":")[0]) or suggest(presets, engine)
    if near is None:
        return ""
    return (f". To start {presets[near].engine} on this project's forced checkpoints and judge it: "
            f"decodespec conform --preset {near}")


def _conform_preset(p, cases, every, checkpoints, llama_cpp, without, jobs, model, name, report_dir, timeouts,
                    policy, dry_run, console, t0) -> None:
    """--preset: the decisions it declares added to --declare, the engine found on PATH, the checkpoints its cases need (given, reused or built), their GGUF
    files for a llama.cpp engine, then the launched run (presets.py)."""
    from .properties.conformance import presets as ps

    def echo(line: str) -> None:
        click.echo(f"conform --preset {p.name}: {line}", err=True)

    policy = attrs.evolve(policy, grading=attrs.evolve(policy.grading,
                                                       declared=policy.grading.declared | frozenset(p.declare)))
    path = ps.engine_path()
    if (why := p.missing(path)) is not None:
        raise click.BadParameter(why, param_hint="--preset")
    groups = ps.groups_needed(cases, every)
    label = name or p.name
    report_dir = output_folder(click.get_current_context(), None, report_dir or Path("reports") / p.name)
    if checkpoints:
        given = {f.name: f for f in _checkpoint_folders(checkpoints)}
        folders = [given[g] for g in groups if g in given]
    else:
        root = ps.cache_root() / "checkpoint-sets" / ps.set_stamp()
        if dry_run:
            built = [g for g in groups if (root / g).is_dir()]
            console.print(f"checkpoints {root}: {len(built)} of {len(groups)} built ({', '.join(groups)})",
                          highlight=False, markup=False)
            folders = [root / g for g in built]
        else:
            folders = ps.ensure_checkpoints(root, groups, every, echo)
    if dry_run:
        console.print(p.describe(), highlight=False, markup=False)
    else:
        try:
            folders = ps.convert_gguf(folders, p, llama_cpp, echo)
        except ps.PresetError as exc:
            raise click.BadParameter(str(exc), param_hint="--llama-cpp") from None
    _conform_launched(cases, folders, p.launch, (p.context or None, p.tight or None), timeouts,
                      without | set(p.without), jobs or p.jobs, model or p.model or None, label, report_dir, policy,
                      dry_run, console, t0, log_dir=ps.cache_root() / "logs" / label, gguf=p.gguf_file,
                      env={**os.environ, "PATH": path})


@attrs.frozen
class Policy:
    """What fails a run: the known failures (--expect), --strict, --partial-ok, and the grading
    (--profile, --declare)."""

    known: frozenset[str]
    strict: bool
    partial_ok: bool
    grading: Grading
    workers: tuple[str, ...] = ()  # a gateway's worker reports, beside its own (attribution.py)


def _run_declared(cases, policy: Policy, label: str, run) -> list:
    """Run the cases that rest on no declared decision (`run(todo, on_result)`) and grade the results
    as one run under the policy's profile (runner.grade_run: a field ignored engine-wide is one cause,
    D71); the others are n/a with the decision's line, in the cases' order."""
    from .properties.conformance.runner import CaseResult, Verdict, declared_on, declared_reason, grade_run

    declared = policy.grading.declared
    own = {c.id: d for c in cases if (d := declared_on(c, declared))}
    tick = Ticker(len(cases), label)
    skipped = {c.id: CaseResult(c, label, Verdict.SKIP, reason=declared_reason(own[c.id])) for c in cases if c.id in own}
    for r in skipped.values():
        tick(r)
    done = {r.case.id: r for r in grade_run(run([c for c in cases if c.id not in own], tick),
                                            policy.grading.profile, declared)}
    return [skipped.get(c.id) or done[c.id] for c in cases]


def _finish(results, label, report_dir, policy: Policy, console, t0: float) -> None:
    """Print the table and headline, write the reports (a gateway's read against its worker's); exit 3
    when most cases could not run (unless --partial-ok), else 1 on a result that fails the run."""
    from .properties.conformance.reports import headline, summary, worker_reports, write_reports
    from .properties.conformance.runner import fixed, unexpected

    table = RichTable(title=f"conformance: {label}")
    for col in ("case", "grade", "verdict", "lead finding / reason"):
        table.add_column(col, overflow="fold")
    for r in sorted(results, key=lambda r: (not r.failed, r.verdict.value == "SKIP", r.case.id)):
        lead = r.lead
        table.add_row(r.case.id, r.case.grade.value, f"[{_STYLE[r.verdict.value]}]{r.verdict.value}[/]",
                      f"{lead.symptom or lead.invariant} ({r.basis(lead).kind}: {r.basis(lead).ref})" if lead
                      else r.reason)
    console.print(table)
    said = headline(results, label, policy.grading)
    if report_dir is not None:
        for path in write_reports(results, label, report_dir, diagrams_dir=default_diagrams_dir(),
                                  wall_s=time.monotonic() - t0, grading=policy.grading,
                                  workers=worker_reports(report_dir, policy.workers)):
            console.print(f"wrote {path}")
        if policy.workers:
            from .properties.conformance.attribution import split_line
            from .properties.conformance.reports import read_report

            split = split_line(read_report.__wrapped__(report_dir / "report.json")["attribution"])
            said += f"\nbehind a gateway: {split}"
    for r in fixed(results, policy.known):
        console.print(f"[yellow]{r.case.id} is listed as a known failure but passed: update the --expect file[/]")
    console.print(said, markup=False, soft_wrap=True)  # last, where a reader of a terminal or a CI log looks first
    if summary(results, policy.grading)["partial_run"] and not policy.partial_ok:
        console.print("[red]most cases could not run, so this run did not judge the engine (exit 3; "
                      "--partial-ok accepts it)[/]")
        sys.exit(PARTIAL_RUN_EXIT)
    bad = unexpected(results, policy.known, strict=policy.strict)
    if bad:
        console.print(f"[red]{len(bad)} result(s) fail the run: {', '.join(r.case.id for r in bad)}[/]")
        sys.exit(1)
