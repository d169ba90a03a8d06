"""The `decodespec` command line (click): the tables, their diagrams, and the commands of other modules.

    decodespec spec validate [--file PATH]...   load and validate tables, print their sizes
    decodespec spec show NAME                   a table as Markdown (§4.1 ... §4.10 anchors per row)
    decodespec diagrams [--out DIR]             write DOT, SVG and Mermaid of the six machines
    decodespec codegen [--check]                write the §4.3 step into runtime/runner.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table as RichTable

from . import __version__
from .checkout import default_diagrams_dir
from .cli_bench import bench
from .cli_check import check
from .cli_checkpoints import checkpoints
from .cli_conform import conform
from .cli_fuzz import fuzz, refound
from .cli_generate import experiment, generate
from .cli_paths import output_folder
from .cli_serve import serve
from .spec import MACHINES, DecisionKind, SpecError, Table, load_file, load_spec


@click.group()
@click.version_option(__version__, prog_name="decodespec")
def main() -> None:
    """decodespec: executable semantics of the LLM decode loop (seed chapter 4)."""


@main.group()
def spec() -> None:
    """Inspect and validate the transition tables in spec/."""


@spec.command()
@click.option(
    "--file",
    "files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Validate this table file instead of the shipped ones (repeatable).",
)
def validate(files: tuple[Path, ...]) -> None:
    """Validate the shipped tables (or --file ones); exit 1 with the error on a broken table."""
    tables = []
    try:
        for source in files or MACHINES:
            tables.append(load_file(source) if files else load_spec(source))
    except SpecError as exc:
        click.echo(f"invalid table: {exc}", err=True)
        sys.exit(1)
    Console(width=100).print(_summary(tables))
    click.echo(f"{len(tables)} table(s) valid")


@spec.command()
@click.argument("name", type=click.Choice(MACHINES))
def show(name: str) -> None:
    """Print table NAME as Markdown: decided pairs, then rejections per state."""
    click.echo(to_markdown(load_spec(name)), nl=False)


@main.command()
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    callback=output_folder,
    help="Output folder (default: diagrams/ of the checkout you are in, else ./diagrams).",
)
@click.option(
    "--format",
    "formats",
    multiple=True,
    type=click.Choice(["dot", "svg", "mmd"]),
    default=("dot", "svg", "mmd"),
    show_default=True,
    help="dot, svg, and mmd (a Mermaid stateDiagram).",
)
def diagrams(out: Path | None, formats: tuple[str, ...]) -> None:
    """Render every machine's diagram (terminal states double, anchors and finish reasons on edges,
    ignored events as dashed loops)."""
    from .machine.diagrams import GraphvizMissing, render_all

    try:
        written = render_all(out or default_diagrams_dir(), formats=formats)
    except GraphvizMissing as exc:
        raise click.ClickException(str(exc)) from exc
    for path in written:
        click.echo(str(path))


@main.command()
@click.option("--check", is_flag=True, help="Write nothing; exit 1 when runtime/runner.py's step differs from what "
                                            "would be written.")
def codegen(check: bool) -> None:
    """Write the step of §4.3 (check_point and select for every order of the lifecycle table's
    [[step]] the loader accepts) into runtime/runner.py from the phases of runtime/stepgen.py."""
    from .runtime import stepgen

    if check:
        if stepgen.current() != stepgen.block():
            raise click.ClickException(f"{stepgen.RUNNER}: its step differs from runtime/stepgen.py's phases; "
                                       "run `decodespec codegen`")
        click.echo(f"{stepgen.RUNNER}: up to date")
        return
    click.echo(f"{stepgen.RUNNER}: {'written' if stepgen.write() else 'up to date'}")


def to_markdown(table: Table) -> str:
    """One line per decided (state, event) pair (rows and ignores), then rejections per state."""
    params = "".join(f" · {k}: {_cell(v)}" for k, v in table.params.items())
    lines = [
        f"# {table.name} ({table.anchor})",
        "",
        f"spec_version {table.spec_version} · initial {table.initial} · "
        f"terminal {', '.join(table.terminal)}{params}",
        "",
        "| state | event | decision | target | action | reason | anchor | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in table.decisions.values():
        if d.allowed:
            cells = (d.state, d.event, d.kind.value, d.target, d.action, d.reason, d.anchor, d.note)
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", "## Rejections", ""]
    for state in table.states:
        groups: dict[str, list[str]] = {}
        for e in table.events:
            d = table.decision(state, e)
            if d.kind is DecisionKind.REJECT:
                groups.setdefault(d.note, []).append(e)
        for note, events in groups.items():
            reason = f": {note}" if note else ""
            lines.append(f"- **{state}**: {', '.join(f'`{e}`' for e in events)}{reason}")
    return "\n".join(lines) + "\n"


def _summary(tables: list[Table]) -> RichTable:
    out = RichTable(title="decodespec tables")
    for col in ("machine", "anchor", "version", "states", "events", "rows", "ignores", "rejects"):
        out.add_column(col, justify="left" if col in ("machine", "anchor") else "right")
    for t in tables:
        counts = {k: 0 for k in DecisionKind}
        for d in t.decisions.values():
            counts[d.kind] += 1
        out.add_row(
            t.name, t.anchor, str(t.spec_version), str(len(t.states)), str(len(t.events)),
            *(str(counts[k]) for k in (DecisionKind.ROW, DecisionKind.IGNORE, DecisionKind.REJECT)),
        )
    return out


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    return str(value).replace("|", "\\|")


# --- Commands of other modules -------------------------------------------------------------
# Each lives in its own module decodespec/cli_<name>.py, imported above, and is added here.
main.add_command(generate)
main.add_command(experiment)
main.add_command(conform)
main.add_command(fuzz)
main.add_command(refound)
main.add_command(serve)
main.add_command(check)
main.add_command(bench)
main.add_command(checkpoints)
