"""`decodespec checkpoints`: compile the script cases into forced checkpoints for real engines
(docs/checkpoints.md).

    decodespec checkpoints build --out .cache/checkpoints        # one folder per tokenizer group
    decodespec checkpoints build --out DIR --select stop/ --no-prove
    decodespec checkpoints list .cache/checkpoints               # what each folder forces
    decodespec checkpoints stamp                                 # the name of this checkout's built set
"""

from __future__ import annotations

from pathlib import Path

import click

from .cli_paths import output_folder


@click.group()
def checkpoints() -> None:
    """Forced-script Llama checkpoints that any engine loads; greedy decoding follows each case."""


@checkpoints.command("build")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path(".cache/checkpoints"),
              callback=output_folder,
              show_default=True, help="Folder to write one checkpoint per tokenizer group into.")
@click.option("--select", "select", multiple=True, help="Only cases whose id starts with this prefix (repeatable).")
@click.option("--group", "groups", multiple=True,
              help="Only this checkpoint group (byte_table, byte_level_bpe, ...): what a reproducer rebuilds.")
@click.option("--prove/--no-prove", default=True, show_default=True,
              help="Run transformers generate on every program in float32, bfloat16 and float16 and refuse a "
                   "checkpoint that deviates in any.")
@click.option("--cases", "cases_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The case files under this folder instead of the suite's, compiled as `decodespec fuzz` compiles "
                   "its minimal cases (no chat variants, no long program): what a fuzz reproducer rebuilds.")
def build(out_dir: Path, select: tuple[str, ...], groups: tuple[str, ...], prove: bool, cases_dir: Path | None) -> None:
    """Build the checkpoints of every script case that can run over HTTP."""
    from .properties.conformance import checkpoints as ck
    from .properties.conformance.cases import CaseError, load_cases, select_cases

    try:  # the chat variants of the selected cases compile into their own groups
        cases = (select_cases(load_cases(folder=cases_dir), select) if cases_dir is not None
                 else ck.with_chat(select_cases(load_cases(), select)))
    except CaseError as exc:
        raise click.BadParameter(f"{exc} (select a chapter case: its chat variants are built with it)",
                                 param_hint="--select") from None
    if groups:
        known = sorted({ck.group_of(c) for c in cases if c.kind.value == "script"})
        if bad := sorted(set(groups) - set(known)):
            raise click.BadParameter(f"no checkpoint group {', '.join(bad)}; groups: {', '.join(known)}",
                                     param_hint="--group")
        cases = [c for c in cases if c.kind.value == "script" and ck.group_of(c) in groups]
    try:
        built = ck.build_checkpoints(cases, out_dir, chat=False,  # `cases` holds the chat variants already
                                     long=cases_dir is None)
    except CaseError as exc:
        raise click.ClickException(str(exc)) from None
    for c in built:
        margins = ", ".join(f"{d} {m['logit']:.1f} (gate {m['gate']:.2f})" for d, m in c.margins.items())
        line = (f"{c.folder}: {len(c.programs) - 1} case(s) + the recipe program; sha256 {ck.digest(c.folder)}; "
                f"logit margins {margins}")
        if prove:
            try:
                line += f"; proved: {ck.prove(c)}"
            except ck.ProofError as exc:
                raise click.ClickException(f"{c.folder} is not usable: {exc}") from None
        click.echo(line)
    blocked = [(c.id, ck.http_blocker(c)) for c in cases if c.kind.value == "script" and ck.http_blocker(c)]
    for cid, why in blocked:
        click.echo(f"not compiled: {cid}: {why}")


@checkpoints.command("list")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
def list_(folder: Path) -> None:
    """Show the case -> prompt ids -> script ids mapping of each checkpoint under FOLDER."""
    from .properties.conformance import CaseError
    from .properties.conformance.checkpoints import MANIFEST, Checkpoint, checkpoint_folders

    found = checkpoint_folders(folder)
    if not found:
        raise click.ClickException(f"no forced checkpoint ({MANIFEST}) under {folder}")
    for sub in found:
        try:
            c = Checkpoint.load(sub)
        except CaseError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"{sub} ({c.group}, eos {c.eos_id}, anchor {c.anchor}; prefix probe: prompt {list(c.probe.prompt)} "
                   f"-> echo {list(c.probe.echo)})")
        for cid, p in c.programs.items():
            click.echo(f"  {cid}: prompt {list(p.prompt)} -> script {list(p.script)}")


@checkpoints.command("digest")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
def digest_(folder: Path) -> None:
    """Print a checkpoint's content hash (the one its reports name)."""
    from .properties.conformance.checkpoints import MANIFEST, digest

    if not (folder / MANIFEST).is_file():
        raise click.ClickException(f"{folder} is not a forced checkpoint ({MANIFEST} is missing)")
    click.echo(digest(folder))


@checkpoints.command("stamp")
def stamp() -> None:
    """Print the name of this checkout's set of checkpoints: a hash of what decides them (the cases and
    the construction, without comments, docstrings or annotations), under which the preset runs and
    scripts/peers/checkpoints.sh keep a built set."""
    from .properties.conformance.presets import set_stamp

    click.echo(set_stamp())
