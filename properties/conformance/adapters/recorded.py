"""A report's recorded exchanges as the server a script case talks to, offline (§4.3-§4.10).

`Recording` is a ScriptServer (script_server.py) and an Adapter whose requests are answered from
the exchanges a report kept for one failing case (`reproducer.exchanges`) instead of the network,
so http_script.run_script judges them again, in its own order, with today's judge. A request is
matched to its recording by its path and body (`request_key`: max_tokens, stream, the usage chunk
and the per-token report fields asked). A request the recording does not hold is an
`Unrecorded` error naming it, but for two the recording leaves out by design, each listed as not
checked: a limit of the sweep that passed (a recording keeps only the limits that failed, so the
sweep runs at those alone: `sweep` is their set), and a stream asking for per-token reports (D59)
where the recording holds none, answered as never sent (status 0), as the judge reads a stream
that was not asked for.

A script case is judged on its own tokenizer, prompt and script (`CaseProgram`): a forced
checkpoint's ids are the case's (checkpoints.py), so no checkpoint is needed. The prefix probe
(D26) is not recorded: the prompt is taken as placed where the answer's usage.prompt_tokens counts
it (the probe was checked when the report was made).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ....runtime.tokenizers import ByteTableTokenizer, HFTokenizer
from ..alignment import aligned, asks_reports
from ..cases import Case, CaseError, CaseKind
from ..chat_cases import chat_of
from ..checkpoints import reference_result
from ..engine_wide import sent
from ..forced import Program
from ..http_script import PATH, run_script
from ..script_check import Prefix
from ..wire import Streamed, parse_sse, token_count
from .base import Outcome, case_prompt, case_script, case_tokenizer
from .openai import retried_connections

Key = tuple[Any, Any, bool, bool, bool, bool]
# What a body may ask that changes what its answer must hold: the usage chunk, per-token reports (D59).
ASKED = ("stream_options.include_usage", "logprobs", "return_token_ids")


class Unrecorded(CaseError):
    """A request the recording does not hold: nothing answers it offline."""


def request_key(path: Any, body: Mapping[str, Any]) -> Key:
    """What tells a script case's requests apart: path, max_tokens, stream, and which of `ASKED` it
    asks (an answer to a body that did not ask for one cannot show whether it was honoured)."""
    usage, logprobs, ids = (sent(body, field) for field in ASKED)
    return (path, body.get("max_tokens"), bool(body.get("stream")), usage, logprobs, ids)


def _shown(key: Key) -> str:
    path, k, stream, *on = key
    asked = [field for field, yes in zip(ASKED, on, strict=True) if yes]
    return f"POST {path} max_tokens={k} {'streamed' if stream else 'not streamed'}" + (
        f" asking for {' and '.join(asked)}" if asked else "")


def replayable(case: Case) -> str | None:
    """Why `case`'s recorded exchanges cannot be judged again offline, or None."""
    if case.kind is not CaseKind.SCRIPT:
        return "a black-box recipe: its verdict rests on timing and probes a recording does not keep"
    if chat_of(case) is not None:
        return "a chat variant: judged on the chat template's prompt, which needs its checkpoint"
    if aligned(case):
        return "its per-token reports are judged on the served checkpoint's tokenizer"
    return None


@attrs.frozen
class CaseProgram:
    """What run_script reads of a forced checkpoint (checkpoints.ScriptPrograms), from the case
    alone: its program (prompt and script ids), tokenizer and EOS id, whose ids a forced
    checkpoint's are (checkpoints.py). No chat prompt: a chat variant is not replayable."""

    group: str
    programs: Mapping[str, Program]
    tokenizer: ByteTableTokenizer | HFTokenizer
    eos_id: int
    chat: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)

    @classmethod
    def of(cls, case: Case) -> CaseProgram:
        tok = case_tokenizer(case)
        if tok.eos_id is None:
            raise CaseError(f"{case.id}: its tokenizer has no EOS, so it never ran on a forced checkpoint")
        prog = Program(case.id, -1, case_prompt(case, tok), case_script(case, tok))
        return cls(f"{case.id}'s own tokenizer", {case.id: prog}, tok, tok.eos_id)


