"""`decodespec fuzz`: generated script cases against an engine, each failure shrunk to a minimal case.

    decodespec fuzz --preset decodespec-serve --budget 10m --seed 1
    decodespec fuzz --preset vllm --budget 15m --out reports/fuzz/vllm
    decodespec fuzz --launch "decodespec serve --port {port} --model {model}" --budget 2m
    decodespec fuzz --engine reference --budget 1m        # decodespec serve's app in this process
    decodespec fuzz --engine my_engine:make --budget 5m   # an engine of your own (adapter contract)
    decodespec fuzz --preset vllm --against reports/vllm --against reports/vllm-align
    decodespec refound reports/fuzz/vllm --against reports/vllm --against reports/vllm-align

Batches of examples drawn from the seed are compiled into forced checkpoints and judged on one
engine start each, by the judge of `decodespec conform` (properties/conformance/fuzz). The minimal
cases go to OUT/cases, the report (conform's format, minimal cases first) and fuzz.json to OUT.
Exit status 1 when any example failed or could not be judged, 0 when none did, 2 for bad usage.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from .cli_paths import output_folder
from .properties.conformance.decisions import DECISIONS
from .properties.conformance.grading import DEFAULT_PROFILE, PROFILES
from .properties.conformance.without import WITHOUT

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}
_REPORT = click.Path(exists=True, path_type=Path)


def parse_budget(text: str) -> float:
    """'90', '90s', '10m', '1h' -> seconds; a clear error otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if m is None or float(m.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is no duration: a positive number with s, m or h (10m, 90s)",
                                 param_hint="--budget")
    return float(m.group(1)) * _UNITS[m.group(2)]


@click.command()
@click.option("--preset", default=None, metavar="NAME", help="Start this engine preset on each batch's checkpoints "
                                                            "(decodespec conform --list-presets).")
@click.option("--presets", "presets_files", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="More presets, in presets.toml's format.")
@click.option("--launch", default=None, metavar="CMD", help="Start a server per checkpoint with CMD ({model}, {gguf}, "
                                                           "{name}, {port} filled in), as conform --launch does.")
@click.option("--engine", default=None, help="reference (decodespec serve's app in this process) | module:factory "
                                             "(an engine of your own, the adapter contract).")
@click.option("--llama-cpp", "llama_cpp", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="With a llama.cpp preset: the llama.cpp checkout whose converter writes the GGUF files.")
@click.option("--budget", default="10m", show_default=True, help="How long to generate and shrink (10m, 90s, 1h).")
@click.option("--seed", default=0, show_default=True, type=int, help="The examples drawn; the same seed, the same run.")
@click.option("--batch", "batch", default=60, show_default=True, type=click.IntRange(1, 999),
              help="Examples compiled into one checkpoint set and judged on one engine start.")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=None, callback=output_folder,
              help="Where the minimal cases, the report and fuzz.json go (default reports/fuzz/NAME).")
@click.option("--name", default=None, help="Engine name shown in the report.")
@click.option("--model", default=None, help="The model name requests carry (default: the first of /v1/models).")
@click.option("--without", "without", multiple=True, type=click.Choice(list(WITHOUT)),
              help="A request field or parser the server does not have (its examples are n/a).")
@click.option("--profile", type=click.Choice(list(PROFILES)), default=DEFAULT_PROFILE, show_default=True,
              help="As conform's: chapter judges the chapter alone, project also this project's decisions.")
@click.option("--declare", "declared", multiple=True, type=click.Choice(list(DECISIONS)), metavar="DNN",
              help="A decision on which the engine documents its own choice (as conform --declare).")
@click.option("-j", "--jobs", default=None, type=click.IntRange(1, 64), help="Cases run at once (default: the preset's, else 1).")
@click.option("--against", "against", multiple=True, type=_REPORT,
              help="A committed report of the engine (its folder or report.json): OUT/refound.md says which of its "
                   "text and ending deviations the run found again.")
