"""`hf`: transformers `generate` on a local checkpoint, with `stop_strings` and a streamer (§4.3-§4.6).

A LogitsProcessor forces the case's script (every other logit -inf), `stop_strings` carries the
case's stop strings, `max_new_tokens` its limit, and a `TextIteratorStreamer` gives the deltas.
The output is what `generate` returns, decoded as transformers decodes it (special tokens skipped);
the events are derived from the streamer: response.start, one response.delta per non-empty chunk,
response.completed. transformers reports no finish reason and no usage, so those are not checked.
The expected output is the reference loop's on this checkpoint's tokenizer (`reference_expect`),
so a checkpoint whose tokenizer differs from the case's fixture is judged on its own ids.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any


from ....runtime.events import Event, EventKind
from ....runtime.tokenizers import HFTokenizer
from ..cases import Case
from .base import Outcome, case_prompt, case_script, reference_expect, tokenizer_kind, unsupported_on

CAPABILITIES = frozenset({"forced_script", "fixture_tokenizer", "stop_strings", "eos", "length_limit", "stream", "errors"})


class HFAdapter:
    """transformers generate over the checkpoint at `path` (its tokenizer must be a fixture kind)."""

    capabilities = CAPABILITIES

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = Path(path)
        self.tokenizer = HFTokenizer(self.path)
        self.kind = tokenizer_kind(self.tokenizer.path)
        self.hf_tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path).eval()
        self.name = f"hf-generate[{self.path.name}]"
        self._lock = threading.Lock()  # one generate at a time on the shared model

    def unsupported(self, case: Case) -> str | None:
        return unsupported_on(self, case, self.kind)

    def run(self, case: Case) -> Outcome:
        import torch
        from transformers import LogitsProcessorList, TextIteratorStreamer

        tok = self.tokenizer
        prompt = case_prompt(case, tok)
        script = case_script(case, tok)
        eos = self.model.generation_config.eos_token_id
        streamer = TextIteratorStreamer(self.hf_tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=60)
        kwargs: dict[str, Any] = dict(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=case.max_tokens, do_sample=False, streamer=streamer,
            logits_processor=LogitsProcessorList([_Force(script, len(prompt), eos)]), pad_token_id=eos,
        )
        if case.inputs.get("stop"):
            kwargs.update(stop_strings=list(case.inputs["stop"]), tokenizer=self.hf_tokenizer)
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["out"] = self.model.generate(**kwargs)
            except Exception as exc:  # surfaces as the Outcome's error
                box["error"] = exc
                streamer.end()

        with self._lock:
            thread = threading.Thread(target=work, name=f"hf-generate-{case.id}")
            thread.start()
            chunks = [c.encode("utf-8") for c in streamer if c]
            thread.join()
        if "error" in box:
            return Outcome(error=f"{type(box['error']).__name__}: {box['error']}", chunks=tuple(chunks),
                           expect=reference_expect(case, tok, prompt, script))
        new = box["out"][0, len(prompt):].tolist()
        output = self.hf_tokenizer.decode(new, skip_special_tokens=True).encode("utf-8")
        return Outcome(output=output, chunks=tuple(chunks), events=_stream_events(case.id, chunks),
                       expect=reference_expect(case, tok, prompt, script),
                       notes=(f"generated ids {new}",))


class _Force:
    """Forces script[t] at output step t (EOS once the script is exhausted)."""

    def __init__(self, script: list[int], prompt_len: int, eos: int | None) -> None:
        self.script, self.prompt_len, self.eos = script, prompt_len, eos

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        t = input_ids.shape[1] - self.prompt_len
        forced = self.script[t] if t < len(self.script) else self.eos
        out = scores.new_full(scores.shape, float("-inf"))
        out[:, forced] = 0.0
        return out


def _stream_events(rid: str, chunks: list[bytes]) -> tuple[Event, ...]:
    kinds = [(EventKind.RESPONSE_START, {})]
    kinds += [(EventKind.RESPONSE_DELTA, {"seq": i, "bytes": c}) for i, c in enumerate(chunks)]
    kinds.append((EventKind.RESPONSE_COMPLETED, {"seq": len(chunks)}))
    return tuple(Event(k, rid, i, 0.0, d) for i, (k, d) in enumerate(kinds))
