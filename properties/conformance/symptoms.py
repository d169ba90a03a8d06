"""Findings by symptom: what an engine's answer got wrong, named by the invariant it breaks.

A case exists to provoke one behaviour, but an engine can break something else on the way: it can
miss a stop and run to its limit, replace a valid character, or count a token it should never have
selected. Each observable dimension of an answer is therefore compared on its own with the
reference's answer on the same checkpoint, and each difference is classified into a symptom
(`SYMPTOMS`, a table): the symptom names the invariant whose statement the observation breaks,
never the case's own invariant by default. The dimensions:

- the bytes sent, non-streamed and streamed (stop bytes sent, text after the stop, tokens past the
  limit or after EOS, bytes lost, replaced or added), §4.5, §4.6;
- the finish reason and its precedence (D4), §4.10;
- the token count (usage.completion_tokens), §4.3, §4.10;
- the stream against the non-streamed answer, and the delta boundaries (a stop prefix sent before
  it was ruled out, an empty delta), §4.5-§4.7;
- the wire conventions of the OpenAI API (properties/conformance/wire.py), their own family: they
  are graded by the convention, never as a §4.x MUST.

The same symptom seen in several places of one case is one finding (`merge`).
"""

from __future__ import annotations

import codecs
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from .adapters.base import Finding
from .cases import Case, bytes_json
from .decisions import DECISIONS

SEMANTICS, WIRE = "semantics", "wire"


class Severity(enum.StrEnum):
    """How much a finding costs a reader, most severe first (SEVERITIES): the text itself (bytes
    lost, invented, replaced or leaked), how the run ended (finish reason, terminal), the counts
    (usage, per-token reports), the stream's shape (empty chunks, hold-back timing, resumption), the
    wire conventions. A case leads with its most severe finding; stream shape and wire alone never
    fail a case (`--strict` counts them)."""

    TEXT = "text"
    ENDING = "ending"
    ACCOUNTING = "accounting"
    STREAM_SHAPE = "stream_shape"
    WIRE = "wire"


SEVERITIES: tuple[Severity, ...] = tuple(Severity)  # most severe first
TEXT, ENDING, ACCOUNTING, SHAPE = Severity.TEXT, Severity.ENDING, Severity.ACCOUNTING, Severity.STREAM_SHAPE
CHAPTER = "chapter"


@attrs.frozen
class Symptom:
    """One row of SYMPTOMS: the invariant whose statement the observation breaks, its severity, a
    short label for matrices and causes, and its basis when it is not the chapter's rule:
    `decision`, a decision of spec/DECISIONS.md it always rests on (decisions.DECISIONS); `fields`,
    the request fields whose having no effect it shows (the finding rests on the fields the case's
    request sets among them). A wire row's basis is its convention."""

    invariant: str
    severity: Severity
    label: str
    decision: str = ""
    fields: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        return WIRE if self.severity is Severity.WIRE else SEMANTICS


_S = Symptom
GUARD_FIELDS = ("min_tokens", "min_new_tokens", "ignore_eos")
_ANY_FIELD = ("*",)  # every field the case's request sets

