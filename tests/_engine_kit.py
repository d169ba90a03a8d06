"""Shared builders for the Engine, server and soak tests (§4.4): a small random TinyLM whose
vocabulary is printable ASCII, newline and EOS, so every output is valid UTF-8 and EOS ends some runs."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from decodespec.runtime.in_thread import serve_in_thread  # noqa: F401 (the tests' server in a thread)
from decodespec.runtime.tinylm import TinyLM, TinyLMConfig
from decodespec.runtime.tokenizers import ByteTableTokenizer

# A model this small gains nothing from intra-op threads, and on a busy 2-core runner OpenMP's
# spinning threads make each tiny matmul ~10x slower (measured): one thread for these tests.
torch.set_num_threads(1)

VOCAB = 97
NEWLINE = 95
EOS = 96


def tiny_model(context_limit: int = 128) -> TinyLM:
    """Deterministic weights (TinyLM seeds its own init); about 0.1 ms a decode step on CPU."""
    return TinyLM(TinyLMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                               context_limit=context_limit, eos_token_id=EOS), name="tiny")


def ascii_tokenizer() -> ByteTableTokenizer:
    """Ids 0..94 -> the printable ASCII characters ' '..'~'; 95 -> newline; 96 -> EOS."""
    return ByteTableTokenizer({i: bytes([32 + i]) for i in range(95)} | {NEWLINE: b"\n", EOS: b""}, eos_id=EOS)


class FlakyModel:
    """Wraps a model; any kernel whose batch holds a sequence with prompt length `bad_len` raises
    (the sequence-specific model fault of §4.10). Everything else is the wrapped model."""

    def __init__(self, inner: Any, bad_len: int, *, in_prefill: bool = False) -> None:
        self.inner, self.bad_len, self.in_prefill = inner, bad_len, in_prefill
        self.name, self.vocab_size, self.context_limit = inner.name, inner.vocab_size, inner.context_limit
        self.device = inner.device
        self.batch_failures = 0

    def prefill(self, prompt_ids: Sequence[int]) -> Any:
        if self.in_prefill and len(prompt_ids) == self.bad_len:
            raise RuntimeError("prefill kernel fault")
        return self.inner.prefill(prompt_ids)

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> Any:
        if self.in_prefill and any(len(p) == self.bad_len for p in prompts):
            self.batch_failures += 1
            raise RuntimeError("prefill kernel fault")
        return self.inner.prefill_batch(prompts)

    def decode_one(self, caches: Sequence[Any], tokens: Sequence[int]) -> Any:
        if not self.in_prefill and any(c.prompt_length == self.bad_len for c in caches):
            self.batch_failures += 1
            raise RuntimeError("decode kernel fault")
        return self.inner.decode_one(caches, tokens)


class FakeClock:
    """A manual monotonic clock for deadline and detach-timeout tests."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SlowModel(FlakyModel):
    """The tiny model with `delay_s` of extra work per decode step, so an HTTP client can act
    (cancel, disconnect) while a request is still decoding."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        super().__init__(inner, bad_len=-1)
        self.delay_s = delay_s

    def decode_one(self, caches: Sequence[Any], tokens: Sequence[int]) -> Any:
        time.sleep(self.delay_s)
        return self.inner.decode_one(caches, tokens)


def slow_model(delay_s: float = 0.002, context_limit: int = 128) -> SlowModel:
    return SlowModel(tiny_model(context_limit), delay_s)


@contextlib.contextmanager
def answering(bodies: Mapping[str, str]) -> Iterator[str]:
    """A server at 127.0.0.1 on a free port that answers GET `path` with `bodies[path]` (200, JSON)
    and any other path with 404; yields the base URL, and stops the server on exit."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies.get(self.path, '{"error": "not found"}').encode()
            self.send_response(200 if self.path in bodies else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(url: str, timeout_s: float = 60.0) -> None:
    """Poll `url`/v1/models until the server answers (a subprocess server started by a test)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(f"{url}/v1/models", timeout=1)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing answered at {url} within {timeout_s:.0f} s") from None
            time.sleep(0.1)


@contextlib.contextmanager
def decodespec_serve(cwd: Any) -> Iterator[str]:
    """`decodespec serve` with its default model on a free port of 127.0.0.1, as a subprocess in
    `cwd`: yields its URL once it answers, and stops it by PID."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "decodespec", "serve", "--port", str(port)], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def eos_banned_under_ignore_eos(eos_id: int) -> Iterator[None]:
    """While active, every request an Engine takes with ignore_eos also biases `eos_id` by -100 (what
    llama.cpp does with every end-of-generation token, D31): a server never selects the EOS, its
    runner-up instead. The conformance reference runs generate(), not an Engine: it is unchanged."""
    from unittest import mock

    import attrs

    from decodespec.runtime.engine import Engine

    submit = Engine.submit

    def banning(self: Engine, request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.ignore_eos:
            request = attrs.evolve(request, logit_bias={**dict(request.logit_bias), eos_id: -100.0})
        return submit(self, request, *args, **kwargs)

    with mock.patch.object(Engine, "submit", banning):
        yield
