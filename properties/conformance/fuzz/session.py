"""A fuzz run: batches of generated examples until the budget, then each distinct failure shrunk
and written as a case with its reproducer (`decodespec fuzz`).

`fuzz(engine, budget_s=..., seed=...)` draws batch k's examples from Hypothesis with the seed
(seed, k) (`draw_examples`: generation only, no database, so a seed gives the same examples) from
the engine's menu (batch.menu_of: the tokenizers it can serve, chat examples where it serves chat), runs
each batch on one engine start (batch.run_batch), and keeps the failures (FAIL or DIFFERS) by key
(shrink.failure_key: the lead finding's symptom and basis). Generation stops when GENERATE_SHARE of
the budget is spent (the whole budget while nothing failed); the smallest failing example of each
key is then shrunk (shrink.shrink_all) while the budget lasts, and each minimal example is filed
as a case (properties/cases' format, id `fuzz-minimal/<symptom>/NNN`, which sorts before the
generated `fuzz/...` in a report; expect = the reference's answer on its own tokenizer) and judged
again in one batch of them alone. `write_run` writes those cases and the report in `decodespec
conform`'s format, the minimal cases first, then the failures as generated, then
the examples the run could not judge (ERROR); a chat case's file also says the reference's split
answer (`case_json`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..adapters.base import case_prompt, case_script, case_tokenizer, reference_expect
from ..cases import Case, case_path, expect_to_json
from ..chat import expected_chat
from ..chat_cases import chat_of
from ..grading import DEFAULT_PROFILE
from ..runner import CaseResult, Verdict
from .batch import Engine, OnResult, judge_cases, menu_of, run_batch
from .shrink import Inputs, Key, Shrunk, failure_key, shrink_all, size
from .strategies import COMPLETIONS, Menu, case_of, examples

GENERATE_SHARE = 0.6  # of the budget spent generating; the rest shrinks
BATCH = 60  # examples a batch compiles into one checkpoint set
SHRINK_WIDTH = 30  # candidates per failure in a shrinking batch (the smallest first)


def draw_examples(n: int, seed: int, menu: Menu = COMPLETIONS) -> list[dict[str, Any]]:
    """Up to `n` distinct examples of `menu` (strategies.examples), the same for the same seed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    out: list[dict[str, Any]] = []

    @seeded(seed)
    @settings(max_examples=n, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(examples(menu))
    def collect(ex: dict[str, Any]) -> None:
        out.append(ex)

    collect()
    seen: dict[str, dict[str, Any]] = {}
    for ex in out:
        seen.setdefault(json.dumps(ex, sort_keys=True, ensure_ascii=False), ex)
    return list(seen.values())


@attrs.frozen
class FuzzRun:
    """What a run did: examples tried, batches (generation and shrinking), the failures as generated
    (one per key, the smallest), every failing result, the ERRORs, the shrunk failures."""

    seed: int
    engine: str
    examples: int
    batches: int
    failing: Mapping[Key, tuple[Inputs, CaseResult]]
    failures: int
    errors: tuple[CaseResult, ...]
    shrunk: tuple[Shrunk, ...]
    wall_s: float
    # each distinct minimal example filed as a case (fuzz-minimal/<symptom>/NNN) and judged again in one last
    # batch of them alone: the checkpoints a reproducer rebuilds from the case files
    minimal: tuple[tuple[Shrunk, CaseResult], ...] = ()


def fuzz(engine: Engine, workdir: Path, *, budget_s: float, seed: int = 0, batch: int = BATCH,
         menu: Menu | None = None, profile: str = DEFAULT_PROFILE,
         declared: frozenset[str] = frozenset(), on_result: OnResult = lambda r: None,
         say: Callable[[str], None] = lambda line: None, max_batches: int | None = None) -> FuzzRun:
    """Generate, run and shrink within `budget_s` seconds (see module); checkpoints are built under
    `workdir`. `menu`: what is drawn (default: the engine's, batch.menu_of). `say` gets a progress
    line per batch; `max_batches` bounds the generation batches."""
    drawn = menu or menu_of(engine)
    t0 = time.monotonic()

    def left() -> float:
        return budget_s - (time.monotonic() - t0)

    def run(exs: Sequence[Inputs], tag: str) -> Sequence[CaseResult]:
        return run_batch(exs, tag, engine, workdir / tag, profile=profile, declared=declared,
                         on_result=on_result).results

    failing: dict[Key, tuple[Inputs, CaseResult]] = {}
    errors: list[CaseResult] = []
    tried = failures = k = 0
    # generate until GENERATE_SHARE of the budget is spent, or all of it while nothing failed
    while (k == 0 or left() > (budget_s * (1 - GENERATE_SHARE) if failing else 0)) and (max_batches is None or k < max_batches):
        k += 1
        exs = draw_examples(batch, seed * 100_003 + k, drawn)
        results = run(exs, f"g{k:04d}")
        tried += len(exs)
        for ex, r in zip(exs, results):
            key = failure_key(r)
            if r.verdict is Verdict.ERROR:
                errors.append(r)
            elif key is not None:
                failures += 1
                if key not in failing or size(ex) < size(failing[key][0]):
                    failing[key] = (ex, r)
        say(f"batch {k}: {len(exs)} examples ({tried} in all), {failures} failing in {len(failing)} kind(s), "
            f"{len(errors)} error(s), {time.monotonic() - t0:.0f} s")
    shrunk = shrink_all([failing[key] for key in sorted(failing)], run, more=lambda: left() > 0, per_target=SHRINK_WIDTH,
                        on_round=lambda n, m: say(f"shrinking, round {n}: {m} failure(s) still shrinking, "
                                                  f"{time.monotonic() - t0:.0f} s")) if failing else []
    filed: list[tuple[Shrunk, Case]] = []
    seen: set[str] = set()
    for s in sorted(shrunk, key=lambda s: s.key):
        canon = json.dumps(s.minimal, sort_keys=True, ensure_ascii=False)
        if canon not in seen:  # two symptoms shrunk to one example: the first keeps it
            seen.add(canon)
            filed.append((s, filed_case(s, len(filed) + 1, seed, engine.label)))
    if filed:
        say(f"judging the {len(filed)} minimal case(s) again, alone, {time.monotonic() - t0:.0f} s")
    again = judge_cases([c for _, c in filed], engine, workdir / "minimal", profile=profile, declared=declared,
                        on_result=on_result) if filed else []
    return FuzzRun(seed, engine.label, tried, k + max((s.rounds for s in shrunk), default=0) + bool(filed), failing,
                   failures, tuple(errors), tuple(shrunk), time.monotonic() - t0,
                   tuple((s, r) for (s, _), r in zip(filed, again)))


def filed_case(s: Shrunk, number: int, seed: int, engine: str) -> Case:
    """The case of a minimal example: id fuzz-minimal/<symptom>/NNN, the reference's answer on its own
    tokenizer as `expect`, a description naming the symptom, the basis and how it was found."""
    symptom, kind, ref = s.key
    case_id = f"fuzz-minimal/{symptom.replace('_', '-')}/{number:03d}"
    lead = s.result.lead
    bare = case_of(case_id, s.minimal)
    tok = case_tokenizer(bare)
    exp = reference_expect(bare, tok, case_prompt(bare, tok), case_script(bare, tok))
    said = (f"Found by decodespec fuzz --seed {seed} against {engine}, shrunk in {s.rounds} round(s)"
            f"{'' if s.proved else ' (the budget ended before it was minimal)'}: {symptom} ({kind}: {ref}). "
            f"{lead.message if lead else ''}")
    return case_of(case_id, s.minimal, description=said[:1500],
                   expect={k: v for k, v in expect_to_json(exp).items() if k in ("output", "finish_reason")})


def case_json(case: Case) -> dict[str, Any]:
    """A minimal case's file: a chat case's `expect` also says the reference's split answer on its own
    tokenizer (content, reasoning, calls, wire finish reason), as the chat case files do."""
    out = case.to_json()
    if chat_of(case) is None:
        return out
    tok = case_tokenizer(case)
    exp = expected_chat(case, tok, case_prompt(case, tok), case_script(case, tok))
    split = {"content": exp.content, "reasoning": exp.reasoning,
             "tool_calls": [{"name": n, "arguments": a} for n, a in exp.calls], "finish_reason": exp.finish_reason}
    return {**out, "expect": {**out.get("expect", {}), "chat": split}}


def write_run(run: FuzzRun, out: Path, *, profile: str = DEFAULT_PROFILE,
              declared: frozenset[str] = frozenset()) -> list[Path]:
    """The minimal cases under out/cases (properties/cases' layout), the report (reports.write_reports:
    the minimal cases as judged alone first, then the failures as generated, then the ERRORs) and
    fuzz.json (the run's figures) under `out`; the paths written. A minimal case's reproducer builds
    its checkpoint from out/cases (`decodespec checkpoints build --cases`), as the run compiled it."""
    from ....checkout import default_diagrams_dir
    from ..reports import Grading, write_reports

    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    minimal: list[CaseResult] = []
    for _, r in run.minimal:
        path = case_path(r.case.id, out / "cases")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(case_json(r.case), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        paths.append(path)
        minimal.append(attrs.evolve(r, case=attrs.evolve(r.case, path=path), observed=_built_from(r.observed, out / "cases")))
    generated = [r for _, r in (run.failing[k] for k in sorted(run.failing))]
    grading = Grading(profile, declared)
    paths += write_reports([*minimal, *generated, *run.errors], run.engine, out, diagrams_dir=default_diagrams_dir(),
                           wall_s=run.wall_s, grading=grading)
    figures = {
        "seed": run.seed, "engine": run.engine, "examples": run.examples, "batches": run.batches,
        "failures": run.failures, "kinds": len(run.failing), "errors": len(run.errors),
        "wall_seconds": round(run.wall_s, 1),
        "minimal": [{"key": list(s.key), "case": r.case.id, "rounds": s.rounds, "proved": s.proved,
                     "verdict_alone": r.verdict.value, "lead_alone": r.lead.symptom if r.lead else None,
                     "size_from": list(size(s.original)), "size_to": list(size(s.minimal))}
                    for s, r in run.minimal],
    }
    (out / "fuzz.json").write_text(json.dumps(figures, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return [*paths, out / "fuzz.json"]


def _built_from(observed: Mapping[str, Any], cases: Path) -> dict[str, Any]:
    """`observed` with its server's checkpoint saying the case files it was compiled from."""
    server = dict(observed.get("server") or {})
    if server.get("checkpoint"):
        server["checkpoint"] = {**server["checkpoint"], "cases": str(cases)}
    return {**observed, "server": server or None}
