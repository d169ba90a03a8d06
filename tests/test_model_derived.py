"""Model-derived tests: checker paths replayed as concrete runs of generate().

machine/paths.py covers every decision and fault point the one-request model reaches (§4.3 loop,
§4.7-§4.10 environment); properties/model_derived.py turns each path into a ScriptedModel script,
a ByteTableTokenizer fixture, request parameters and a FaultPlan, runs generate() and projects the
trace onto the lifecycle, stream and resources tables. The projection must equal the path's steps
machine by machine (see that module's docstring for the exact definition).
"""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from decodespec.machine.checker_model import PARKED_CANCEL
from decodespec.machine.paths import ModelPath, covering_paths, is_model_run
from decodespec.properties import check_trace
from decodespec.properties import model_derived as md

REGRESSIONS = Path(__file__).parent / "regressions"


@pytest.fixture(scope="module")
def pathset():
    return md.derive_paths()


@pytest.fixture(scope="module")
def outcomes(pathset):
    """Every distinct derived path with its concrete run and the run's projection."""
    tok = md.tokenizer()
    out = []
    for path in pathset.distinct():
        run = md.concretize(path, tok)
        events, extra = md.execute(run, tok)
        out.append((path, run, events, md.project(events, extra)))
    return out


def _describe(path: ModelPath, run: md.ConcreteRun, mm: dict) -> str:
    lines = [f"target {path.target} policy={path.policy} script={run.script} faults={run.faults} "
             f"actions={run.actions}"]
    lines += [f"    {s.point:18} {s.label}" for s in path.steps]
    for m, (want, got) in mm.items():
        lines += [f"  {m}:", f"    path:    {want}", f"    runtime: {got}"]
    return "\n".join(lines)


def test_every_derived_run_refines_its_path(outcomes):
    """§4.3: for every covering path, the runtime's trace projects onto exactly the path's steps of
    the lifecycle, stream and each resource (no extra self-loop or ignore row, none missing)."""
    bad = [_describe(p, r, mm) for p, r, _, got in outcomes if (mm := md.mismatches(p, got))]
    assert not bad, f"{len(bad)} of {len(outcomes)} derived runs do not refine their path:\n" + "\n".join(bad)


def test_every_derived_trace_keeps_every_invariant(outcomes):
    """§4.12: the derived runs are ordinary runs: check_trace finds nothing in any of them."""
    tok = md.tokenizer()
    bad = {p.target: v for p, _, ev, _ in outcomes if (v := check_trace(ev, tokenizer=tok))}
    assert not bad, "\n".join(f"{t}: {[str(x) for x in v]}" for t, v in bad.items())


def test_every_reachable_row_is_covered_by_a_concrete_run(pathset, outcomes):
    """Every row of lifecycle, stream and resources that the model reaches is
    fired by at least one concrete run whose trace refines its path."""
    covered = set()
    for p, _, _, got in outcomes:
        if not md.mismatches(p, got):
            covered |= md.covered(got)
    rows = {t[1:] for t in pathset.reachable if t[0] == "row" and t[1] in md.COMPARED and t not in md.MODEL_ONLY}
    missing = sorted(rows - covered)
    per = collections.Counter(m for m, _, _ in rows)
    hit = collections.Counter(m for m, _, _ in rows & covered)
    summary = ", ".join(f"{m} {hit[m]}/{per[m]}" for m in md.COMPARED)
    assert not missing, f"rows reached by the model but by no concrete run ({summary}):\n" + \
        "\n".join(f"  {m}: {s} --{e}-->" for m, s, e in missing)
    assert set(per) == set(md.COMPARED)


def test_ignore_rows_are_covered_or_documented_model_only(pathset, outcomes):
    """§4.9/§4.7: ignore rows the model reaches are fired by a run, or named in MODEL_ONLY."""
    covered = set().union(*(md.covered(got) for _, _, _, got in outcomes))
    ignores = {t for t in pathset.reachable if t[0] == "ignore" and t[1] in md.COMPARED}
    missing = sorted(t for t in ignores if t[1:] not in covered and t not in md.MODEL_ONLY)
    assert not missing, f"ignore rows neither covered nor documented: {missing}"


