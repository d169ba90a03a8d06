"""What a script case needs of the server adapter it runs on (§4.3-§4.7 cases over HTTP).

adapters/openai.OpenAIAdapter is one. http_script and chat type against this protocol and import
no adapter, so the adapter may import them (no import circle, issue 27 item 5).
"""

from __future__ import annotations

from typing import Any, Protocol

from .checkpoints import Checkpoint
from .wire import Streamed


class ScriptServer(Protocol):
    """The adapter's side of a script case: its checkpoint, the model name, and the exchanges."""

    checkpoint: Checkpoint
    model: str
    sweep: bool
    prompt_note: str

    def post(self, path: str, body: dict[str, Any], log: list[dict[str, Any]] | None = None) -> tuple[int, Any, str]: ...

    def stream_body(self, path: str, body: dict[str, Any], *, log: list[dict[str, Any]] | None = None) -> Streamed: ...

    def reference(self, case: Case) -> Any: ...

    def prefix(self) -> Any: ...

    def prompt_for(self, ids: list[int]) -> list[int] | str: ...

    def log_exchanges(self, entries: list[dict[str, Any]]) -> None: ...


class LiveServer(ScriptServer, Protocol):
    """The adapter's side of a request-life case (life/, issue 24): also its URL (requests go out
    side by side on connections of their own), whether it was started tight (concurrency and KV
    budget limited), and which cases it cannot run."""

    url: str
    tight: bool

    def unsupported(self, case: Any) -> str | None: ...
