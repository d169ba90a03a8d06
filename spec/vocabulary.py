"""The fixed vocabulary shared by every table: finish reasons (§4.10) and terminal kinds."""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """The ten finish reasons of §4.10; a row's `reason` must be one of them."""

    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    GRAMMAR_COMPLETE = "grammar_complete"
    MAX_OUTPUT_TOKENS = "max_output_tokens"
    CONTEXT_LIMIT = "context_limit"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CONTENT_INTERRUPTED = "content_interrupted"
    MODEL_ERROR = "model_error"
    TRANSPORT_ERROR = "transport_error"


class DecisionKind(enum.StrEnum):
    """How a (state, event) pair is decided (DESIGN: a row, an ignore or a rejection)."""

    ROW = "row"
    IGNORE = "ignore"
    REJECT = "reject"
