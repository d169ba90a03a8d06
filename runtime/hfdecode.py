"""A batched decode step for Llama-family checkpoints on the resident batch cache (§4.4, DECISIONS D58).

`HFModel.decode_one` gives a batch of two or more rows to `LeanDecoder.step` when the checkpoint's
layers are of a family it knows (`unsupported` says why another is not): one token a row, the
model's own modules for the embedding, the norms, the rotary phases and the activation, and for
the rest three things transformers' generic forward does not do for this one shape:

- each row's new keys and values are written straight into the resident buffers at the shared
  column, and attention is two batched matmuls over the columns read (the scores as K @ q^T, a
  matrix-vector product over each head's keys as they lie), with the rows' masks added as -inf
  (the step reads exactly the columns the transformers path reads; no cache object, no mask
  construction, no output capture);
- on the CPU, each projection runs on a weight packed once for oneDNN (what vLLM's CPU backend
  does; faster than the plain `linear` at 16-64 rows, D58), elsewhere plain `linear`;
- nothing is built per step but the tensors the arithmetic needs.

Its rows round like any padded row (D50: kernels of another shape), so a batch of one never comes
here: it stays the plain transformers call, bit for bit `generate()`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import attrs
import torch

# Decoder layers whose one-token step is: x += o(attn(rope(q(n1 x)), rope(k(n1 x)), v(n1 x)));
# x += down(act(gate(n2 x)) * up(n2 x)); full attention, no per-head norms, no softcapping.
FAMILIES = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer"}


def _packed(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear` as a function of its input: on a weight packed for oneDNN on the CPU, else plain."""
    weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    ops = getattr(torch.ops, "mkldnn", None)
    if (ops is not None and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_linear_pointwise")):
        try:
            packed = ops._reorder_linear_weight(weight, 16)
        except RuntimeError:  # a dtype oneDNN does not pack here: the plain call
            packed = None
        if packed is not None:
            return lambda x: ops._linear_pointwise(x, packed, bias, "none", [], "")
    return lambda x: torch.nn.functional.linear(x, weight, bias)


@attrs.frozen
class _Layer:
    norm_in: torch.nn.Module
    norm_post: torch.nn.Module
    q: Callable[[torch.Tensor], torch.Tensor]
    k: Callable[[torch.Tensor], torch.Tensor]
    v: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate: Callable[[torch.Tensor], torch.Tensor]
    up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]
    scaling: float


def unsupported(model: Any) -> str | None:
    """Why `model` (a transformers causal LM) has no lean step, or None when it has one."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    layer_class = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if layer_class is None:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {sorted(FAMILIES)}"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention (the resident columns assume full attention, D50)"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or any(type(layer).__name__ != layer_class for layer in layers):
        return f"its decoder layers are not all {layer_class}"
    if any(hasattr(layer.self_attn, "q_norm") for layer in layers):
        return "per-head q/k norms"
    return None


def _layer(layer: Any) -> _Layer:
    """One decoder layer's norms, its projections packed (`_packed`), its activation and scaling."""
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(layer.input_layernorm, layer.post_attention_layernorm,
                  q=_packed(attn.q_proj), k=_packed(attn.k_proj), v=_packed(attn.v_proj), o=_packed(attn.o_proj),
                  gate=_packed(mlp.gate_proj), up=_packed(mlp.up_proj), down=_packed(mlp.down_proj),
                  act=mlp.act_fn, scaling=float(attn.scaling))


class LeanDecoder:
    """The one-token step of a supported checkpoint (module doc); built once per HFModel, which
    loads its weights from disk and never changes them: the packed copies are made here, once."""

    def __init__(self, model: Any) -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"no lean decode step for this checkpoint: {why}")
        inner = model.model
        self._embed, self._rotary, self._norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self._head = _packed(model.lm_head)
        first = inner.layers[0].self_attn
        self._rope = sys.modules[type(first).__module__].apply_rotary_pos_emb
        self._head_dim: int = first.head_dim
        self._layers = [_layer(layer) for layer in inner.layers]

    def step(self, ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             column: int, visible: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of one token a row. ids, positions: [B]; keys, values: the resident
        buffers [L, B, H_kv, S, d_h], each row's new K/V written at `column`; visible: [B, W] bool
        (column < W <= S), the columns each row attends to (its own new column among them): the
        first W columns are read, all S of them, one contiguous block a layer, when W = S."""
        rows, d, width = ids.shape[0], self._head_dim, visible.shape[1]
        with torch.inference_mode():
            x = self._embed(ids)  # [B, D]
            cos, sin = self._rotary(x, positions[:, None])  # [B, 1, d]
            mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))
            mask = mask[:, None, None, :]  # [B, 1, 1, S]: every head of a row
            for i, layer in enumerate(self._layers):
                h = layer.norm_in(x)
                q = layer.q(h).view(rows, -1, 1, d)
                k = layer.k(h).view(rows, -1, 1, d)
                q, k = self._rope(q, k, cos, sin)
                kv_heads = k.shape[1]
                keys[i, :rows, :, column] = k[:, :, 0]
                values[i, :rows, :, column] = layer.v(h).view(rows, kv_heads, d)
                seen_k = keys[i, :rows, :, :width]  # [B, H_kv, W, d]
                seen_v = values[i, :rows, :, :width]
                q = q.view(rows, kv_heads, -1, d)  # [B, H_kv, groups, d]: grouped heads share a K/V head
                # K @ q^T: a matrix-vector product over each head's keys as they lie (faster than
                # q @ K^T on resident buffers, D58), [B, H_kv, S, groups], read as [B, H_kv, groups, S]
                scores = torch.matmul(seen_k, q.transpose(-1, -2)).transpose(-1, -2).mul_(layer.scaling).add_(mask)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                x = x + layer.o(torch.matmul(probs, seen_v).reshape(rows, -1))
                h = layer.norm_post(x)
                x = x + layer.down(layer.act(layer.gate(h)) * layer.up(h))
            return self._head(self._norm(x))
