"""The explicit per-sequence KV cache the runtime owns (§4.2, §4.4).

One `KVCache` holds the keys and values of every layer for one sequence: the prompt x[1:m] and
the outputs y[1:t-1] already decoded (§4.2). `length` is the logical number of tokens written;
each processed token adds exactly 2·L·H_kv·d_h scalars (§4.4), which `numel()` reports.

Layout: K and V are each one preallocated tensor ``[capacity, L, H_kv, d_h]`` (time first), so
``k[:, l]`` is layer l's ``[capacity, H_kv, d_h]`` store. Time-first lets the model append one
token to all layers with a single copy and gather a batch of caches of different lengths with
one padded stack (see `TinyLM.decode_one`). Capacity starts at the first write and doubles on
demand, never past `max_length` (the model's context limit).

Write-behind (D61): a model that keeps the newest tokens' K/V in a buffer of its own (HFModel's
resident batch) may `owe` them instead of copying them here every step: `length` counts them at
once, and the owed K/V are written by the model's writer before anything reads or changes what is
stored (`keys_values`, `snapshot`, `append`, `reserve`, `settle`). A cache freed while it owes is
never written: a request that ends in the batch costs no copy-back at all.

Swap-out for preemption (§4.8): `snapshot()` copies the written part to CPU, `free()` drops the
device tensors, `restore(snap)` writes it back into the *same* object, so a resumed sequence
continues bit-identically and anything keyed by the cache object survives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch


class CacheError(ValueError):
    """A cache used against its invariants (write past the limit, use after free, bad shape)."""


class SequenceCache(Protocol):
    """What the runtime needs from any model's per-sequence cache (§4.4)."""

    @property
    def length(self) -> int: ...

    @property
    def numel_per_token(self) -> int: ...

    def numel(self) -> int: ...

    def nbytes(self) -> int: ...

    def free(self) -> None: ...


@attrs.frozen(slots=True)
class CacheSnapshot:
    """The written part of a cache, on CPU (§4.8 swap-out). Restores bit-identically."""

    k: torch.Tensor
    v: torch.Tensor
    length: int
    prompt_length: int


