"""An engine of your own (`--engine module:factory` or an entry point) on a set of forced checkpoints.

As `--launch` starts a server per checkpoint, a ModuleSet calls the factory once per checkpoint
folder (`checkpoint=`, a contract.Checkpoint) and runs on it the cases compiled into it; a case
with a context limit runs on the engine loaded again with the context length it needs
(`Checkpoint.context_length`, D10), as `--launch-context` starts a server of its own. A factory
that raises on a checkpoint, or an engine that says a context length the contract cannot take,
makes every case it was to run an ERROR carrying what went wrong (the run fails, the other
checkpoints' cases run), never n/a; a case that no checkpoint of the set holds is n/a with the reason.
`run_module_set` runs a list of cases for one report (`decodespec conform`); the pytest plugin runs
a ModuleSet one case at a time, its items in `order`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import groupby
from pathlib import Path

from .adapters import Adapter, EngineLoadError, built, factory_of
from .cases import Case
from .checkpoints import Checkpoint, group_of, http_blocker, served_context
from .runner import CaseResult, Verdict, run_case, run_cases

# Where a case runs: the index of its checkpoint in the set and the context length to load it with
# (None: the engine's own).
Place = tuple[int, int | None]


class ModuleSet:
    """The factory an --engine value names over the checkpoints at `folders` (see module). One
    engine is loaded at a time: the one for the place of the case run last (the engine before it
    is let go first). An EngineSpecError (no such factory, or one that returns no engine) is raised
    when the ModuleSet is made or an engine is loaded, before any case runs on it."""

    def __init__(self, spec: str, folders: Sequence[Path]) -> None:
        self.spec = spec
        self.factory, self.args = factory_of(spec)
        self.checkpoints = [Checkpoint.load(f) for f in folders]
        self._loaded: tuple[Place, Adapter | str] | None = None

    def place(self, case: Case) -> Place | None:
        """The checkpoint `case` was compiled into, among the set's, and its context length (D10);
        None where no checkpoint of the set holds it."""
        i = next((i for i, ck in enumerate(self.checkpoints) if case.id in ck.programs), None)
        return None if i is None else (i, served_context(case, self.checkpoints[i]))

    def order(self, cases: Sequence[Case]) -> list[Case]:
        """`cases` in the order that loads each engine once: by checkpoint, then context length,
        those of no checkpoint last (the original order within each)."""
        def key(c: Case) -> tuple[int, int]:
            p = self.place(c)
            return (len(self.checkpoints), 0) if p is None else (p[0], p[1] or 0)
        return sorted(cases, key=key)

    def engine(self, place: Place) -> Adapter | str:
        """The engine loaded for `place`, or the message of the EngineLoadError its load raised
        (kept: a factory that failed on a place is not called again for it)."""
        if self._loaded is None or self._loaded[0] != place:
            self._loaded = None
            ck = self.checkpoints[place[0]]
            try:
                got: Adapter | str = built(self.factory, self.args, self.spec, ck, context=place[1])
            except EngineLoadError as exc:
                got = str(exc)
            self._loaded = (place, got)
        return self._loaded[1]

    def run(self, case: Case) -> CaseResult:
        """`case` on the engine of its place: its result, an ERROR where the factory raised, n/a
        where no checkpoint of the set holds it."""
        place = self.place(case)
        if place is None:
            why = http_blocker(case)
            return CaseResult(case, self.spec, Verdict.SKIP, reason=f"not compiled into a forced checkpoint: {why}"
                              if why else f"compiled into the {group_of(case)} checkpoint, which this run did not load")
        got = self.engine(place)
        if isinstance(got, str):
            return CaseResult(case, f"{self.spec}[{self.checkpoints[place[0]].group}]", Verdict.ERROR, reason=got)
        return run_case(got, case)


def run_module_set(cases: Sequence[Case], folders: Sequence[Path], spec: str, *, jobs: int = 1,
                   on_result: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Every case, run on the engine the factory of `spec` loads for it (ModuleSet; the cases of
    one engine on `jobs` threads); one list of results, in case order, for one report."""
    engines = ModuleSet(spec, folders)
    done: dict[str, CaseResult] = {}
    for place, batch in groupby(engines.order(cases), key=engines.place):
        todo = list(batch)
        got = None if place is None else engines.engine(place)
        if got is None or isinstance(got, str):  # no engine: each case n/a, or an ERROR with what the factory raised
            results = [engines.run(c) for c in todo]
            for r in results:
                if on_result is not None:
                    on_result(r)
        else:
            results = run_cases(got, todo, jobs=jobs, on_result=on_result)
        done.update((r.case.id, r) for r in results)
    return [done[c.id] for c in cases]
