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
    """Start ASGI apps on uvicorn in this process, each on a free 127.0.0.1 port: `start(app) -> url`.
    Every server started is stopped when the module's tests are done."""
    import socket
    import threading
    import time

    import uvicorn

    servers = []

    def start(app) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        for _ in range(500):
            if server.started:
                break
            time.sleep(0.02)
        servers.append(server)
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.should_exit = True
