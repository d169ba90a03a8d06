"""Shrinking a failing example to a minimal one with the same symptom (§4.3-§4.10 findings).

A failure is keyed by its lead finding's symptom and basis (`failure_key`): two examples that fail
with the same key show the same deviation. `candidates(inputs)` lists the examples one step smaller
(`size`): a script item or a run of items fewer (a chat example's channels shorter: its reasoning,
its call's JSON, a tag), a stop fewer or one character shorter, a smaller max_tokens, a request
field or the stop token ids fewer, a chat example's reasoning or tools no longer asked (where its
script allows: strategies.well_posed) or its template ChatML, a shorter prompt. `shrink_all` shrinks
several failures at once, one batch per round: every target's candidates are compiled into the same
checkpoints and run on one engine start (batch.run_batch), each target moves to its smallest
candidate that fails with its key, and a target none of whose candidates fails is minimal. The
order of candidates is fixed, so the result is deterministic for a deterministic engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from ..cases import CaseError
from ..runner import CaseResult, Verdict
from .strategies import settled, spelled, well_posed

Inputs = Mapping[str, Any]
Key = tuple[str, str, str]


def failure_key(r: CaseResult) -> Key | None:
    """(symptom, basis kind, basis ref) of a result that fails (FAIL or DIFFERS), else None."""
    if r.verdict not in (Verdict.FAIL, Verdict.DIFFERS) or r.lead is None:
        return None
    lead = r.lead
    basis = r.basis(lead)
    return (lead.symptom or lead.invariant, basis.kind, basis.ref)


def size(inputs: Inputs) -> tuple[int, ...]:
    """How big an example is: its parts' total first, then script, stops, limit, fields (a chat
    example's settings among them), prompt."""
    parts = (len(inputs["script"]), sum(len(s) + 1 for s in inputs.get("stop", ())), int(inputs["max_tokens"]),
             2 * len(inputs.get("request", {})) + len(inputs.get("stop_token_ids", ())) + _chat_size(inputs),
             _prompt_len(inputs))
    return (sum(parts), *parts)


def _chat_size(inputs: Inputs) -> int:
    """A chat example's settings: each channel asked, and a template other than ChatML."""
    chat = inputs.get("chat") or {}
    return sum(bool(chat.get(flag)) for flag in ("reasoning", "tools")) + (chat.get("template", "chatml") != "chatml")


def _prompt_len(inputs: Inputs) -> int:
    p = inputs.get("prompt", [])
    return len(p) if isinstance(p, list) else 1


def _without(seq: Sequence[Any], i: int) -> list[Any]:
    return [*seq[:i], *seq[i + 1:]]


