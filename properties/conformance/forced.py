"""Llama weights set by construction so that greedy decoding follows a script (issue 13; §4.3).

A `Program` is one case compiled for a real engine: a marker token at position 0, the case's
prompt after it, and the scripted outputs. `forced_llama(programs, vocab_size, eos_id)` returns a
one-layer LlamaForCausalLM config and state dict under which greedy decoding from
`[marker] + prompt` yields exactly the script, then EOS, on any engine that computes the Llama
forward pass (transformers, vLLM, llama.cpp from a GGUF of it). Prior art compiles programs into
transformer weights (Tracr, RASP); this construction is narrower and built for numerical margin.

The residual stream has three parts: dim 0 is a constant (bias), one *channel* per program, and
one *vote* dim per vocabulary token.

- **Embeddings.** Every token embeds as the bias alone; a program's marker adds KAPPA on its
  channel. All tokens but the markers therefore look alike: the model never reads token identity.
- **Attention: a position counter.** W_q = W_k = 0, so every score is exactly 0 and each position
  n attends uniformly to 0..n, whatever the engine's precision, kernel or RoPE (q is 0). The value
  of a marker is 1 on its program's channel and every other value is 0, so after attention the
  channel holds ch_n = 1/(n+1) at position n (plus KAPPA at n = 0). The channel thus says both
  which program runs and where it is, and other programs' channels stay 0.
- **MLP: one position picked out.** For each pair of consecutive positions the program asks about,
  a soft step made of two SiLU ramps fires when ch lies above their midpoint; the gate reads the
  channel against the bias (so the threshold does not depend on RMSNorm's scale) and `up` reads
  the bias. The difference of neighbouring steps is 1 at exactly one position n, and the down
  projection writes VOTE on the vote dim of the token the script wants after position n.
- **lm_head.** Token t reads its vote dim; EOS also reads the bias weakly, so a position no
  program votes at (past a script's end, an unknown prompt) chooses EOS.

Margins are computed, not hoped for: `check_margins` evaluates the forward pass in float64 for
every position of every program and reports the smallest gap between the scripted logit and the
runner-up; the thresholds sit a quarter of a gap away from the nearest channel value, which
absorbs the f16 rounding of a KV cache (about 1e-3 relative) for scripts of a hundred positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

HEAD_DIM = 64  # vLLM's CPU attention rejects 16; 64 is accepted everywhere tried
KAPPA = 0.25  # the marker's own weight on its channel (position 0 only)
SHARPNESS = 100.0  # ramp slope times the gap between neighbouring channel values
VOTE = 20.0  # what a firing position writes on its vote dim
LOGIT = 20.0  # the scripted token's logit, about (RMSNorm makes a dominant dim sqrt(hidden))
EOS_BIAS = 0.5  # how strongly EOS reads the bias dim, relative to a vote (the default choice)
RMS_EPS = 1e-6
ROPE_THETA = 1e6
CONTEXT = 512


class ProgramError(ValueError):
    """Programs that cannot share one forced checkpoint (the message names the program)."""


@attrs.frozen
class Program:
    """One scripted run: `prompt` starts with `marker`; `script` is what greedy must produce."""

    name: str
    marker: int
    prompt: tuple[int, ...] = attrs.field(converter=tuple)
    script: tuple[int, ...] = attrs.field(converter=tuple)

    @property
    def positions(self) -> range:
        """The positions whose next token the script fixes: the last prompt token onward."""
        first = len(self.prompt) - 1
        return range(first, first + len(self.script))


def _channel(n: int) -> float:
    """What a program's channel holds at position n after attention (before RMSNorm)."""
    return 1.0 / (n + 1) + (KAPPA if n == 0 else 0.0)


