"""`hf`: transformers `generate` with `stop_strings` and a streamer (§4.3-§4.6).

Two ways to run it:

- On forced checkpoints (`hf:DIR`, DIR a checkpoint or a folder of them, `decodespec checkpoints
  build`): greedy `generate` on the real weights follows each case's compiled script by itself,
  so every case compiled into a checkpoint runs, judged as the HTTP engines are
  (judgement.judge_observed) against the reference on the checkpoint's tokenizer. What transformers
  shows: the returned ids (their count and text) and the streamer's chunks; it reports no finish
  reason, so that is not checked.
- On any other checkpoint whose tokenizer is a fixture kind: a LogitsProcessor forces the case's
  script (every other logit -inf), the output is what `generate` returns (special tokens skipped)
  and the streamer gives the deltas; judged against the reference's answer for the same ids.

Nothing the case is judged on is made up by the adapter: no terminal event is added, and the
length is `max_new_tokens`, applied by transformers.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ....runtime.tokenizers import HFTokenizer
from ..cases import Case
from .base import (
    Outcome,
    case_prompt,
    case_script,
    missing_capabilities,
    reference_expect,
    tokenizer_kind,
    unsupported_on,
)

if TYPE_CHECKING:
    from ..checkpoints import Checkpoint

CAPABILITIES = frozenset({"forced_script", "fixture_tokenizer", "stop_strings", "eos", "length_limit", "stream", "errors"})
# On forced checkpoints the inline byte tables are compiled into a tokenizer.json too.
FORCED_CAPABILITIES = CAPABILITIES | {"byte_table", "stop_token_ids"}


class HFAdapter:
    """transformers generate over the checkpoint(s) at `path` (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        from ..checkpoints import is_forced, load_set

        self.path = Path(path)
        if not self.path.is_dir():
            raise OSError(f"{self.path} is not a folder")
        self.forced = load_set(self.path) if is_forced(self.path) else None
        self.capabilities = FORCED_CAPABILITIES if self.forced is not None else CAPABILITIES
        self._models: dict[Path, Any] = {}
        if self.forced is None:
            self.tokenizer = HFTokenizer(self.path)
            self.kind = tokenizer_kind(self.tokenizer.path)
        self.name = f"hf-generate[{self.path.name}]"
        self._lock = threading.Lock()  # one generate at a time on a shared model

    def unsupported(self, case: Case) -> str | None:
        if self.forced is None:
            return unsupported_on(self, case, self.kind)
        if case.id not in self.forced:
            return f"not compiled into the forced checkpoints under {self.path}"
        return missing_capabilities(self, case)

    def _model(self, folder: Path) -> tuple[Any, Any]:
        if folder not in self._models:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self._models[folder] = (AutoTokenizer.from_pretrained(folder),
                                    AutoModelForCausalLM.from_pretrained(folder).eval())
        return self._models[folder]

    def _generate(self, folder: Path, prompt: list[int], case: Case, processors: list[Any]) -> tuple[Any, list[bytes]]:
        """(new ids or the exception generate raised, the streamer's chunks)."""
        import torch
        from transformers import LogitsProcessorList, TextIteratorStreamer

        hf_tok, model = self._model(folder)
        eos = model.generation_config.eos_token_id
        streamer = TextIteratorStreamer(hf_tok, skip_prompt=True, skip_special_tokens=True, timeout=60)
        kwargs: dict[str, Any] = dict(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=case.max_tokens, do_sample=False, streamer=streamer, pad_token_id=eos,
            logits_processor=LogitsProcessorList(processors))
        if case.inputs.get("stop"):
            kwargs.update(stop_strings=list(case.inputs["stop"]), tokenizer=hf_tok)
        if case.inputs.get("stop_token_ids"):
            kwargs["eos_token_id"] = [eos, *(s[0] for s in case.inputs["stop_token_ids"] if len(s) == 1)]
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["out"] = model.generate(**kwargs)
            except Exception as exc:  # surfaces as the Outcome's error
                box["error"] = exc
                streamer.end()

        with self._lock:
            thread = threading.Thread(target=work, name=f"hf-generate-{case.id}")
            thread.start()
            chunks = [c.encode("utf-8") for c in streamer]
            thread.join()
        if chunks and not chunks[-1]:
            chunks.pop()  # the streamer's end signal (its final flush, empty): not a delta
        if "error" in box:
            return box["error"], chunks
        return box["out"][0, len(prompt):].tolist(), chunks

    def run(self, case: Case) -> Outcome:
        if self.forced is not None:
            return self._run_forced(case, self.forced)
        tok = self.tokenizer
        prompt = case_prompt(case, tok)
        script = case_script(case, tok)
        _, model = self._model(self.path)
        new, chunks = self._generate(self.path, prompt, case, [_Force(script, len(prompt), model.generation_config.eos_token_id)])
        expect = reference_expect(case, tok, prompt, script)
        if isinstance(new, Exception):
            return Outcome(error=f"{type(new).__name__}: {new}", chunks=tuple(chunks), expect=expect)
        output = self._model(self.path)[0].decode(new, skip_special_tokens=True).encode("utf-8")
        return Outcome(output=output, chunks=tuple(chunks), expect=expect, notes=(f"generated ids {new}",))

    def _run_forced(self, case: Case, forced: dict[str, Checkpoint]) -> Outcome:
        from ..judgement import Observed, expected_for, judge_observed

        ck = forced[case.id]
        prog = ck.programs[case.id]
        new, chunks = self._generate(ck.folder, list(prog.prompt), case, [])
        exp = expected_for(case, ck)
        if isinstance(new, Exception):
            obs = Observed(error=f"{type(new).__name__}: {new}", chunks=tuple(chunks), reason_shown=False)
        else:
            text = self._model(ck.folder)[0].decode(new, skip_special_tokens=True).encode("utf-8")
            obs = Observed(text=text, completion_tokens=len(new), chunks=tuple(chunks), reason_shown=False)
        findings, not_checked = judge_observed(exp, obs)
        return Outcome(output=obs.text, chunks=obs.chunks, error=obs.error, findings=tuple(findings),
                       not_checked=tuple(not_checked), judged=True, reference=exp.to_json(),
                       notes=(f"checkpoint {ck.group}; generated ids {new if not isinstance(new, Exception) else '-'}; "
                              f"script ids {list(prog.script)}",))


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
