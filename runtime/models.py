"""The model protocol of the reference engine and the scripted fixture model (§4.2-§4.4).

A model turns a prompt into next-token logits plus a per-sequence cache (`prefill`, §4.2) and
advances an *active batch* by one token (`decode_one`, §4.4): the batch's caches may have
different lengths m_b + t_b - 1; token b is written at logical position `caches[b].length` and
that cache grows by one. Implementations: `TinyLM` (runtime/tinylm.py), `HFModel`
(runtime/hfmodel.py) and `ScriptedModel` below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from .hfmodel import HFModel
from .kvcache import CacheError, CacheSnapshot, KVCache, PrefillOne, SequenceCache, check_active_batch
from .tinylm import TinyLM, TinyLMConfig

__all__ = [
    "CacheError", "CacheSnapshot", "HFModel", "KVCache", "Model", "ScriptExhausted",
    "ScriptedModel", "SequenceCache", "TinyLM", "TinyLMConfig",
]


@runtime_checkable
class Model(Protocol):
    """What the decode loop and the batched engine call (§4.3, §4.4)."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def context_limit(self) -> int:
        """The most tokens a cache may hold, prompt included."""

    @property
    def device(self) -> torch.device: ...

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, SequenceCache]: ...

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[SequenceCache]]: ...

    def decode_one(self, caches: Sequence[SequenceCache], tokens: Sequence[int]) -> torch.Tensor: ...


class ScriptExhausted(RuntimeError):
    """A ScriptedModel was asked for logits past the end of its script (a fixture bug)."""


FORCED_LOGIT = 1.0e4


class ScriptedModel(PrefillOne):
    """Forces `tokens` as the outputs y_1, y_2, ... (the hand-computable fixtures of §4.6, §4.11).

    The logits for output step t are FORCED_LOGIT at tokens[t-1] and 0 elsewhere, so greedy and
    any sampling pick the script. The prompt's content is ignored (any non-negative ids). A real
    KVCache (one layer, one head, d_h 1: 2 scalars a token) is still written: prefill writes the
    prompt, each decode_one one token, so cache accounting is exercised as with a real model.

    Each sequence's position in the script is derived from its own cache (outputs processed =
    length - prompt_length), so batches of different lengths, snapshot/restore and preemption
    keep it. After the script's last token has been processed there are no more logits:
    decode_one raises ScriptExhausted (a fixture that runs past its script is a mistake; stop it
    with EOS, a stop string or max_output_tokens). The raise happens before any cache changes.
    """

    def __init__(self, tokens: list[int], vocab_size: int | None = None, *, context_limit: int = 4096,
                 device: str | torch.device = "cpu") -> None:
        if not tokens or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
            raise ValueError(f"tokens must be a non-empty list of non-negative ints, got {tokens!r}")
        need = max(tokens) + 1
        if vocab_size is None:
            vocab_size = need
        elif vocab_size < need:
            raise ValueError(f"vocab_size {vocab_size} is too small for token id {need - 1}")
        self.tokens = list(tokens)
        self.vocab_size = vocab_size
        self.context_limit = context_limit
        self.device = torch.device(device)
        self.name = "scripted"

    def _logits(self, caches: Sequence[KVCache]) -> torch.Tensor:
        out = torch.zeros(len(caches), self.vocab_size, device=self.device)
        for b, c in enumerate(caches):
            out[b, self.tokens[c.length - c.prompt_length]] = FORCED_LOGIT
        return out

    def _cache(self) -> KVCache:
        return KVCache(n_layers=1, n_kv_heads=1, head_dim=1, max_length=self.context_limit, device=self.device)

    @staticmethod
    def _kv(ids: Sequence[int], start: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.tensor(list(ids), dtype=torch.float32, device=device).view(-1, 1, 1, 1)
        v = torch.arange(start, start + len(ids), dtype=torch.float32, device=device).view(-1, 1, 1, 1)
        return k, v

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[KVCache]]:
        if not prompts:
            raise ValueError("prefill_batch needs at least one prompt")
        caches = []
        for i, p in enumerate(prompts):
            if len(p) == 0 or any(not isinstance(t, int) or t < 0 for t in p):
                raise ValueError(f"prompt {i} must be a non-empty sequence of non-negative ints")
            cache = self._cache()
            cache.append(*self._kv(p, 0, self.device))
            cache.prompt_length = len(p)
            caches.append(cache)
        return self._logits(caches), caches

    def decode_one(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """Write each token at its cache's position and return the script's next logits [B, V]."""
        check_active_batch(caches, tokens, self.context_limit)
        for c in caches:
            if c.length - c.prompt_length + 1 >= len(self.tokens):
                raise ScriptExhausted(
                    f"the script has {len(self.tokens)} tokens and all of them were processed; "
                    "end the fixture with EOS, a stop or max_output_tokens"
                )
        for c, t in zip(caches, tokens):
            c.append(*self._kv([t], c.length, self.device))
        return self._logits(caches)
