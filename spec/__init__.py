"""The tables: the single source of truth (docs/concepts.md, "The tables come first"). Imports
nothing else of decodespec."""

from .loader import MACHINES, SpecError, load_file, load_spec, load_text, spec_path
from .tables import Decision, Table
from .value import Spec, default_spec
from .vocabulary import DecisionKind, FinishReason

__all__ = [
    "MACHINES", "Decision", "DecisionKind", "FinishReason", "Spec", "SpecError", "Table",
    "default_spec", "load_file", "load_spec", "load_text", "spec_path",
]