def test_model_only_list_is_exactly_what_the_runtime_cannot_reach(pathset):
    """Nothing is skipped silently: the targets left unreached by realizable steps are exactly the
    documented MODEL_ONLY list, and each names a reason in UNREALIZABLE."""
    assert set(pathset.unreached) == set(md.MODEL_ONLY), (
        f"undocumented: {sorted(set(pathset.unreached) - set(md.MODEL_ONLY))}; "
        f"stale: {sorted(set(md.MODEL_ONLY) - set(pathset.unreached))}")
    assert set(md.MODEL_ONLY.values()) <= set(md.UNREALIZABLE)
    assert all(reason for _, reason in md.UNREALIZABLE.values())
    assert all(t in pathset.reachable for t in md.MODEL_ONLY)


def test_every_fault_point_has_a_refining_run(pathset, outcomes):
    """Every realizable fault point of the model (cancel, deadline, model error,
    transport error, reader, disconnect, reconnect at each loop point) has a path, and the FaultPlan
    actions used include every injectable kind (§4.9, §4.10)."""
    faults = {t for t in pathset.reachable if t[0] == "fault"}
    assert faults - set(md.MODEL_ONLY) <= set(pathset.paths)
    actions = {f.action.value for _, r, _, _ in outcomes for f in r.faults}
    assert actions >= {"cancel", "deadline", "model_error", "decoding_error", "transport_error"}


def test_each_path_hits_its_target_and_ends(pathset):
    """A covering path starts at the request's creation, fires its target and reaches 'done'."""
    for target, path in pathset.paths.items():
        assert path.steps[0].point == "new"
        if target[0] == "fault":
            assert any(s.label == target[1] and s.point == target[2] for s in path.steps), target
        else:
            assert any((m.split("[")[0], s, e) == target[1:] for st in path.steps for m, s, e in st.fired), target
        assert any(s.label.startswith("loop: stream resources released") for s in path.steps), target


def test_refinement_check_has_teeth(outcomes):
    """A run compared with another path's steps, or a path with one step dropped, is a mismatch."""
    by_target = {p.target: (p, got) for p, _, _, got in outcomes}
    p_eos = next(p for p, _, _, _ in outcomes if any("select EOS" in s.label for s in p.steps))
    p_cancel = next(p for p, _, _, _ in outcomes if any(e == "safe_point" for s in p.steps for _, _, e in s.fired))
    assert md.mismatches(p_eos, by_target[p_cancel.target][1])
    dropped = attrs.evolve(p_eos, steps=tuple(s for s in p_eos.steps if not s.label.startswith("device: prefill")))
    assert "lifecycle" in md.mismatches(dropped, by_target[p_eos.target][1])


def test_unread_stream_steps_are_observed_by_the_harness(pathset):
    """§4.8: block and unblock are not trace events; the harness logs them, so a pause-policy path
    through PAUSED --unblock--> is compared too (a run that skips the read would differ)."""
    p = pathset.paths[("row", "stream", "PAUSED", "unblock")]
    run = md.concretize(p)
    events, extra = md.execute(run)
    assert ("PAUSED", "unblock") in md.project(events, extra)["stream"]
    no_read = attrs.evolve(run, actions=tuple(a for a in run.actions if a[2] != "read"))
    events, extra = md.execute(no_read)
    assert md.mismatches(p, md.project(events, extra))


