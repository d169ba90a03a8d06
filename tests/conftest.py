"""Shared fixtures (kept minimal: each test file builds what it needs)."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    """The checkout the tests run from (holds spec/, diagrams/, pyproject.toml)."""
    return REPO_ROOT


@pytest.fixture(scope="module")
def app_server():
    """Start ASGI apps on uvicorn in this process (tests/_engine_kit.serve_in_thread), each on a free
    127.0.0.1 port: `start(app) -> url`. Every server started stops when the module's tests are done."""
    import contextlib

    from _engine_kit import serve_in_thread

    with contextlib.ExitStack() as stack:
        yield lambda app: stack.enter_context(serve_in_thread(app))
