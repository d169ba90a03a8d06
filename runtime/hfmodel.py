"""HFModel: any local transformers causal-LM checkpoint behind the `Model` protocol (§4.4).

Each sequence owns a `KVCache` (runtime/kvcache.py, the cache TinyLM uses), so snapshot, restore
and free are the same code for both models and swap restores the bits. One kernel call per step
for the whole batch (DECISIONS D50):

- `prefill_batch` runs the prompts as one right-padded batch with no attention mask: causal
  attention keeps every real position from seeing the padding after it, and each row's logits are
  read at its own last prompt position;
- `decode_one` gathers the caches of different lengths into one right-padded batch cache (a
  transformers `DynamicCache`, one copy of each cache), writes each token at its own position
  (position_ids = its cache's length) and masks every padded slot; each row's new K/V is copied
  back to its own cache. The batch cache stays resident: while the next step decodes the same
  caches, none changed since (KVCache.writes), it is used again as the forward left it (the new
  tokens appended after the padding, the mask grown by a column), so a step copies the batch once
  (transformers' own append) instead of gathering it anew.

A batch of one is the plain call (no padding, no mask), which is what `generate()` and the
Engine's `batch_invariant` mode use, so those stay bit for bit what they are alone. Rows of a
padded batch are computed by a kernel of another shape and may round differently (the Engine's
docstring says what holds). Nothing is downloaded (`local_files_only=True`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.nn.utils.rnn import pad_sequence

from .kvcache import CacheError, KVCache, PrefillOne, check_active_batch


@attrs.frozen
class _Resident:
    """The batch cache the last decode left: for these caches at these write counts; `valid`
    [B, S] marks each row's real slots (False: padding)."""

    caches: tuple[KVCache, ...]
    writes: tuple[int, ...]
    past: Any
    valid: torch.Tensor


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer, [B, H_kv, S, d_h], of a transformers cache (4.x: two lists)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


class HFModel(PrefillOne):
    """A local transformers causal LM (AutoModelForCausalLM) behind the Model protocol."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu") -> None:
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"no transformers checkpoint at {folder}: config.json is missing")
        from transformers import AutoModelForCausalLM, DynamicCache

        self.model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).to(device).eval()
        self._new_cache = DynamicCache
        self._resident: _Resident | None = None
        cfg = self.model.config
        self.name = folder.name
        self.vocab_size: int = cfg.vocab_size
        self.context_limit: int = cfg.max_position_embeddings
        eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) else eos
        n_heads = cfg.num_attention_heads
        self._shape = (cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or n_heads,
                       getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
        # transformers 5.x renames `past_key_values` to `cache` (argument and output field)
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = next((a for a in ("logits_to_keep", "num_logits_to_keep") if a in params), None)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _ids(self, rows: Sequence[Sequence[int]], what: str) -> torch.Tensor:
        """Right-padded [B, T] ids (pad 0); every row non-empty and inside the vocabulary."""
        tensors = []
        for i, ids in enumerate(rows):
            if len(ids) == 0:
                raise ValueError(f"{what} {i} must hold at least one token id")
            t = torch.as_tensor(list(ids), dtype=torch.long)
            if t.min() < 0 or t.max() >= self.vocab_size:
                raise ValueError(f"{what} {i}: token ids must lie in [0, {self.vocab_size})")
            tensors.append(t)
        return pad_sequence(tensors, batch_first=True).to(self.device)

    def _cache(self) -> KVCache:
        layers, kv_heads, head_dim = self._shape
        return KVCache(n_layers=layers, n_kv_heads=kv_heads, head_dim=head_dim, max_length=self.context_limit,
                       device=self.device, dtype=self.model.dtype)

    def _forward(self, ids: torch.Tensor, past: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One model call; logits and the K/V of the T positions it processed, [B, T, L, H_kv, d_h]."""
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: past}, **kw)
        t, layers = ids.shape[1], _layers(out[self._cache_arg])
        k = torch.stack([keys[:, :, -t:] for keys, _ in layers], dim=1)  # [B, L, H, T, d]
        v = torch.stack([values[:, :, -t:] for _, values in layers], dim=1)
        return out.logits, k.permute(0, 3, 1, 2, 4), v.permute(0, 3, 1, 2, 4)

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[KVCache]]:
        """All prompts in one right-padded call: logits [B, V] at each prompt's last position (§4.2)."""
        if not prompts:
            raise ValueError("prefill_batch needs at least one prompt")
        for p in prompts:
            if len(p) > self.context_limit:
                raise CacheError(f"{len(p)} prompt tokens exceed the context limit {self.context_limit}")
        ids = self._ids(prompts, "prompt")
        last = torch.as_tensor([len(p) - 1 for p in prompts], device=self.device)
        keep = torch.unique(last)  # the logits of the last positions only (a real vocabulary is large)
        kw = {self._keep_arg: keep} if self._keep_arg else {}
        logits, k, v = self._forward(ids, None, **kw)
        if self._keep_arg:
            last = torch.searchsorted(keep, last)
        rows = logits[torch.arange(len(prompts), device=self.device), last].float()
        caches = []
        for b, p in enumerate(prompts):
            cache = self._cache()
            cache.append(k[b, : len(p)], v[b, : len(p)])
            cache.prompt_length = len(p)
            caches.append(cache)
        return rows, caches

    def _gather(self, caches: Sequence[KVCache]) -> tuple[Any, torch.Tensor]:
        """The caches as one right-padded transformers cache ([B, H_kv, T_max, d_h] a layer, zeros
        past each length: one copy of each cache) and its real slots."""
        layers, heads, dim = self._shape
        t_max = max(c.length for c in caches)
        shape = (layers, len(caches), heads, t_max, dim)
        keys = torch.zeros(shape, dtype=self.model.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.model.dtype, device=self.device)
        valid = torch.zeros((len(caches), t_max), dtype=torch.bool, device=self.device)
        for b, c in enumerate(caches):
            k, v = c.keys_values()  # [T, L, H, d]
            keys[:, b, :, : c.length] = k.permute(1, 2, 0, 3)
            values[:, b, :, : c.length] = v.permute(1, 2, 0, 3)
            valid[b, : c.length] = True
        past = self._new_cache()
        for layer in range(layers):
            past.update(keys[layer], values[layer], layer)
        return past, valid

    def decode_one(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """One token per sequence at position cache.length, one call for the batch (§4.4); the
        batch cache of the last call is used again while it is current (module docstring)."""
        check_active_batch(caches, tokens, self.context_limit)
        ids = self._ids([[t] for t in tokens], "token")
        key = tuple(caches)
        res, self._resident = self._resident, None  # dropped first: a failed call leaves nothing stale
        if res is not None and res.caches == key and res.writes == tuple(c.writes for c in caches):
            past, valid = res.past, res.valid
        else:
            past, valid = self._gather(caches)
        lens = torch.as_tensor([c.length for c in caches], device=self.device)
        valid = torch.cat([valid, torch.ones((len(caches), 1), dtype=torch.bool, device=self.device)], dim=1)
        kw: dict[str, Any] = {"position_ids": lens[:, None]}
        if len(caches) > 1:  # a batch of one has no padding: the plain call, as generate() makes it
            kw["attention_mask"] = valid.long()  # the new token sees itself and every real slot
        logits, k, v = self._forward(ids, past, **kw)
        for b, c in enumerate(caches):
            c.append(k[b], v[b])
        self._resident = _Resident(key, tuple(c.writes for c in caches), past, valid)
        return logits[:, -1].float()
