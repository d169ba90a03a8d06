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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--overlap", action="store_true", default=False,
                     help="Build every Engine with overlapped steps (Engine(overlap=True), DECISIONS D73): "
                          "the suite selected then specifies the overlapped Engine too.")


@pytest.fixture(scope="session", autouse=True)
def _overlap_everywhere(request: pytest.FixtureRequest):
    """With --overlap, an Engine built without `overlap` overlaps its steps."""
    if not request.config.getoption("--overlap"):
        yield
        return
    from decodespec.runtime.engine import Engine

    defaults = Engine.__init__.__kwdefaults__
    defaults["overlap"] = True
    yield
    defaults["overlap"] = False
