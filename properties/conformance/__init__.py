"""The conformance suite: JSON cases, engine adapters, a runner and reports (§4.3-§4.10).

    from decodespec.properties.conformance import load_cases, adapter_for, run_cases
    results = run_cases(adapter_for("reference"), load_cases(["stop/"]))

Against a real engine: `checkpoints.build_checkpoints` compiles the script cases into forced
checkpoints, and `adapter_for("openai:URL", checkpoint=FOLDER)` runs them over HTTP
(`launch.run_launched` starts a server per checkpoint).

Names load lazily, as runtime's do: reading the cases (`decodespec conform --list`) does not
import the adapters, and through them torch.
"""

from __future__ import annotations

from ...lazy import lazy_exports

_EXPORTS = {
    "Adapter": "adapters",
    "EngineSpecError": "adapters",
    "Finding": "adapters",
    "Outcome": "adapters",
    "adapter_for": "adapters",
    "Case": "cases",
    "CaseError": "cases",
    "Grade": "cases",
    "load_cases": "cases",
    "save_case": "cases",
    "select_cases": "cases",
    "CaseResult": "runner",
    "Verdict": "runner",
    "run_case": "runner",
    "run_cases": "runner",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
