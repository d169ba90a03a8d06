"""Everything generated from a table: compiled stepper, transitions backend, diagrams, checker."""

from .compiled import CompiledMachine, IllegalTransition, Stepper, compile_table, compiled, compiled_of, per_table

__all__ = ["CompiledMachine", "IllegalTransition", "Stepper", "compile_table", "compiled", "compiled_of",
           "per_table"]
