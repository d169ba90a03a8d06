"""TinyLM: a small Llama-style decoder in plain torch, with the runtime-owned KV cache (§4.2, §4.4).

Blocks: RMSNorm -> attention with rotary positions (RoPE) and grouped KV heads -> residual ->
RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; LM head (tied to the embedding or not).

Batched decode over caches of different lengths (§4.4): each step gathers the active caches
into one zero-padded ``[B, T_max, L, H_kv, d_h]`` tensor (`pad_sequence`, one call for K and one
for V), and a boolean mask ``[B, T_max + 1]`` hides the padding. Row b's new token sits at
position m_b + t_b - 1 = cache.length (RoPE uses that position), attends to its own first
`length` keys plus itself, and its K/V of all layers are appended to its own cache with one copy
after the last layer. Attention itself has no Python loop over the batch; the loops over the
batch are only the gather and the append (two small copies per sequence).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from .dtypes import DEFAULT_DTYPE, torch_dtype
from .kvcache import CacheError, KVCache, PrefillOne, append_token, check_active_batch

ASSETS = Path(__file__).parent / "assets" / "default"


def _positive(_inst: Any, attr: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"TinyLMConfig.{attr.name} must be a positive int, got {value!r}")


@attrs.frozen(kw_only=True)
class TinyLMConfig:
    """Shape of a TinyLM. `context_limit` bounds the cache, prompt included (§4.3)."""

    vocab_size: int = attrs.field(validator=_positive)
    d_model: int = attrs.field(default=128, validator=_positive)
    n_layers: int = attrs.field(default=4, validator=_positive)
    n_heads: int = attrs.field(default=4, validator=_positive)
    n_kv_heads: int = attrs.field(default=2, validator=_positive)
    d_ff: int = attrs.field(default=384, validator=_positive)
    context_limit: int = attrs.field(default=256, validator=_positive)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    eos_token_id: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary positions")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TinyLMConfig:
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TinyLM config keys: {', '.join(unknown)}")
        return cls(**data)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Block(nn.Module):
    def __init__(self, c: TinyLMConfig) -> None:
        super().__init__()
        hd = c.head_dim
        self.attn_norm = _RMSNorm(c.d_model, c.norm_eps)
        self.wq = nn.Linear(c.d_model, c.n_heads * hd, bias=False)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(c.n_heads * hd, c.d_model, bias=False)
        self.mlp_norm = _RMSNorm(c.d_model, c.norm_eps)
        self.w_gate = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w_up = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w_down = nn.Linear(c.d_ff, c.d_model, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp_norm(x)
        return self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [..., T, H, d_h] with cos/sin [..., T, 1, d_h/2] (pairs: first half, second half)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention. q [B,Tq,H,d], k/v [B,Tk,Hkv,d], allowed [B,Tq,Tk] -> [B,Tq,H*d]."""
    B, Tq, H, d = q.shape
    hkv = k.shape[2]
    qg = q.view(B, Tq, hkv, H // hkv, d).permute(0, 2, 3, 1, 4)  # [B,Hkv,G,Tq,d]
    kt = k.permute(0, 2, 3, 1).unsqueeze(2)  # [B,Hkv,1,d,Tk]
    scores = (qg @ kt) * (1.0 / math.sqrt(d))  # [B,Hkv,G,Tq,Tk]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    out = scores.softmax(-1) @ v.permute(0, 2, 1, 3).unsqueeze(2)  # [B,Hkv,G,Tq,d]
    return out.permute(0, 3, 1, 2, 4).reshape(B, Tq, H * d)


class TinyLM(PrefillOne, nn.Module):
    """A small Llama-style causal LM behind the `Model` protocol (§4.4). CPU or CUDA via `device`."""

    rope_cos: torch.Tensor  # buffers (register_buffer): [context_limit, head_dim / 2]
    rope_sin: torch.Tensor

    def __init__(self, config: TinyLMConfig, device: str | torch.device = "cpu", *, name: str = "tinylm") -> None:
        super().__init__()
        self.config = config
        self.name = name
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layers))
        self.norm = _RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        angles = torch.arange(c.context_limit, dtype=torch.float64)[:, None] * inv[None]
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)
        self._init_weights()
        self.to(device)
        self.eval()

    # -- protocol attributes -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def context_limit(self) -> int:
        return self.config.context_limit

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def eos_token_id(self) -> int | None:
        return self.config.eos_token_id

    def _init_weights(self) -> None:
        gen = torch.Generator().manual_seed(0)
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = std / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo.weight", "w_down.weight")) else std
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)

    # -- the core ------------------------------------------------------------------------
    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        return h @ self.embed.weight.T if self.lm_head is None else self.lm_head(h)

    def _blocks(self) -> Iterable[_Block]:
        """The layers in order (`blocks` holds them as an nn.ModuleList, which types its items as Module)."""
        return cast("Iterable[_Block]", self.blocks)

    def _qkv(self, blk: _Block, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        B, T, _ = x.shape
        h = blk.attn_norm(x)
        q = blk.wq(h).view(B, T, c.n_heads, c.head_dim)
        k = blk.wk(h).view(B, T, c.n_kv_heads, c.head_dim)
        v = blk.wv(h).view(B, T, c.n_kv_heads, c.head_dim)
        cos, sin = self.rope_cos[pos][:, :, None], self.rope_sin[pos][:, :, None]
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _run(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Causal forward over [B, T] ids from position 0: hidden [B,T,D], K and V [B,T,L,Hkv,d]."""
        B, T = ids.shape
        if self.context_limit < T:
            raise CacheError(f"{T} tokens exceed the context limit {self.context_limit}")
        pos = torch.arange(T, device=ids.device).expand(B, T)
        allowed = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril().expand(B, T, T)
        x = self.embed(ids)
        ks, vs = [], []
        for blk in self._blocks():
            q, k, v = self._qkv(blk, x, pos)
            x = x + blk.wo(_attend(q, k, v, allowed))
            x = x + blk.mlp(x)
            ks.append(k)
            vs.append(v)
        return x, torch.stack(ks, dim=2), torch.stack(vs, dim=2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Training entry: logits [B, T, V] for a batch of equal-length id rows (autograd on)."""
        h, _, _ = self._run(ids)
        return self._logits(h)

    def _check_ids(self, ids: Sequence[int], what: str) -> torch.Tensor:
        if len(ids) == 0:
            raise ValueError(f"{what} must hold at least one token id")
        t = torch.as_tensor(list(ids), dtype=torch.long)
        if t.dim() != 1:
            raise TypeError(f"{what} must be a flat sequence of ints")
        bad = t[(t < 0) | (t >= self.vocab_size)]
        if bad.numel():
            raise ValueError(f"{what}: token id {int(bad[0])} outside [0, {self.vocab_size})")
        return t.to(self.device)

    def _new_cache(self) -> KVCache:
        c = self.config
        return KVCache(
            n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
            max_length=c.context_limit, device=self.device, dtype=self.embed.weight.dtype,
        )

    def forward_full(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, V] for every position by a plain recompute without cache (the test oracle)."""
        with torch.inference_mode():
            h, _, _ = self._run(self._check_ids(ids, "ids")[None])
            return self._logits(h[0])

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[KVCache]]:
        """Prefill several prompts at once (right-padded; causality keeps padding unseen)."""
        if not prompts:
            raise ValueError("prefill_batch needs at least one prompt")
        rows = [self._check_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        lengths = [len(r) for r in rows]
        with torch.inference_mode():
            h, K, V = self._run(pad_sequence(rows, batch_first=True))
            last = torch.as_tensor(lengths, device=self.device) - 1
            logits = self._logits(h[torch.arange(len(rows), device=self.device), last])
            caches = []
            for b, m in enumerate(lengths):
                cache = self._new_cache()
                cache.append(K[b, :m], V[b, :m])
                cache.prompt_length = m
                caches.append(cache)
        return logits, caches

    def decode_one(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """One step for an active batch (§4.4): token b goes to position caches[b].length.

        Returns next-token logits [B, V]; every cache grows by one token.
        """
        check_active_batch(caches, tokens, self.context_limit)
        ids = self._check_ids(tokens, "tokens")
        with torch.inference_mode():
            lens = torch.as_tensor([c.length for c in caches], device=self.device)
            pairs = [c.keys_values() for c in caches]
            past_k = pad_sequence([p[0] for p in pairs], batch_first=True)  # [B,Tm,L,Hkv,d]
            past_v = pad_sequence([p[1] for p in pairs], batch_first=True)
            t_max = past_k.shape[1]
            allowed = torch.arange(t_max + 1, device=self.device)[None] < lens[:, None]
            allowed[:, t_max] = True  # the new token sees itself
            allowed = allowed[:, None]  # [B,1,Tm+1]
            x = self.embed(ids)[:, None]  # [B,1,D]
            pos = lens[:, None]
            new_k, new_v = [], []
            for layer, blk in enumerate(self._blocks()):
                q, k, v = self._qkv(blk, x, pos)
                keys = torch.cat((past_k[:, :, layer], k), dim=1)
                vals = torch.cat((past_v[:, :, layer], v), dim=1)
                x = x + blk.wo(_attend(q, keys, vals, allowed))
                x = x + blk.mlp(x)
                new_k.append(k)
                new_v.append(v)
            K = torch.stack(new_k, dim=2)[:, 0]  # [B,L,Hkv,d]
            V = torch.stack(new_v, dim=2)[:, 0]
            append_token(caches, K.unbind(0), V.unbind(0))
            return self._logits(x[:, 0])

    # -- persistence ---------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write config.json and the weights (safetensors when installed, else model.pt)."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        try:
            from safetensors.torch import save_file
        except ImportError:
            torch.save(state, out / "model.pt")
        else:
            save_file(state, str(out / "model.safetensors"))
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu", *,
                        dtype: str = DEFAULT_DTYPE) -> TinyLM:
        """Load a folder written by `save` (config.json + model.safetensors or model.pt), its weights,
        buffers and cache in `dtype` (runtime/dtypes.py)."""
        as_dtype = torch_dtype(dtype)
        folder = Path(path)
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no TinyLM checkpoint at {folder}: config.json is missing")
        config = TinyLMConfig.from_dict(json.loads(cfg_file.read_text()))
        model = cls(config, device=device, name=folder.name)
        model.load_state_dict(_load_weights(folder))
        return model.to(device=device, dtype=as_dtype)

    @classmethod
    def default(cls, device: str | torch.device = "cpu", *, dtype: str = DEFAULT_DTYPE) -> TinyLM:
        """The embedded default checkpoint (runtime/assets/default, made by scripts/train_default.py)."""
        return cls.from_pretrained(ASSETS, device=device, dtype=dtype)


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    st, pt = folder / "model.safetensors", folder / "model.pt"
    if st.is_file():
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ImportError(f"{st} needs the 'safetensors' package (pip install safetensors)") from exc
        return load_file(str(st))
    if pt.is_file():
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {folder}: expected model.safetensors or model.pt")
