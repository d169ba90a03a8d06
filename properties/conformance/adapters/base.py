"""The adapter interface: `run(case) -> Outcome`, plus what every white-box adapter shares.

An adapter declares its `capabilities`; a case whose `requires` are not all among them is a SKIP
with the reason (never a pass). Within a run, a check the adapter cannot observe (a finish reason
from an engine that reports none) is listed as not checked in the verdict.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from ....runtime.models import FORCED_LOGIT, ScriptedModel
from ....runtime.tokenizers import ByteTableTokenizer, HFTokenizer
from .. import cases as _cases
from ..cases import Case, CaseError
from ..forced import LOGIT

FIXTURE_DIR = Path(tempfile.gettempdir()) / "decodespec-conformance-fixtures"


@attrs.frozen
class Finding:
    """One thing an engine got wrong, named by the invariant whose statement it breaks.

    `symptom` says what was seen (a key of symptoms.SYMPTOMS: 'stop_sent', 'past_limit', ...);
    `family` is "semantics" (a rule of chapter 4) or "wire" (an OpenAI wire convention, graded as
    such, never as a §4.x MUST); `fields`, the request fields it shows had no effect, where it names
    them itself (its basis: symptoms.basis_of)."""

    invariant: str
    message: str
    symptom: str = ""
    family: str = "semantics"
    fields: tuple[str, ...] = ()


@attrs.frozen
class Outcome:
    """What an engine did for one case. None means the engine does not expose that field."""

    output: bytes | None = None
    finish_reason: str | None = None
    state: str | None = None
    events: tuple[Any, ...] | None = None  # runtime Events (full_trace) or stream-level ones
    chunks: tuple[bytes, ...] | None = None  # streamed deltas, in order
    error: str | None = None
    usage: Mapping[str, int] | None = None
    full_trace: bool = False  # events are a complete reference-vocabulary trace (check_trace)
    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()
    skip: str | None = None  # the adapter found at run time that it cannot run the case
    abort: str | None = None  # the run could not be judged (the engine left its forced script, D27): ERROR
    # What this run must meet, when the adapter compiled the case for its engine (over HTTP: the
    # reference loop's answer on the engine's checkpoint, in the wire's vocabulary); else the case's.
    expect: _cases.Expect | None = None
    exchanges: tuple[Mapping[str, Any], ...] = ()  # requests sent and raw answers (cut in the middle if long)
    reference: Mapping[str, Any] | None = None  # the reference engine's answer on the same checkpoint
    not_checked: tuple[str, ...] = ()  # what the case expects that this run could not observe
    judged: bool = False  # the adapter judged the answer itself (judgement.py): `findings` is the verdict
    server: Mapping[str, Any] | None = None  # the server judged (URL, version, launch, checkpoint hash)


def raised(exc: BaseException) -> str:
    """An exception as an ERROR's reason: its class by name, with its whole message where it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class RunRaised(Exception):
    """A run that raised (the engine, the adapter or the judge broke), with what the adapter had
    exchanged by then (`exchanges`, `server`), so the case's ERROR keeps them as its reproducer and
    the answers can be judged again offline (replay.py)."""

    def __init__(self, cause: Exception, exchanges: Sequence[Mapping[str, Any]],
                 server: Mapping[str, Any] | None = None) -> None:
        super().__init__(raised(cause))
        self.cause = cause
        self.exchanges = tuple(exchanges)
        self.server = server


class Adapter(Protocol):
    """One engine under test."""

    name: str
    capabilities: frozenset[str]

    def unsupported(self, case: Case) -> str | None:
        """Why this adapter cannot run `case` (a SKIP reason), or None."""

    def run(self, case: Case) -> Outcome: ...


# What each capability means, for SKIP reasons a reader can act on.
CAPABILITY_TEXT = {
    "http": "a black-box HTTP recipe (run it with --engine openai:URL)",
    "forced_script": "a forced token script",
    "byte_table": "an inline byte-table tokenizer",
    "fixture_tokenizer": "a fixture tokenizer of the engine's kind",
    "stop_strings": "stop strings",
    "stop_token_ids": "stop token-id sequences",
    "faults": "fault injection",
    "eos": "an EOS token in the script",
    "length_limit": "the engine to apply max_tokens",
    "context_limit": "a context limit",
    "trace": "an internal event trace (selection, decode, resources)",
}
REQUEST = "request."  # a case's `inputs.request` field F needs the capability "request.F"


def request_needs(case: Case) -> frozenset[str]:
    """The capabilities the case's `inputs.request` fields (OpenAI names) need."""
    return frozenset(REQUEST + name for name in case.inputs.get("request", {}))


