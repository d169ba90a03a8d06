"""The explicit-state model checker (machine/checker.py): the shipped tables pass on one and two
requests with a witness for every sometimes-property, and seeded table bugs (a row out of a
terminal state, a delta after the terminal event, a missing safe point) are each found with the
shortest counterexample, naming the broken invariant (§4.1, §4.7, §4.9)."""

from __future__ import annotations

import functools
import os
import re

import attrs
import pytest

from decodespec.machine import compile_table
from decodespec.machine.checker import check, parked_config
from decodespec.machine.checker_model import POOL_WITNESSES, WITNESSES, ModelConfig
from decodespec.properties.invariants import load_invariants
from decodespec.spec import Decision, DecisionKind, load_spec, load_text
from decodespec.spec.loader import SPEC_DIR


def seeded(name, state, event, target=None, kind=DecisionKind.ROW, **fields):
    """The shipped table `name` with one decision replaced (bypassing the loader's validation); a
    row runs no action unless it names one the table declares (Executor.plans refuses any other)."""
    table = load_spec(name)
    decisions = dict(table.decisions)
    decisions[(state, event)] = Decision(kind, state, event, target or state, action=fields.get("action"),
                                         anchor="§4.1", reason=fields.get("reason"), where="seeded")
    return {name: attrs.evolve(table, decisions=decisions)}


@pytest.fixture(scope="module")
def one():
    return check(requests=1)


def test_one_request_shipped_tables_hold(one):
    """§4.1-§4.12 on every interleaving of one request with every fault: no violation, exhaustive."""
    assert one.violations == ()
    assert one.exhaustive and one.states > 10_000 and one.transitions > one.states
    assert one.max_depth > 10


def test_one_request_has_every_witness(one):
    """Each sometimes-property (a cancel beats a completion, a stop on the last allowed token is
    stop_sequence, a deadline ends deadline_exceeded, ...) has a witness path: the pass is not vacuous."""
    assert one.missing_witnesses == ()
    assert set(one.witnesses) == set(WITNESSES)
    stop_last = one.witnesses["stop_at_last_allowed_token"]
    assert ("lifecycle", "DECODING", "stop_hit") in [s[1:] for s in stop_last.steps]
    assert ("lifecycle", "DECODING", "length") not in [s[1:] for s in stop_last.steps]


def test_one_request_fires_every_row(one):
    """Every row of every table is exercised by the one-request model (nothing dead in the tables)."""
    assert {m: rows for m, rows in one.rows_never_fired.items() if rows} == {}


def test_one_request_offers_every_ignored_event_where_it_can_arrive(one):
    """Every ignore row of every table is fired by some step (a cancel after the
    end, a racing release, a connection failing while a cancel is pending, the scheduler's idle
    park and unpark), so an ignore turned into a reject is a refinement violation, not unseen."""
    assert {m: pairs for m, pairs in one.ignores_never_fired.items() if pairs} == {}


def test_an_ignore_no_step_sends_leaves_the_check_unexplored():
    """An ignore the model never offers (QUEUED safe_point) makes the one-request check not ok."""
    report = check(requests=1, tables=seeded("lifecycle", "QUEUED", "safe_point", kind=DecisionKind.IGNORE, action=None))
    assert report.violations == () and report.unexplored and not report.ok
    assert report.ignores_never_fired["lifecycle"] == (("QUEUED", "safe_point"),)


def test_two_requests_share_one_slot():
    """Two requests, one batch slot (§4.4, §4.10): no violation, the second waits in QUEUED and the
    slot is reused after its single release; symmetric states are stored once."""
    report = check(requests=2)
    assert report.violations == () and report.exhaustive
    assert report.missing_witnesses == ()
    assert set(POOL_WITNESSES) <= set(report.witnesses)
    wait = report.witnesses["request_waits_for_slot"]
    assert any(label.startswith(("r1: loop: scheduled", "r0: loop: scheduled")) for label in wait.labels)
    assert report.states > 100_000


