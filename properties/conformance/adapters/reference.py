"""`reference`: this project's generate() in process, its full trace checked with check_trace (§4.3)."""

from __future__ import annotations

from ....runtime.openai_schema import FIELDS
from ..cases import Case
from .base import REQUEST, Outcome, case_prompt, case_script, case_tokenizer, missing_capabilities, reference_on

CAPABILITIES = frozenset({
    "forced_script", "byte_table", "fixture_tokenizer", "stop_strings", "stop_token_ids", "faults",
    "eos", "length_limit", "context_limit", "trace", "stream", "finish_reason", "state", "usage", "errors",
}) | {REQUEST + name for name in FIELDS[False]}  # every completions field decodespec serve knows


class ReferenceAdapter:
    """ScriptedModel forces the case's script over the case's tokenizer; every event is kept."""

    name = "reference"
    capabilities = CAPABILITIES

    def unsupported(self, case: Case) -> str | None:
        return missing_capabilities(self, case)

    def run(self, case: Case) -> Outcome:
        tok = case_tokenizer(case)
        res = reference_on(case, tok, case_prompt(case, tok), case_script(case, tok))
        return Outcome(
            output=res.output,
            finish_reason=str(res.finish_reason.value if hasattr(res.finish_reason, "value") else res.finish_reason),
            state=res.state.name,
            events=res.events,
            chunks=tuple(bytes(e.data["bytes"]) for e in res.events if e.kind == "response.delta"),
            error=res.error,
            usage=res.usage.as_dict(),
            full_trace=True,
        )