def test_paths_module_stays_below_runtime_and_properties():
    """Layering spec -> machine -> runtime -> properties: machine/paths.py imports neither."""
    code = ("import sys, decodespec.machine.paths; "
            "print(sorted(m for m in sys.modules if m.startswith(('decodespec.runtime', 'decodespec.properties'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_covering_paths_for_chosen_targets_only():
    """covering_paths(targets=...) returns exactly the asked targets (all reachable here)."""
    want = [("row", "lifecycle", "DRAINING", "stop_hit"), ("row", "stream", "OPEN", "overflow")]
    ps = covering_paths(targets=want)
    assert set(ps.paths) == set(want) and not ps.unreached


@pytest.mark.parametrize("case", sorted(p.stem for p in REGRESSIONS.glob("*.json")))
def test_regression_case_still_refines_its_path(case):
    """Counterexamples and notable paths kept as JSON (path + concrete run) replay and refine."""
    (name, run), = [c for c in md.load_regressions(REGRESSIONS) if c[0] == case]
    events, extra = md.execute(run)
    assert not md.mismatches(run.path, md.project(events, extra)), name
    assert check_trace(events, tokenizer=md.tokenizer()) == []


@pytest.mark.parametrize("case", sorted(p.stem for p in REGRESSIONS.glob("*.json")))
def test_regression_path_is_still_a_run_of_the_model(case):
    """A kept case stays meaningful only while the model still takes its path (§4.3): every step,
    point and table step is a successor in the current model, and the path ends."""
    (_, run), = [c for c in md.load_regressions(REGRESSIONS) if c[0] == case]
    assert is_model_run(run.path)


def test_a_replay_that_leaves_a_paused_producer_paused_is_not_a_model_run():
    """The regression path replay-resumes-paused without its unblock of the PAUSED stream (a replay
    that leaves a paused producer paused) is not a run of the model."""
    (_, run), = [c for c in md.load_regressions(REGRESSIONS) if c[0] == "replay-resumes-paused"]
    old = attrs.evolve(run.path, steps=tuple(
        attrs.evolve(s, fired=tuple(f for f in s.fired if f != ("stream", "PAUSED", "unblock"))) for s in run.path.steps))
    assert old != run.path and not is_model_run(old)


def test_regression_cases_exist():
    assert len(list(REGRESSIONS.glob("*.json"))) >= 3


def _path_through(pathset, label_part: str) -> ModelPath:
    return next(p for t, p in sorted(pathset.paths.items()) if t[0] == "fault" and label_part in t[1])


def test_parked_cancel_is_realised_by_the_engine(pathset):
    """§4.8/§4.9: a pause-policy request whose reader is behind is parked by the Engine before its
    next select; a cancel requested then is observed at the check point of the next step. The path
    through that check point runs on the Engine and refines; without the cancel the Engine keeps
    the run parked (so the run really was parked, not merely slow)."""
    p = pathset.paths[("fault", PARKED_CANCEL, "top_of_step")]
    run = md.concretize(p)
    assert run.driver is md.Driver.ENGINE and run.cancel_when_parked
    events, extra = md.execute(run)
    assert not md.mismatches(p, md.project(events, extra))
    kinds = [str(e.kind) for e in events]
    assert kinds.index("cancel.requested") > max(i for i, k in enumerate(kinds) if k == "decode.completed")
    assert kinds.count("token.selected") == sum(1 for s in p.steps if s.label.startswith("loop: select"))
    with pytest.raises(md.EngineStalled, match="DECODING"):
        md.execute(attrs.evolve(run, cancel_when_parked=False))
    with pytest.raises(ValueError, match="engine driver"):
        attrs.evolve(run, driver="generate")


def test_content_policy_interrupts_before_the_chunk_is_sent(pathset, outcomes):
    """DECISIONS D11 (§4.10): every content-interrupt path, on a clear, held or hit stop matcher,
    sends no delta for the interrupting token, and its run refines the path: the runtime's trace
    has the path's deltas only and ends FINISHED with content_interrupted (a stop matched in the
    same chunk does not win: the policy looks first)."""
    runs = [(p, ev) for p, r, ev, _ in outcomes if r.interrupt_at is not None]
    variants = {t[1].split("stop matcher ")[1].split(",")[0] for t in pathset.paths
                if t[0] == "fault" and "content policy interrupts" in t[1]}
    assert variants == {"clear", "hold", "hit"} and runs
    for p, ev in runs:
        deltas = [e for e in ev if e.kind == "response.delta"]
        assert len(deltas) == sum(1 for s in p.steps if s.label.startswith("loop: delta queued"))
        assert [e.data["finish_reason"] for e in ev if e.kind in md.TERMINAL_KINDS] == ["content_interrupted"]
    hit = _path_through(pathset, "stop matcher hit, safe bytes non-empty, content policy")
    events, extra = md.execute(md.concretize(hit))
    assert not md.mismatches(hit, md.project(events, extra))
    assert [e.data["finish_reason"] for e in events if e.kind == "response.completed"] == ["content_interrupted"]
    assert not any(e.kind in ("stop.hit", "response.delta") for e in events)


def test_replay_counts_as_read_and_resumes_a_paused_producer(pathset):
    """§4.7 rule 4 / §4.8: OrderedStream.replay counts the replayed deltas as read, so a replay in
    PAUSED fires unblock; the model does the same and the run refines. A path whose replay left the
    producer paused (the old model) does not match the runtime."""
    p = pathset.paths[("ignore", "stream", "PAUSED", "replay")]
    events, extra = md.execute(md.concretize(p))
    got = md.project(events, extra)["stream"]
    assert got[got.index(("PAUSED", "replay")) + 1] == ("PAUSED", "unblock")
    assert not md.mismatches(p, md.project(events, extra))
    stale = attrs.evolve(p, steps=tuple(
        attrs.evolve(s, fired=tuple(f for f in s.fired if f != ("stream", "PAUSED", "unblock")))
        if s.label.startswith("transport: the client reconnects") else s for s in p.steps))
    assert "stream" in md.mismatches(stale, md.project(events, extra))


def test_model_only_entries_are_the_cancels_no_driver_observes(pathset):
    """What stays model-only is a cancel observed a second time or after the reason
    is fixed (the ignore rows of D2, for other engines) and a stop completing in a drained tail
    (the reference's matcher sees every byte at once), the scheduler's preemptions
    (the Engine preempts by its own schedule; the multi-request checker covers them), and
    two ignores the model offers wherever they can arrive though the reference never sends them (a
    racing second release, a connection failing while a cancel is pending), and a request's own code
    raising on its flushed tail (no fault plan names it; tests/test_engine.py drives it);
    nothing about content policy, replay or a parked producer (both drivers realise those)."""
    assert set(md.UNREALIZABLE) == {"repeated_cancel", "cancel_observed_without_kernel", "stop_in_drained_tail",
                                    "scheduler_preempts", "racing_release", "transport_while_cancel_pending",
                                    "raises_on_the_flush"}
    assert {t[1] for t in md.MODEL_ONLY if t[0] == "ignore"} == {"lifecycle", "resources"}
    assert {t[3] for t in md.MODEL_ONLY if t[0] == "ignore"} == {"cancel", "transport_error", "release"}
    assert not any("replay" in str(t) or "content" in str(t) or "parked" in str(t) for t in pathset.unreached
                   if md.MODEL_ONLY.get(t) != "stop_in_drained_tail")  # there only as the point a replay lands


def test_every_derived_path_also_refines_on_the_engine(outcomes):
    """§4.4: the Engine drives the same RequestRun, so the generate() paths run on it too (no
    batch-mates, stepped on this thread) and refine the same path, except the documented
    ENGINE_DIFFERENCES; each path listed there really does not refine (the list cannot go stale)."""
    same, differ = 0, 0
    for path, run, _, _ in outcomes:
        if run.driver is md.Driver.ENGINE:
            continue
        try:
            events, extra = md.execute(attrs.evolve(run, driver="engine"))
            refines = not md.mismatches(path, md.project(events, extra))
        except md.EngineStalled:
            refines = False
        assert refines != bool(md.engine_differs(path)), (path.target, md.engine_differs(path))
        same, differ = same + refines, differ + (not refines)
    assert same > 10 * differ and differ >= 1
    assert all(reason for _, reason in md.ENGINE_DIFFERENCES.values())