def test_three_requests_share_two_places_through_preemption_cancel_and_errors():
    """§4.4, §4.8, §4.10: three requests, two batch places, the scheduler free to
    preempt, park and resume each one, a cancel or a model error at any point: every place is
    given back exactly once (the product's accounting, checked in every state) and every run ends;
    a swapped sequence is resumed, another waits for a place, and a cancelled one ends while
    swapped out."""
    config = ModelConfig(max_output_tokens=1, policies=("pause",), byte_choices=False, faults=("cancel", "model_error"))
    report = check(requests=3, slots=2, config=config)
    assert report.violations == () and report.exhaustive and report.missing_witnesses == ()
    assert {"preempted_then_resumed", "cancelled_while_swapped", "request_waits_for_slot"} <= set(report.witnesses)
    assert report.states > 300_000
    # the same search finds a sequence table whose resume takes no place (a place made from nothing)
    text = (SPEC_DIR / "sequence.toml").read_text(encoding="utf-8")
    bad = load_text(text.replace('restore_cache = ["take_place", "restore_cache"]', 'restore_cache = ["restore_cache"]'),
                    "sequence.toml")
    broken = check(requests=3, slots=2, config=config, tables={"sequence": bad})
    assert [v.name for v in broken.violations][:1] == ["release_exactly_once"]


def test_several_requests_reach_parked_sequences():
    """§4.8: under `parked_config` two requests on one place and three on two reach
    every parked move of the sequence table (park, unpark, a parked one preempted), with a slow
    reader's pause and resume as witnesses and no violation; the default configurations (one token)
    never park."""
    two = check(requests=2, config=parked_config(2))
    assert two.violations == () and two.exhaustive and two.missing_witnesses == ()
    assert two.rows_never_fired["sequence"] == ()
    assert {"parked_then_preempted", "slow_reader_pauses_and_resumes", "cancelled_while_swapped"} <= set(two.witnesses)
    three = check(requests=3, slots=2, config=parked_config(3))
    assert three.violations == () and three.exhaustive
    parked = {("RESIDENT", "park"), ("PARKED", "unpark"), ("PARKED", "preempt")}
    assert not parked & set(three.rows_never_fired["sequence"])
    assert parked <= set(check(requests=2).rows_never_fired["sequence"])


def test_bad_fault_and_preemption_bounds_are_refused():
    with pytest.raises(ValueError, match=r"unknown fault\(s\) \['oom'\]; known: cancel, deadline"):
        ModelConfig(faults=("oom",))
    with pytest.raises(ValueError, match="preemptions must be 0..3"):
        ModelConfig(preemptions=4)


SEEDED = {
    "row out of a terminal state (§4.1)": (
        seeded("lifecycle", "FINISHED", "cancel", "CANCEL_REQUESTED", action="observe_cancel"),
        "terminal_irreversible", ("lifecycle", "FINISHED", "cancel")),
    "delta allowed after the terminal event (§4.7)": (
        seeded("stream", "COMPLETED", "delta"), "no_delta_after_terminal", ("stream", "COMPLETED", "delta")),
    "select allowed after a cancel was observed (§4.9)": (
        seeded("lifecycle", "CANCEL_REQUESTED", "select"), "no_select_after_cancel_observed",
        ("lifecycle", "CANCEL_REQUESTED", "select")),
    "cancel ends DECODING with a kernel in flight (§4.9)": (
        seeded("lifecycle", "DECODING", "cancel", "CANCELLED", action="cancel_at_safe_point", reason="cancelled"),
        "no_kernel_in_flight_at_cancelled", ("lifecycle", "DECODING", "cancel")),
}


@functools.cache
def seeded_report(bug):
    return check(requests=1, tables=SEEDED[bug][0])


@pytest.mark.parametrize("bug", sorted(SEEDED))
def test_seeded_table_bug_is_found_with_the_shortest_counterexample(bug):
    """The checker names the broken invariant; its path is a BFS-shortest one (a search one level
    shallower finds nothing) and ends with the faulty table step."""
    tables, invariant, last = SEEDED[bug]
    report = seeded_report(bug)
    found = {v.name: v for v in report.violations}
    assert invariant in found, [str(v.name) for v in report.violations]
    cx = found[invariant]
    assert cx.anchor == load_invariants()[invariant].anchor
    assert last in [s[1:] for s in cx.steps]
    depth = sum(1 for label in cx.labels if not label.split(": ", 1)[1].startswith("the table allows"))
    shallower = check(requests=1, tables=tables, max_depth=depth - 1)
    assert invariant not in {v.name for v in shallower.violations}


