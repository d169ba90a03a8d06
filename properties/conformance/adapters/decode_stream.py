"""`decode-stream`: tokenizers' `DecodeStream` on the detokenizer cases (§4.5).

The script's ids are fed one by one after the prompt (given to DecodeStream as its prefill ids);
the chunks are the deltas and their concatenation the output. DecodeStream has no flush: whatever
it still holds after the last id is simply never returned, which the cases observe as a lost
tail (no error is raised). The adapter feeds the first `max_tokens` ids (what an engine selects),
so the length limit is the adapter's and is listed as not checked; DecodeStream applies no stop
rules and knows no EOS, so cases that need them are skipped.

`decode-stream:PATH` takes a tokenizer.json (the cases of its fixture kind run, on their own ids)
or forced checkpoints (a checkpoint or a folder of them): then every case compiled into one runs
on that checkpoint's tokenizer.json and compiled ids, the inline byte tables included.
"""

from __future__ import annotations

from pathlib import Path

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

CAPABILITIES = frozenset({"forced_script", "fixture_tokenizer", "length_limit", "stream", "errors"})


class DecodeStreamAdapter:
    """One DecodeStream per case, over the tokenizer.json (or forced checkpoints) the engine spec names."""

    def __init__(self, path: str | Path) -> None:
        from ..checkpoints import is_forced, load_set

        self.forced = load_set(path) if is_forced(path) else None
        self.capabilities = CAPABILITIES | {"byte_table"} if self.forced is not None else CAPABILITIES
        if self.forced is None:
            self.tokenizer = HFTokenizer(path)
            self.kind = tokenizer_kind(self.tokenizer.path)
        self.name = f"decode-stream[{'forced' if self.forced is not None else self.kind or Path(path).name}]"

    def unsupported(self, case: Case) -> str | None:
        if self.forced is None:
            return unsupported_on(self, case, self.kind)
        if case.id not in self.forced:
            return "not compiled into the forced checkpoints given"
        return missing_capabilities(self, case)

    def run(self, case: Case) -> Outcome:
        from tokenizers.decoders import DecodeStream

        if self.forced is not None:
            ck = self.forced[case.id]
            tok, prompt, script = ck.tokenizer, list(ck.programs[case.id].prompt), list(ck.programs[case.id].script)
        else:
            tok = self.tokenizer
            prompt, script = case_prompt(case, tok), case_script(case, tok)
        stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        chunks: list[bytes] = []
        error = None
        for tid in script[: case.max_tokens]:  # the ids an engine would have selected
            try:
                piece = stream.step(tok.backend, tid)
            except Exception as exc:  # tokenizers raises a plain Exception on undecodable input
                error = f"decoding_error: {exc}"
                break
            if piece:
                chunks.append(piece.encode("utf-8"))
        expect = reference_expect(case, tok, prompt, script)
        cut = ("the length limit (the adapter feeds max_tokens ids: DecodeStream applies none)",) \
            if len(script) > case.max_tokens else ()
        return Outcome(
            output=b"".join(chunks), chunks=tuple(chunks), error=error, expect=expect, not_checked=cut,
            notes=("DecodeStream has no flush: bytes it still holds after the last id are not returned",),
        )
