"""Generated tests (docs/concepts.md, "How it is checked"): both backends follow every table, and the tests have teeth.

Each table is its own oracle: the stateful walk and the exhaustive pair check are generated from
its rows (§4.1 lifecycle, §4.6 stop matcher, §4.5 detokenizer, §4.7/§4.8 stream, §4.10 resources).
A mutant implementation, compiled from a valid table that differs in one pair, must be caught.
"""

from __future__ import annotations

import copy
import tomllib

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from decodespec.machine import compile_table
from decodespec.machine.transitions_backend import TransitionsMachine
from decodespec.properties.stateful import exhaustive_check, stateful_test_for
from decodespec.spec import MACHINES, SpecError, Table, load_spec, spec_path
from decodespec.spec.loader import build_table

BACKENDS = {
    "compiled": lambda t: compile_table(t).new,
    "transitions": lambda t: TransitionsMachine(t).new,
}
WALK = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True, database=None)
#: lifecycle (§4.1, nine states) needs longer walks before every DECODING exit has been taken.
DEEP = {"lifecycle": settings(WALK, max_examples=100, stateful_step_count=100)}
HUNT = settings(
    max_examples=400, stateful_step_count=40, deadline=None, derandomize=True, database=None,
    report_multiple_bugs=False, phases=[Phase.generate],
)


def _with_mutant_action(data: dict) -> dict:
    """Declare the action `mutant` (no effects) and drop the actions and effects no row names now."""
    named = {e.get("action") for sec in ("row", "ignore") for e in data.get(sec, [])}
    data["actions"] = {a: fx for a, fx in {**data["actions"], "mutant": []}.items() if a in named}
    used = {x for fx in data["actions"].values() for x in fx}
    data["effects"] = {e: v for e, v in data["effects"].items() if e in used}
    return data


def _mutants(name: str) -> dict[str, tuple[Table, tuple[str, str]]]:
    """Valid one-pair mutants of table `name`, each with the pair it changes.

    `retarget`: the last row (the deepest, in file order) whose target can move to another state
    and still validate (none exists for resources: any move strands a state). `reject_to_row`:
    the last rejected event of a non-terminal state becomes a self-loop row. `new_action`: the
    last row keeps its target but names another action.
    """
    data = tomllib.loads(spec_path(name).read_text(encoding="utf-8"))
    source = f"mutant of {name}"
    out: dict[str, tuple[Table, tuple[str, str]]] = {}
    for i in reversed(range(len(data["row"]))):
        row = data["row"][i]
        for target in data["states"]:
            if target == row["target"] or "retarget" in out:
                continue
            mutated = copy.deepcopy(data)
            mutated["row"][i]["target"] = target
            try:
                out["retarget"] = (build_table(mutated, source), (row["state"], row["event"]))
            except SpecError:
                continue
    entry = [r for r in data["reject"] if r["state"] not in data["terminal"]][-1]
    mutated = copy.deepcopy(data)
    event = next(r for r in mutated["reject"] if r == entry)["events"].pop()
    mutated["row"].append({"state": entry["state"], "event": event, "target": entry["state"], "action": "mutant", "anchor": "§0"})
    out["reject_to_row"] = (build_table(_with_mutant_action(mutated), source), (entry["state"], event))
    mutated = copy.deepcopy(data)
    mutated["row"][-1]["action"] = "mutant"
    mutated["row"][-1].pop("reason", None)  # `mutant` fixes no reason
    out["new_action"] = (build_table(_with_mutant_action(mutated), source), (data["row"][-1]["state"], data["row"][-1]["event"]))
    return out


MUTANTS = {(name, kind): m for name in MACHINES for kind, m in _mutants(name).items()}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", MACHINES)
def test_backend_follows_table_on_random_walks(name: str, backend: str) -> None:
    """Random walks (mostly allowed events) agree with the table at every step (§4.1 and per machine)."""
    table = load_spec(name)
    run_state_machine_as_test(stateful_test_for(table, BACKENDS[backend](table)), settings=WALK)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", MACHINES)
def test_backend_decides_every_pair_like_the_table(name: str, backend: str) -> None:
    """Every (state, event) pair: row, ignore or rejection exactly as decided (§4.1 table)."""
    table = load_spec(name)
    assert exhaustive_check(table, BACKENDS[backend](table)) == []


@pytest.mark.parametrize("name", MACHINES)
def test_walks_get_deep_enough_to_fire_every_row(name: str) -> None:
    """The biased event draw reaches every row of the table, deep ones included (§4.3 loop end)."""
    table = load_spec(name)
    machine = compile_table(table)
    fired: set[tuple[str, str]] = set()

    class Recording:
        def __init__(self, state: str | None) -> None:
            self.inner = machine.new(state)

        def fire(self, event: str):
            before = str(self.inner.state)
            result = self.inner.fire(event)
            fired.add((before, event))
            return result

        def allows(self, event: str) -> bool:
            return self.inner.allows(event)

        state = property(lambda self: self.inner.state)
        terminal = property(lambda self: self.inner.terminal)

    run_state_machine_as_test(stateful_test_for(table, Recording), settings=DEEP.get(name, WALK))
    assert {(d.state, d.event) for d in table.rows} - fired == set()


@pytest.mark.parametrize(("name", "kind"), sorted(MUTANTS))
def test_exhaustive_check_names_exactly_the_mutated_pair(name: str, kind: str) -> None:
    """A one-pair change to a table is reported for that pair and no other (§4.1: each pair decided once)."""
    mutant, (state, event) = MUTANTS[name, kind]
    for backend in BACKENDS.values():
        mismatches = exhaustive_check(load_spec(name), backend(mutant))
        assert len(mismatches) == 1 and mismatches[0].startswith(f"({state}, {event}): "), mismatches


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(("name", "kind"), sorted(MUTANTS))
def test_generated_walk_catches_a_one_pair_mutant(name: str, kind: str, backend: str) -> None:
    """The stateful test generated from the true table fails on a mutant implementation (§4.1)."""
    mutant, (state, event) = MUTANTS[name, kind]
    walk = stateful_test_for(load_spec(name), BACKENDS[backend](mutant))
    with pytest.raises(AssertionError, match=rf"\({state}, {event}\)"):
        run_state_machine_as_test(walk, settings=HUNT)
