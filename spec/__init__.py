"""The tables: the single source of truth (docs/concepts.md, "The tables come first"). Imports
nothing else of decodespec."""

from .loader import MACHINES, SpecError, load_file, load_spec, load_text, spec_path
from .tables import Decision, Table
from .vocabulary import DecisionKind, FinishReason

__all__ = [
    "MACHINES", "Decision", "DecisionKind", "FinishReason", "SpecError", "Table",
    "load_file", "load_spec", "load_text", "spec_path",
]
