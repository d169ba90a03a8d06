"""An ASGI app served by uvicorn in a thread of this process, as `decodespec serve` configures it:
the in-process server of the tests and of `decodespec fuzz --engine reference` (§4.7 over HTTP)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def serve_in_thread(app: Any, **config: Any) -> Iterator[str]:
    """Run `app` on uvicorn at 127.0.0.1 on a free port in a thread, configured as `decodespec
    serve` configures it (`uvicorn_config`, with `config` on top); yields the base URL and shuts
    the server down (lifespan included) on exit."""
    import uvicorn

    from .server import uvicorn_config

    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it every response written in two parts waits 40 ms for a delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, lifespan="on", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