SYMPTOMS: Mapping[str, Symptom] = {
    "stop_sent": _S("stop_bytes_never_emitted", TEXT, "stop bytes sent"),
    "stop_prefix_sent": _S("stop_prefix_held", SHAPE, "stop prefix sent before it was ruled out"),
    "stop_prefix_left": _S("stop_prefix_held", TEXT, "start of a completed stop sent, left in the text"),
    "wrong_stop": _S("stop_earliest_wins", TEXT, "cut at a later-ending stop", decision="D3"),
    "text_after_stop": _S("nothing_after_stop_hit", TEXT, "text after the stop"),
    "stop_id_kept": _S("stop_bytes_never_emitted", TEXT, "a stop id's text kept", decision="D33"),
    "token_after_stop": _S("nothing_after_stop_hit", ENDING, "token selected after the stop"),
    "past_limit": _S("length_respected", TEXT, "token past max_tokens"),
    "early_length": _S("length_respected", ENDING, "'length' before max_tokens"),
    "past_context": _S("refinement", TEXT, "tokens past the context limit"),
    "after_eos": _S("eos_not_emitted", TEXT, "token after EOS"),
    "eos_sent": _S("eos_not_emitted", TEXT, "EOS text sent"),
    "bytes_lost": _S("detok_concat_equals_batch", TEXT, "bytes never sent"),
    "held_not_released": _S("detok_concat_equals_batch", TEXT, "held stop prefix never sent"),
    "stop_not_kept": _S("detok_concat_equals_batch", TEXT, "kept stop never sent",
                        fields=("include_stop_str_in_output", "no_stop_trim")),
    "bytes_replaced": _S("detok_concat_equals_batch", TEXT, "bytes replaced"),
    "bytes_dropped": _S("detok_concat_equals_batch", TEXT, "bytes left out mid-text"),
    "bytes_inserted": _S("detok_concat_equals_batch", TEXT, "bytes put in mid-text"),
    "special_sent": _S("detok_concat_equals_batch", TEXT, "a special token sent as text"),
    "bytes_added": _S("detok_concat_equals_batch", TEXT, "bytes added"),
    "bytes_repeated": _S("detok_concat_equals_batch", TEXT, "a delta sent twice"),
    "invalid_sent": _S("detok_concat_equals_batch", TEXT, "invalid bytes sent as U+FFFD"),
    "invalid_dropped": _S("detok_concat_equals_batch", TEXT, "invalid bytes left out, the text went on"),
    "tail_dropped": _S("detok_concat_equals_batch", ENDING, "incomplete tail dropped silently"),
    "stream_vs_batch": _S("detok_concat_equals_batch", TEXT, "stream differs from non-stream"),
    "precedence": _S("finish_reason_precedence", ENDING, "'length' where D4 says 'stop'", decision="D4"),
    "guard_ignored": _S("eos_guards_respected", ENDING, "EOS ended a run min_tokens/ignore_eos guards", fields=GUARD_FIELDS),
    "stop_without_hit": _S("stop_reason_requires_hit", ENDING, "'stop' without a stop or EOS"),
    "count_low": _S("usage_consistent", ACCOUNTING, "token count too low"),
    "usage_missing": _S("usage_consistent", ACCOUNTING, "no token counts"),
    "usage_total": _S("usage_consistent", ACCOUNTING, "total != prompt + completion"),
    "usage_stream": _S("usage_consistent", ACCOUNTING, "streamed usage differs"),
    "prompt_count": _S("usage_consistent", ACCOUNTING, "prompt count is not the prompt run"),
    "usage_chunk": _S("usage_consistent", ACCOUNTING, "include_usage asked, no usage chunk sent"),
    "no_reason": _S("single_terminal_event", ENDING, "no finish_reason"),
    "two_terminals": _S("single_terminal_event", ENDING, "two finish chunks"),
    "stream_cut": _S("single_terminal_event", ENDING, "stream closed mid-body before its terminal"),
    "error_in_stream": _S("refinement", ENDING, "error on a run that finishes"),
    "content_after_finish": _S("no_delta_after_terminal", TEXT, "text after the finish chunk"),
    "empty_delta": _S("delta_nonempty", SHAPE, "empty delta"),
    "refused": _S("refinement", ENDING, "valid request refused"),
    "fields_ignored": _S("refinement", TEXT, "request fields had no effect", fields=_ANY_FIELD),
    "choices_missing": _S("refinement", TEXT, "fewer choices than n asked", fields=("n",)),
    "accepted_bad_input": _S("refinement", ENDING, "bad request accepted"),
    "unexpected_error": _S("refinement", ENDING, "error where the run finishes"),
    "gauge_stuck": _S("no_leak", ENDING, "running gauge stays up"),
    # the request's life: under load, after a disconnect, on a resume
    "batch_mismatch": _S("refinement", TEXT, "answer differs under load"),
    "slot_leaked": _S("no_leak", ENDING, "place not freed after a disconnect"),
    "ran_on": _S("no_select_after_cancel_observed", ENDING, "decoding went on after the client left"),
    "no_event_ids": _S("reader_delivery_complete", SHAPE, "no SSE ids to resume from", decision="D42"),
    "no_resume": _S("reader_delivery_complete", SHAPE, "no resumption with Last-Event-ID", decision="D42"),
    "resume_mismatch": _S("reader_delivery_complete", SHAPE, "resumed stream loses or repeats events", decision="D42"),
    # a gateway in front of several workers, one of which fails (life/failover.py)
    "cut_as_finished": _S("transport_not_eos", ENDING, "a stream a worker broke off ended as if whole"),
    "healthy_cut": _S("refinement", ENDING, "streams on the serving workers failed too"),
    "wrong_state": _S("refinement", ENDING, "other terminal state"),
    "wrong_error": _S("refinement", ENDING, "other error"),
    "usage_mismatch": _S("usage_consistent", ACCOUNTING, "usage count differs"),
    "case_check": _S("", ENDING, "case check"),
    # Per-token reports (logprobs, token ids) against each chunk's text (D59, properties/conformance/alignment.py)
    "tokens_lost": _S("stream_tokens_aligned", ACCOUNTING, "selected tokens never reported", decision="D59"),
    "tokens_extra": _S("stream_tokens_aligned", ACCOUNTING, "tokens reported twice or past the finish", decision="D59"),
    "tokens_wrong": _S("stream_tokens_aligned", ACCOUNTING, "a reported token is not the one selected", decision="D59"),
    "text_before_token": _S("stream_tokens_aligned", ACCOUNTING, "text sent before its token was reported",
                            decision="D59"),
    "token_bytes_differ": _S("stream_tokens_aligned", ACCOUNTING, "per-token bytes do not spell the text",
                             decision="D59"),
    "tokens_ahead": _S("stream_tokens_aligned", ACCOUNTING, "tokens reported further ahead than a stop can hold",
                       decision="D59"),
    # The chat answer's channels (spec/channels.toml, machine/checker_channels.INVARIANTS; D45-D47).
    "chat_content": _S("pieces_once", TEXT, "content differs"),
    "chat_reasoning": _S("reasoning_is_bracketed", TEXT, "reasoning_content differs", decision="D45"),
    "chat_tool_calls": _S("calls_only_when_closed", TEXT, "tool calls differ", decision="D47"),
    "chat_half_call": _S("calls_only_when_closed", TEXT, "half a call reported", decision="D47"),
    "chat_call_unclosed": _S("calls_only_when_closed", TEXT, "a call reported before </tool_call>", decision="D47"),
    "chat_tag_leaked": _S("think_tags_never_text", TEXT, "a tag (or a piece of one) sent as text"),
    "chat_finish": _S("calls_end_as_calls", ENDING, "chat finish_reason differs",  # a recipe's own check: invariant given by the case
                      decision="D47"),
    # OpenAI wire conventions (graded by the convention, not by chapter 4)
    "done_missing": _S("openai_sse_done", Severity.WIRE, "no data: [DONE]"),
    "data_after_done": _S("openai_sse_done", Severity.WIRE, "data after [DONE]"),
    "malformed": _S("openai_sse_json", Severity.WIRE, "data line not a chunk"),
    "reason_value": _S("openai_finish_reason", Severity.WIRE, "finish_reason outside the API's set"),
    "sse_id": _S("openai_sse_id", Severity.WIRE, "SSE ids repeat or go back"),
    "chunk_id": _S("openai_sse_id", Severity.WIRE, "chunk ids differ within a response"),
    "error_body": _S("openai_error_body", Severity.WIRE, "error body not in the API's shape"),
    "call_arguments": _S("openai_tool_arguments", Severity.WIRE, "tool-call arguments not JSON text"),
    "answer_shape": _S("openai_answer_shape", Severity.WIRE, "answer not in the API's shape"),
    "connection_dropped": _S("http_keep_alive", Severity.WIRE, "connection dropped"),
}

