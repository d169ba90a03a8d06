"""Exceptions of the runtime that name what went wrong (§4.10 failure classes)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request field is invalid; `field` names it (the server answers 4xx with it; DECISIONS D9)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ModelError(RuntimeError):
    """The model step (prefill or decode_one) failed: the request ends FAILED with model_error."""