@pytest.mark.parametrize("bug", sorted(SEEDED))
def test_counterexample_replays_through_the_tables(bug):
    """The counterexample is replayable: its lifecycle and stream steps run on the (seeded) tables."""
    tables, invariant, _ = SEEDED[bug]
    report = seeded_report(bug)
    cx = next(v for v in report.violations if v.name == invariant)
    for name in ("lifecycle", "stream"):
        stepper = compile_table(tables.get(name) or load_spec(name)).new()
        for state, event in cx.path(name):
            assert stepper.state.value == state
            stepper.fire(event)


def test_a_step_the_table_refuses_is_a_refinement_violation_and_a_deadlock():
    """If DRAINING refuses `complete`, the §4.3 loop cannot end: refinement and liveness both report it."""
    report = check(requests=1, tables=seeded("lifecycle", "DRAINING", "complete", kind=DecisionKind.REJECT))
    names = {v.name for v in report.violations}
    assert {"refinement", "every_run_terminates"} <= names
    stuck = next(v for v in report.violations if v.name == "every_run_terminates")
    assert "deadlock" in stuck.message


def test_depth_bound_makes_the_search_partial():
    """--max-depth stops the search: the report says it is not exhaustive (liveness not judged)."""
    report = check(requests=1, max_depth=5)
    assert not report.exhaustive and report.max_depth == 5 and report.violations == ()


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        (dict(requests=4), "requests must be 1 to 3"),
        (dict(slots=0), "slots must be >= 1"),
        (dict(tables={"lifecyle": load_spec("lifecycle")}), "unknown machine"),
    ],
)
def test_bad_arguments_are_refused(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        check(**kwargs)


def test_bad_model_bounds_are_refused():
    with pytest.raises(ValueError, match="policies"):
        ModelConfig(policies=("drop",))
    with pytest.raises(ValueError, match="max_output_tokens"):
        ModelConfig(max_output_tokens=0)


def test_cli_check_passes_on_the_shipped_tables():
    """`decodespec check --json` exhausts the one-request model and exits 0."""
    import json

    from click.testing import CliRunner

    from decodespec.cli import main

    result = CliRunner().invoke(main, ["check", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["violations"] == [] and data["missing_witnesses"] == [] and data["states"] > 10_000


def test_cli_check_reports_a_changed_table_and_draws_it(tmp_path):
    """--table checks a researcher's modified lifecycle (DECODING cancel straight to CANCELLED, no
    safe point, §4.9): exit 1, the counterexample printed and drawn with --draw."""
    from click.testing import CliRunner

    from decodespec.cli import main
    from decodespec.spec.loader import spec_path

    text = spec_path("lifecycle").read_text(encoding="utf-8")
    row = 'state = "DECODING"\nevent = "cancel"\ntarget = "CANCEL_REQUESTED"\naction = "observe_cancel"'
    assert row in text
    changed = tmp_path / "lifecycle.toml"
    changed.write_text(text.replace(row, row.replace('target = "CANCEL_REQUESTED"\naction = "observe_cancel"',
                                                                'target = "CANCELLED"\naction = "cancel_at_safe_point"\nreason = "cancelled"')),
                       encoding="utf-8")
    out = tmp_path / "draw"
    result = CliRunner().invoke(main, ["check", "--table", str(changed), "--draw", str(out)])
    assert result.exit_code == 1
    assert "no_kernel_in_flight_at_cancelled" in result.output
    dot = (out / "counterexample_no_kernel_in_flight_at_cancelled_lifecycle.dot").read_text()
    assert "DECODING" in dot and "cancel" in dot
    assert '\tCANCELLED [' in dot and 'fillcolor="#f5b7b1"' in dot.split("\tCANCELLED [", 1)[1].split("\n", 1)[0]
    # steps are numbered across machines: the lifecycle's numbers skip those of the other machines
    nums = [int(n) for n in re.findall(r"\[(\d+)(?:,\d+)*\] ", dot)]
    assert nums and max(nums) > len(nums)


def test_cli_check_draws_a_witness_and_refuses_an_unknown_one(tmp_path, one):
    from click.testing import CliRunner

    from decodespec.cli import main

    name = sorted(one.witnesses)[0]
    result = CliRunner().invoke(main, ["check", "--draw", str(tmp_path), "--witness", name])
    assert result.exit_code == 0, result.output
    assert list(tmp_path.glob(f"witness_{name}_*.svg"))
    bad = CliRunner().invoke(main, ["check", "--draw", str(tmp_path), "--witness", "no_such"])
    assert bad.exit_code == 2 and "no witness 'no_such'" in bad.output


def test_content_policy_acts_before_the_send_and_before_the_length_check(one):
    """DECISIONS D11 (§4.10), as the runtime does it (the emit phase of runner.py's step): the
    interrupt is decided on the token's safe chunk before it is queued, so it can land on the last
    allowed token, ahead of `length`, and the interrupting step queues no delta."""
    w = one.witnesses["content_interrupt_on_last_allowed_token"]
    fired = [s[1:] for s in w.steps]
    assert ("lifecycle", "DECODING", "content_interrupt") in fired
    assert ("lifecycle", "DECODING", "length") not in fired
    last = fired[len(fired) - 1 - fired[::-1].index(("lifecycle", "DECODING", "select")):]
    assert not any(m == "stream" for m, _, _ in last)
    assert "content policy interrupts" in w.labels[-1]


def test_replay_counts_as_read_and_resumes_the_producer(one):
    """§4.7 rule 4, §4.8 (OrderedStream.replay): a reconnect's replay empties the unread buffer, so a
    paused producer resumes at once: PAUSED --replay--> is followed by PAUSED --unblock-->."""
    fired = [s[1:] for s in one.witnesses["replay_resumes_paused_producer"].steps]
    i = fired.index(("stream", "PAUSED", "replay"))
    assert fired[i + 1] == ("stream", "PAUSED", "unblock")


def test_no_cancel_is_observed_inside_a_paused_send():
    """§4.8/§4.9: a producer waiting inside a paused send (generate() in OrderedStream.delta) observes
    no cancel there; the Engine parks before the select instead, and the cancel lands at the check
    point at the top of the step. In the model: no step from `sending` on a PAUSED stream fires a
    lifecycle cancel, and the parked check point does."""
    from collections import deque

    from decodespec.machine.checker_model import PARKED_CANCEL, Model
    from decodespec.machine.checker_state import PC

    model = Model(config=ModelConfig(policies=("pause",)))
    seen = set(model.initial())
    todo = deque(seen)
    parked_cancels = 0
    while todo:
        comp = todo.popleft()
        for step in model.expand(comp):
            cancels = [f for f in step.fired if f == ("lifecycle", "DECODING", "cancel")]
            if comp.pc == PC.sending and model.stream.states[comp.stream] == "PAUSED":
                assert not cancels, (step.label, cancels)
            parked_cancels += step.label == PARKED_CANCEL and bool(cancels)
            post = step.post()
            if not step.dead and post not in seen:
                seen.add(post)
                todo.append(post)
    assert parked_cancels > 0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a running process has used so far (Linux /proc)."""
    import os
    from pathlib import Path

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads a process's CPU time from /proc")
def test_ctrl_c_says_how_far_the_search_got_and_claims_nothing():
    """An interrupted check reports the states explored, proves nothing, exits 130."""
    import signal
    import subprocess
    import sys
    import time

    # three requests on two places with both policies: over 100 s of search here, so it is still
    # going when the signal comes; the signal waits for 5 s of the child's CPU time (the imports
    # take well under that), not for a wall-clock guess that a faster checker outruns
    proc = subprocess.Popen([sys.executable, "-m", "decodespec", "check", "--requests", "3", "--slots", "2",
                             "--policy", "pause", "--policy", "buffer"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and _cpu_seconds(proc.pid) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-500:]
    assert "interrupted after" in out and "nothing is proved" in " ".join(out.split()) and "Traceback" not in out


def test_the_search_pauses_the_cycle_collector_and_leaves_no_cycle():
    """check() runs with the cycle collector paused and restores its setting; what the search made
    holds no cycle, so pausing it leaves nothing for it to find."""
    import gc

    assert gc.isenabled()
    gc.collect()
    seen = []
    check(requests=2, progress=lambda states, depth: seen.append(gc.isenabled()))
    assert seen and not any(seen) and gc.isenabled()
    assert gc.collect() == 0
    gc.disable()
    try:
        check(requests=2)
        assert not gc.isenabled()
    finally:
        gc.enable()
