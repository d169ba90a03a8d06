"""decodespec: executable semantics of the LLM decode loop (seed chapter 4)."""

__version__ = "0.1.0"