@attrs.define(eq=False, slots=True, on_setattr=attrs.setters.NO_OP)
class KVCache:
    """Keys and values of one sequence, all layers (§4.4). Identity-hashed (eq=False). Its fields
    are set as plain attributes (the converter runs once, at construction): the model counts a
    token into every cache of the batch at every step."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_length: int
    device: torch.device = attrs.field(converter=torch.device)
    dtype: torch.dtype = torch.float32
    length: int = 0
    prompt_length: int = 0
    k: torch.Tensor | None = attrs.field(default=None, repr=False)
    v: torch.Tensor | None = attrs.field(default=None, repr=False)
    freed: bool = False
    # Counts every change of the contents (append, owe, restore, free): a copy of them kept
    # elsewhere (HFModel's resident batch) is current exactly while this is the count it was made at.
    writes: int = 0
    # The newest `owed` tokens are counted in `length` but their K/V are not stored here yet:
    # `writer(self, start)` writes them at [start, length) (write-behind, D61).
    owed: int = attrs.field(default=0, init=False)
    writer: Callable[[KVCache, int], None] | None = attrs.field(default=None, init=False, repr=False)

    @property
    def numel_per_token(self) -> int:
        """2·L·H_kv·d_h: the scalars one processed token adds (§4.4)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def numel(self) -> int:
        """Logical scalars held: length·2·L·H_kv·d_h (the physical capacity may be larger)."""
        return self.length * self.numel_per_token

    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def _check_live(self) -> None:
        if self.freed:
            raise CacheError("KV cache used after free()")

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` more tokens (capacity doubles, capped at max_length)."""
        self._check_live()
        self.settle()
        self._grow(self._room_for(n_tokens))

    def _room_for(self, n_tokens: int) -> int:
        need = self.length + n_tokens
        if need > self.max_length:
            raise CacheError(
                f"KV cache would hold {need} tokens, over the context limit {self.max_length}"
            )
        return need

    def _grow(self, need: int) -> None:
        """Capacity for `need` tokens; the stored ones move (everything before the owed ones)."""
        if need <= self.capacity:
            return
        cap = min(self.max_length, max(need, 2 * self.capacity, 16))
        shape = (cap, self.n_layers, self.n_kv_heads, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)  # only [:length] is ever read
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        stored = self.length - self.owed
        if stored:
            old_k, old_v = self.buffers()
            k[:stored] = old_k[:stored]
            v[:stored] = old_v[:stored]
        self.k, self.v = k, v

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V tensors; a cache that holds tokens (after `_grow`) has both."""
        if self.k is None or self.v is None:
            raise CacheError("KV cache has no tensors: nothing was reserved or it was freed")
        return self.k, self.v

    def owe(self, n_tokens: int, writer: Callable[[KVCache, int], None]) -> None:
        """Count `n_tokens` new tokens whose K/V `writer` holds and will write (D61); a debt to
        another writer is settled first."""
        self._check_live()
        need = self._room_for(n_tokens)
        if self.owed and self.writer is not writer:
            self.settle()
        self.length = need
        self.owed += n_tokens
        self.writer = writer
        self.writes += 1

    def settle(self) -> None:
        """Write the owed K/V now (D61); nothing owed, nothing done."""
        if not self.owed:
            return
        writer, n = self.writer, self.owed
        if writer is None:
            raise CacheError(f"KV cache owes {n} tokens but names no writer for them")
        self._grow(self.length)
        self.owed, self.writer = 0, None
        writer(self, self.length - n)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of `n` new tokens ([n, L, H_kv, d_h] each) at positions length..length+n-1."""
        expected = (self.n_layers, self.n_kv_heads, self.head_dim)
        if k.dim() != 4 or tuple(k.shape[1:]) != expected or k.shape != v.shape:
            raise CacheError(
                f"K/V must have shape [n, {', '.join(map(str, expected))}], got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        n = k.shape[0]
        self.reserve(n)  # settles what is owed first
        k_buf, v_buf = self.buffers()
        k_buf[self.length : self.length + n] = k
        v_buf[self.length : self.length + n] = v
        self.length += n
        self.writes += 1

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the written part, [length, L, H_kv, d_h] each."""
        self._check_live()
        self.settle()
        k, v = self.buffers()
        return k[: self.length], v[: self.length]

    def snapshot(self) -> CacheSnapshot:
        """Copy the written part to CPU (the cache stays usable)."""
        k, v = self.keys_values()
        return CacheSnapshot(
            k=k.to("cpu", copy=True),
            v=v.to("cpu", copy=True),
            length=self.length,
            prompt_length=self.prompt_length,
        )

    def restore(self, snap: CacheSnapshot) -> None:
        """Put a snapshot back into this object (after `free()` or over live contents)."""
        self.k = self.v = self.writer = None
        self.owed = 0
        self.length, self.freed = 0, False
        self.append(snap.k.to(self.device, self.dtype), snap.v.to(self.device, self.dtype))
        self.prompt_length = snap.prompt_length

    def free(self) -> None:
        """Drop the tensors (and what is owed, unwritten). The runtime's ledger guarantees this
        happens exactly once (§4.10)."""
        self.k = self.v = self.writer = None
        self.owed = 0
        self.length, self.freed = 0, True
        self.writes += 1


def append_token(caches: Sequence[KVCache], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """One token's K/V ([L, H_kv, d_h] each, keys[i] for caches[i]) appended to every cache, as
    `append` of n=1 would, with one copy a list (§4.4): at 64 rows a step this is a third of
    one `append` a row here. Every cache has room before anything is written."""
    if not len(caches) == len(keys) == len(values):
        raise ValueError(f"append_token needs one K and one V a cache, got {len(keys)} and {len(values)} "
                         f"for {len(caches)} caches")
    for c, k, v in zip(caches, keys, values):
        expected = (c.n_layers, c.n_kv_heads, c.head_dim)
        if tuple(k.shape) != expected or k.shape != v.shape:
            raise CacheError(f"K/V must have shape [{', '.join(map(str, expected))}], got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        c.reserve(1)
    buffers = [c.buffers() for c in caches]
    torch._foreach_copy_([k[c.length] for c, (k, _) in zip(caches, buffers)], list(keys))
    torch._foreach_copy_([v[c.length] for c, (_, v) in zip(caches, buffers)], list(values))
    for c in caches:
        c.length += 1
        c.writes += 1


class _PrefillsBatches(Protocol):
    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[KVCache]]: ...


class PrefillOne:
    """`prefill(prompt)` as a batch of one, for models whose real kernel is `prefill_batch`."""

    def prefill(self: _PrefillsBatches, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, KVCache]:
        """Process the prompt x[1:m]: next-token logits [V] and a cache of length m (§4.2)."""
        logits, caches = self.prefill_batch([prompt_ids])
        return logits[0], caches[0]


def check_active_batch(caches: Sequence[SequenceCache], tokens: Sequence[int], context_limit: int) -> None:
    """Validate a decode_one call before anything is written (§4.4): one token per live,
    prefilled, distinct cache that still has room under the context limit."""
    if len(caches) != len(tokens) or not caches:
        raise ValueError(f"decode_one needs one token per cache, got {len(tokens)} tokens for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("decode_one got the same cache twice in one batch")
    for c in caches:
        if getattr(c, "freed", False) or c.length == 0:
            raise CacheError("decode_one needs prefilled caches that were not freed")
        if c.length >= context_limit:
            raise CacheError(f"cache already holds {c.length} tokens, the context limit")
