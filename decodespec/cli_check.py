"""`decodespec check`: model-check the tables (machine/checker.py; docs/concepts.md, "How it is checked").

Exit status: 0 when there is no violation and every sometimes-property has a witness, 1 otherwise.
`--table FILE` replaces the shipped table of the same name by a modified one (a researcher's change
is checked before anyone writes engine code); `--draw DIR` renders the first counterexample as a
highlighted path on the diagram of each machine it passes through (steps numbered across machines,
each machine's last state filled red), `--witness NAME` a sometimes-property's witness. Ctrl-C
stops the search and says how far it got (exit 130, no verdict).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import attrs
import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable

from .cli_paths import output_folder
from .machine.checker_model import MAX_REQUESTS
from .spec import SpecError, load_file, load_spec

if TYPE_CHECKING:  # the checker (and numpy) load when the command runs, not for `decodespec --help`
    from .machine.checker import CheckReport, Counterexample
    from .machine.checker_channels import ChannelsReport
    from .machine.checker_overlap import OverlapReport


@click.command("check")
@click.option("--requests", type=click.IntRange(1, MAX_REQUESTS), default=1, show_default=True,
              help="1: one request; 2 or 3: requests sharing the batch's places (symmetry reduced).")
@click.option("--slots", type=click.IntRange(1, 4), default=1, show_default=True,
              help="Places in the batch (spec/sequence.toml: admission and resume take one).")
@click.option("--max-depth", type=click.IntRange(min=0), default=None, help="Stop the search at this depth.")
@click.option("--max-tokens", type=click.IntRange(1, 8), default=None,
              help="max_output_tokens of the model (default 2 for one request, 1 for several).")
@click.option("--policy", "policies", multiple=True, type=click.Choice(["pause", "buffer", "fail"]),
              help="Backpressure policies explored (repeatable; default pause+buffer, pause for several).")
@click.option("--table", "table_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A modified table file that replaces the shipped one of the same name (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--draw", "draw_dir", type=click.Path(file_okay=False), default=None, callback=output_folder,
              help="Render the first counterexample (or --witness) on the state diagrams into this folder.")
@click.option("--witness", "witness", default=None, metavar="NAME",
              help="With --draw: draw this sometimes-property's witness instead of a counterexample.")
def check(requests, slots, max_depth, max_tokens, policies, table_files, as_json, draw_dir, witness) -> None:
    """Exhaust the model of the §4.3 loop over the tables and report invariants, liveness, witnesses."""
    from .machine.checker import check as model_check
    from .machine.checker import default_config
    from .machine.checker_channels import check_channels
    from .machine.checker_overlap import check_overlap

    tables = {}
    for path in table_files:
        try:
            t = load_file(path)
        except SpecError as exc:
            raise click.BadParameter(str(exc), param_hint="--table") from None
        tables[t.name] = t
    channels = tables.pop("channels", None)  # checked on its own (machine/checker_channels.py)
    overlap = tables.pop("overlap", None)  # and so is the overlapped step (machine/checker_overlap.py)
    config = None
    if max_tokens is not None or policies:
        changes: dict[str, Any] = {}
        if max_tokens:
            changes["max_output_tokens"] = max_tokens
        if policies:
            changes["policies"] = tuple(policies)
        config = attrs.evolve(default_config(requests), **changes)
    if witness is not None and draw_dir is None:
        raise click.BadParameter("needs --draw DIR to draw into", param_hint="--witness")
    err = Console(stderr=True)
    seen = [0, 0]

    def progress(n: int, d: int) -> None:
        seen[:] = [n, d]
        bar.update(task, description=f"{n:,} states, depth {d}")

    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=err, transient=True, disable=as_json) as bar:
            task = bar.add_task("exploring", total=None)
            report = model_check(requests=requests, max_depth=max_depth, tables=tables or None, config=config,
                                 slots=slots, progress=progress)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except KeyboardInterrupt:
        err.print(f"interrupted after {seen[0]:,} states (depth {seen[1]}): the search was not finished, "
                  "so nothing is proved and no violation is claimed")
        sys.exit(130)
    split = check_channels(channels)
    ahead = check_overlap(overlap, requests=min(requests, 2))
    if as_json:
        click.echo(json.dumps({**report.to_json(), "channels": _channels_json(split), "overlap": _overlap_json(ahead)},
                              indent=2, ensure_ascii=False))
    else:
        _summary(report, Console())
        _channels_summary(split, Console())
        _overlap_summary(ahead, Console())
    if draw_dir is not None:
        if witness is not None:
            if witness not in report.witnesses:
                known = ", ".join(sorted(report.witnesses)) or "none"
                raise click.BadParameter(f"no witness {witness!r} was found; found: {known}", param_hint="--witness")
            paths = draw(report.witnesses[witness], tables, draw_dir, mark_end=False)
        elif report.violations:
            paths = draw(report.violations[0], tables, draw_dir)
        else:
            paths = []
            click.echo("no counterexample to draw (give --witness NAME to draw a witness)", err=True)
        for path in paths:
            click.echo(f"wrote {path}", err=True)
    sys.exit(0 if report.ok and split.ok and ahead.ok else 1)



def draw(cx: Counterexample, tables: dict, out_dir: str, *, mark_end: bool = True) -> list:
    """Render the path on the diagram of each machine of request 0 it touches, steps numbered
    globally; with `mark_end` each machine's state at the end of the path is filled red (where the
    violation stands)."""
    from .machine.diagrams import render
    from .spec import DecisionKind

    written = []
    for name in ("lifecycle", "stream", "stop_matcher", "detokenizer", "sequence"):
        path = cx.path(name)
        if path:
            table = tables.get(name) or load_spec(name)
            last = table.decision(*path[-1])
            end = last.target if last.kind is DecisionKind.ROW else path[-1][0]
            written += render(table, out_dir, highlight=path, numbers=cx.numbers(name), formats=("dot", "svg"),
                              violation=end if mark_end else None, stem=f"{'counterexample' if mark_end else 'witness'}_{cx.name}_{name}")
    return written


def _overlap_json(r: OverlapReport) -> dict:
    return {"requests": r.requests, "states": r.states, "ok": r.ok,
            "violations": [v.to_json() for v in r.violations], "witnesses": sorted(r.witnesses),
            "rows_never_fired": [list(p) for p in r.rows_never_fired]}


def _overlap_summary(r: OverlapReport, out: Console) -> None:
    """The overlapped step (spec/overlap.toml, D73), checked over every run of its requests."""
    verdict = "ok" if r.ok else "VIOLATED: " + ", ".join(f"{v.name} ({v.message})" for v in r.violations)
    out.print(f"overlap: {r.requests} request(s), {r.states:,} states, {verdict}; witnesses: "
              f"{', '.join(sorted(r.witnesses)) or 'none'}; rows never fired: {len(r.rows_never_fired)}")


def _channels_json(r: ChannelsReport) -> dict:
    return {"sequences": r.sequences, "states": r.states, "violations": [v.to_json() for v in r.violations],
            "rows_never_fired": [list(p) for p in r.rows_never_fired]}


def _channels_summary(r: ChannelsReport, out: Console) -> None:
    """The chat answer's split (spec/channels.toml), checked over every scanner sequence in bounds."""
    verdict = "ok" if r.ok else f"{len(r.violations)} violation(s)"
    out.print(f"channels: {r.sequences:,} answers, {r.states:,} states, {verdict}; rows never fired: "
              + (", ".join(f"({s}, {e})" for s, e in r.rows_never_fired) or "none"))
    for v in r.violations:
        out.print(f"  {v.name} ({v.anchor}): {v.message}\n    " + " -> ".join(v.labels))


