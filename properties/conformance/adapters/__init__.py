"""Engine adapters: `adapter_for("reference" | "hf:PATH" | "decode-stream:TOKENIZER_JSON" | "openai:URL")`."""

from __future__ import annotations

from .base import Adapter, Finding, Outcome

__all__ = ["Adapter", "EngineSpecError", "Finding", "Outcome", "adapter_for", "ENGINES"]

ENGINES = ("reference", "hf:PATH", "decode-stream:TOKENIZER_JSON", "openai:URL")


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
    if kind == "hf":
        from .hf import HFAdapter

        return HFAdapter(arg)
    if kind == "decode-stream":
        from .decode_stream import DecodeStreamAdapter

        return DecodeStreamAdapter(arg)
    if kind == "openai":
        from .openai import OpenAIAdapter

        from ..checkpoints import Checkpoint
        from ..cases import CaseError

        try:
            ckpt = Checkpoint.load(checkpoint) if checkpoint is not None else None
        except CaseError as exc:
            raise EngineSpecError(str(exc)) from None
        return OpenAIAdapter(arg, model=model, checkpoint=ckpt, without=without)
    raise EngineSpecError(f"unknown engine {spec!r}; use one of {', '.join(ENGINES)}")
