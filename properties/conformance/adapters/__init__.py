"""Engine adapters: `adapter_for("reference" | "hf:PATH" | "decode-stream:TOKENIZER_JSON" | "openai:URL")`,
or an engine of your own: `module:factory`, or the name of an entry point in the
`decodespec.adapters` group (`NAME` or `NAME:ARG`; the factory gets ARG when given).

A factory of your own follows the adapter contract (contract.py, its one public module): called
with `checkpoint=` (a contract.Checkpoint) for each forced checkpoint, it returns a contract.Engine,
which runs as an InHouseAdapter (adapters/inhouse.py: judged as HTTP engines are). A factory that
raises, or whose engine says a context length that is no positive int, is an EngineLoadError (an
ERROR of that checkpoint's cases, never n/a). `module` is imported with the current folder on
sys.path. A factory may also return an object with this package's
internal Adapter members (`name`, `capabilities`, `unsupported(case)`, `run(case) -> Outcome`);
those are not part of the contract and may change without a version step.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from importlib.metadata import entry_points
from typing import Any

from .base import Adapter, Finding, Outcome

__all__ = ["Adapter", "EngineLoadError", "EngineSpecError", "Finding", "Outcome", "adapter_for", "ENGINES",
           "is_module_engine"]

ENGINES = ("reference", "hf:PATH", "decode-stream:TOKENIZER_JSON", "openai:URL", "module:factory")
BUILT_IN = tuple(e.partition(":")[0] for e in ENGINES[:-1])  # the --engine kinds that are no factory of yours
ENTRY_POINTS = "decodespec.adapters"
_MEMBERS = ("name", "capabilities", "unsupported", "run")


class EngineSpecError(ValueError):
    """An --engine value that names no adapter, or lacks its argument."""


class EngineLoadError(EngineSpecError):
    """The engine's factory raised: it did not load (an ERROR of the cases it was to run)."""


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

        read_timeout: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        return OpenAIAdapter(arg, model=model, checkpoint=ckpt, without=without, **read_timeout)
    factory, args = factory_of(spec)
    return built(factory, args, spec, ckpt)


def is_module_engine(spec: str) -> bool:
    """Whether an --engine value names a factory (`module:factory`, an entry point), not a built-in."""
    return spec.partition(":")[0] not in BUILT_IN


def factory_of(spec: str) -> tuple[Any, tuple[str, ...]]:
    """The factory an entry point or `module:factory` --engine value names, and its arguments (the
    entry point's ARG); an EngineSpecError when it names none."""
    kind, _, arg = spec.partition(":")
    found = [ep for ep in entry_points(group=ENTRY_POINTS) if ep.name == kind]
    if found:
        return found[0].load(), (arg,) if arg else ()
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
        return factory, ()
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


def built(factory: Any, args: tuple[str, ...], spec: str, ckpt: Any, context: int | None = None) -> Adapter:
    """The adapter of what `factory(*args, checkpoint=...)` returns for the forced checkpoint `ckpt`
    (a checkpoints.Checkpoint; None: called without one), to be loaded with the context length
    `context` (contract.Checkpoint.context_length): a contract.Engine runs as an InHouseAdapter.
    A factory that raises, or an engine that says a context length the contract cannot take, is an
    EngineLoadError; one that returns neither an Engine nor an adapter, an EngineSpecError naming
    what it lacks."""
    from .inhouse import ContextLengthError, InHouseAdapter, public_checkpoint

    kw = {"checkpoint": public_checkpoint(ckpt, context)} if ckpt is not None else {}
    if ckpt is None and _needs_checkpoint(factory):
        raise EngineSpecError(f"--engine {spec}: the factory loads a forced checkpoint; pass --checkpoint DIR "
                              "(`decodespec checkpoints build`)")
    on = f" on checkpoint {ckpt.group}" if ckpt is not None else ""
    try:
        made = factory(*args, **kw)
    except Exception as exc:  # a third-party factory: its failure is the engine's load failure, said plainly
        raise EngineLoadError(f"--engine {spec}: the factory raised{on}: {type(exc).__name__}: {exc}") from None
    if callable(getattr(made, "complete", None)):
        if ckpt is None:
            raise EngineSpecError(f"--engine {spec}: an in-house engine runs the script cases of forced checkpoints; "
                                  "pass --checkpoint DIR (`decodespec checkpoints build`)")
        try:
            return InHouseAdapter(made, ckpt, context)
        except ContextLengthError as exc:  # what this load says, not how the engine was named
            raise EngineLoadError(f"--engine {spec}: the engine loaded{on}: {exc}") from None
        except ValueError as exc:
            raise EngineSpecError(f"--engine {spec}: {exc}") from None
    missing = [m for m in _MEMBERS if not hasattr(made, m)]
    if missing:
        raise EngineSpecError(f"--engine {spec}: the factory's {type(made).__name__} lacks complete(request) "
                              "(a contract.Engine: decodespec.properties.conformance.contract)")
    return made


def _needs_checkpoint(factory: Any) -> bool:
    """Whether `factory` takes a `checkpoint` it has no default for (a contract factory)."""
    try:
        param = inspect.signature(factory).parameters.get("checkpoint")
    except (TypeError, ValueError):  # a builtin or a class whose signature cannot be read
        return False
    return param is not None and param.default is inspect.Parameter.empty