def _summary(report: CheckReport, out: Console) -> None:
    t = RichTable(title=f"decodespec check: {report.requests} request(s)", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    cfg = report.config
    t.add_row("model", f"max_output_tokens {cfg.max_output_tokens}, policies {', '.join(cfg.policies)}, "
              f"{report.slots} place(s), preemptions {cfg.preemptions}, faults {', '.join(cfg.faults)}"
              + ("" if cfg.byte_choices else ", plain text"))
    t.add_row("states", f"{report.states:,}")
    t.add_row("transitions", f"{report.transitions:,}")
    t.add_row("depth", f"{report.max_depth}" + ("" if report.exhaustive else " (bounded: not exhaustive)"))
    t.add_row("time", f"{report.seconds:.2f} s")
    t.add_row("states/s", f"{report.states_per_s:,.0f}")
    t.add_row("violations", str(len(report.violations)))
    t.add_row("witnesses", f"{len(report.witnesses)} found, {len(report.missing_witnesses)} missing")
    never = {m: rows for m, rows in report.rows_never_fired.items() if rows}
    t.add_row("rows never fired", "none" if not never else "; ".join(
        f"{m}: " + ", ".join(f"({s}, {e})" for s, e in rows) for m, rows in never.items()))
    never = {m: pairs for m, pairs in report.ignores_never_fired.items() if pairs}
    t.add_row("ignores never fired", "none" if not never else "; ".join(
        f"{m}: " + ", ".join(f"({s}, {e})" for s, e in pairs) for m, pairs in never.items()))
    t.add_row("reasons never reached", ", ".join(report.reasons_never_reached) or "none")
    out.print(t)
    for name in report.missing_witnesses:
        out.print(f"[red]no witness[/red] for {name}: the pass may be vacuous")
    if report.requests == 1 and report.exhaustive and report.unexplored:
        out.print("[red]unexplored[/red]: the model never fired the rows or reached the reasons above, so the "
                  "pass says nothing about them (a new event or reason needs a step in machine/checker_model.py)")
    for v in report.violations:
        out.print(f"[red]violation[/red] {v.name} ({v.anchor}): {v.message}")
        out.print(v.text(), markup=False, highlight=False, soft_wrap=True)
