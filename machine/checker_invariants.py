"""The model checker's state checks: one function per invariant of spec/invariants.toml that it
judges in a request's state, registered by name in `STATE_CHECKS` (a spec.invariants.Registry,
the kind that holds the trace monitors of properties/monitors.py).

A check takes the model and the fields of one request it may read (machine/checker_state.Judged)
and returns its violations as (message, guard) pairs; a guard names a step the tables would allow
from this state although they must refuse it (the tables are the runtime's last line of defence
against a wrong producer), and the counterexample ends with that step. machine/checker.py judges
each distinct request with every check, in registration order (`StateJudge`: once per distinct
Judged). What a model step reports as it happens (checker_model.STEP_CHECKS) and what the product
search checks (checker.SEARCH_CHECKS) complete the checker's side; checker.registry_mismatch()
holds the three against the invariants of scope "state" and "both".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..spec import FinishReason
from ..spec.invariants import Registry, Scope
from .checker_model import MIN_TOKENS, REASONS, Model
from .checker_state import CANCEL, DEADLINE, EOS, KERNEL, PC, RESOURCE_KINDS, Judged, judged_key

Guard = tuple[str, str, str]  # (machine, state, event): a step the tables must refuse
Found = Sequence[tuple[str, Guard | None]]
StateCheck = Callable[[Model, Judged], Found]
Violation = tuple[str, str, Guard | None]  # (invariant, message, guard)
STATE_CHECKS: Registry[StateCheck] = Registry("state check", Scope.STATE)
_OK: Found = ()


def _held(m: Model, c: Judged) -> list[str]:
    """The resource kinds the request holds."""
    return [k for k in RESOURCE_KINDS if getattr(c, k) in m.held]


# §4.1, §4.3, §4.7: the terminal states and the terminal event


@STATE_CHECKS.register("terminal_exclusive")
def _terminal_exclusive(m: Model, c: Judged) -> Found:
    life, st = m.life.states[c.lifecycle], m.stream.states[c.stream]
    if m.life.terminal[c.lifecycle] and m.stream.terminal[c.stream] and m.stream_end_of.get(life) != st:
        return ((f"lifecycle {life} but stream {st}", None),)
    return _OK


@STATE_CHECKS.register("terminal_with_transition")
def _terminal_with_transition(m: Model, c: Judged) -> Found:
    if m.life.terminal[c.lifecycle] != m.stream.terminal[c.stream] and c.pc != PC.new:
        life, st = m.life.states[c.lifecycle], m.stream.states[c.stream]
        return ((f"lifecycle {life} and stream {st}: one terminal without the other", None),)
    return _OK


@STATE_CHECKS.register("single_terminal_event")
def _single_terminal_event(m: Model, c: Judged) -> Found:
    out = []
    if c.terminals > 1:
        out.append((f"{c.terminals} terminal events", None))
    if c.pc == PC.done and c.terminals != 1:
        out.append(("the request ended without a terminal event", None))
    return out


# §4.10, §4.3: resources


@STATE_CHECKS.register("no_leak")
def _no_leak(m: Model, c: Judged) -> Found:
    out = []
    held = _held(m, c)
    if c.pc == PC.done and held:
        out.append((f"{held} still held at the end", None))
    unfreed = [k for bit, k in enumerate(RESOURCE_KINDS)
               if m.res.terminal[getattr(c, k)] and not c.freed >> bit & 1]
    if unfreed:
        out.append((f"{unfreed} released without their free callback (the row's action frees nothing)", None))
    return out


@STATE_CHECKS.register("detok_concat_equals_batch")
def _detok_concat_equals_batch(m: Model, c: Judged) -> Found:
    """§4.5 in the model, which keeps no bytes: a finished request lost none (Judged.lost: output
    bytes that a row neither sent nor discarded)."""
    if c.lost and c.lifecycle in m.finished:
        return (("output bytes neither sent nor discarded by a row", None),)
    return _OK


@STATE_CHECKS.register("model_released_before_terminal")
def _model_released_before_terminal(m: Model, c: Judged) -> Found:
    if m.life.terminal[c.lifecycle]:
        kept = set(_held(m, c)) & set(m.model_kinds)
        if kept:
            return ((f"{sorted(kept)} held in {m.life.states[c.lifecycle]}", None),)
    return _OK


# §4.2: the off-by-one convention


@STATE_CHECKS.register("selected_minus_decoded_0_or_1")
def _selected_minus_decoded(m: Model, c: Judged) -> Found:
    if c.selected - c.decoded not in (0, 1):
        return ((f"selected {c.selected}, decoded {c.decoded}", None),)
    return _OK


@STATE_CHECKS.register("decode_after_selected")
def _decode_after_selected(m: Model, c: Judged) -> Found:
    if c.kernel == KERNEL.decode and c.selected != c.decoded + 1:
        return ((f"decode in flight with selected {c.selected}, decoded {c.decoded}", None),)
    return _OK


# §4.9: cancel and deadline


@STATE_CHECKS.register("no_kernel_in_flight_at_cancelled")
def _no_kernel_in_flight_at_cancelled(m: Model, c: Judged) -> Found:
    if c.lifecycle in m.cancelled and c.kernel:
        return ((f"{m.life.states[c.lifecycle]} with a kernel in flight", None),)
    return _OK


@STATE_CHECKS.register("cancelled_only_if_requested")
def _cancelled_only_if_requested(m: Model, c: Judged) -> Found:
    life = c.lifecycle
    if (life in m.cancelled or life in m.cancel_observed or REASONS[c.reason] == FinishReason.CANCELLED) and c.cancel == CANCEL.none:
        return ((f"{m.life.states[life]} without a cancel request", None),)
    return _OK


@STATE_CHECKS.register("deadline_not_cancelled")
def _deadline_not_cancelled(m: Model, c: Judged) -> Found:
    if c.deadline == DEADLINE.observed and REASONS[c.reason] == FinishReason.CANCELLED:
        return (("deadline observed, reason cancelled", None),)
    return _OK


# §4.10, §4.3: reasons


@STATE_CHECKS.register("transport_not_eos")
def _transport_not_eos(m: Model, c: Judged) -> Found:
    if REASONS[c.reason] == FinishReason.EOS and c.eos != EOS.ended:
        return (("reason eos without an EOS token", None),)
    return _OK


@STATE_CHECKS.register("eos_guards_respected")
def _eos_guards_respected(m: Model, c: Judged) -> Found:
    """D31: the request's guard field as FINISH_GUARDS reads it, independently of the table's list."""
    field = m.guard_field(c)
    if (REASONS[c.reason] == FinishReason.EOS and m.life.terminal[c.lifecycle]
            and (field == "ignore_eos" or field == "min_tokens" and c.selected <= MIN_TOKENS)):
        return ((f"a request with {field} ended with eos on token {c.selected}", None),)
    return _OK


@STATE_CHECKS.register("finish_reason_matches_state")
def _finish_reason_matches_state(m: Model, c: Judged) -> Found:
    life, reason = m.life.states[c.lifecycle], REASONS[c.reason]
    if m.life.terminal[c.lifecycle] and reason not in m.reasons_of_state.get(life, ()):
        return ((f"{life} with reason {reason}", None),)
    return _OK


@STATE_CHECKS.register("length_respected")
def _length_respected(m: Model, c: Judged) -> Found:
    limit, reason = m.config.max_output_tokens, REASONS[c.reason]
    if c.selected > limit or (reason == FinishReason.MAX_OUTPUT_TOKENS and c.selected != limit):
        return ((f"{c.selected} selected, limit {limit}, reason {reason}", None),)
    return _OK


# §4.8: the buffer cap


@STATE_CHECKS.register("stream_bounded")
def _stream_bounded(m: Model, c: Judged) -> Found:
    if c.unread > m.config.buffer_cap:
        return ((f"{c.unread} unread deltas, cap {m.config.buffer_cap}", None),)
    return _OK


# Guards: what the tables must refuse in this state.


@STATE_CHECKS.register("terminal_irreversible")
def _terminal_irreversible(m: Model, c: Judged) -> Found:
    """§4.1: the first event the lifecycle table lets leave a terminal state."""
    if m.life.terminal[c.lifecycle]:
        life = m.life.states[c.lifecycle]
        for e, (t, *_) in m.life.step[c.lifecycle].items():
            if t != c.lifecycle:
                return ((f"the lifecycle table lets '{e}' leave {life}", ("lifecycle", life, e)),)
    return _OK


@STATE_CHECKS.register("no_delta_after_terminal")
def _no_delta_after_terminal(m: Model, c: Judged) -> Found:
    """§4.7: a terminal stream whose table accepts a delta as a row."""
    if m.stream.terminal[c.stream] and m.stream.step[c.stream].get("delta", (0, False, 0, None))[1]:
        st = m.stream.states[c.stream]
        return ((f"the stream table accepts a delta in {st}", ("stream", st, "delta")),)
    return _OK


@STATE_CHECKS.register("release_exactly_once")
def _release_exactly_once(m: Model, c: Judged) -> Found:
    """§4.10: a second acquire of a held resource, a place taken twice or given back unheld."""
    out: list[tuple[str, Guard | None]] = []
    held = _held(m, c)
    for i in m.held if held else ():
        if "acquire" in m.res.step[i]:
            state = m.res.states[i]
            out.append((f"the resources table accepts a second 'acquire' of {held[0]} in {state} "
                        "(a second acquire would need a second release)", ("resources", state, "acquire")))
    where = m.seq.states[c.sequence]
    for e, what in m.place_guards[c.sequence]:
        out.append((f"the sequence table lets '{e}' in {where}: it {what}", ("sequence", where, e)))
    return out


@STATE_CHECKS.register("no_select_after_cancel_observed")
def _no_select_after_cancel_observed(m: Model, c: Judged) -> Found:
    """§4.9: CANCEL_REQUESTED accepts no selection."""
    if c.lifecycle in m.cancel_observed and "select" in m.life.step[c.lifecycle]:
        life = m.life.states[c.lifecycle]
        return ((f"the lifecycle table accepts 'select' in {life}", ("lifecycle", life, "select")),)
    return _OK


@STATE_CHECKS.register("no_select_while_draining")
def _no_select_while_draining(m: Model, c: Judged) -> Found:
    """§4.1: DRAINING accepts no selection."""
    if c.lifecycle in m.draining and "select" in m.life.step[c.lifecycle]:
        life = m.life.states[c.lifecycle]
        return ((f"the lifecycle table accepts 'select' in {life}", ("lifecycle", life, "select")),)
    return _OK


_CHECKS = tuple(STATE_CHECKS.registered().items())


def state_violations(m: Model, c: Judged) -> list[Violation]:
    """Every state check's violations by the fields of one request, in registration order."""
    return [(name, msg, guard) for name, check in _CHECKS for msg, guard in check(m, c)]


class StateJudge:
    """The state checks of one model, each distinct Judged judged once (a search reaches many
    requests that differ only in fields no state check reads)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._judged: dict[tuple[int, ...], list[Violation]] = {}

    def __call__(self, comp: Sequence[int]) -> list[Violation]:
        """The violations of one request (a RequestState or a plain tuple of its fields); the
        list is shared by every request with the same Judged fields: read it, do not change it."""
        key = judged_key(comp)
        found = self._judged.get(key)
        if found is None:
            found = self._judged[key] = state_violations(self.model, Judged._make(key))
        return found