def fuzz(preset: str | None, presets_files: tuple[Path, ...], launch: str | None, engine: str | None,
         llama_cpp: Path | None, budget: str, seed: int, batch: int, out: Path | None, name: str | None,
         model: str | None, without: tuple[str, ...], profile: str, declared: tuple[str, ...], jobs: int | None,
         against: tuple[Path, ...]) -> None:
    """Generate script cases, judge ENGINE on them as conform does, shrink each failure (§4.3-§4.10)."""
    seconds = parse_budget(budget)
    committed = [_loaded(p) for p in against]  # a bad report is refused before the run
    given = [n for n, v in (("--preset", preset), ("--launch", launch), ("--engine", engine)) if v is not None]
    if len(given) != 1:
        raise click.UsageError("give one of --preset NAME, --launch CMD or --engine reference|module:factory"
                               + (f" (got {', '.join(given)})" if given else ""))
    from .properties.conformance.fuzz.batch import InProcess, Launched, Module
    from .properties.conformance.fuzz.session import fuzz as run_fuzz
    from .properties.conformance.fuzz.session import write_run

    decl = frozenset(declared)
    runner: InProcess | Launched | Module
    if preset is not None:
        from .properties.conformance import presets as ps

        try:
            p = ps.find(ps.load_presets(presets_files), preset)
        except ps.PresetError as exc:
            raise click.BadParameter(str(exc), param_hint="--preset") from None
        path = ps.engine_path()
        if (why := p.missing(path)) is not None:
            raise click.BadParameter(why, param_hint="--preset")
        label = name or p.name
        decl |= frozenset(p.declare)

        def prepare(folders: list[Path]) -> list[Path]:
            try:
                return ps.convert_gguf(folders, p, llama_cpp, lambda line: click.echo(f"fuzz: {line}", err=True))
            except ps.PresetError as exc:
                raise click.BadParameter(str(exc), param_hint="--llama-cpp") from None

        runner = Launched(p.launch, ps.cache_root() / "logs" / f"fuzz-{label}", label=label,
                          without=frozenset(without) | set(p.without), jobs=jobs or p.jobs,
                          model=model or p.model or None, gguf=p.gguf_file or "model.gguf",
                          env={**os.environ, "PATH": path}, prepare=prepare if p.gguf_file else None,
                          chat=p.cases == "chat")
    elif launch is not None:
        from .properties.conformance.presets import cache_root

        label = name or "launched"
        runner = Launched(launch, cache_root() / "logs" / f"fuzz-{label}", label=label, without=frozenset(without),
                          jobs=jobs or 1, model=model)
    elif engine == "reference":
        label = name or "decodespec-serve-in-process"
        runner = InProcess(label=label, jobs=jobs or 4)
    else:
        from .properties.conformance.adapters import is_module_engine

        if engine is None or not is_module_engine(engine):
            raise click.BadParameter(f"{engine!r}: reference or module:factory (HTTP engines: --preset or --launch)",
                                     param_hint="--engine")
        label = name or engine.replace(":", "-")
        runner = Module(engine, label=label, jobs=jobs or 1)
    folder = out or Path("reports") / "fuzz" / label
    from .properties.conformance.presets import cache_root

    work = cache_root() / "fuzz" / f"{label}-{seed}"
    t0 = time.monotonic()

    def say(line: str) -> None:
        click.echo(f"fuzz {label}: {line}", err=True)

    marks = {"PASS": ".", "FAIL": "F", "DIFFERS": "D", "ERROR": "E", "SKIP": "s"}

    def tick(r) -> None:
        sys.stderr.write(marks[r.verdict.value])
        sys.stderr.flush()

    # SIGTERM ends the run as Ctrl-C does: the server a batch started is stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    say(f"seed {seed}, budget {seconds:.0f} s, batches of {batch}; checkpoints under {work}")
    def progress(line: str) -> None:  # after a batch's marks
        sys.stderr.write("\n")
        say(line)

    run = run_fuzz(runner, work, budget_s=seconds, seed=seed, batch=batch, profile=profile, declared=decl,
                   on_result=tick, say=progress)
    for written in write_run(run, folder, profile=profile, declared=decl):
        click.echo(f"wrote {written}")
    if committed:
        click.echo(f"wrote {_write_refound(folder, committed)}")
    click.echo(f"fuzz {label}: {run.examples} examples in {run.batches} batches, {run.failures} failing in "
               f"{len(run.failing)} kind(s) (symptom and basis), {len(run.shrunk)} shrunk, {len(run.errors)} not "
               f"judged (ERROR), {time.monotonic() - t0:.0f} s; seed {seed}")
    if run.failures or run.errors:
        sys.exit(1)


def _loaded(path: Path) -> tuple[str, Mapping[str, Any]]:
    """(path, report) of a report folder or report.json; a clear usage error when it is none."""
    from .properties.conformance.fuzz.refound import RefoundError, load

    try:
        return str(path), load(path)
    except RefoundError as exc:
        raise click.BadParameter(str(exc), param_hint="--against") from None


def _write_refound(run: Path, committed: list[tuple[str, Mapping[str, Any]]]) -> Path:
    """RUN/refound.md: the fuzz run in RUN against the committed reports (fuzz/refound.py)."""
    from .properties.conformance.fuzz.refound import compare, render

    out = run / "refound.md"
    out.write_text(render(compare(_loaded(run), committed)), encoding="utf-8")
    return out


@click.command()
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--against", "against", multiple=True, required=True, type=_REPORT,
              help="A committed report of the engine (its folder or report.json); give each one.")
def refound(run: Path, against: tuple[Path, ...]) -> None:
    """Which text and ending deviations of the committed reports the fuzz run in RUN (decodespec fuzz's
    --out) found again, and what it found that they do not show: RUN/refound.md (§4.3-§4.10)."""
    click.echo(f"wrote {_write_refound(run, [_loaded(p) for p in against])}")