# The severity of a finding with no symptom (a trace monitor's, a case's event check on an
# in-process engine): that of its invariant, for the invariants no symptom row names.
UNNAMED_SEVERITY: Mapping[str, Severity] = {
    "terminal_exclusive": ENDING, "terminal_irreversible": ENDING, "every_run_terminates": ENDING,
    "start_first": SHAPE, "terminal_after_all_deltas": SHAPE, "terminal_with_transition": ENDING,
    "seq_strictly_increasing": SHAPE, "seq_contiguous": SHAPE, "stream_bounded": SHAPE,
    "release_exactly_once": ENDING, "model_released_before_terminal": ENDING,
    "selected_minus_decoded_0_or_1": ACCOUNTING, "decode_after_selected": ACCOUNTING, "steps_consecutive": ACCOUNTING,
    "no_kernel_in_flight_at_cancelled": ENDING, "cancel_observed_after_requested": ENDING,
    "cancelled_only_if_requested": ENDING, "observed_cancel_ends_cancelled": ENDING, "no_select_while_draining": ENDING,
    "deadline_not_cancelled": ENDING, "transport_not_eos": ENDING, "transport_failure_reported_as_such": ENDING,
    "finish_reason_matches_state": ENDING, "refused_chunk_never_sent": TEXT,
}


def _check_rows() -> None:
    """Every row's decision is one of decisions.DECISIONS; wire rows rest on their convention."""
    for name, row in SYMPTOMS.items():
        if row.decision and row.decision not in DECISIONS:
            raise ValueError(f"symptom {name!r}: decision {row.decision!r} is not in decisions.DECISIONS")
        if row.severity is Severity.WIRE and (row.decision or row.fields):
            raise ValueError(f"symptom {name!r}: a wire row rests on its convention, not on a decision or a field")


_check_rows()


def _invariant_severity() -> dict[str, Severity]:
    """Each invariant's most severe symptom row, then UNNAMED_SEVERITY's."""
    out: dict[str, Severity] = dict(UNNAMED_SEVERITY)
    for row in SYMPTOMS.values():
        known = out.get(row.invariant)
        if row.invariant and (known is None or SEVERITIES.index(row.severity) < SEVERITIES.index(known)):
            out[row.invariant] = row.severity
    return out


INVARIANT_SEVERITY: Mapping[str, Severity] = _invariant_severity()


def severity_of(f: Finding) -> Severity:
    """A finding's severity: its symptom row's; a finding without one (a trace monitor's), its
    invariant's (a wire family finding, wire). An unknown symptom or invariant is a KeyError."""
    if f.symptom:
        return SYMPTOMS[f.symptom].severity
    if f.family == WIRE:
        return Severity.WIRE
    try:
        return INVARIANT_SEVERITY[f.invariant]
    except KeyError:
        raise KeyError(f"no severity for a finding of invariant {f.invariant!r} without a symptom: "
                       "add its row to symptoms.UNNAMED_SEVERITY") from None


def severity_rank(f: Finding) -> int:
    """0 for text, the most severe, up to 4 for wire: sort findings with it (a stable sort keeps
    the judge's order within one class)."""
    return SEVERITIES.index(severity_of(f))


CHAPTER_BASIS, DECISION_BASIS, FIELD_BASIS, WIRE_BASIS = "chapter", "decision", "field_ignored", "wire"


@attrs.frozen
class Basis:
    """What a finding rests on: a rule of chapter 4 (`ref` its invariant), a decision of
    spec/DECISIONS.md where engines differ (`ref` 'D31'), request fields the engine accepted and
    that had no effect (`ref` 'min_tokens'), or a wire convention (`ref` its name)."""

    kind: str
    ref: str

    @property
    def chapter(self) -> bool:
        return self.kind == CHAPTER_BASIS


def _request_fields(case: Case | None, fields: tuple[str, ...]) -> list[str]:
    """The fields of `fields` the case's request sets ('*': every one it sets), in the request's order."""
    asked = list((case.inputs.get("request") or {}) if case is not None else {})
    return [k for k in asked if fields == _ANY_FIELD or k in fields]


def basis_of(f: Finding, case: Case | None) -> Basis:
    """The basis of finding `f` in `case` (None: the case is unknown, the row alone decides), from
    data: a wire finding rests on its convention; one that names the fields it shows ignored on
    those; a row with `fields` on the ones the case's request sets; a row with a `decision` on it;
    then the first decision the case rests on whose `covers` holds the symptom; else the chapter's
    rule (its invariant)."""
    if f.family == WIRE:
        return Basis(WIRE_BASIS, f.invariant)
    if f.fields:
        return Basis(FIELD_BASIS, ", ".join(f.fields))
    row = SYMPTOMS.get(f.symptom)
    if row is None:
        return Basis(CHAPTER_BASIS, f.invariant)
    if row.fields and (asked := _request_fields(case, row.fields)):
        return Basis(FIELD_BASIS, ", ".join(asked))
    if row.decision:
        return Basis(DECISION_BASIS, row.decision)
    for d in case.decisions if case is not None else ():
        if f.symptom in DECISIONS[d].covers:
            return Basis(DECISION_BASIS, d)
    return Basis(CHAPTER_BASIS, f.invariant)


def by_severity(findings: Iterable[Finding]) -> list[Finding]:
    """The findings most severe first; within one class in the order given (D65's cause first)."""
    return sorted(findings, key=severity_rank)


# Statements of the chat channels' invariants (machine/checker_channels.py, §4.7).
CHAT_STATEMENTS: Mapping[str, str] = {
    "pieces_once": "every piece of the output goes out once, as content, reasoning or inside a complete call",
    "reasoning_is_bracketed": "reasoning_content is exactly the text between <think> and </think> (D45)",
    "think_tags_never_text": "a tag that opens or closes a section is no channel's text, whole or in pieces",
    "calls_only_when_closed": "a tool call is reported whole, only once its </tool_call> closed it (D47)",
    "calls_end_as_calls": "finish_reason is tool_calls exactly when the model ended a turn holding complete calls",
}

# Statements of the wire conventions (the §4.x invariants' statements are in spec/invariants.toml).
WIRE_STATEMENTS: Mapping[str, str] = {
    "openai_sse_done": "an OpenAI stream ends with the line `data: [DONE]` and sends nothing after it",
    "openai_sse_json": "every event of an OpenAI stream but [DONE] is one JSON object in the chunk's shape",
    "openai_finish_reason": "finish_reason is one of stop, length, content_filter, tool_calls, function_call",
    "openai_sse_id": "SSE `id:` fields strictly increase, and every chunk of one response carries the same `id`",
    "openai_error_body": "an error answer is JSON {\"error\": {\"message\": ..., \"type\": ...}}",
    "openai_answer_shape": "a non-streamed answer is a JSON object in the API's shape: choices a list of objects, "
                           "text and content strings, usage an object",
    "openai_tool_arguments": "a tool call's function.arguments is a string holding JSON (streamed, in string pieces)",
    "http_keep_alive": "a persistent HTTP/1.1 connection is closed only with `Connection: close` (RFC 9112 §9.3); "
                       "a request sent on it gets an answer",
}


