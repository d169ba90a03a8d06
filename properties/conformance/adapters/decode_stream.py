"""`decode-stream`: tokenizers' `DecodeStream` on the detokenizer cases (§4.5).

The script's ids are fed one by one after the prompt (given to DecodeStream as its prefill ids);
the chunks are the deltas and their concatenation the output. DecodeStream has no flush: whatever
it still holds after the last id is simply never returned, which the cases observe as a lost
tail (no error is raised). The adapter feeds the first `max_tokens` ids (what an engine selects);
DecodeStream applies no stop rules and knows no EOS, so cases that need them are skipped.
"""

from __future__ import annotations

from pathlib import Path


from ....runtime.tokenizers import HFTokenizer
from ..cases import Case
from .base import Outcome, case_prompt, case_script, reference_expect, tokenizer_kind, unsupported_on

CAPABILITIES = frozenset({"forced_script", "fixture_tokenizer", "length_limit", "stream", "errors"})


class DecodeStreamAdapter:
    """One DecodeStream per case, over the tokenizer.json the engine spec names."""

    capabilities = CAPABILITIES

    def __init__(self, tokenizer_json: str | Path) -> None:
        self.tokenizer = HFTokenizer(tokenizer_json)
        self.kind = tokenizer_kind(self.tokenizer.path)
        self.name = f"decode-stream[{self.kind or Path(tokenizer_json).name}]"

    def unsupported(self, case: Case) -> str | None:
        return unsupported_on(self, case, self.kind)

    def run(self, case: Case) -> Outcome:
        from tokenizers.decoders import DecodeStream

        tok = self.tokenizer
        prompt = case_prompt(case, tok)
        stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        chunks: list[bytes] = []
        error = None
        script = case_script(case, tok)
        for tid in script[: case.max_tokens]:  # the ids an engine would have selected
            try:
                piece = stream.step(tok.backend, tid)
            except Exception as exc:  # tokenizers raises a plain Exception on undecodable input
                error = f"decoding_error: {exc}"
                break
            if piece:
                chunks.append(piece.encode("utf-8"))
        expect = reference_expect(case, tok, prompt, script)
        return Outcome(
            output=b"".join(chunks), chunks=tuple(chunks), error=error, expect=expect,
            notes=("DecodeStream has no flush: bytes it still holds after the last id are not returned",),
        )
