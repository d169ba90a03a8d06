"""The reference engine (docs/concepts.md, "The runtime"). Names load lazily so `import decodespec.runtime`
does not pull in torch until a model is used."""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "Event": "events",
    "EventKind": "events",
    "Trace": "events",
    "Request": "request",
    "Result": "result",
    "Usage": "result",
    "generate": "loop",
    "Engine": "engine",
    "TinyLM": "models",
    "HFModel": "models",
    "ScriptedModel": "models",
    "HFTokenizer": "tokenizers",
    "ByteTableTokenizer": "tokenizers",
    "StopMatcher": "stop",
    "TokenStopMatcher": "stop",
    "IncrementalDetokenizer": "detokenizer",
    "DecodingError": "detokenizer",
    "OrderedStream": "stream",
    "ResourceLedger": "ledger",
    "FaultPlan": "faults",
    "Fault": "faults",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
