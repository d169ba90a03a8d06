"""A byte-level validity guard for the sampler: a run that never emits invalid UTF-8 (§4.5, §4.6;
DECISIONS D16).

The strict detokenizer of §4.5 fails a request whose output bytes cannot become valid UTF-8 (D12).
Under sampling that happens by chance: a token that starts a character the next one cannot finish.
The guard is a grammar over bytes, applied where §4.6 places grammars that constrain rather than
stop: before `choose`, it sets to -inf the logit of every token that would make the output
invalid. Its state is the UTF-8 automaton below, run over the detokenizer's held bytes.

- A token is allowed when its bytes keep the held bytes a valid UTF-8 *prefix* and, from the
  state they reach, a complete character is still reachable within the tokens the budget leaves
  (`max_output_tokens` and the context limit): the budget can never end inside a character.
- EOS, and every id of a token finish check, is allowed only with nothing held (the run would end
  inside a character).
- A greedy request with a stop passes `remaining` UNBOUNDED: a stop may still cut before an
  unfinished character (the character is then past the end), so only tokens that fail at once are
  refused; a budget that does end inside the character drops it (DECISIONS D22).
- Special tokens the detokenizer deletes are neutral (they leave the state as it is).
- Where no token is allowed (a vocabulary that cannot finish the character in time) the logits
  are left as they are and §4.5's strictness decides.

For greedy decoding the guard changes nothing in a run that would have succeeded: the argmax,
when allowed, stays the argmax, and it is refused only where the run would fail without the guard.
Sampling draws from the distribution conditioned on validity.
"""

from __future__ import annotations

import weakref

import torch

from .tokenizers import DecodePlan

# The UTF-8 automaton (RFC 3629, Table 3-7 of Unicode) as plain data: state -> ((lo, hi), next).
# ACCEPT holds nothing; the others need continuation bytes, some from a narrowed range (no
# overlong forms, no surrogates, nothing above U+10FFFF).
ACCEPT = 0
_ROWS: dict[str, tuple[tuple[tuple[int, int], str], ...]] = {
    "ACCEPT": (((0x00, 0x7F), "ACCEPT"), ((0xC2, 0xDF), "NEED1"), ((0xE0, 0xE0), "E0"), ((0xE1, 0xEC), "NEED2"),
               ((0xED, 0xED), "ED"), ((0xEE, 0xEF), "NEED2"), ((0xF0, 0xF0), "F0"), ((0xF1, 0xF3), "NEED3"),
               ((0xF4, 0xF4), "F4")),
    "NEED1": (((0x80, 0xBF), "ACCEPT"),),
    "NEED2": (((0x80, 0xBF), "NEED1"),),
    "E0": (((0xA0, 0xBF), "NEED1"),),
    "ED": (((0x80, 0x9F), "NEED1"),),
    "NEED3": (((0x80, 0xBF), "NEED2"),),
    "F0": (((0x90, 0xBF), "NEED2"),),
    "F4": (((0x80, 0x8F), "NEED2"),),
}
STATES = tuple(_ROWS)
_INDEX = {name: i for i, name in enumerate(STATES)}
REJECT = -1
# _STEP[state][byte] -> next state index, or REJECT.
_STEP = tuple(
    tuple(next((_INDEX[to] for (lo, hi), to in rows if lo <= b <= hi), REJECT) for b in range(256))
    for rows in _ROWS.values()
)
_NEVER = 1 << 30  # the cost of a token that can never be made valid


def run(state: int, data: bytes) -> int:
    """The automaton's state after `data` from `state` (REJECT once invalid)."""
    for b in data:
        state = _STEP[state][b]
        if state == REJECT:
            return REJECT
    return state


def _after(data: bytes) -> list[int]:
    """The state `data` leads to from each state (ASCII text, most of a vocabulary, in one go)."""
    if not data:
        return list(range(len(STATES)))
    if data.isascii():
        return [ACCEPT] + [REJECT] * (len(STATES) - 1)
    return [run(s, data) for s in range(len(STATES))]


class Utf8Guard:
    """The per-tokenizer tables of the guard, built once per decode plan (O(vocabulary))."""

    __slots__ = ("_blocked",)
    UNBOUNDED = 1 << 30  # `remaining` that never binds: only tokens that fail at once are refused (D22)

    def __init__(self, plan: DecodePlan, vocab_size: int, eos_ids: frozenset[int]) -> None:
        n = len(STATES)
        after = []  # per token: the state it leads to from each state
        for tid in range(vocab_size):
            data = plan.rest.get(tid)
            if tid in eos_ids:
                after.append([ACCEPT] + [REJECT] * (n - 1))
            elif data is None:
                after.append(list(range(n)) if tid in plan.skipped else [REJECT] * n)
            else:
                after.append(_after(data))
        # dist[s]: fewest tokens that take state s back to ACCEPT (a fixpoint over n states).
        reach = {(s, t) for row in after for s, t in enumerate(row) if t != REJECT}
        dist = [0 if s == ACCEPT else _NEVER for s in range(n)]
        for _ in range(n):
            for s, t in reach:
                if dist[t] + 1 < dist[s]:
                    dist[s] = dist[t] + 1
        cost = torch.tensor([[dist[row[s]] if row[s] != REJECT else _NEVER for row in after] for s in range(n)])
        horizon = max(d for d in dist if d < _NEVER)
        # blocked[s, r]: tokens refused in state s when r more tokens may follow this one; one
        # copy per device the logits live on.
        blocked = cost.unsqueeze(1) > torch.arange(horizon + 1).view(1, -1, 1)
        self._blocked = {torch.device("cpu"): blocked}

    def restrict(self, logits: torch.Tensor, held: bytes, remaining: int) -> torch.Tensor:
        """`logits` [V] with every token that would break UTF-8 set to -inf (see the module
        docstring); `held`: the detokenizer's pending bytes; `remaining`: tokens that may follow."""
        state = run(ACCEPT, held)
        if state == REJECT:
            return logits  # the detokenizer never holds invalid bytes; nothing to guard
        table = self._blocked.get(logits.device)
        if table is None:
            table = self._blocked[logits.device] = self._blocked[torch.device("cpu")].to(logits.device)
        blocked = table[state, min(max(remaining, 0), table.shape[1] - 1)]
        if bool(blocked.all()):
            return logits
        return logits.masked_fill(blocked, float("-inf"))


# (id(plan), vocab size, end ids) -> (a weak reference to the plan, its guard); plans are
# unhashable (they hold dicts). Requests with other end ids (a token check's) get their own guard.
_GUARDS: dict[tuple[int, int, frozenset[int]], tuple[weakref.ref, Utf8Guard]] = {}


def guard_for(plan: DecodePlan, vocab_size: int, eos_ids: frozenset[int]) -> Utf8Guard:
    """The guard of a decode plan, built on first use and dropped with the plan. `eos_ids`: every
    id that ends the output without bytes (EOS, a token check's ids), allowed only with nothing held."""
    key = (id(plan), vocab_size, eos_ids)
    entry = _GUARDS.get(key)
    if entry is None or entry[0]() is not plan:
        guard = Utf8Guard(plan, vocab_size, eos_ids)
        _GUARDS[key] = (weakref.ref(plan, lambda _ref: _GUARDS.pop(key, None)), guard)
        return guard
    return entry[1]