def finding(symptom: str, message: str, *, invariant: str | None = None, fields: tuple[str, ...] = ()) -> Finding:
    """A Finding for `symptom` (a key of SYMPTOMS); `invariant` only for a recipe's own check;
    `fields`, the request fields the finding shows had no effect (its basis, `basis_of`)."""
    row = SYMPTOMS[symptom]
    return Finding(invariant or row.invariant, message, symptom=symptom, family=row.family, fields=fields)


def label(symptom: str) -> str:
    """The symptom's short label ('' for a finding without one)."""
    return SYMPTOMS[symptom].label if symptom in SYMPTOMS else ""


def merge(findings: Iterable[Finding]) -> list[Finding]:
    """One finding per (invariant, symptom): the messages of repeats are joined, first one first."""
    order: list[tuple[str, str]] = []
    by: dict[tuple[str, str], list[str]] = {}
    proto: dict[tuple[str, str], Finding] = {}
    for f in findings:
        key = (f.invariant, f.symptom or f.message)
        if key not in by:
            order.append(key)
            by[key], proto[key] = [], f
        if f.message not in by[key]:
            by[key].append(f.message)
    return [attrs.evolve(proto[k], message="; ".join(by[k])) for k in order]


# ---- what the reference says --------------------------------------------------------------------


@attrs.frozen
class Expected:
    """The reference's answer on the engine's checkpoint, with what naming a deviation needs (§4.3).

    `script_text` is what an engine that never stopped would send: the bytes of every script token
    before the first EOS. `eos_at` is the 1-based position of that EOS in the script (None: no EOS).
    `reason` is None when the reference fails the run (D12: bytes no continuation makes valid);
    `output` is then what it sends before the failure."""

    output: bytes
    reason: str | None  # the reference's FinishReason value; None when the run fails
    wire_reason: str | None
    selected: int
    max_tokens: int
    script_text: bytes
    stops: tuple[bytes, ...] = ()
    stop: bytes | None = None  # the stop string that wins (D3), when the run ends on one
    eos_at: int | None = None
    eos_text: bytes = b""
    error: str | None = None
    released: tuple[int, ...] = ()  # bytes the reference had sent after each selected text token
    spelled: tuple[int, ...] = ()  # whole-character bytes the reference's first k selected tokens spell, for each k (with stops)
    kept: bool = False  # the winning stop is part of the output (include_stop_str_in_output, D33)
    keep_asked: bool = False  # the request keeps stops (include_stop_str_in_output), whatever ended the run
    stop_id_text: bytes = b""  # what the stop token ids that ended the run spell (D33: no text, kept or not)
    special_texts: tuple[bytes, ...] = ()  # the table texts of the special tokens besides EOS the run selected (D33: no text)
    echo_len: int = 0  # the output opens with this many bytes of the echoed prompt (D33)
    guarded: bool = False  # the request turns the EOS off for a while (a field of GUARD_FIELDS, D31)
    state: str = "FINISHED"
    # (field, output): what the reference sends for the same request without that one field (D66)
    without: tuple[tuple[str, bytes], ...] = ()

    @property
    def holds_back(self) -> bool:
        """Whether §4.6 hold-back is in question: the request has stop strings and does not keep the
        winning one in the output (a kept stop is output either way, D33), and the run selected text."""
        return bool(self.stops and self.released and not self.kept)

    @property
    def guard_passed(self) -> bool:
        """The request guards the EOS and the reference went on past the script's first EOS
        (min_tokens, ignore_eos, D31): it selected more tokens than that EOS's position, or ended on
        that position for another reason (a run that fails there, D12, too). A run that a later EOS
        ends (min_tokens) passed the guard all the same. Without a guard nothing is passed over."""
        at = self.eos_at
        return self.guarded and at is not None and (at < self.selected or (at == self.selected and self.reason != "eos"))

    def to_json(self) -> dict[str, Any]:
        b = bytes_json
        return {"state": self.state, "output": b(self.output), "finish_reason": self.reason, "wire_finish_reason": self.wire_reason,
                "selected_tokens": self.selected, "max_tokens": self.max_tokens, "script_text": b(self.script_text),
                "stops": [b(s) for s in self.stops], "stop": None if self.stop is None else b(self.stop),
                "eos_at": self.eos_at, "eos_text": b(self.eos_text), "error": self.error,
                "released": list(self.released), "kept": self.kept,
                "echo_len": self.echo_len, "without": {f: b(o) for f, o in self.without}}



_FFFD = "\ufffd".encode()


def _show(b: bytes) -> str:
    return repr(b.decode("utf-8", "backslashreplace"))


def _echo_end(exp: Expected, text: bytes) -> int:
    """Where the echoed prompt ends in an engine's `text` (D33): after the first place it has the
    reference's echo, whatever the engine put before it (a prompt's special tokens' text); the
    reference's echo length where `text` does not have it."""
    if not exp.echo_len:
        return 0
    at = text.find(exp.output[:exp.echo_len])
    return at + exp.echo_len if at >= 0 else exp.echo_len


def _first_stop(exp: Expected, text: bytes) -> tuple[bytes, int] | None:
    """The first configured stop in the output part of `text`, past the echoed prompt as the engine
    sent it (§4.6 matches output only, D33), leaving out the winning stop where the request keeps it."""
    start = _echo_end(exp, text)
    kept_at = len(exp.output) - len(exp.stop) + start - exp.echo_len if exp.kept and exp.stop else -1
    hits = []
    for s in exp.stops:
        at = text.find(s, start) if s else -1
        if at == kept_at and s == exp.stop:
            at = text.find(s, at + 1)
        if at >= 0:
            hits.append((at, s))
    return (min(hits)[1], min(hits)[0]) if hits else None


def _kept_stop_id(exp: Expected, got: bytes) -> bool:
    """Whether `got` is the reference's output and then (part of) the text of the stop token id that
    ended the run, which the engine kept under include_stop_str_in_output (D33)."""
    want = exp.output or b""
    return (exp.kept and len(got) > len(want) and got.startswith(want)
            and exp.stop_id_text.startswith(got[len(want):]))


