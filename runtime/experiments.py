"""The two minimal experiments of §4.11, as runnable fixtures with their assertions.

Each returns the Result and a list of (claim, held) pairs, so the CLI and the tests check the same
statements. Tokens are forced by ScriptedModel over a ByteTableTokenizer (hand-computable, §4.6).
"""

from __future__ import annotations

import attrs

from .events import Event, EventKind
from .faults import Fault, FaultPlan
from .loop import generate
from .models import ScriptedModel
from .request import Request
from .result import Result
from .tokenizers import ByteTableTokenizer

# §4.6 fixture plus a few letters for the longer script of experiment B.
TABLE = {101: b"AB", 102: b"CD", 103: b"E", 104: b"F", 105: b"G", 106: b"H", 107: b"I", 108: b"J"}
PROMPT = [1]
TABLE_WITH_PROMPT = {1: b"> ", **TABLE}


@attrs.frozen
class Experiment:
    name: str
    title: str
    result: Result
    claims: tuple[tuple[str, bool], ...]

    @property
    def passed(self) -> bool:
        return all(ok for _, ok in self.claims)


def _kinds(events: tuple[Event, ...], *kinds: str) -> list[Event]:
    return [e for e in events if e.kind in kinds]


def experiment_a() -> Experiment:
    """Cross-token stop string: 101 -> "AB", 102 -> "CD", stop "BCD" (§4.11 A)."""
    tok = ByteTableTokenizer(TABLE_WITH_PROMPT)
    model = ScriptedModel([101, 102, 103, 104], vocab_size=128)
    res = generate(Request(PROMPT, stop=["BCD"], max_output_tokens=8), model=model, tokenizer=tok)
    order = [
        e for e in res.events
        if e.kind in (EventKind.TOKEN_SELECTED, EventKind.RESPONSE_DELTA, EventKind.DECODE_COMPLETED,
                      EventKind.STOP_HIT, EventKind.RESPONSE_COMPLETED)
    ]
    shape = [
        (e.kind, e.data.get("token") or e.data.get("bytes") or e.data.get("stop") or e.data.get("finish_reason"))
        for e in order
    ]
    expected = [
        (EventKind.TOKEN_SELECTED, 101),
        (EventKind.RESPONSE_DELTA, b"A"),
        (EventKind.DECODE_COMPLETED, None),
        (EventKind.TOKEN_SELECTED, 102),
        (EventKind.STOP_HIT, "BCD"),
        (EventKind.RESPONSE_COMPLETED, "stop_sequence"),
    ]
    selected = _kinds(res.events, EventKind.TOKEN_SELECTED)
    claims = (
        ("event order selected(101) -> delta('A') -> decode(101) -> selected(102) -> stop_hit('BCD') -> completed(stop_sequence)",
         shape == expected),
        ("returned bytes are exactly b'A'", res.output == b"A"),
        ("finish reason is stop_sequence", res.finish_reason == "stop_sequence"),
        ("no token selected after 102", [e.data["token"] for e in selected] == [101, 102]),
    )
    return Experiment("A", "cross-token stop string (§4.11 A)", res, claims)


def experiment_b() -> Experiment:
    """A cancel injected after decode.started(step=3), before its completion (§4.11 B)."""
    tok = ByteTableTokenizer(TABLE_WITH_PROMPT)
    model = ScriptedModel([103, 104, 105, 106, 107, 108], vocab_size=128)
    plan = FaultPlan([Fault(point="decode.started", step=3, action="cancel")])
    res = generate(Request(PROMPT, max_output_tokens=6), model=model, tokenizer=tok, faults=plan)
    ev = res.events
    steps = [e.data["step"] for e in _kinds(ev, EventKind.TOKEN_SELECTED)]
    terminal = [e.index for e in ev if e.kind in (EventKind.RESPONSE_COMPLETED, EventKind.RESPONSE_CANCELLED, EventKind.RESPONSE_FAILED)]
    deltas = _kinds(ev, EventKind.RESPONSE_DELTA)
    released = [e.data["resource"] for e in _kinds(ev, EventKind.RESOURCE_RELEASED)]
    observed = _kinds(ev, EventKind.CANCEL_OBSERVED)
    started3 = next(e.index for e in ev if e.kind == EventKind.DECODE_STARTED and e.data["step"] == 3)
    completed3 = [e.index for e in ev if e.kind == EventKind.DECODE_COMPLETED and e.data["step"] == 3]
    claims = (
        ("the cancel is observed while decode(step=3) is in flight",
         bool(observed) and started3 < observed[0].index and (not completed3 or observed[0].index < completed3[0])),
        ("no token.selected(step=4)", 4 not in steps),
        ("final state is CANCELLED", res.state.value == "CANCELLED"),
        ("exactly one terminal event and no delta after it",
         len(terminal) == 1 and all(d.index < terminal[0] for d in deltas)),
        ("cache and batch slot released exactly once",
         released.count("kv_cache") == 1 and released.count("batch_slot") == 1),
        ("the sent prefix is unchanged (EFG) and nothing is rolled back", res.output == b"EFG"),
    )
    return Experiment("B", "cancel during decode (§4.11 B)", res, claims)


EXPERIMENTS = {"A": experiment_a, "B": experiment_b}
