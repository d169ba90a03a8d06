"""Engine adapters: `adapter_for("reference" | "hf:PATH" | "decode-stream:TOKENIZER_JSON" | "openai:URL")`,
or a Python adapter of your own: `module:factory`, or the name of an entry point in the
`decodespec.adapters` group (`NAME` or `NAME:ARG`; the factory gets ARG when given).

The contract for a factory of your own: it returns an object with `name`, `capabilities`,
`unsupported(case)` and `run(case) -> Outcome`; with `--checkpoint DIR` it is called with the
keyword `checkpoint=` (a checkpoints.Checkpoint: its programs and tokenizer) so it can load the
forced checkpoint into its engine; `module` is imported with the current folder on sys.path. To
be judged as the HTTP engines are, `run` can return `Outcome(judged=True, findings=...,
not_checked=...)` from `judgement.judge_observed(judgement.expected_for(case, checkpoint),
judgement.Observed(...))`.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points
from typing import Any

from .base import Adapter, Finding, Outcome

__all__ = ["Adapter", "EngineSpecError", "Finding", "Outcome", "adapter_for", "ENGINES"]

ENGINES = ("reference", "hf:PATH", "decode-stream:TOKENIZER_JSON", "openai:URL", "module:factory")
ENTRY_POINTS = "decodespec.adapters"
_MEMBERS = ("name", "capabilities", "unsupported", "run")


class EngineSpecError(ValueError):
    """An --engine value that names no adapter, or lacks its argument."""


def adapter_for(spec: str, *, model: str | None = None, checkpoint: str | None = None,
                without: frozenset[str] = frozenset(), timeout: float | None = None) -> Adapter:
    """Build the adapter an --engine value names (imports only what that engine needs).

    `checkpoint` is the forced checkpoint folder the engine serves (openai) or loads (a factory of
    your own gets it as `checkpoint=`); `without` names what the server lacks (without.WITHOUT);
    `timeout` (openai only) the seconds to wait for a whole answer, or for a stream's next event.
    """
    kind, _, arg = spec.partition(":")
    if timeout is not None and kind != "openai":
        raise EngineSpecError(f"--timeout applies to openai engines, not {kind}")
    if timeout is not None and not timeout > 0:
        raise EngineSpecError(f"--timeout must be a positive number of seconds, got {timeout}")
    if checkpoint is not None and kind in ("reference", "hf", "decode-stream"):
        raise EngineSpecError(f"--checkpoint does not apply to {kind} engines")
    ckpt = _checkpoint(checkpoint)
    if kind == "reference" and not arg:
        from .reference import ReferenceAdapter

        return ReferenceAdapter()
    if kind in ("hf", "decode-stream", "openai") and not arg:
        raise EngineSpecError(f"--engine {kind} needs an argument: {kind}:{dict(zip(('hf', 'decode-stream', 'openai'), ENGINES[1:]))[kind].split(':')[1]}")
    if kind in ("hf", "decode-stream"):
        from .decode_stream import DecodeStreamAdapter
        from .hf import HFAdapter

        try:
            return (HFAdapter if kind == "hf" else DecodeStreamAdapter)(arg)
        except (OSError, ValueError) as exc:  # a missing folder, an unreadable tokenizer or checkpoint
            raise EngineSpecError(f"--engine {spec}: {exc}") from None
    if kind == "openai":
        from .openai import OpenAIAdapter

        return OpenAIAdapter(arg, model=model, checkpoint=ckpt, without=without,
                             **({} if timeout is None else {"timeout": timeout}))
    kw = {"checkpoint": ckpt} if ckpt is not None else {}
    found = [ep for ep in entry_points(group=ENTRY_POINTS) if ep.name == kind]
    if found:
        return _checked(found[0].load(), (arg,) if arg else (), spec, kw)
    if arg.isidentifier():
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # `--engine my_engine:make` run from the engine's folder
        try:
            module = importlib.import_module(kind)
        except ImportError as exc:
            raise EngineSpecError(f"--engine {spec}: cannot import module {kind!r}: {exc}") from None
        factory = getattr(module, arg, None)
        if not callable(factory):
            raise EngineSpecError(f"--engine {spec}: module {kind!r} has no callable {arg!r}")
        return _checked(factory, (), spec, kw)
    known = ", ".join([*ENGINES, *(f"{ep.name} (entry point)" for ep in entry_points(group=ENTRY_POINTS))])
    raise EngineSpecError(f"unknown engine {spec!r}; use one of {known}")


def _checkpoint(folder: str | None) -> Any:
    if folder is None:
        return None
    from ..cases import CaseError
    from ..checkpoints import Checkpoint

    try:
        return Checkpoint.load(folder)
    except CaseError as exc:
        raise EngineSpecError(str(exc)) from None


def _checked(factory: Any, args: tuple[str, ...], spec: str, kw: dict[str, Any]) -> Adapter:
    try:
        adapter = factory(*args, **kw)
    except Exception as exc:  # a third-party factory: its failure is a bad engine spec, said plainly
        raise EngineSpecError(f"--engine {spec}: the adapter factory raised {type(exc).__name__}: {exc}") from None
    missing = [m for m in _MEMBERS if not hasattr(adapter, m)]
    if missing:
        raise EngineSpecError(f"--engine {spec}: the factory's {type(adapter).__name__} lacks {', '.join(missing)} "
                              "(an adapter needs name, capabilities, unsupported(case) and run(case))")
    return adapter