def missing_capabilities(adapter: Adapter, case: Case) -> str | None:
    """The default `unsupported`: the case's requirements the adapter lacks, in words."""
    missing = sorted((case.requires | request_needs(case)) - adapter.capabilities)
    if not missing:
        return None
    return f"{adapter.name} cannot run {'; '.join(_capability_text(m) for m in missing)}"


def _capability_text(name: str) -> str:
    if name.startswith(REQUEST):
        return f"the request field {name[len(REQUEST):]}"
    return CAPABILITY_TEXT.get(name, name)


def context_unmet(case: Case, need: int, started: int | None, running: Callable[[], tuple[int | None, str]], *,
                  who: str, how: str, differs: str = "") -> str | None:
    """Why a case with a context limit cannot be judged on an engine (§4.3, D10), or None. It needs
    the engine started with the `need` positions the case's limit comes to on its checkpoint
    (`started`; `how` says how to start it so), and the engine's own word that it runs with them:
    `running()` gives the number it says (None: it says none) and where it says it. `who` names the
    engine, `differs` says why a number said may differ from the one asked."""
    if started != need:
        return (f"it needs {who} started with a context length of {need} (the case's "
                f"{case.inputs['context_limit']} and the program's marker and anchor; {how})")
    said, where = running()
    if said is None:
        return (f"{who} does not say the context length it runs with ({where}), so whether the case's "
                f"limit of {need} positions is where its runs end cannot be known")
    if said != need:
        return (f"{who} runs with a context of {said} positions ({where}), not the {need} it was "
                f"started with{differs}: the case's limit is not where its runs end")
    return None


def unsupported_on(adapter: Adapter, case: Case, kind: str | None) -> str | None:
    """`unsupported` for an engine with one tokenizer of fixture shape `kind`."""
    missing = missing_capabilities(adapter, case)
    if missing is None and case.fixture != kind:
        return f"the case's tokenizer is {case.fixture}; {adapter.name} runs a {kind} tokenizer"
    return missing


# ---- tokenizers and scripts of script cases ----------------------------------------------------


@functools.cache
def fixture_tokenizer(name: str) -> HFTokenizer:
    """The properties/fixtures.py tokenizer `name`, trained once per process into a temp folder."""
    from ... import fixtures

    build = fixtures.BUILDERS.get(name)
    if build is None:
        raise CaseError(f"unknown tokenizer fixture {name!r}; known: {', '.join(fixtures.BUILDERS)}")
    return HFTokenizer(build(FIXTURE_DIR))


def table_tokenizer(spec: Mapping[str, Any]) -> ByteTableTokenizer:
    """An inline byte table `{"table": {"101": "AB", ...}, "eos": 0}`."""
    try:
        table = {int(k): _cases.as_bytes(v, f"tokenizer.table[{k}]") for k, v in spec["table"].items()}
    except ValueError as exc:
        raise CaseError(f"tokenizer.table: {exc}") from None
    return ByteTableTokenizer(table, eos_id=spec.get("eos"))


def case_tokenizer(case: Case) -> ByteTableTokenizer | HFTokenizer:
    spec = case.tokenizer_spec
    return table_tokenizer(spec) if "table" in spec else fixture_tokenizer(spec["fixture"])


def tokenizer_kind(path: str | Path) -> str | None:
    """Which fixture shape a tokenizer.json has (by its decoder), so a case can run on it."""
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    decoder = json.loads(p.read_text(encoding="utf-8")).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    if "ByteLevel" in kinds:
        return "byte_level_bpe"
    if "ByteFallback" in kinds:
        return "sentencepiece_byte_fallback"
    if "WordPiece" in kinds:
        return "wordpiece"
    return None


@functools.cache
def _single_tokens(tok: Any) -> dict[bytes, int]:
    """bytes -> the id of a token contributing exactly those bytes (mid-sequence), lowest id first."""
    plan = tok.plan(skip_special=True)
    if plan is None:
        return {}
    out: dict[bytes, int] = {}
    for tid in sorted(plan.rest):
        out.setdefault(plan.rest[tid], tid)
    return out


