"""The mutant matrix: each seeded runtime bug of §4.12 is caught by the invariant
that names its failure, and the unmutated runtime passes every scenario."""

from __future__ import annotations

import pytest

from decodespec.properties.mutants import MUTANTS, SCENARIOS, run_matrix, scenario_violations


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_unmutated_runtime_passes_every_scenario(name):
    """Without a mutant no scenario breaks an invariant (so a catch below means the mutant)."""
    assert scenario_violations(name) == set()


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_caught_by_the_invariant_naming_its_failure(mutant):
    """§4.12: each failure mode shows up as a violation of its own invariant, not a crash."""
    (row,) = run_matrix((mutant,))
    assert row.errors == ()
    assert row.caught, f"{mutant.name} ({mutant.failure}) escaped; fired: {row.caught_by}"


def test_matrix_covers_the_seven_failures_of_section_4_12_and_two_more():
    """§4.12 lists seven failures; the matrix adds deadline-as-cancelled and double release."""
    assert len(MUTANTS) == 9 and len({m.name for m in MUTANTS}) == 9
