"""Engine adapters: `adapter_for("reference" | "hf:PATH" | "decode-stream:TOKENIZER_JSON" | "openai:URL")`,
or a Python adapter of your own: `module:factory`, or the name of an entry point in the
`decodespec.adapters` group (`NAME` or `NAME:ARG`; the factory gets ARG when given). A factory
returns an object with `name`, `capabilities`, `unsupported(case)` and `run(case) -> Outcome`.
"""

from __future__ import annotations

import importlib
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
                without: frozenset[str] = frozenset()) -> Adapter:
    """Build the adapter an --engine value names (imports only what that engine needs).

    `checkpoint` (openai only) is the forced checkpoint folder the server serves; `without` names
    request fields the server does not offer.
    """
    if checkpoint is not None and not spec.startswith("openai:"):
        raise EngineSpecError("--checkpoint applies to openai:URL engines only")
    kind, _, arg = spec.partition(":")
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
        from ..cases import CaseError
        from ..checkpoints import Checkpoint
        from .openai import OpenAIAdapter

        try:
            ckpt = Checkpoint.load(checkpoint) if checkpoint is not None else None
        except CaseError as exc:
            raise EngineSpecError(str(exc)) from None
        return OpenAIAdapter(arg, model=model, checkpoint=ckpt, without=without)
    found = [ep for ep in entry_points(group=ENTRY_POINTS) if ep.name == kind]
    if found:
        return _checked(found[0].load(), (arg,) if arg else (), spec)
    if arg.isidentifier():
        try:
            module = importlib.import_module(kind)
        except ImportError as exc:
            raise EngineSpecError(f"--engine {spec}: cannot import module {kind!r}: {exc}") from None
        factory = getattr(module, arg, None)
        if not callable(factory):
            raise EngineSpecError(f"--engine {spec}: module {kind!r} has no callable {arg!r}")
        return _checked(factory, (), spec)
    known = ", ".join([*ENGINES, *(f"{ep.name} (entry point)" for ep in entry_points(group=ENTRY_POINTS))])
    raise EngineSpecError(f"unknown engine {spec!r}; use one of {known}")


def _checked(factory: Any, args: tuple[str, ...], spec: str) -> Adapter:
    try:
        adapter = factory(*args)
    except Exception as exc:  # a third-party factory: its failure is a bad engine spec, said plainly
        raise EngineSpecError(f"--engine {spec}: the adapter factory raised {type(exc).__name__}: {exc}") from None
    missing = [m for m in _MEMBERS if not hasattr(adapter, m)]
    if missing:
        raise EngineSpecError(f"--engine {spec}: the factory's {type(adapter).__name__} lacks {', '.join(missing)} "
                              "(an adapter needs name, capabilities, unsupported(case) and run(case))")
    return adapter
