"""HFModel: any local transformers causal-LM checkpoint behind the `Model` protocol (§4.4).

Each sequence owns an `HFCache` wrapping its own transformers `DynamicCache`. Batched decode
over sequences of different lengths runs one forward per sequence (a loop over the batch):
it is the reference path for foreign checkpoints, not a fast one; TinyLM is the batched model.
Nothing is downloaded (`local_files_only=True`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .kvcache import CacheError, check_active_batch


@attrs.define(eq=False, slots=True)
class HFCache:
    """One sequence's transformers past_key_values plus its logical length (§4.2, §4.4)."""

    past: Any = attrs.field(repr=False)
    length: int
    numel_per_token: int
    itemsize: int
    prompt_length: int = 0
    freed: bool = False

    def numel(self) -> int:
        return self.length * self.numel_per_token

    def nbytes(self) -> int:
        return self.numel() * self.itemsize

    def snapshot(self) -> HFCache:
        """A deep copy of the cache (on the model's device) to restore from later."""
        if self.freed:
            raise CacheError("HF cache used after free()")
        return copy.deepcopy(self)

    def restore(self, snap: HFCache) -> None:
        self.past = copy.deepcopy(snap.past)
        self.length, self.prompt_length, self.freed = snap.length, snap.prompt_length, False

    def free(self) -> None:
        self.past, self.length, self.freed = None, 0, True


class HFModel:
    """A local transformers causal LM (AutoModelForCausalLM) behind the Model protocol."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu") -> None:
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"no transformers checkpoint at {folder}: config.json is missing")
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).to(device).eval()
        cfg = self.model.config
        self.name = folder.name
        self.vocab_size: int = cfg.vocab_size
        self.context_limit: int = cfg.max_position_embeddings
        eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) else eos
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        self._per_token = 2 * cfg.num_hidden_layers * n_kv * head_dim
        self._itemsize = self.model.dtype.itemsize
        # transformers 5.x renames `past_key_values` to `cache` (argument and output field)
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _ids(self, ids: Sequence[int], what: str) -> torch.Tensor:
        if len(ids) == 0:
            raise ValueError(f"{what} must hold at least one token id")
        t = torch.as_tensor(list(ids), dtype=torch.long)
        if t.min() < 0 or t.max() >= self.vocab_size:
            raise ValueError(f"{what}: token ids must lie in [0, {self.vocab_size})")
        return t.to(self.device)[None]

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, HFCache]:
        if len(prompt_ids) > self.context_limit:
            raise CacheError(f"{len(prompt_ids)} prompt tokens exceed the context limit {self.context_limit}")
        with torch.inference_mode():
            out = self.model(input_ids=self._ids(prompt_ids, "prompt"), use_cache=True)
        m = len(prompt_ids)
        cache = HFCache(out[self._cache_arg], m, self._per_token, self._itemsize, prompt_length=m)
        return out.logits[0, -1].float(), cache

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[HFCache]]:
        if not prompts:
            raise ValueError("prefill_batch needs at least one prompt")
        pairs = [self.prefill(p) for p in prompts]
        return torch.stack([p[0] for p in pairs]), [p[1] for p in pairs]

    def decode_one(self, caches: Sequence[HFCache], tokens: Sequence[int]) -> torch.Tensor:
        """One token per sequence at position cache.length; loops over the batch."""
        check_active_batch(caches, tokens, self.context_limit)
        rows = []
        with torch.inference_mode():
            for c, tok in zip(caches, tokens):
                pos = torch.tensor([[c.length]], device=self.device)
                out = self.model(input_ids=self._ids([tok], "token"), position_ids=pos, use_cache=True,
                                 **{self._cache_arg: c.past})
                c.past, c.length = out[self._cache_arg], c.length + 1
                rows.append(out.logits[0, -1].float())
        return torch.stack(rows)
