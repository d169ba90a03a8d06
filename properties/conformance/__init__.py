"""The conformance suite (issue 7): JSON cases, engine adapters, a runner and reports.

    from decodespec.properties.conformance import load_cases, adapter_for, run_cases
    results = run_cases(adapter_for("reference"), load_cases(["stop/"]))

Against a real engine: `checkpoints.build_checkpoints` compiles the script cases into forced
checkpoints, and `adapter_for("openai:URL", checkpoint=FOLDER)` runs them over HTTP
(`launch.run_launched` starts a server per checkpoint).
"""

from .adapters import Adapter, EngineSpecError, Finding, Outcome, adapter_for
from .cases import Case, CaseError, Grade, load_cases, save_case, select_cases
from .runner import CaseResult, Verdict, run_case, run_cases

__all__ = [
    "Adapter", "Case", "CaseError", "CaseResult", "EngineSpecError", "Finding", "Grade", "Outcome",
    "Verdict", "adapter_for", "load_cases", "run_case", "run_cases", "save_case", "select_cases",
]