def resolve_ids(items: Sequence[Any], tok: Any, where: str) -> list[int]:
    """Script or prompt items to ids: an int, `{"text"}`, `{"bytes": hex}`, `{"token"}`, `{"eos"}`."""
    ids: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, int) and not isinstance(item, bool):
            ids.append(item)
        elif isinstance(item, Mapping) and "text" in item:
            ids.extend(tok.encode(item["text"]))
        elif isinstance(item, Mapping) and "bytes" in item:
            data = bytes.fromhex(item["bytes"])
            tid = _single_tokens(tok).get(data)
            if tid is None:
                raise CaseError(f"{where}[{i}]: the tokenizer has no single token for bytes {data!r}")
            ids.append(tid)
        elif isinstance(item, Mapping) and "token" in item:
            backend = getattr(tok, "backend", None)
            tid = backend.token_to_id(item["token"]) if backend is not None else None
            if tid is None:
                raise CaseError(f"{where}[{i}]: the tokenizer has no token {item['token']!r}")
            ids.append(tid)
        elif isinstance(item, Mapping) and item.get("eos"):
            if tok.eos_id is None:
                raise CaseError(f"{where}[{i}]: the script asks for EOS but the tokenizer has none")
            ids.append(tok.eos_id)
        else:
            raise CaseError(f"{where}[{i}]: {item!r} is not an id, text, bytes, token or eos item")
    return ids


def case_prompt(case: Case, tok: Any) -> list[int]:
    """The prompt ids: a list of items, or `{"text": ...}` (default `{"text": "The"}`)."""
    prompt = case.inputs.get("prompt", {"text": "The"})
    if isinstance(prompt, Mapping):
        prompt = [prompt]
    return resolve_ids(prompt, tok, f"{case.id}: inputs.prompt")


def case_script(case: Case, tok: Any) -> list[int]:
    return resolve_ids(case.inputs["script"], tok, f"{case.id}: inputs.script")


def reference_on(case: Case, tok: Any, prompt: Sequence[int], script: Sequence[int], *,
                 finish_tokens: Mapping[str, Sequence[int]] | None = None) -> Any:
    """The reference loop's Result for `case` over `tok`, forcing `script` after `prompt` (§4.3),
    with the case's stops, limits, context limit and faults, and its `inputs.request` fields
    (OpenAI names -> values) mapped as `decodespec serve` maps them
    (openai_schema.request_options); `n` and `best_of` are judged per choice: every choice of a
    greedy case is this one run (DECISIONS D34). With request fields the scripted token leads by the
    forced checkpoint's logit (forced.LOGIT), so a logit_bias or a penalty acts on both alike.
    `finish_tokens`: the token finish checks a server names (a chat request with tools: D47)."""
    from ....runtime.errors import RequestError
    from ....runtime.faults import Fault, FaultPlan
    from ....runtime.loop import generate
    from ....runtime.openai_schema import FIELDS, ApiError, request_options
    from ....runtime.request import Request

    inp = case.inputs
    fields = inp.get("request", {})
    vocab = max(tok.vocab_size, max(script) + 1)
    unknown = sorted(set(fields) - set(FIELDS[False]))
    if unknown:
        raise CaseError(f"{case.id}: inputs.request.{unknown[0]} is not a completions field decodespec serve knows")
    try:
        options = request_options(fields, vocab)
    except ApiError as exc:
        raise CaseError(f"{case.id}: inputs.request: {exc.message}") from None
    kind = _CheckpointLogits if fields else ScriptedModel
    model = kind(list(script), vocab_size=vocab, context_limit=int(inp.get("context_limit", 4096)))
    try:
        request = Request(list(prompt), stop=tuple(inp.get("stop", ())),
                          stop_token_ids=tuple(tuple(s) for s in inp.get("stop_token_ids", ())),
                          max_output_tokens=case.max_tokens, request_id=case.id,
                          finish_tokens=dict(finish_tokens or {}), **options)
    except RequestError as exc:
        raise CaseError(f"{case.id}: inputs.request: {exc}") from None
    faults = FaultPlan([Fault(**f) for f in inp.get("faults", ())])
    return generate(request, model=model, tokenizer=tok, faults=faults)


class _CheckpointLogits(ScriptedModel):
    """ScriptedModel with the forced checkpoint's margin: the scripted token's logit is
    forced.LOGIT, every other 0 (properties/conformance/forced.py)."""

    def _logits(self, caches: Any) -> Any:
        return super()._logits(caches) * (LOGIT / FORCED_LOGIT)


def reference_expect(case: Case, tok: Any, prompt: Sequence[int], script: Sequence[int]) -> _cases.Expect:
    """What an engine running `tok` must answer: the reference's output, reason and state on the same
    tokenizer and ids, never the case file's text (which holds for the case's own tokenizer only).
    The case's stream-level event constraints still apply."""
    res = reference_on(case, tok, prompt, script)
    return _cases.Expect(output=res.output, finish_reason=res.finish_reason.value, state=res.state.name,
                         error=case.expect.error, events=case.expect.events)
