"""The reference engine (DESIGN, runtime/). Names load lazily so `import decodespec.runtime`
does not pull in torch until a model is used."""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'decodespec.runtime' has no attribute '{name}'")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
