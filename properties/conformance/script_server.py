"""What a script case needs of the server adapter it runs on (§4.3-§4.7 cases over HTTP).

adapters/openai.OpenAIAdapter, adapters/inhouse.InHouseAdapter and adapters/recorded.Recording are
ones. http_script and chat type against these protocols and import no adapter, so the adapter may
import them (no import circle).
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import Any, Protocol

import attrs

from .adapters.base import Finding
from .cases import STREAM_KINDS, Case
from .checkpoints import Checkpoint, ScriptPrograms
from .forced import Program
from .wire import Streamed


class ScriptServer(Protocol):
    """The adapter's side of a script case: the programs it serves (`checkpoint`: a built forced
    checkpoint, or a case's own program for a recording), the model name, and the exchanges.
    `sweep`: whether a case also runs at every other max_tokens (§4.3), or the limits the server
    holds answers at (a recording keeps only those that failed: adapters/recorded.py)."""

    @property
    def checkpoint(self) -> ScriptPrograms: ...

    @property
    def model(self) -> str: ...

    @property
    def prompt_note(self) -> str: ...

    @property
    def sweep(self) -> bool | Set[int]: ...

    def post(self, path: str, body: dict[str, Any], log: list[dict[str, Any]] | None = None) -> tuple[int, Any, str]: ...

    def stream_body(self, path: str, body: dict[str, Any], *, log: list[dict[str, Any]] | None = None) -> Streamed: ...

    def reference(self, case: Case) -> Any: ...

    def prefix(self) -> Any: ...

    def prompt_for(self, ids: list[int]) -> list[int] | str: ...

    def log_exchanges(self, entries: list[dict[str, Any]]) -> None: ...


class ProbedServer(ScriptServer, Protocol):
    """A server of a built forced checkpoint, whose prefix probe it is asked (D26: http_script.probe_prefix)."""

    @property
    def checkpoint(self) -> Checkpoint: ...


class LiveServer(ProbedServer, Protocol):
    """The adapter's side of a request-life case (life/): also its URL (requests go out
    side by side on connections of their own), whether it was started tight (concurrency and KV
    budget limited), and which cases it cannot run."""

    url: str
    tight: bool

    def unsupported(self, case: Any) -> str | None: ...


def not_observable(case: Case) -> list[str]:
    """What the case expects that no HTTP answer shows (a pass that needed them is partial)."""
    out = []
    for c in case.expect.events:
        if not c.kinds <= STREAM_KINDS:
            out.append(f"events {sorted(c.kinds - STREAM_KINDS)} ({c.invariant}: internal trace)")
    if case.expect.state is not None:
        out.append(f"state {case.expect.state} (the wire shows no lifecycle state)")
    if case.expect.usage and set(case.expect.usage) - {"completion_tokens", "selected_tokens", "prompt_tokens"}:
        extra = sorted(set(case.expect.usage) - {"completion_tokens", "selected_tokens", "prompt_tokens"})
        out.append(f"usage {extra} (not in the API's usage)")
    return out


def program_body(a: ScriptServer, prog: Program, max_tokens: int, **over: Any) -> dict[str, Any]:
    """A greedy /v1/completions body for a forced program: its prompt ids (marker first), the limit."""
    return {"model": a.model, "prompt": a.prompt_for(list(prog.prompt)), "max_tokens": max_tokens,
            "temperature": 0, **over}


def case_fields(case: Case) -> dict[str, Any]:
    """What a script case asks of any request, completions or chat: its `stop` strings, single-id
    stop sequences as vLLM's `stop_token_ids`, and its `inputs.request` fields as they are."""
    out: dict[str, Any] = {}
    if case.inputs.get("stop"):
        out["stop"] = list(case.inputs["stop"])
    if case.inputs.get("stop_token_ids"):
        out["stop_token_ids"] = [s[0] for s in case.inputs["stop_token_ids"]]
    return {**out, **case.inputs.get("request", {})}


@attrs.frozen
class Swept:
    """What the sweep saw: the findings at the limits it judged, and where an answer left its
    forced script (`left`, naming the limit; None: none did). An answer off its script at any limit
    makes the case an ERROR naming where, as at the served limit (D27), never a finding."""

    findings: tuple[Finding, ...] = ()
    left: str | None = None


def sweep_limits(a: ScriptServer, case: Case, served: int, path: str,
                 at: Callable[[int], tuple[Any, dict[str, Any]] | None],
                 judge: Callable[[int, Any, int, Any, str, Streamed], list[Finding]],
                 left: Callable[[int, Any, int, Any], str | None] | None = None) -> Swept:
    """§4.3: the case again at every max_tokens up to its script's length but the `served` one (a
    tail bug can show only when the limit lands on one particular token). `at(k)` gives the
    reference's answer and the body at limit k (None: no valid request there); the body is sent
    both ways; `left(k, expected, status, answer)` says where the non-streamed answer left the
    script (D27: the sweep stops there), else `judge` returns the findings; the exchanges are kept
    only for a limit that fails or left.
    A server whose `sweep` is a set of limits is asked at those alone."""
    out: list[Finding] = []
    for k in range(1, len(a.checkpoint.programs[case.id].script) + 1):
        held = not isinstance(a.sweep, Set) or k in a.sweep
        got = at(k) if held and k != served else None
        if got is None:
            continue
        exp, body = got
        log: list[dict[str, Any]] = []
        status, data, raw = a.post(path, {**body, "stream": False}, log)
        st = a.stream_body(path, {**body, "stream": True}, log=log)
        if left is not None and (gone := left(k, exp, status, data)) is not None:
            a.log_exchanges(log)
            return Swept(tuple(out), f"at max_tokens={k}: {gone}")
        found = judge(k, exp, status, data, raw, st)
        if found:
            a.log_exchanges(log)
            out += found
    return Swept(tuple(out))
