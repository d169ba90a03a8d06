"""`reference`: this project's generate() in process, its full trace checked with check_trace (§4.3)."""

from __future__ import annotations

from ....runtime.faults import Fault, FaultPlan
from ....runtime.loop import generate
from ....runtime.models import ScriptedModel
from ....runtime.request import Request
from ..cases import Case
from .base import Outcome, case_prompt, case_script, case_tokenizer, missing_capabilities

CAPABILITIES = frozenset({
    "forced_script", "byte_table", "fixture_tokenizer", "stop_strings", "stop_token_ids", "faults",
    "eos", "length_limit", "context_limit", "trace", "stream", "finish_reason", "state", "usage", "errors",
})


class ReferenceAdapter:
    """ScriptedModel forces the case's script over the case's tokenizer; every event is kept."""

    name = "reference"
    capabilities = CAPABILITIES

    def unsupported(self, case: Case) -> str | None:
        return missing_capabilities(self, case)

    def run(self, case: Case) -> Outcome:
        tok = case_tokenizer(case)
        script = case_script(case, tok)
        inp = case.inputs
        model = ScriptedModel(script, vocab_size=max(tok.vocab_size, max(script) + 1),
                              context_limit=int(inp.get("context_limit", 4096)))
        request = Request(
            case_prompt(case, tok),
            stop=tuple(inp.get("stop", ())),
            stop_token_ids=tuple(tuple(s) for s in inp.get("stop_token_ids", ())),
            max_output_tokens=case.max_tokens,
            request_id=case.id,
        )
        faults = FaultPlan([Fault(**f) for f in inp.get("faults", ())])
        res = generate(request, model=model, tokenizer=tok, faults=faults)
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
