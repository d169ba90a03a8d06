"""Shared fixtures (kept minimal: each test file builds what it needs)."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    """The checkout the tests run from (holds spec/, diagrams/, pyproject.toml)."""
    return REPO_ROOT