def _steps(inputs: Inputs) -> Iterator[dict[str, Any]]:
    """The raw one-step-smaller edits of `inputs` (see module), possibly not runnable."""
    script, stops = list(inputs["script"]), list(inputs.get("stop", ()))
    req = dict(inputs.get("request", {}))
    for k in range(1, len(script)):  # the script cut short
        yield {**inputs, "script": script[:k]}
    for i in range(len(script)):
        if len(script) > 1:
            yield {**inputs, "script": _without(script, i)}
    for i, s in enumerate(stops):
        rest = _without(stops, i)
        yield {k: v for k, v in {**inputs, "stop": rest}.items() if k != "stop" or rest}
        for shorter in (s[1:], s[:-1]):
            if shorter:
                yield {**inputs, "stop": [*stops[:i], shorter, *stops[i + 1:]]}
    m = int(inputs["max_tokens"])
    for smaller in sorted({1, m // 2, m - 1}):
        if 1 <= smaller < m:
            yield {**inputs, "max_tokens": smaller}
    for name in req:
        rest_req = {k: v for k, v in req.items() if k != name}
        yield {k: v for k, v in {**inputs, "request": rest_req}.items() if k != "request" or rest_req}
    if inputs.get("stop_token_ids"):
        yield {k: v for k, v in inputs.items() if k != "stop_token_ids"}
    chat = dict(inputs.get("chat") or {})
    for flag in ("reasoning", "tools"):
        if chat.get(flag):
            yield {**inputs, "chat": {k: v for k, v in chat.items() if k != flag}}
    if chat.get("template", "chatml") != "chatml":
        yield {**inputs, "chat": {**chat, "template": "chatml"}}
    prompt = inputs.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1:
        yield {**inputs, "prompt": prompt[-1:]}


def candidates(inputs: Inputs, runnable: Callable[[Inputs], bool] | None = None) -> list[dict[str, Any]]:
    """The distinct runnable examples one step smaller than `inputs` (strategies.settled), smallest
    first; `runnable` may refuse more (by default: those the case format or the reference refuse)."""
    seen = {_canon(inputs)}
    out = []
    for step in _steps(inputs):
        try:
            cand = settled(step)
        except (CaseError, ValueError, KeyError):
            continue
        c = _canon(cand)
        if c in seen or size(cand) >= size(inputs) or not well_posed(cand) or not (runnable or _reference_runs)(cand):
            continue
        seen.add(c)
        out.append(cand)
    return sorted(out, key=size)


def _canon(inputs: Inputs) -> str:
    return json.dumps(inputs, sort_keys=True, ensure_ascii=False)


def _reference_runs(inputs: Inputs) -> bool:
    """Whether the reference takes the example at all (its fields valid together on its tokenizer)."""
    from ..adapters.base import case_prompt, case_script, case_tokenizer, reference_on
    from .strategies import case_of

    try:
        case = case_of("fuzz/shrink/001", inputs)
        tok = case_tokenizer(case)
        reference_on(case, tok, case_prompt(case, tok), case_script(case, tok))
    except (CaseError, ValueError):
        return False
    return bool(spelled(inputs).ids)


@attrs.frozen
class Shrunk:
    """One failure shrunk: its key, the example it started from and the minimal one, the minimal
    one's result, and the rounds it took."""

    key: Key
    original: Inputs
    minimal: Inputs
    result: CaseResult
    rounds: int
    proved: bool = True  # no one-step-smaller example fails with the key (False: the rounds ran out)


# (examples, tag) -> the graded results, in the examples' order (batch.run_batch on an engine).
RunBatch = Callable[[Sequence[Inputs], str], Sequence[CaseResult]]


def shrink_all(failures: Sequence[tuple[Inputs, CaseResult]], run: RunBatch, *, max_rounds: int = 12,
               per_target: int = 60, tag: str = "s", on_round: Callable[[int, int], None] | None = None,
               more: Callable[[], bool] = lambda: True) -> list[Shrunk]:
    """Shrink every (example, result) of `failures` (see module): at most `max_rounds` batches, each of
    at most `per_target` candidates per target still moving, a round started only while `more()`.
    `on_round(round, targets)` is told of each batch before it runs. A Shrunk whose last round is
    the last one run may not be minimal yet (`proved` False)."""
    state = [(inp, r, failure_key(r), inp) for inp, r in failures]
    moving = [i for i, (_, _, key, _) in enumerate(state) if key is not None]
    rounds = {i: 0 for i in moving}
    for n in range(1, max_rounds + 1):
        batch: list[tuple[int, dict[str, Any]]] = []
        for i in moving:
            batch += [(i, c) for c in candidates(state[i][0])[:per_target]]
        if not batch:  # no smaller example to try: every target is minimal
            moving = []
            break
        if not more():
            break
        if on_round is not None:
            on_round(n, len(moving))
        results = run([c for _, c in batch], f"{tag}{n:03d}")
        best: dict[int, tuple[dict[str, Any], CaseResult]] = {}
        for (i, cand), r in zip(batch, results):
            if failure_key(r) == state[i][2] and i not in best:  # the candidates come smallest first
                best[i] = (cand, r)
        for i, (cand, r) in best.items():
            state[i] = (cand, r, state[i][2], state[i][3])
            rounds[i] = n
        moving = sorted(best)
        if not moving:
            break
    open_ = set(moving)  # still moving when the rounds ran out
    return [Shrunk(key, original, inp, r, rounds[i], i not in open_) for i, (inp, r, key, original) in enumerate(state)
            if key is not None]