def _stop_id_kept(where: str, what: str, want: bytes) -> Finding:
    """stop_id_kept: `what` (the stop token's or the EOS's text) kept after `want` (D33)."""
    return finding("stop_id_kept", f"the {where} keeps {what} after {_show(want)}: include_stop_str_in_output keeps a "
                                   f"stop string; a stop token id (an EOS too) is not text and stays out of the "
                                   f"output (D33)")


def without_specials(exp: Expected, got: bytes) -> bytes:
    """`got` without the text of every special token besides EOS the reference's run selected."""
    for own in exp.special_texts:
        got = got.replace(own, b"")
    return got


def compare_text(exp: Expected, got: bytes, where: str, *, cut_right: bool = False) -> list[Finding]:
    """The bytes an engine sent (`where`: 'non-streamed text' or 'stream') against the reference.
    `cut_right`: the engine's other answer ends where the reference's does, so its stop was chosen
    as D3 chooses it and text past that end went out early (a hold-back), not at another stop."""
    if exp.reason is None:
        return _compare_failing(exp, got, where)
    want = exp.output
    if got == want:
        return []
    out: list[Finding] = []
    if (hit := _first_stop(exp, got)) and hit[1] >= len(want) and _kept_stop_id(exp, got):
        hit = None  # the stop lies in a stop token's text the engine kept: stop_id_kept names that (D33)
    if hit:
        s, at = hit
        out.append(finding("stop_sent", f"the {where} contains the stop {_show(s)} at byte {at}: {_show(got)}"))
    elif exp.special_texts and without_specials(exp, got) == want:
        shown = ", ".join(_show(sp) for sp in exp.special_texts if sp in got)
        return [finding("special_sent", f"the {where} carries the text of the special token(s) {shown} where the run "
                                        f"selected them; a special token has no bytes under skip_special_tokens "
                                        f"(§4.5, D33): {_show(got)} (expected {_show(want)})")]
    if got.startswith(want):
        out += _ran_on(exp, got, where, stop_seen=bool(hit), cut_right=cut_right)
    elif want.startswith(got):
        out.append(_lost(exp, got, where))
    elif exp.eos_text and exp.eos_text in got and got.replace(exp.eos_text, b"") == want:
        out.append(finding("special_sent", f"the {where} carries the EOS token's text {_show(exp.eos_text)} where "
                                           f"the run passed over the EOS as a token (D31); a special token has no "
                                           f"bytes under skip_special_tokens: {_show(got)} (expected {_show(want)})"))
    elif not hit and (ignored := _echo_ignored(exp, got, where)) is not None:
        out.append(ignored)
    elif not hit:
        p = first_difference(got, want)
        if fields := _fields_ignored(exp, got):
            out.append(finding("fields_ignored", f"field_ignored: {', '.join(fields)}: the {where} is the reference's "
                                                 f"answer to the request without {' or '.join(fields)}: from byte {p} it "
                                                 f"has {_show(got[p:])}, where the reference, applying it, has "
                                                 f"{_show(want[p:])} (D66)", fields=tuple(fields)))
        elif not exp.echo_len and got[:p + 1] == exp.script_text[:p + 1] != want[:p + 1]:
            out.append(finding("fields_ignored", f"the {where} follows the script where the request's fields make the "
                                                 f"reference leave it: from byte {p} it has {_show(got[p:])}, where the "
                                                 f"reference, applying them, has {_show(want[p:])} (D30, D32): the "
                                                 f"fields had no effect"))
        elif got[p:].startswith(_FFFD):
            out.append(finding("bytes_replaced", f"the {where} has U+FFFD at byte {p} where the reference sends "
                                                 f"{_show(want[p:p + 4])}: {_show(got)} (expected {_show(want)})"))
        elif len(got) < len(want) and got[p:] == want[p + len(want) - len(got):]:
            out.append(finding("bytes_dropped", f"the {where} leaves out {_show(want[p:p + len(want) - len(got)])} at "
                                                f"byte {p}, the rest as the reference sends it: {_show(got)} (expected "
                                                f"{_show(want)})"))
        elif len(got) > len(want) and got[p + len(got) - len(want):] == want[p:]:
            out.append(finding("bytes_inserted", f"the {where} puts {_show(got[p:p + len(got) - len(want)])} in at "
                                                 f"byte {p}, the rest as the reference sends it: {_show(got)} (expected "
                                                 f"{_show(want)})"))
        else:
            out.append(finding("bytes_replaced", f"the {where} differs from byte {p}: {_show(got)} (expected {_show(want)})"))
    return out


def _echo_ignored(exp: Expected, got: bytes, where: str) -> Finding | None:
    """The request asks for echo (D33) and `got` is the output alone, without the prompt's text: as
    the reference sends it after the prompt, or decoded on its own (a character the prompt began
    then shows as U+FFFD). The field had no effect; None for any other text."""
    if not exp.echo_len or got.startswith(exp.output[:exp.echo_len]):
        return None
    alone = exp.output[exp.echo_len:]
    if got not in (alone, alone.decode("utf-8", "replace").encode()):
        return None
    return finding("fields_ignored", f"field_ignored: echo: the {where} is the output alone, {_show(got)}, without "
                                     f"the prompt's text {_show(exp.output[:exp.echo_len])} that echo puts before it "
                                     f"(D33; the reference: {_show(exp.output)})")


RUN_ON = frozenset({"past_limit", "past_context"})  # a run that selected tokens it must not have


def run_on_first(findings: Iterable[Finding]) -> list[Finding]:
    """The findings with a run that went past its limit first, at whichever max_tokens it showed (D65:
    tokens selected past the limit lead the text they explain); otherwise in the order given."""
    return sorted(findings, key=lambda f: f.symptom not in RUN_ON)


def _common_tail(a: bytes, b: bytes) -> int:
    """How many bytes `a` and `b` end with in common."""
    return next((i for i in range(min(len(a), len(b))) if a[-1 - i] != b[-1 - i]), min(len(a), len(b)))


