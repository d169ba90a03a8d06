"""`decodespec bench`: run the benchmarks of benchmarks/ and print their figures (docs/performance.md).

Each benchmark is a file `benchmarks/bench_<name>.py` with `run(...) -> dict`; it times its
contenders side by side (several rounds, medians with spreads; benchmarks/common.py). The folder
is not part of the installed package, so the files are loaded by path from the checkout (or
`--dir`). A benchmark may define `QUICK`, the keyword arguments of a small run (`--quick`);
without it `--quick` only sets one round. A missing file is skipped with a note.

    decodespec bench [NAME...] [--rounds N] [--json FILE] [--quick] [--dir DIR]
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import click
from rich.console import Console
from rich.table import Table as RichTable

from .cli_paths import output_file

BENCHMARKS = ("framework", "stop", "detok", "stepper", "checker", "engine", "overlap", "server")


def default_folder() -> Path:
    """benchmarks/ of the checkout this package was installed from (editable), else ./benchmarks."""
    here = Path(__file__).resolve().parents[1] / "benchmarks"
    return here if here.is_dir() else Path.cwd() / "benchmarks"


def load_benchmark(name: str, folder: Path) -> ModuleType | None:
    """Import `folder/bench_<name>.py` (None when there is no such file). The folder goes on
    sys.path first, as when the file is run as a script, so `from common import ...` works."""
    path = folder / f"bench_{name}.py"
    if not path.is_file():
        return None
    module = load_file(path)
    if not callable(getattr(module, "run", None)):
        raise click.ClickException(f"{path} has no run() function")
    return module


def load_file(path: Path) -> ModuleType:
    """Import the script at `path` as a module, its folder first on sys.path (as when run)."""
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"decodespec_bench_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise click.ClickException(f"{path}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_arguments(module: ModuleType, rounds: int | None, quick: bool) -> dict[str, Any]:
    """Keyword arguments for `module.run`: its QUICK ones under --quick, then --rounds; only those
    its signature takes."""
    kwargs: dict[str, Any] = dict(getattr(module, "QUICK", {"rounds": 1})) if quick else {}
    if rounds is not None:
        kwargs["rounds"] = rounds
    params = inspect.signature(module.run).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def flatten(figures: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) rows; a timing stat (a dict with a median) stays one row."""
    rows: list[tuple[str, Any]] = []
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and "median" not in value:
            rows += flatten(value, f"{name}.")
        else:
            rows.append((name, value))
    return rows


def cell(value: Any) -> tuple[str, str]:
    """(median or value, spread) as text."""
    if isinstance(value, dict):
        spread = value.get("spread_pct")
        return _number(value["median"]), "" if spread is None else f"{spread:.0f}%"
    if isinstance(value, (list, tuple)):
        text = ", ".join(map(str, value))
        return (text if len(text) <= 60 else text[:57] + "..."), ""
    return _number(value), ""


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(name: str, figures: dict[str, Any], seconds: float) -> RichTable:
    out = RichTable(title=f"bench {name} ({seconds:.1f} s)", title_justify="left")
    out.add_column("figure")
    out.add_column("median / value", justify="right")
    out.add_column("spread (max-min)/median", justify="right")
    for key, value in flatten(figures):
        out.add_row(key, *cell(value))
    return out


@click.command()
@click.argument("names", nargs=-1)
@click.option("--rounds", type=click.IntRange(min=1), default=None, help="Rounds per benchmark (default: its own).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              callback=output_file,
              help="Also write every result to this JSON file.")
@click.option("--quick", is_flag=True, help="Small sizes and one round (a smoke run, not a measurement).")
@click.option("--dir", "folder", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="The benchmarks folder (default: benchmarks/ of this checkout).")
def bench(names: tuple[str, ...], rounds: int | None, json_path: Path | None, quick: bool, folder: Path | None) -> None:
    """Run benchmarks NAME... (default: all) and print one table each: medians and spreads."""
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise click.UsageError(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    folder = (folder or default_folder()).resolve()
    console = Console(width=120)
    results: dict[str, Any] = {}
    failed = False
    for name in names or BENCHMARKS:
        module = load_benchmark(name, folder)
        if module is None:
            console.print(f"[yellow]bench {name}: skipped, {folder / f'bench_{name}.py'} does not exist[/]")
            results[name] = {"skipped": "no such file"}
            continue
        kwargs = run_arguments(module, rounds, quick)
        console.print(f"bench {name}: running ({', '.join(f'{k}={v}' for k, v in kwargs.items()) or 'full size'})")
        t0 = time.perf_counter()
        try:
            figures = module.run(**kwargs)
        except Exception as exc:  # one broken benchmark does not hide the others' figures
            failed = True
            console.print(f"[red]bench {name} failed: {type(exc).__name__}: {exc}[/]")
            results[name] = {"error": "".join(traceback.format_exception_only(exc)).strip()}
            continue
        seconds = time.perf_counter() - t0
        results[name] = {"arguments": kwargs, "seconds": seconds, "figures": figures}
        console.print(table(name, figures, seconds))
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
        click.echo(f"results written to {json_path}")
    if failed:
        sys.exit(1)
