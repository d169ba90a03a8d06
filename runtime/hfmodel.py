"""HFModel: any local transformers causal-LM checkpoint behind the `Model` protocol (§4.4).

Each sequence owns a `KVCache` (runtime/kvcache.py, the cache TinyLM uses), so snapshot, restore
and free are the same code for both models and swap restores the bits. One kernel call per step
for the whole batch (DECISIONS D50):

- `prefill_batch` runs the prompts as one right-padded batch with no attention mask: causal
  attention keeps every real position from seeing the padding after it, and each row's logits are
  read at its own last prompt position;
- `decode_one` runs the batch on a resident batch cache (`_Slots`): preallocated K/V buffers with
  a row per sequence, in which every row's new token is written at one shared column (the forward
  writes in place: no concatenation, no copy of the batch a step), each token at its own position
  (position_ids = its cache's length) and a mask hiding every column that is not the row's. A
  sequence keeps its row while its cache is unchanged (KVCache.writes); one that joins, or whose
  cache changed (restore, recompute), is copied into a free row; a row sitting a step out is
  computed on a dummy token and masked. When rows or columns would be more than half waste, the
  batch is gathered afresh (one copy of each cache). Each row's new K/V is copied back to its
  own cache. A batch of two or more rows of a Llama-family checkpoint is computed by the lean
  step of runtime/hfdecode.py on the same rows (D58); other families, by transformers' forward.

A batch of one is the plain call (its cache alone in one row, no gap, no mask), which is what `generate()` and the
Engine's `batch_invariant` mode use, so those stay bit for bit what they are alone. Rows of a
padded batch are computed by a kernel of another shape and may round differently (the Engine's
docstring says what holds). Nothing is downloaded (`local_files_only=True`).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .dtypes import DEFAULT_DTYPE, torch_dtype
from .hfdecode import LeanDecoder, unsupported
from .kvcache import CacheError, KVCache, PrefillOne, check_active_batch


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer, [B, H_kv, S, d_h], of a transformers cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _column_layer(base: type) -> type:
    """transformers' DynamicLayer, writing into preallocated buffers instead of concatenating."""

    class ColumnLayer(base):
        """One layer of the resident batch: the forward's new keys and values are written at the
        next column of [B, H_kv, S_cap, d_h] buffers and the views up to it are returned (D50)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: int) -> None:
            super().__init__()
            self.buffers = keys, values
            self.is_initialized, self.device = True, keys.device
            self.dtype = keys.dtype
            self.keys, self.values = keys[:, :, :column], values[:, :, :column]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.buffers
            start = self.keys.shape[-2]
            stop = start + key_states.shape[-2]
            keys[:, :, start:stop] = key_states
            values[:, :, start:stop] = value_states
            self.keys, self.values = keys[:, :, :stop], values[:, :, :stop]
            return self.keys, self.values

    return ColumnLayer


def _room(n_columns: int) -> int:
    """The capacity made for `n_columns` columns: half as many again, at least 32 more. A step adds
    one column, so the buffers move once in n/2 steps, and the lean step reads the slack, masked
    (D58 gives the measurements behind the growth)."""
    return n_columns + max(32, n_columns // 2)


@attrs.define(eq=False)
class _Spare:
    """Buffers the resident batch let go (moved when it grew, or gathered afresh), kept for its next
    ones (D63): a new buffer of tens of MB is a page fault every 4 KB on first touch, and beside
    another large process each fault costs several times as much. The largest `keep` are kept."""

    keep: int = 4
    free: list[torch.Tensor] = attrs.field(factory=list)  # flat, largest first

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, zeroed: bool) -> torch.Tensor:
        """A tensor of `shape` on a kept buffer when one is large enough (the smallest such), else new."""
        numel = math.prod(shape)
        fits = [i for i, t in enumerate(self.free) if t.numel() >= numel and t.dtype == dtype and t.device == device]
        if not fits:
            return (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
        flat = self.free.pop(fits[-1])
        out = flat[:numel].view(shape)
        return out.zero_() if zeroed else out

    def give(self, *tensors: torch.Tensor) -> None:
        """Keep these buffers (nothing may use them after): the whole allocation each one is a view of."""
        for t in tensors:
            self.free.append((t._base if t._base is not None else t).view(-1))
        self.free.sort(key=torch.Tensor.numel, reverse=True)
        del self.free[self.keep:]


@attrs.define(eq=False)
class _Slots:
    """The resident batch cache (D50). Row b holds `rows[b]`'s keys and values as of its
    `writes[b]` (None: never written); every row's next token goes to column `column`; `valid[b]`
    marks row b's columns (a row that joined late or sat out a step has masked gaps: attention
    does not care where a key lies, its position is in its rotary phase). The buffers are zeroed
    when made and hold only finite values after (written keys and values, or zeros), so a masked
    key never turns a score into NaN, and the lean step (D58) may read every column of the
    capacity: a layer's rows are then one contiguous block, which the CPU's batched products read
    faster than the same columns strided (D58). The capacity is what
    the longest row needs and half as much again (`_room`): the columns read past `column` are
    masked waste.

    A decoded token's K/V stay here: row b's cache owes them (`KVCache.owe`, D61) and `owed[b]`
    lists their columns until `writers[b]` writes them into the cache, when it is read, swapped,
    or its row is given to another cache. A cache freed first is never written."""

    keys: torch.Tensor  # [L, B_cap, H_kv, S_cap, d_h]
    values: torch.Tensor
    valid: torch.Tensor  # [B_cap, S_cap] bool
    rows: list[KVCache | None]
    writes: list[int]
    column: int = 0
    spare: _Spare | None = None  # where its buffers come from and go back to (D63)
    owed: list[list[int]] = attrs.field(init=False)
    writers: list[Callable[[KVCache, int], None]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.owed = [[] for _ in self.rows]
        self.writers = [functools.partial(self._pay, b) for b in range(len(self.rows))]

    def _pay(self, b: int, cache: KVCache, start: int) -> None:
        """Row b's owed columns, written into `cache` at [start, length) (its settle, D61)."""
        cols, self.owed[b] = self.owed[b], []
        n, first = len(cols), cols[0] if cols else 0
        if n != cache.length - start:
            raise CacheError(f"row {b} holds {n} owed tokens, its cache owes {cache.length - start}")
        at = slice(first, first + n) if cols[-1] - first == n - 1 else torch.tensor(cols, device=self.keys.device)
        k, v = cache.buffers()
        k[start : cache.length] = self.keys[:, b, :, at].permute(2, 0, 1, 3)
        v[start : cache.length] = self.values[:, b, :, at].permute(2, 0, 1, 3)

    def settle(self, b: int | None = None) -> None:
        """Row b's cache (every row's, None) is paid what it is owed from here; columns owed to a
        cache that has let the debt go (freed, restored) are forgotten."""
        for i in range(len(self.rows)) if b is None else (b,):
            c = self.rows[i]
            if c is not None and c.writer is self.writers[i]:
                c.settle()
            self.owed[i] = []

    def owe(self, b: int, cache: KVCache, column: int) -> None:
        """Row b's new token, at `column`, stays here; its cache counts it (D61)."""
        self.owed[b].append(column)
        cache.owe(1, self.writers[b])
        self.writes[b] = cache.writes

    @classmethod
    def gather(cls, caches: Sequence[KVCache], spare: _Spare | None = None) -> _Slots:
        """The caches in rows 0.. (one copy of each), with spare rows for caches that join later."""
        c0, longest = caches[0], max(c.length for c in caches)
        n_rows = len(caches) + max(4, len(caches) // 2)
        shape = (c0.n_layers, n_rows, c0.n_kv_heads, _room(longest + 1), c0.head_dim)
        slots = cls(*cls._alloc(shape, c0.dtype, c0.device, spare=spare), rows=[None] * n_rows,
                    writes=[0] * n_rows, spare=spare)
        for b, c in enumerate(caches):
            slots._write(b, c)
        return slots

    @staticmethod
    def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, zeroed: bool = True,
               spare: _Spare | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K and V buffers [L, B, H_kv, S, d_h] (kept ones from `spare` where they fit), zeroed
        unless the caller writes every element itself (`reserve`), and a cleared mask [B, S]."""
        take = spare.take if spare is not None else _Spare().take
        return (take(shape, dtype, device, zeroed), take(shape, dtype, device, zeroed),
                torch.zeros((shape[1], shape[3]), dtype=torch.bool, device=device))

    def release(self) -> None:
        """Its K/V buffers go to `spare`: the caches it owes are paid first, and it is used no more."""
        self.settle()
        if self.spare is not None:
            self.spare.give(self.keys, self.values)

    def place(self, caches: Sequence[KVCache]) -> list[int] | None:
        """A row for each cache: its own while unchanged, else the lowest one no cache of this
        step holds (written anew). None when there is none, or when more than half the rows
        computed or the columns read would be for nothing: the caller gathers afresh, so the
        waste stays under 2x."""
        current = {id(c): b for b, (c, w) in enumerate(zip(self.rows, self.writes))
                   if c is not None and w == c.writes}
        order = [current.get(id(c)) for c in caches]
        joining = [i for i, b in enumerate(order) if b is None]
        taken = set(order)
        spare = [b for b in range(len(self.rows)) if b not in taken][: len(joining)]
        if len(spare) < len(joining):
            return None
        for i, b in zip(joining, spare):
            order[i] = b
        placed = [b for b in order if b is not None]  # every cache has its row now
        column = max([self.column, *(caches[i].length for i in joining)])
        longest = max(c.length for c in caches)
        if max(placed) + 1 > 2 * len(caches) + 2 or column > 2 * longest + 16:
            return None
        for i, b in zip(joining, spare):
            self._write(b, caches[i])
        return placed

    def _write(self, b: int, cache: KVCache) -> None:
        """Row b := the cache, from column 0 (its other columns keep the finite values they hold,
        masked)."""
        self.settle(b)  # the row's last cache is paid before the row changes hands
        n = cache.length
        if n > self.column:  # the columns skipped are read (masked) by every computed row
            self.reserve(n + 1)
            self.column = n
        k, v = cache.keys_values()  # [T, L, H, d]
        for buf, new in ((self.keys, k), (self.values, v)):
            buf[:, b, :, :n] = new.permute(1, 2, 0, 3)
        self.valid[b].zero_()
        self.valid[b, :n] = True
        self.rows[b], self.writes[b] = cache, cache.writes

    def reserve(self, n_columns: int) -> None:
        """Room for `n_columns` columns (`_room` of them). What the rows up to the last one held
        wrote before `column` moves; the rest of the new buffers is zeros, as in fresh ones."""
        have = self.valid.shape[1]
        if n_columns <= have:
            return
        layers, rows, heads, _, dim = self.keys.shape
        keys, values, valid = self._alloc((layers, rows, heads, _room(n_columns), dim), self.keys.dtype,
                                          self.keys.device, zeroed=False, spare=self.spare)
        held = 1 + max((b for b, c in enumerate(self.rows) if c is not None), default=-1)
        cols = self.column
        for new, old in ((keys, self.keys), (values, self.values)):  # each element written once:
            new[:, :held, :, :cols] = old[:, :held, :, :cols]  # the kept block, zeros around it
            new[:, :held, :, cols:] = 0
            new[:, held:] = 0
        valid[:held, :cols] = self.valid[:held, :cols]
        if self.spare is not None:
            self.spare.give(self.keys, self.values)
        self.keys, self.values, self.valid = keys, values, valid


class HFModel(PrefillOne):
    """A local transformers causal LM (AutoModelForCausalLM) behind the Model protocol, its weights
    and cache in `dtype` (runtime/dtypes.py; whatever type the checkpoint was saved in)."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu", *, dtype: str = DEFAULT_DTYPE) -> None:
        as_dtype = torch_dtype(dtype)
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"no transformers checkpoint at {folder}: config.json is missing")
        from transformers import AutoModelForCausalLM, DynamicCache
        from transformers.cache_utils import DynamicLayer

        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=as_dtype)
        # transformers wraps PreTrainedModel.to in a decorator whose declared call has no `self`
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        self._new_cache = DynamicCache
        self._layer = _column_layer(DynamicLayer)
        self._slots: _Slots | None = None
        # buffers the resident batch let go, for its next ones (D63); on CUDA the caching allocator
        # already reuses freed memory without faults, and a kept buffer would only hold memory
        self._spare = _Spare(keep=4 if self.device.type == "cpu" else 0)
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
        # A batch of two or more rows takes the lean step where the family has one (D58).
        self.lean_unsupported: str | None = unsupported(self.model)
        self._lean = LeanDecoder(self.model) if self.lean_unsupported is None else None

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _ids(self, rows: Sequence[Sequence[int]], what: str) -> torch.Tensor:
        """Right-padded [B, T] ids (pad 0); every row non-empty and inside the vocabulary."""
        flat = [t for ids in rows for t in ids]
        for i, ids in enumerate(rows):
            if len(ids) == 0:
                raise ValueError(f"{what} {i} must hold at least one token id")
        if min(flat) < 0 or max(flat) >= self.vocab_size:
            bad = next(i for i, ids in enumerate(rows) if min(ids) < 0 or max(ids) >= self.vocab_size)
            raise ValueError(f"{what} {bad}: token ids must lie in [0, {self.vocab_size})")
        width = max(len(ids) for ids in rows)
        padded = [list(ids) + [0] * (width - len(ids)) for ids in rows]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def _cache(self) -> KVCache:
        layers, kv_heads, head_dim = self._shape
        return KVCache(n_layers=layers, n_kv_heads=kv_heads, head_dim=head_dim, max_length=self.context_limit,
                       device=self.device, dtype=self.model.dtype)

    def _forward(self, ids: torch.Tensor, past: Any, **kw: Any) -> Any:
        """One model call: its logits and its cache (the K/V of every position processed)."""
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: past}, **kw)
        return out.logits, out[self._cache_arg]

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
        logits, past = self._forward(ids, None, **kw)
        if self._keep_arg:
            last = torch.searchsorted(keep, last)
        rows = logits[torch.arange(len(prompts), device=self.device), last].float()
        layers = _layers(past)
        k = torch.stack([keys for keys, _ in layers], dim=1).permute(0, 3, 1, 2, 4)  # [B, T, L, H, d]
        v = torch.stack([values for _, values in layers], dim=1).permute(0, 3, 1, 2, 4)
        caches = []
        for b, p in enumerate(prompts):
            cache = self._cache()
            cache.append(k[b, : len(p)], v[b, : len(p)])
            cache.prompt_length = len(p)
            caches.append(cache)
        return rows, caches

    def _place(self, caches: Sequence[KVCache]) -> tuple[_Slots, list[int]]:
        """The resident rows for this step's caches, or a fresh gather of them. A batch of one is
        computed alone: its cache in the only row, without gaps (then no mask is needed)."""
        slots, self._slots = self._slots, None  # dropped first: a failed call leaves nothing stale
        order = slots.place(caches) if slots is not None else None
        if slots is None or order is None or (len(caches) == 1 and (order != [0] or slots.column != caches[0].length)):
            if slots is not None:
                slots.release()  # every cache it owes is paid before its buffers are kept for reuse
            return _Slots.gather(caches, self._spare), list(range(len(caches)))
        return slots, order

    def decode_one(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """One token per sequence at position cache.length, one call for the batch (§4.4), on the
        resident batch cache (module docstring, D50)."""
        check_active_batch(caches, tokens, self.context_limit)
        ids = self._ids([tokens], "tokens")[0]
        slots, order = self._place(caches)
        span, col = max(order) + 1, slots.column
        slots.reserve(col + 1)
        rows = torch.as_tensor(order, device=self.device)
        batch_ids = torch.zeros((span, 1), dtype=torch.long, device=self.device)
        batch_ids[rows, 0] = ids
        positions = torch.zeros((span, 1), dtype=torch.long, device=self.device)
        positions[rows, 0] = torch.as_tensor([c.length for c in caches], device=self.device)
        if span > 1:  # a batch of one has no gaps: the plain call, as generate() makes it
            # the lean step reads the whole capacity, one contiguous block (masked past col)
            mask = slots.valid[:span, : None if self._lean is not None else col + 1].clone()
            mask[:, col] = True  # the new token sees itself (a row sitting out sees only that)
        if span > 1 and self._lean is not None:
            logits = self._lean.step(batch_ids[:, 0], positions[:, 0], slots.keys, slots.values, col, mask)
        else:
            past = self._new_cache()
            past.layers = [self._layer(slots.keys[layer, :span], slots.values[layer, :span], col)
                           for layer in range(self._shape[0])]
            kw: dict[str, Any] = {"position_ids": positions}
            if span > 1:
                kw["attention_mask"] = mask.long()
            logits = self._forward(batch_ids, past, **kw)[0][:, -1]
        slots.valid[:span, col] = False
        slots.valid[rows, col] = True
        slots.column = col + 1
        for b, c in zip(order, caches):  # row b's new K/V stay in column col, owed to its cache (D61)
            slots.owe(b, c, col)
        self._slots = slots
        return logits[rows].float()
