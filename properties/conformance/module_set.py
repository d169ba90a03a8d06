"""An engine of your own (`--engine module:factory` or an entry point) on a set of forced checkpoints.

As `--launch` starts a server per checkpoint, `run_module_set` calls the factory once per
checkpoint folder (`checkpoint=`, a contract.Checkpoint) and runs the cases compiled into it; one
list of results comes back, in case order, for one report. A factory that raises on a checkpoint
makes every case of that checkpoint an ERROR carrying what it raised (the run fails), never n/a; a
case that no loaded checkpoint holds is n/a with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from .adapters import EngineLoadError, built, factory_of
from .cases import Case
from .checkpoints import Checkpoint, group_of, http_blocker
from .runner import CaseResult, Verdict, run_cases

BUILT_IN = ("reference", "hf", "decode-stream", "openai")  # the --engine kinds that are no factory of yours


def is_module_engine(spec: str) -> bool:
    """Whether an --engine value names a factory (`module:factory`, an entry point), not a built-in."""
    return spec.partition(":")[0] not in BUILT_IN


def run_module_set(cases: Sequence[Case], folders: Sequence[Path], spec: str, *, jobs: int = 1,
                   on_result: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Every case, run on the engine the factory of `spec` loads from the checkpoint it was compiled
    into (see module). An EngineSpecError (no such factory, or it returns no engine) is raised before
    any case runs on the checkpoint that shows it."""
    factory, args = factory_of(spec)
    done: dict[str, CaseResult] = {}

    def record(r: CaseResult) -> None:
        done[r.case.id] = r
        if on_result is not None:
            on_result(r)

    for folder in folders:
        ck = Checkpoint.load(folder)
        mine = [c for c in cases if c.id in ck.programs]
        if not mine:
            continue
        try:
            adapter = built(factory, args, spec, ck)
        except EngineLoadError as exc:
            for c in mine:
                record(CaseResult(c, f"{spec}[{ck.group}]", Verdict.ERROR, reason=str(exc)))
            continue
        done.update((r.case.id, r) for r in run_cases(adapter, mine, jobs=jobs, on_result=on_result))
    for c in cases:
        if c.id not in done:
            why = http_blocker(c)
            record(CaseResult(c, spec, Verdict.SKIP, reason=f"not compiled into a forced checkpoint: {why}" if why else
                              f"compiled into the {group_of(c)} checkpoint, which this run did not load"))
    return [done[c.id] for c in cases]