class Recording:
    """One case's recorded exchanges, answering run_script's requests (see module)."""

    capabilities: frozenset[str] = frozenset()
    prompt_note = ""

    def __init__(self, case: Case, exchanges: Sequence[Mapping[str, Any]], name: str = "replay") -> None:
        if why := replayable(case):
            raise CaseError(f"{case.id} cannot be judged again from a recording: {why}")
        self.case_id = case.id
        self.name = name
        self.checkpoint = CaseProgram.of(case)
        self.exchanges = tuple(exchanges)
        self.held: dict[Key, Mapping[str, Any]] = {}
        for ex in self.exchanges:
            req = ex.get("request") or {}
            if isinstance(req.get("body"), dict) and "status" in ex:
                self.held.setdefault(request_key(req.get("path"), req["body"]), ex)
        streams = {key[:2] for key in self.held if key[2] and not any(key[4:])}  # the plain stream at each limit
        both = [key[1] for key in self.held if key[0] == PATH and not key[2] and key[:2] in streams]
        self.sweep: frozenset[int] = frozenset(both)  # held both ways: the served limit and the sweep's that failed
        self.model = next((str(ex["request"]["body"].get("model")) for ex in self.held.values()), "replay")
        self.not_held: list[str] = []  # what a request found missing and the judge could not check
        self.missing: Unrecorded | None = None

    def unsupported(self, case: Case) -> str | None:
        return None if case.id == self.case_id else f"the recording is {self.case_id}'s, not {case.id}'s"

    def run(self, case: Case) -> Outcome:
        """run_script over the recording; a connection it shows sent again is a finding, as live."""
        out = run_script(self, case)
        if out.skip:
            return attrs.evolve(out, exchanges=self.exchanges)
        left = sorted(set(range(1, len(self.checkpoint.programs[case.id].script) + 1)) - self.sweep)
        return attrs.evolve(
            out, findings=(*out.findings, *retried_connections(self.exchanges)), exchanges=self.exchanges,
            not_checked=(*out.not_checked, *self.not_held, "the prompt's placement (D26): the recording keeps no "
                         "prefix probe", *([f"max_tokens {left} (the recording keeps only the limits that failed "
                                            "when it was made)"] if left else [])))

    def _answer(self, path: str, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return self.held.get(request_key(path, body))

    def _unrecorded(self, path: str, body: Mapping[str, Any]) -> Unrecorded:
        self.missing = Unrecorded(f"{self.case_id}: the recording holds no answer to {_shown(request_key(path, body))} "
                                  f"(it holds {', '.join(_shown(k) for k in self.held) or 'none'})")
        return self.missing

    # ---- the ScriptServer side: requests answered from the recording ----------------------------

    def post(self, path: str, body: dict[str, Any], log: list[dict[str, Any]] | None = None) -> tuple[int, Any, str]:
        ex = self._answer(path, body)
        if ex is None:
            raise self._unrecorded(path, body)
        raw = str(ex.get("response", ""))
        try:
            data = json.loads(raw)
        except ValueError:  # cut in the middle by the report (reports.trim_middle), or no JSON
            data = None
        return int(ex["status"]), data, raw

    def stream_body(self, path: str, body: dict[str, Any], *, log: list[dict[str, Any]] | None = None) -> Streamed:
        ex = self._answer(path, body)
        if ex is None and asks_reports(body):
            self.not_held.append(f"the stream at max_tokens={body.get('max_tokens')} asking for per-token reports "
                                 "(D59): the recording holds none")
            return Streamed()
        if ex is None:
            raise self._unrecorded(path, body)
        return parse_sse(str(ex.get("sse", "")), status=int(ex["status"]))

    def log_exchanges(self, entries: list[dict[str, Any]]) -> None:
        """Nothing to add: the recording is the case's log."""

    def reference(self, case: Case) -> Any:
        return reference_result(case, self.checkpoint)

    def prefix(self) -> Prefix:
        """The tokens before the case's prompt as the first non-streamed answer's usage.prompt_tokens
        counts them (the marker and anchor the report's checkpoint put there, and the engine's own),
        so the prompt reads as placed (see module)."""
        first = next((ex for key, ex in self.held.items() if key[0] == PATH and not key[2]), {})
        try:
            usage = json.loads(str(first.get("response", ""))).get("usage")
        except (ValueError, AttributeError):
            usage = None
        sent = token_count(usage, "prompt_tokens")
        before = 0 if sent is None else sent - len(self.checkpoint.programs[self.case_id].prompt)
        return Prefix(before, False, "the recording keeps no prefix probe: the prompt is taken as placed")

    def prompt_for(self, ids: list[int]) -> list[int]:
        return ids