def _fields_ignored(exp: Expected, got: bytes) -> list[str]:
    """The request fields the engine's `got` shows had no effect (D66): `got` is the reference's
    answer without that field; or, where the field chose a token the script does not give (the
    runner-up of an EOS that min_tokens masks, a model's own ranking), `got` differs from the
    reference's answer only at that token's bytes, the text on both sides of them the reference's."""
    want = exp.output
    out = []
    for field, alt in exp.without:
        if alt == want:
            continue  # the field moved nothing here
        start = first_difference(alt, want)
        tail = min(_common_tail(alt, want), len(want) - start, len(alt) - start)
        runner_up = alt[start:len(alt) - tail]  # what the run writes there without the field
        free = (runner_up != b"" and start >= exp.echo_len
                and not exp.script_text[start - exp.echo_len:].startswith(runner_up))
        same_place = (free and first_difference(got, want) >= start and _common_tail(got, want) >= tail
                      and len(got) - tail >= start)
        if got == alt or same_place:
            out.append(field)
    return out


def _lost(exp: Expected, got: bytes, where: str) -> Finding:
    """`got` is a proper prefix of the reference's output: say what the missing bytes are. A tail
    that is the winning stop the request keeps (D33) was cut as if not kept; a tail that ends with
    the start of a configured stop is what a matcher holds (a token at a time, on some engines)
    while that stop may still complete, and §4.6 releases it once the stop is ruled out or the run
    ends."""
    want, lost = exp.output, exp.output[len(got):]
    ends = f"the {where} ends after {len(got)} of {len(want)} bytes"
    if exp.kept and exp.stop is not None and lost == exp.stop:
        return finding("stop_not_kept", f"{ends}: the stop {_show(lost)} was cut off, but the request keeps "
                                        f"the stop in the output (include_stop_str_in_output, D33; expected "
                                        f"{_show(want)})")
    held = next(((lost[i:], s) for i in range(len(lost)) for s in exp.stops
                 if s.startswith(lost[i:]) and s != lost[i:]), None)
    if held is not None:
        tail, stop = held
        which = f"{_show(tail)}, the start of the stop {_show(stop)}" if tail == lost else \
            f"{_show(lost)}, ending with {_show(tail)}, the start of the stop {_show(stop)}"
        return finding("held_not_released", f"{ends}: {which}, was never sent; that stop never completes, so "
                                            f"what was held for it goes out when the run ends ({exp.reason}; "
                                            f"expected {_show(want)})")
    return finding("bytes_lost", f"{ends}: {_show(lost)} was never sent (expected {_show(want)})")


def _ran_on(exp: Expected, got: bytes, where: str, *, stop_seen: bool, cut_right: bool = False) -> list[Finding]:
    """`got` extends the reference's output: say what the extra bytes are, by where they lie. The
    script's own continuation past the end is text after the stop (after its end), the start of a
    stop that completed (sent before it did, §4.6 hold-back), tokens past the limit, the EOS or the
    context; anything else was added."""
    want, extra = exp.output or b"", got[len(exp.output or b""):]
    if exp.reason == "stop_sequence" and exp.stop is not None and not cut_right:
        for s in exp.stops:  # the engine cut at another configured stop (D3: earliest end wins)
            if s != exp.stop and exp.script_text.startswith(got + s) and not stop_seen:
                return [finding("wrong_stop", f"the {where} is cut where {_show(s)} starts (byte {len(got)}), but "
                                              f"{_show(exp.stop)} wins under D3 (it ends at byte {len(want) + len(exp.stop)}, "
                                              f"first or as early and longer): {_show(got)}, expected {_show(want)}")]
    if exp.reason == "eos" and exp.eos_text and extra.startswith(exp.eos_text):
        if exp.keep_asked:  # an engine that ends on EOS as on a stop token id keeps its text as one
            return [_stop_id_kept(where, f"the EOS token's text {_show(exp.eos_text)}", want)]
        return [finding("eos_sent", f"the {where} carries the EOS token's text {_show(exp.eos_text)}: {_show(got)}")]
    if exp.script_text.startswith(got[exp.echo_len:]):
        return _script_past_end(exp, got, where, stop_seen=stop_seen)
    return [finding("bytes_added", f"the {where} adds {_show(extra)} after {_show(want)}, bytes that no script "
                                   "token carries")]


def _script_past_end(exp: Expected, got: bytes, where: str, *, stop_seen: bool) -> list[Finding]:
    """`got` is the reference's output and then more of the script's own text."""
    want, extra = exp.output or b"", got[len(exp.output or b""):]
    if exp.reason == "stop_sequence" and exp.stop is not None:
        end = len(want) + (0 if exp.kept else len(exp.stop))
        if len(got) > end:
            return [finding("text_after_stop", f"the {where} goes on {len(got) - end} byte(s) past the end of the "
                                               f"stop {_show(exp.stop)} (byte {end}): {_show(got)}")]
        if stop_seen:
            return []  # the stop itself: stop_sent says so
        return [finding("stop_prefix_left", f"the {where} ends with {_show(extra)}, the start of the stop "
                                            f"{_show(exp.stop)}, which completes right after it: those bytes belong "
                                            f"to the stop's match and stay in the text (§4.6: held until the stop is "
                                            f"ruled out, cut with it; expected {_show(want)})")]
    if exp.reason == "stop_sequence":  # a token-id stop: its bytes are not text
        if _kept_stop_id(exp, got):
            return [_stop_id_kept(where, f"the stop token's text {_show(extra)}", want)]
        return [finding("text_after_stop", f"the {where} goes on past the stop token: {_show(extra)} after {_show(want)}")]
    kind = {"max_output_tokens": "past_limit", "eos": "after_eos", "context_limit": "past_context"}.get(
        exp.reason or "", "bytes_added")
    what = {"past_limit": f"past max_tokens = {exp.max_tokens}", "after_eos": "after the EOS",
            "past_context": "past the context limit (D10: no position left for the next token)",
            "bytes_added": f"after the end ({exp.reason})"}[kind]
    return [finding(kind, f"the {where} has {len(extra)} byte(s) of script text {what}: {_show(extra)} "
                          f"after {_show(want)}")]


def _held_when_failed(exp: Expected) -> bytes:
    """The whole characters the reference had decoded but still held (a stop's possible start, §4.6)
    when it failed the run (D12): text before the invalid bytes, never sent because the run failed."""
    want = exp.output or b""
    decoded = want + exp.script_text[max(len(want) - exp.echo_len, 0):]
    return decoded[len(want):exp.spelled[-1]] if exp.spelled else b""