@attrs.frozen
class Layout:
    """Where each part of the residual stream lives."""

    vocab_size: int
    n_programs: int

    @property
    def hidden(self) -> int:
        need = 1 + self.n_programs + self.vocab_size
        return -(-need // HEAD_DIM) * HEAD_DIM

    def channel(self, c: int) -> int:
        return 1 + c

    def vote(self, token: int) -> int:
        return 1 + self.n_programs + token


def _check(programs: Sequence[Program], vocab_size: int, eos_id: int) -> None:
    markers: dict[int, str] = {}
    for p in programs:
        if not p.prompt or p.prompt[0] != p.marker:
            raise ProgramError(f"program {p.name}: the prompt must start with its marker {p.marker}")
        if not p.script:
            raise ProgramError(f"program {p.name}: the script is empty")
        if p.marker in markers:
            raise ProgramError(f"program {p.name}: marker {p.marker} is also {markers[p.marker]}'s")
        markers[p.marker] = p.name
        bad = [t for t in (*p.prompt, *p.script) if not 0 <= t < vocab_size]
        if bad:
            raise ProgramError(f"program {p.name}: token ids {bad} are outside the vocabulary 0..{vocab_size - 1}")
        if p.positions.stop > CONTEXT:
            raise ProgramError(f"program {p.name}: prompt plus script exceed the context of {CONTEXT}")
    if not 0 <= eos_id < vocab_size:
        raise ProgramError(f"eos id {eos_id} is outside the vocabulary 0..{vocab_size - 1}")
    if inside := [p.name for p in programs if any(t in markers for t in (*p.prompt[1:], *p.script))]:
        raise ProgramError(f"programs {inside}: a marker may stand only at position 0 of its own prompt")


def forced_llama(programs: Sequence[Program], vocab_size: int, eos_id: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A LlamaConfig dict and a float32 state dict (HF names) forcing every program (see module)."""
    _check(programs, vocab_size, eos_id)
    lay = Layout(vocab_size, len(programs))
    H = lay.hidden
    n_heads = H // HEAD_DIM
    steps = []  # (program index, threshold, gap, +vote token or None, -vote token or None)
    for c, p in enumerate(programs):
        first, last = p.positions.start, p.positions.stop - 1
        # Threshold k sits between positions k and k+1 and fires at every position <= k. It votes for
        # script step k and against step k+1, so at position n the firing ones telescope to step n
        # alone, to nothing before the first position, and past the last none fires.
        for k in range(first - 1, last + 1):
            if k < 0:
                continue  # nothing precedes position 0: its vote is just "not position > 0"
            hi, lo = _channel(k), _channel(k + 1)
            plus = p.script[k - first] if k >= first else None
            minus = p.script[k + 1 - first] if k + 1 <= last else None
            steps.append((c, (hi + lo) / 2, hi - lo, plus, minus))
    inter = -(-max(2 * len(steps), HEAD_DIM) // HEAD_DIM) * HEAD_DIM

    f64 = np.float64
    embed = np.zeros((vocab_size, H), f64)
    embed[:, 0] = 1.0
    for c, p in enumerate(programs):
        embed[p.marker, lay.channel(c)] = KAPPA
    # Attention: RMSNorm(marker embedding) has KAPPA / rho on its channel; the value reads it back as 1.
    rho = math.sqrt((1.0 + KAPPA**2) / H + RMS_EPS)
    q = np.zeros((H, H), f64)
    k = np.zeros((H, H), f64)
    v = np.zeros((H, H), f64)
    o = np.zeros((H, H), f64)
    for c in range(len(programs)):
        slot = c  # value slot c of the concatenated heads (head c // 64, dim c % 64)
        v[slot, lay.channel(c)] = rho / KAPPA
        o[lay.channel(c), slot] = 1.0
    # MLP: ramps on g = (ch - t) / D with D the RMSNorm scale; reading the channel with weight w and the
    # bias with -w t gives exactly that, since RMSNorm scales both alike. D at ch = 0 is sqrt(1/H + eps).
    d0 = math.sqrt(1.0 / H + RMS_EPS)
    gate = np.zeros((inter, H), f64)
    up = np.zeros((inter, H), f64)
    down = np.zeros((H, inter), f64)
    for i, (c, t, gap, plus, minus) in enumerate(steps):
        slope = SHARPNESS / gap
        width = gap / 4  # knees at t -/+ gap/8: the nearest channel value is 3 gap / 8 from either
        for j, knee in ((2 * i, t - width / 2), (2 * i + 1, t + width / 2)):
            gate[j, lay.channel(c)] = slope * d0
            gate[j, 0] = -slope * d0 * knee
            up[j, 0] = d0  # up = d0 / D, about 1
        # (silu(g1) - silu(g2)) * up saturates at slope * width * (d0/D)^2 = SHARPNESS/4 * (d0/D)^2.
        scale = VOTE / (SHARPNESS / 4)
        for tok, sign in ((plus, 1.0), (minus, -1.0)):
            if tok is not None:
                down[lay.vote(tok), 2 * i] += sign * scale
                down[lay.vote(tok), 2 * i + 1] -= sign * scale
    head = np.zeros((vocab_size, H), f64)
    for t in range(vocab_size):
        head[t, lay.vote(t)] = LOGIT / math.sqrt(H)
    head[eos_id, 0] = EOS_BIAS * LOGIT / math.sqrt(H)
    ones = np.ones(H, f64)
    state = {
        "model.embed_tokens.weight": embed,
        "model.layers.0.input_layernorm.weight": ones,
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
        "model.layers.0.self_attn.o_proj.weight": o,
        "model.layers.0.post_attention_layernorm.weight": ones,
        "model.layers.0.mlp.gate_proj.weight": gate,
        "model.layers.0.mlp.up_proj.weight": up,
        "model.layers.0.mlp.down_proj.weight": down,
        "model.norm.weight": ones,
        "lm_head.weight": head,
    }
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": H, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": n_heads, "num_key_value_heads": n_heads, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "max_position_embeddings": CONTEXT, "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "torch_dtype": "float32",
    }
    return config, {name: w.astype(np.float32) for name, w in state.items()}


# ---- a float64 forward pass, to prove margins before any engine runs ---------------------------


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-np.clip(x, -700, 700)))


def forward64(state: dict[str, np.ndarray], ids: Sequence[int]) -> np.ndarray:
    """Logits [len(ids), V] of the one-layer model in float64 (uniform attention, as q = 0)."""
    w = {k: v.astype(np.float64) for k, v in state.items()}
    x = w["model.embed_tokens.weight"][list(ids)]
    h = _rms(x)
    vals = h @ w["model.layers.0.self_attn.v_proj.weight"].T
    att = np.cumsum(vals, axis=0) / np.arange(1, len(ids) + 1)[:, None]  # uniform causal attention
    x = x + att @ w["model.layers.0.self_attn.o_proj.weight"].T
    h = _rms(x)
    mlp = _silu(h @ w["model.layers.0.mlp.gate_proj.weight"].T) * (h @ w["model.layers.0.mlp.up_proj.weight"].T)
    x = x + mlp @ w["model.layers.0.mlp.down_proj.weight"].T
    return _rms(x) @ w["lm_head.weight"].T


def check_margins(state: dict[str, np.ndarray], programs: Sequence[Program], eos_id: int) -> float:
    """The smallest (scripted logit - best other logit) over every program's positions, then EOS.

    Raises ProgramError naming the program and position where greedy would leave the script.
    """
    worst = math.inf
    for p in programs:
        ids = [*p.prompt, *p.script]
        logits = forward64(state, ids)
        want = [*p.script, eos_id]  # after the script, the model chooses EOS
        for i, target in enumerate(want):
            row = logits[len(p.prompt) - 1 + i]
            other = np.delete(row, target).max()
            gap = float(row[target] - other)
            if gap <= 0:
                raise ProgramError(f"program {p.name}: at output step {i + 1} greedy picks {int(row.argmax())}, "
                                   f"not {target} (gap {gap:.3g})")
            worst = min(worst, gap)
    return worst