def _compare_failing(exp: Expected, got: bytes, where: str) -> list[Finding]:
    """The reference fails the run (D12: bytes no continuation makes valid) after sending `exp.output`.
    Text the reference held back then (`_held_when_failed`) is no byte past the invalid ones: an engine
    that sent it and finished normally dropped the invalid tail (judgement's tail_dropped)."""
    want = exp.output or b""
    if got.startswith(want):
        extra = got[len(want):]
        if not extra or _held_when_failed(exp).startswith(extra):
            return []
        kind, how = ("invalid_sent", "sending them as U+FFFD") if _FFFD in extra else \
            ("invalid_dropped", "leaving them out")
        return [finding(kind, f"the {where} goes on past the invalid bytes at byte {len(want)}, {how}: "
                              f"{_show(extra)} after {_show(want)}; the reference ends the run there with "
                              f"{exp.error or 'a decoding error'} (D12)")]
    if want.startswith(got):
        return [finding("bytes_lost", f"the {where} ends after {len(got)} bytes; before the decoding error the reference "
                                      f"sends {_show(want)}")]
    p = first_difference(got, want)
    return [finding("bytes_replaced", f"the {where} differs from byte {p}: {_show(got)}; before the decoding error "
                                      f"the reference sends {_show(want)}")]


def whole_length(data: bytes) -> int:
    """The length of `data` without an unfinished UTF-8 character at its end (§4.5: not sendable yet)."""
    return len(codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(data).encode("utf-8", "surrogateescape"))


def first_difference(got: Sequence[Any], want: Sequence[Any]) -> int:
    """The index of the first item where `got` and `want` differ (the shorter length when one is a
    prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))


def text_difference(got: str, want: str, width: int = 24) -> str:
    """How `got` differs from `want`, for a finding: the lengths, and both texts at the first difference."""
    at = first_difference(got, want)
    return (f"{len(got)} characters for {len(want)}, first difference at {at} "
            f"({got[at:at + width]!r} for {want[at:at + width]!r})")


def compare_stream(batch: bytes | None, streamed: bytes | None) -> list[Finding]:
    """§4.5: the concatenated stream equals the non-streamed answer."""
    if batch is None or streamed is None or batch == streamed:
        return []
    return [finding("stream_vs_batch", f"the stream sent {_show(streamed)}, the non-streamed answer {_show(batch)}")]


def compare_reason(exp: Expected, got: str | None, where: str, *, count: int | None,
                   text_agrees: bool = False) -> list[Finding]:
    """The wire finish_reason against the reference's (§4.10; D4 precedence). `text_agrees`: the
    answer's text is the reference's, so a 'length' the count cannot explain is not explained by
    the text either."""
    want = exp.wire_reason
    if want is None or got == want:
        return []
    if got is None:
        return [finding("no_reason", f"the {where} carries no finish_reason (the reference: {want!r}, {exp.reason})")]
    if got == "stop" and exp.guard_passed and (count is None or count < exp.selected or count == exp.eos_at):
        return [finding("guard_ignored", f"the {where} reports 'stop' after {count if count is not None else 'fewer'} "
                                         f"token(s): the script's EOS (token {exp.eos_at}) ended it, which the "
                                         f"request's min_tokens or ignore_eos turns off; the reference goes on to "
                                         f"token {exp.selected} ({exp.reason})")]
    if (got, want) in _REASON_SWAPS:
        return _REASON_SWAPS[got, want](exp, where, count, text_agrees)
    return [finding("reason_value" if got not in _API_REASONS else "stop_without_hit",
                    f"the {where} reports {got!r}; the reference: {want!r} ({exp.reason})")]


def _length_for_stop(exp: Expected, where: str, count: int | None, text_agrees: bool) -> list[Finding]:
    """'length' where the reference says 'stop': D4 precedence on the last token, or an early end."""
    if exp.selected == exp.max_tokens:
        return [finding("precedence", f"the {where} reports 'length'; the {exp.reason} completes on token "
                                      f"{exp.selected} = max_tokens, so D4 gives 'stop'")]
    if count is None and text_agrees:  # no count, and the text ends where the reference's does
        at = f"on token {exp.selected} " if exp.selected > 0 else ""
        return [finding("early_length", f"the {where} reports 'length', but its text ends where the reference's "
                                        f"{exp.reason} ends it, {at}before max_tokens {exp.max_tokens}: the run "
                                        "ended there and says otherwise, or ran on selecting tokens it never sent")]
    if count is None or count >= exp.max_tokens:
        return []  # 'length' at the limit: right for the engine's run; its text (or its count) says what went wrong
    return [finding("early_length", f"the {where} reports 'length' after {count} token(s) with max_tokens "
                                    f"{exp.max_tokens}; the reference ends with {exp.reason} on token {exp.selected}")]


def _stop_for_length(exp: Expected, where: str, count: int | None, text_agrees: bool) -> list[Finding]:
    """'stop' where the reference says 'length': past the context limit (D10) or max_tokens, or a
    stop with nothing that ends the run."""
    if exp.reason == "context_limit":
        return [finding("past_context", f"the {where} reports 'stop': the run went on past the context limit "
                                        f"(token {exp.selected}, D10) to an end of its own")]
    if exp.eos_at == exp.max_tokens + 1:
        return [finding("past_limit", f"the {where} reports 'stop' at max_tokens = {exp.max_tokens}: the script's "
                                      f"EOS is token {exp.eos_at}, so it was selected past the limit")]
    return [finding("stop_without_hit", f"the {where} reports 'stop' with no stop string completed and no EOS "
                                        f"within max_tokens = {exp.max_tokens}")]


# (the engine's wire reason, the reference's) -> what the swap means.
_REASON_SWAPS: dict[tuple[str, str], Callable[[Expected, str, int | None, bool], list[Finding]]] = {
    ("length", "stop"): _length_for_stop,
    ("stop", "length"): _stop_for_length,
}
_API_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls", "function_call"})


def compare_choices(n: int, returned: frozenset[int]) -> list[Finding]:
    """The choices of n the engine never returned, in any answer it gave (D34): it took `n` and
    answered fewer choices, a field ignored (basis `n`), never the bytes of a choice lost."""
    if missing := [i for i in range(n) if i not in returned]:
        return [finding("choices_missing", f"field_ignored: n: the request asks for {n} choices and the engine "
                                           f"answered {len(returned)} (index {sorted(returned)}); choice(s) "
                                           f"{missing} never came")]
    return []


def compare_count(exp: Expected, got: int | None) -> list[Finding]:
    """usage.completion_tokens against the tokens the reference selected (§4.3, §4.10).

    Counting the EOS that ended the run is a convention servers differ on: both counts pass."""
    if got is None:
        return []
    if got > exp.max_tokens:
        return [finding("past_limit", f"usage.completion_tokens is {got} with max_tokens {exp.max_tokens}")]
    if exp.reason is None:
        return []
    n = exp.selected
    ok = {n, n - 1} if exp.reason == "eos" else {n}
    if got in ok:
        return []
    if got < min(ok):
        return [finding("count_low", f"usage.completion_tokens is {got}; the reference selects {n} ({exp.reason})")]
    kind = {"stop_sequence": "token_after_stop", "eos": "after_eos", "max_output_tokens": "past_limit",
            "context_limit": "past_context"}.get(exp.reason or "", "token_after_stop")
    what = {"token_after_stop": "after the token that completes the stop", "after_eos": "after the EOS",
            "past_limit": "past max_tokens", "past_context": "past the context limit"}[kind]
    return [finding(kind, f"usage.completion_tokens is {got}: {got - n} token(s) selected {what} "
                          f"({exp.reason} at token {n})")]


@attrs.frozen
class Timeline:
    """A stream's chunks before its finish chunk (opening empty ones too), as §4.6's hold-back reads
    them (D59): each one's text; how many tokens the stream had reported through it (token ids or
    logprobs entries; None: a chunk with text reports none); and how many the engine says it had
    selected when the chunk went out (the reference's `decodespec.selected`, an in-process engine's
    own trace; None: not said). `where` names the stream in findings; `reported_in_all` how many
    tokens the whole stream reported, its finish chunk's too (None: as `reported`'s last)."""

    texts: tuple[bytes, ...]
    reported: tuple[int, ...] | None = None
    selected: tuple[int, ...] | None = None
    where: str = "the stream"
    reported_in_all: int | None = None

    @property
    def shows_tokens(self) -> bool:
        """Whether the chunks say anything of the tokens behind them."""
        return self.reported is not None or self.selected is not None


def compare_split(exp: Expected, chunks: Sequence[bytes],
                  selected: Sequence[int] | None = None) -> tuple[list[Finding], list[str]]:
    """One stream's delta boundaries (§4.3 no empty delta: `compare_empty`; §4.6 hold-back:
    `compare_held`, with `selected`, the tokens selected when each chunk went out, where known),
    and what was not checked."""
    held, missed = compare_held(exp, Timeline(tuple(chunks), selected=None if selected is None else tuple(selected)))
    return compare_empty(chunks) + held, missed


def compare_empty(chunks: Sequence[bytes]) -> list[Finding]:
    """§4.3: an empty delta is never sent."""
    empty = sum(1 for c in chunks if not c)
    return [finding("empty_delta", f"{empty} streamed chunk(s) carry empty text and no finish_reason")] if empty else []


def reports_per_step(exp: Expected, sent: Sequence[int], reported: Sequence[int]) -> bool:
    """Whether a stream's token reports show when each token was selected: some chunk reports a
    token that spells text before any of that text has gone out (vLLM and llama-server report each
    selected token at once, with an empty chunk while its text is held). Reports that go out with
    their token's text, its first byte (the reference's, D59) or all of it (llama-cpp-python, which
    holds whole tokens and releases them later), show the order of the text, not of the selections."""
    spelled = exp.spelled
    for s, k in zip(sent, reported):  # a report past the reference's selections places nothing
        if 0 < k <= len(spelled) and spelled[k - 1] > (spelled[k - 2] if k > 1 else exp.echo_len) >= s:
            return True
    return False


def compare_held(exp: Expected, tl: Timeline) -> tuple[list[Finding], list[str]]:
    """§4.6 hold-back of one stream (`tl`), and what was not checked.

    Held text must not go out before the tokens that rule out its stop are selected: after the
    selection of k tokens the bytes sent may not pass what the reference had released then
    (`exp.released`); holding more is allowed. So hold-back is judged only where the stream shows
    when each chunk went out in selected tokens, never from the number of chunks: from the count the
    engine gives (`tl.selected`), else from its token reports where they are sent as tokens are
    selected (`reports_per_step`), and only where they are complete: a stream that reports fewer
    tokens than the run selected leaves the boundaries of the others unknown, so its reports count
    no selection (D59). What the reference released after its last text token includes the end's
    flush of held text. A stream that sent no text before its finish chunk held everything back."""
    if not exp.holds_back:
        return [], []
    sent = [sum(len(c) for c in tl.texts[:i + 1]) for i in range(len(tl.texts))]
    shown = tl.reported_in_all if tl.reported_in_all is not None else (tl.reported or (0,))[-1]
    if not sent or sent[-1] == 0:  # no byte went out before the finish chunk: none went out early
        return [], []
    if tl.selected is not None:
        clock: Sequence[int] = tl.selected
    elif tl.reported is None:
        return [], ["hold-back (the engine reports no token boundaries with its chunks)"]
    elif shown < exp.selected:
        return [], [f"hold-back ({tl.where} reports {shown} of the {exp.selected} tokens the run selects: the "
                    "boundaries of the others are not on the wire, D59)"]
    elif reports_per_step(exp, sent, tl.reported):
        clock = tl.reported
    else:
        return [], ["hold-back (the engine reports each token only with its text, which does not show when a "
                    "held token was selected)"]
    for s, k in zip(sent, clock):
        if k > 0 and s > (safe := exp.released[min(k, len(exp.released)) - 1]):
            held = b"".join(tl.texts)[safe:s]  # the engine's bytes where the reference held back
            return [finding("stop_prefix_sent", f"with {k} token(s) selected {tl.where} had sent {s} bytes; the "
                                                f"reference still held {held!r} there, which could begin a stop of "
                                                f"{[x.decode('utf-8', 'replace') for x in exp.stops]}")], []
    return [], []
