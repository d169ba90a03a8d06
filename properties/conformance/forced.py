"""Llama weights set by construction so that greedy decoding follows a script in float32, bfloat16
and float16 (§4.3).

A `Program` is one case compiled for a real engine: its marker token, a shared anchor token, the
case's prompt, and the scripted outputs. `forced_llama(programs, vocab_size, eos_id, anchor, probe)`
returns a one-layer LlamaForCausalLM config and state dict under which greedy decoding from
`[marker, anchor] + prompt` yields exactly the script, then EOS, on any engine that computes the
Llama forward pass (transformers, vLLM, llama.cpp from a GGUF of it), in any of the three dtypes.

Prior art compiles programs into transformer weights (Tracr and RASP): there positions are one-hot
absolute embeddings, which Llama lacks, and numeric aggregates are averages over a BOS token, so a
position is read as 1/(n+1). The first construction of this module did the same (uniform attention)
and picked out one position by the difference of two saturated SiLU ramps: bfloat16 cannot resolve
1/(n+1) from 1/(n+2) past a few dozen positions, and float16 overflowed the steep ramps. This one
reads the position through RoPE instead, relative to the marker, as a point on a curve that never
comes close to itself, and every vote is one ramp against a fixed bias:

- **Residual stream.** Dim 0 is a constant (bias); one dim per special token (each marker, the
  anchor, the probe marker), which its embedding adds to the bias; one dim per attention output;
  one *vote* dim per vocabulary token. Ordinary tokens embed as the bias alone: the model never
  reads their identity. Attention outputs are written small (SCALE) so that they hardly move the
  RMS norms.
- **Shape.** Heads are HEAD_DIM (32) wide and hidden = heads x HEAD_DIM, as a Llama loader that
  derives the head size as hidden / heads (ignoring `head_dim`) assumes: hidden is the larger of the
  residual's dims and the used heads' width, rounded up to ALIGN; spare heads attend to nothing
  useful and write nothing, spare dims stay zero. 32 is the narrowest head vLLM's CPU attention
  takes, and 24 heads of 32 fit in the hidden size that a vocabulary of a few hundred tokens needs
  anyway. rope_theta is 2^16, so RoPE pair k turns 2^-k rad per token.
- **Feature heads: where the marker is.** In each, ordinary tokens score SUPPRESS below the marker
  and the anchor (through the slowest RoPE pair, which turns under 1/32 rad across REACH), so only
  those two count. The anchor scores 0; the marker scores AMPLITUDE * cos(m * theta + phase), m
  being the query's distance from the marker, through one RoPE pair. The head returns
  sigmoid(score) - 1/2: a feature in (-0.4, 0.4) that depends on m alone, whatever stands before the
  marker. Seven pairs (turning 2^0 down to 2^-8 rad per token, powers of two so that every angle is
  exact in any dtype) at two phases give 14 features.
- **Program heads.** The marker scores PROGRAM_SCORE over everything else, so the head copies which
  program runs (a one-hot over the programs), exactly, at every position.
- **MLP: one ramp per scripted position.** The 14 features trace a curve in m on which every point
  is an extreme point (each pair's curve is convex), so for each scripted position t a hyperplane
  (the pairs' outward normals at t, weighted by PAIR_WEIGHTS) separates t from every other m in
  1..REACH. The neuron's gate is that linear form minus a fixed threshold halfway to the nearest
  other position, minus a penalty unless its program runs, scaled so that it is +GATE at t and at
  most -GATE elsewhere; `up` reads the bias and the down projection writes VOTE on the vote dim of
  the token the script wants. Nothing is a difference of saturated activations.
- **lm_head.** Token t reads its vote dim (LOGIT where it fires); EOS also reads the bias, so where
  nothing votes (past a script's end, an unknown prompt) EOS wins by EOS_LOGIT, and every other
  token's vote dim negatively, so where one votes EOS sits below the unvoted tokens' 0. The runner-up
  of a scripted token is thus at 0 and no logit is negative enough to gain from a repetition
  penalty (which divides positive logits and multiplies negative ones).
- **The prefix probe.** A separate marker whose prompt is itself alone: its PROBE_MAX heads each ask
  whether an ordinary token stands exactly D places before the query (D = 1..PROBE_MAX, a RoPE peak
  at distance D against the marker's own score), so the probe's first output token `echo[p]` tells
  how many tokens p an engine put in front of the prompt (a BOS, a template), `echo[-1]` meaning
  PROBE_MAX or more. The programs themselves do not depend on such a prefix (positions are read
  relative to the marker).

Limits. Relative positions 1..REACH (1024) are told apart, so a program's prompt plus script must
fit CONTEXT (512); the vocabulary needs one hidden dim per token (the model grows with it); one
checkpoint holds any number of programs (HEAD_DIM = 32 per program head). The prefix probe tells
0..7 tokens exactly. Weights and activations stay far inside float16's range (|x| < 1e3).

Margins are computed, not hoped for: `check_margins` runs the forward pass in float64 with each
dtype's rounding applied to weights, every activation and the KV cache (`forward`), for every
position of every program and the probe, and reports per dtype the smallest logit gap and how much
of the designed gate margin is left.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np

HEAD_DIM = 32  # vLLM's CPU attention takes 32 (not 16); hidden = heads x HEAD_DIM, see Layout.hidden
ROPE_THETA = 2.0**16  # RoPE pair k turns by 2**-k rad per position: exact in every dtype, at every position
ALIGN = 64  # hidden and intermediate sizes are multiples of this
CONTEXT = 512
REACH = 2 * CONTEXT  # relative positions the position code separates (twice the context, for margin)
# The RoPE pairs the feature heads read, and each one's weight in the position detector: chosen by a
# search (greedy over pairs, then random over weights) for the widest worst-case separation over REACH.
FEATURE_PAIRS = (0, 1, 2, 3, 4, 6, 8)
PAIR_WEIGHTS = (1.0, 0.13, 0.08, 0.12, 0.14, 0.31, 0.44)
QUIET_PAIR = HEAD_DIM // 2 - 1  # turns 2**-15 rad per position: cos > 0.9995 over REACH, a constant score
AMPLITUDE = 2.0  # the marker's score swing in a feature head (sigmoid(+-2) = 0.88 / 0.12)
SUPPRESS = 30.0  # how far below the marker and anchor an ordinary token scores in a feature head
PROGRAM_SCORE = 25.0  # the marker's score in a program head, over 0 for every other token
PROBE_MAX = 8  # the probe tells prefixes of 0..PROBE_MAX-1 tokens, and "PROBE_MAX or more"
PROBE_PAIRS = (0, 1, 2, 3)  # their sum peaks at the asked distance, >= 14.9 lower 1..7 places nearer
PROBE_PEAK = 24.0  # each probe pair's score amplitude
PROGRAMS_PER_HEAD = HEAD_DIM
KAPPA = 1.0  # a special token's own dim, beside the bias
SCALE = 0.1  # what an attention output writes into the residual
GATE = 16.0  # a deciding neuron's gate at its position (+) and everywhere else (at most -)
VOTE = 20.0  # what a firing neuron writes on its vote dim
LOGIT = 30.0  # the voted token's logit
EOS_LOGIT = 25.0  # EOS's logit where nothing votes
EOS_AGAINST = 10.0  # how far a vote for another token pushes EOS below 0 (so the runner-up scores 0)
RMS_EPS = 1e-6
DTYPES = ("float32", "bfloat16", "float16")


def _ids(items: Iterable[int]) -> tuple[int, ...]:
    """The ids as a tuple: a converter mypy can type (it cannot type `converter=tuple`)."""
    return tuple(items)


class ProgramError(ValueError):
    """Programs that cannot share one forced checkpoint, or one that would leave its script."""


@attrs.frozen
class Program:
    """One scripted run: `prompt` is `[marker, anchor, ...]`; `script` is what greedy must produce."""

    name: str
    marker: int
    prompt: tuple[int, ...] = attrs.field(converter=_ids)
    script: tuple[int, ...] = attrs.field(converter=_ids)

    @property
    def positions(self) -> range:
        """The positions (from the marker) whose next token the script fixes: the last prompt token onward."""
        first = len(self.prompt) - 1
        return range(first, first + len(self.script))


@attrs.frozen
class Probe:
    """The prefix probe: prompt `[marker]`; greedy answers `echo[p]` when p tokens precede the marker
    (`echo[PROBE_MAX]` for PROBE_MAX or more), then EOS."""

    marker: int
    echo: tuple[int, ...] = attrs.field(converter=_ids)

    @property
    def prompt(self) -> tuple[int, ...]:
        return (self.marker,)


def theta() -> np.ndarray:
    """Each RoPE pair's turn per position, as engines compute it (float32 inverse frequencies)."""
    exponents = np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM
    return (1.0 / np.float32(ROPE_THETA) ** exponents).astype(np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def features(m: np.ndarray) -> np.ndarray:
    """The feature heads' exact outputs (before SCALE) at distances m from the marker: [len(m), 14]."""
    ang = np.outer(m, theta()[list(FEATURE_PAIRS)])
    out = np.empty((len(m), 2 * len(FEATURE_PAIRS)))
    out[:, 0::2] = _sigmoid(AMPLITUDE * np.cos(ang)) - 0.5
    out[:, 1::2] = _sigmoid(AMPLITUDE * np.sin(ang)) - 0.5
    return out


@functools.cache
def detector() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every target t in 0..CONTEXT-1: the normal N[t] (one coefficient per feature), the threshold b[t]
    halfway between N[t].f(t) and the largest N[t].f(m) over m != t in 1..REACH, and that gap[t]."""
    t = np.arange(CONTEXT)
    ang = np.outer(t, theta()[list(FEATURE_PAIRS)])

    def slope(u: np.ndarray) -> np.ndarray:
        s = _sigmoid(AMPLITUDE * u)
        return AMPLITUDE * s * (1 - s)

    normal = np.empty((CONTEXT, 2 * len(FEATURE_PAIRS)))
    normal[:, 0::2] = slope(np.sin(ang)) * np.cos(ang) * PAIR_WEIGHTS  # the outward normal of (g(cos), g(sin)) at t
    normal[:, 1::2] = slope(np.cos(ang)) * np.sin(ang) * PAIR_WEIGHTS
    m = np.arange(1, REACH + 1)
    proj = normal @ features(m).T  # [t, m]
    own = np.einsum("ij,ij->i", normal, features(t))
    proj[t[1:], t[1:] - 1] = -np.inf  # m = t itself (m starts at 1)
    best = proj.max(axis=1)
    return normal, (own + best) / 2, own - best


@attrs.frozen
class Layout:
    """Where each part of the residual stream and each head lives."""

    vocab_size: int
    n_programs: int
    probe: bool

    @property
    def n_special(self) -> int:
        return self.n_programs + 1 + int(self.probe)  # the markers, the anchor, the probe marker

    @property
    def n_features(self) -> int:
        return 2 * len(FEATURE_PAIRS)

    @property
    def n_program_heads(self) -> int:
        return -(-self.n_programs // PROGRAMS_PER_HEAD)

    @property
    def heads_used(self) -> int:
        return self.n_features + self.n_program_heads + (PROBE_MAX if self.probe else 0)

    @property
    def n_heads(self) -> int:
        """hidden / HEAD_DIM: the heads used, then spare ones that attend to nothing useful and write nothing."""
        return self.hidden // HEAD_DIM

    def special(self, i: int) -> int:
        """Special token i's dim: markers 0..n-1, then the anchor (n), then the probe marker (n + 1)."""
        return 1 + i

    def feature(self, h: int) -> int:
        return 1 + self.n_special + h

    def program(self, c: int) -> int:
        return 1 + self.n_special + self.n_features + c

    def bit(self, d: int) -> int:
        """The probe head asking for a token at distance d (1..PROBE_MAX)."""
        return self.program(self.n_programs) + d - 1

    def vote(self, token: int) -> int:
        return self.bit(1) + (PROBE_MAX if self.probe else 0) + token

    @property
    def hidden(self) -> int:
        """Every dim and every used head's width, rounded up to a multiple of ALIGN: heads x HEAD_DIM is
        hidden, so a loader that derives the head size as hidden / heads (ignoring `head_dim`) gets
        HEAD_DIM; the dims past the vote dims, if any, stay zero in every weight."""
        return -(-max(self.vote(self.vocab_size), self.heads_used * HEAD_DIM) // ALIGN) * ALIGN

    def program_head(self, c: int) -> tuple[int, int]:
        """(head, value slot) carrying program c."""
        return self.n_features + c // PROGRAMS_PER_HEAD, c % PROGRAMS_PER_HEAD

    def probe_head(self, d: int) -> int:
        return self.n_features + self.n_program_heads + d - 1


def _check(programs: Sequence[Program], vocab_size: int, eos_id: int, anchor: int, probe: Probe | None) -> None:
    special: dict[int, str] = {anchor: "the anchor"}
    if probe is not None:
        special[probe.marker] = "the probe's marker"
    for p in programs:
        if p.marker in special:
            raise ProgramError(f"program {p.name}: marker {p.marker} is also {special[p.marker]}")
        special[p.marker] = f"{p.name}'s"
    if not 0 <= eos_id < vocab_size:
        raise ProgramError(f"eos id {eos_id} is outside the vocabulary 0..{vocab_size - 1}")
    if eos_id in special:
        raise ProgramError(f"eos id {eos_id} is also {special[eos_id]} marker")
    for p in programs:
        if len(p.prompt) < 2 or p.prompt[0] != p.marker or p.prompt[1] != anchor:
            raise ProgramError(f"program {p.name}: the prompt must start with its marker {p.marker}, then the "
                               f"anchor {anchor}")
        if not p.script:
            raise ProgramError(f"program {p.name}: the script is empty")
        bad = [t for t in (*p.prompt, *p.script) if not 0 <= t < vocab_size]
        if bad:
            raise ProgramError(f"program {p.name}: token ids {bad} are outside the vocabulary 0..{vocab_size - 1}")
        if len(p.prompt) + len(p.script) > CONTEXT:  # the EOS after the script is chosen at the last position
            raise ProgramError(f"program {p.name}: prompt plus script ({len(p.prompt) + len(p.script)} tokens) exceed "
                               f"the context of {CONTEXT}")
        if inside := sorted({t for t in (*p.prompt[2:], *p.script) if t in special}):
            raise ProgramError(f"program {p.name}: special ids {inside} stand inside its prompt or script; a marker "
                               "may stand only first, the anchor only second")
    if probe is not None:
        if len(probe.echo) != PROBE_MAX + 1 or len(set(probe.echo)) != len(probe.echo):
            raise ProgramError(f"the probe needs {PROBE_MAX + 1} distinct echo tokens, got {list(probe.echo)}")
        if bad := [t for t in probe.echo if t in special or t == eos_id or not 0 <= t < vocab_size]:
            raise ProgramError(f"the probe's echo tokens {bad} are special, EOS or outside the vocabulary")


def forced_llama(programs: Sequence[Program], vocab_size: int, eos_id: int, anchor: int,
                 probe: Probe | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A LlamaConfig dict and a float32 state dict (HF names) forcing every program (see module)."""
    _check(programs, vocab_size, eos_id, anchor, probe)
    lay = Layout(vocab_size, len(programs), probe is not None)
    H, n_heads = lay.hidden, lay.n_heads
    specials = [p.marker for p in programs] + [anchor] + ([probe.marker] if probe else [])
    embed = np.zeros((vocab_size, H))
    embed[:, 0] = 1.0
    for i, tid in enumerate(specials):
        embed[tid, lay.special(i)] = KAPPA

    # Linear readers of the input RMSNorm's output h, each exact for every token kind: `one` is 1 for
    # every token, `ordinary` 1 for a non-special token, `is_[i]` 1 for special token i, else 0.
    rho_o = math.sqrt(1.0 / H + RMS_EPS)
    rho_s = math.sqrt((1.0 + KAPPA**2) / H + RMS_EPS)
    one, ordinary = np.zeros(H), np.zeros(H)
    one[0] = ordinary[0] = rho_o
    for i in range(len(specials)):
        one[lay.special(i)] = (rho_s - rho_o) / KAPPA
        ordinary[lay.special(i)] = -rho_o / KAPPA

    def is_(*idx: int) -> np.ndarray:
        r = np.zeros(H)
        for i in idx:
            r[lay.special(i)] = rho_s / KAPPA
        return r

    markers = is_(*range(len(programs)))
    q = np.zeros((n_heads * HEAD_DIM, H))
    k = np.zeros_like(q)
    v = np.zeros_like(q)
    o = np.zeros((H, n_heads * HEAD_DIM))
    half = HEAD_DIM // 2

    def row(head: int, dim: int) -> int:
        return head * HEAD_DIM + dim

    def constant(head: int, key_reader: np.ndarray, value: float) -> None:
        """In `head`, the tokens key_reader picks score `value` at any distance (the quiet pair does not turn)."""
        s = math.sqrt(abs(value) * math.sqrt(HEAD_DIM))  # q . k / sqrt(HEAD_DIM) = value
        q[row(head, QUIET_PAIR)] = s * one
        k[row(head, QUIET_PAIR)] = math.copysign(s, value) * key_reader

    amp = math.sqrt(AMPLITUDE * math.sqrt(HEAD_DIM))
    for h in range(lay.n_features):
        pair, phase = FEATURE_PAIRS[h // 2], (0.0 if h % 2 == 0 else -math.pi / 2)
        # score = q . R(-m theta) k = AMPLITUDE cos(m theta + phase) for the marker (k on the pair's first dim)
        q[row(h, pair)] = amp * math.cos(phase) * one
        q[row(h, pair + half)] = amp * math.sin(phase) * one
        k[row(h, pair)] = amp * markers
        constant(h, ordinary, -SUPPRESS)
        v[row(h, 0)] = 0.5 * markers - 0.5 * is_(len(programs))
        o[lay.feature(h), row(h, 0)] = SCALE
    for c in range(len(programs)):
        head, slot = lay.program_head(c)
        v[row(head, slot)] = is_(c)
        o[lay.program(c), row(head, slot)] = SCALE
    for head in {lay.program_head(c)[0] for c in range(len(programs))}:
        constant(head, markers, PROGRAM_SCORE)
    th = theta()
    if probe is not None:
        probe_is = is_(len(specials) - 1)
        peak = np.array([1 - np.cos(d * th[list(PROBE_PAIRS)]) for d in range(1, PROBE_MAX)]).sum(1).min()
        for d in range(1, PROBE_MAX + 1):
            head = lay.probe_head(d)
            # An ordinary token at distance x scores PROBE_PEAK * sum cos((x - d) theta): its peak at x = d,
            # at least PROBE_PEAK * `peak` lower at 1 <= x < d. The marker itself (x = 0) scores halfway.
            for pair in PROBE_PAIRS:
                q[row(head, pair)] = math.sqrt(PROBE_PEAK * math.sqrt(HEAD_DIM)) * math.cos(-d * th[pair]) * one
                q[row(head, pair + half)] = math.sqrt(PROBE_PEAK * math.sqrt(HEAD_DIM)) * math.sin(-d * th[pair]) * one
                k[row(head, pair)] = math.sqrt(PROBE_PEAK * math.sqrt(HEAD_DIM)) * ordinary
            constant(head, probe_is, PROBE_PEAK * (len(PROBE_PAIRS) - peak / 2))
            v[row(head, 0)] = 0.5 * probe_is - 0.5 * ordinary
            o[lay.bit(d), row(head, 0)] = SCALE

    # MLP. The post-attention RMSNorm scales every dim alike, so a gate reading x_d with weight
    # alpha_d * rho2 computes (rho2 / rms) * sum(alpha_d x_d): the sign of sum(alpha_d x_d), with x_0 = 1.
    rho2 = math.sqrt(1.0 / H + RMS_EPS)
    normal, thresh, gap = detector()
    neurons: list[tuple[dict[int, float], int]] = []  # (alpha by dim, token voted for)
    for c, p in enumerate(programs):
        for step, t in enumerate(p.positions):
            if gap[t] <= 0:
                raise ProgramError(f"program {p.name}: position {t} is not told apart from another (gap {gap[t]:.3g})")
            lam = 2 * GATE / gap[t]  # +GATE at t, at most -GATE at any other distance
            n = normal[t]
            # Unless program c runs, subtract more than the form can reach on any feature values.
            penalty = 0.5 * np.abs(n).sum() + abs(thresh[t]) + gap[t]
            alpha = {lay.feature(h): lam * n[h] / SCALE for h in range(lay.n_features)}
            alpha[lay.program(c)] = lam * penalty / SCALE
            alpha[0] = -lam * (thresh[t] + penalty)
            neurons.append((alpha, p.script[step]))
    if probe is not None:
        tok = lay.special(len(specials) - 1)  # the probe marker's own dim: 1 where it is the current token
        for shift, echo in enumerate(probe.echo):
            # bit(d) holds +1/2 when no token stands d places back, -1/2 when one does: p tokens are there
            # when bit(p) is -1/2 (p >= 1) and bit(p + 1) is +1/2 (p < PROBE_MAX), p being `shift`.
            conds = [(lay.bit(shift), -1.0)] if shift >= 1 else []
            conds += [(lay.bit(shift + 1), 1.0)] if shift < PROBE_MAX else []
            lam = 2 * GATE  # each met condition gives +1/2, an unmet one -1/2: +1/2 at p, <= -1/2 elsewhere
            alpha = {d: lam * s / SCALE for d, s in conds}
            alpha[tok] = lam * (len(conds) + 1) / KAPPA
            alpha[0] = -lam * ((len(conds) - 1) / 2 + len(conds) + 1)
            neurons.append((alpha, echo))
    inter = -(-max(len(neurons), 1) // ALIGN) * ALIGN
    gate = np.zeros((inter, H))
    up = np.zeros((inter, H))
    down = np.zeros((H, inter))
    for j, (alpha, token) in enumerate(neurons):
        for d, a in alpha.items():
            gate[j, d] = a * rho2
        up[j, 0] = rho2  # about 1
        down[lay.vote(token), j] = VOTE / GATE  # silu(GATE) * 1 ~ GATE

    lm_head = np.zeros((vocab_size, H))
    rho3 = math.sqrt(1.0 / H + RMS_EPS)
    for t in range(vocab_size):
        lm_head[t, lay.vote(t)] = LOGIT / math.sqrt(H)  # a firing vote dominates the final norm: h ~ sqrt(H)
        lm_head[eos_id, lay.vote(t)] = -EOS_AGAINST / math.sqrt(H) if t != eos_id else LOGIT / math.sqrt(H)
    lm_head[eos_id, 0] = EOS_LOGIT * rho3
    ones = np.ones(H)
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
        "lm_head.weight": lm_head,
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


# ---- the forward pass with each dtype's rounding, to prove margins before any engine runs -------------


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest, ties to even) through float32's bits."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    b = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return b.view(np.float32).astype(np.float64)


ROUNDING: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "float64": lambda x: x,
    "float32": lambda x: np.asarray(x, np.float32).astype(np.float64),
    "bfloat16": _bf16,
    "float16": lambda x: np.asarray(x, np.float16).astype(np.float64),
}


def forward(state: dict[str, np.ndarray], config: dict[str, Any], ids: Sequence[int],
            dtype: str = "float64") -> tuple[np.ndarray, np.ndarray]:
    """(logits [n, V], MLP gate pre-activations [n, I]) of the one-layer Llama in `dtype`.

    Computed as transformers' eager path does in that dtype: weights rounded once, every product,
    sum, RoPE table, score, softmax output (taken in float32) and residual rounded, the KV cache
    holding the rounded keys and values; only the RMSNorm statistics and the matmul accumulations
    are exact.
    """
    return forward_many(rounded(state, dtype), config, [ids], dtype)[0]


def rounded(state: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The weights as an engine holds them in `dtype` (float64 arrays of the rounded values)."""
    with np.errstate(over="ignore"):  # a weight past the dtype's range becomes inf, as it does in the engine
        return {k: ROUNDING[dtype](v.astype(np.float64)) for k, v in state.items()}


def forward_many(w: dict[str, np.ndarray], config: dict[str, Any], seqs: Sequence[Sequence[int]],
                 dtype: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """`forward` of several sequences on weights already `rounded`: the per-token steps run on all
    their tokens at once, attention on each sequence alone."""
    with np.errstate(over="ignore", invalid="ignore"):  # a dtype's overflow shows as inf / NaN in the result
        return _forward_many(w, config, seqs, dtype)


def _forward_many(w: dict[str, np.ndarray], config: dict[str, Any], seqs: Sequence[Sequence[int]],
                  dtype: str) -> list[tuple[np.ndarray, np.ndarray]]:
    r = ROUNDING[dtype]
    n_heads, d = config["num_attention_heads"], config["head_dim"]
    eps = config["rms_norm_eps"]
    lens = [len(s) for s in seqs]
    starts = np.cumsum([0, *lens])

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return r(r(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight)

    x = w["model.embed_tokens.weight"][[t for s in seqs for t in s]]
    h = rms(x, w["model.layers.0.input_layernorm.weight"])
    qkv = [r(h @ w[f"model.layers.0.self_attn.{p}_proj.weight"].T) for p in "qkv"]
    exact = dtype == "float64"
    inv = (1.0 / config["rope_theta"] ** (np.arange(0, d, 2) / d)) if exact else theta().astype(np.float32)
    att = np.empty_like(qkv[0])
    for n, a in zip(lens, starts):
        qs, ks, vs = (t[a:a + n].reshape(n, n_heads, d).transpose(1, 0, 2) for t in qkv)
        pos = np.arange(n, dtype=np.float64 if exact else np.float32)
        ang = np.concatenate([np.outer(pos, inv)] * 2, axis=1)
        cos, sin = r(np.cos(ang).astype(np.float64)), r(np.sin(ang).astype(np.float64))

        def rope(t: np.ndarray) -> np.ndarray:
            turned = np.concatenate([-t[..., d // 2:], t[..., : d // 2]], axis=-1)
            return r(r(t * cos) + r(turned * sin))

        scores = r(r(rope(qs) @ rope(ks).transpose(0, 2, 1)) * d**-0.5)
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p = r(ROUNDING["float32"](p / p.sum(axis=-1, keepdims=True)))
        att[a:a + n] = r(p @ vs).transpose(1, 0, 2).reshape(n, n_heads * d)
    x = r(x + r(att @ w["model.layers.0.self_attn.o_proj.weight"].T))
    h = rms(x, w["model.layers.0.post_attention_layernorm.weight"])
    gate = r(h @ w["model.layers.0.mlp.gate_proj.weight"].T)
    act = r(gate / (1.0 + np.exp(-np.clip(gate, -700, 700))))
    mlp = r(r(act * r(h @ w["model.layers.0.mlp.up_proj.weight"].T)) @ w["model.layers.0.mlp.down_proj.weight"].T)
    logits = r(rms(r(x + mlp), w["model.norm.weight"]) @ w["lm_head.weight"].T)
    return [(logits[a:a + n], gate[a:a + n]) for n, a in zip(lens, starts)]


@attrs.frozen
class Margin:
    """How far one dtype's forward pass is from leaving the scripts (see check_margins)."""

    dtype: str
    logit: float  # the smallest (wanted logit - best other) over every checked step
    gate: float  # the smallest deciding gate (the firing neuron's, minus the highest other's) / GATE
    steps: int  # steps checked
    where: str  # the program and step where `gate` is smallest

    def line(self) -> str:
        return (f"{self.dtype}: {self.steps} steps, logit margin {self.logit:.2f}, gate margin "
                f"{self.gate:.2f} of the designed {GATE:g} (at {self.where})")


def _runs(programs: Sequence[Program], eos_id: int, probe: Probe | None) -> list[tuple[str, list[int], list[int]]]:
    """(name, prompt, tokens wanted after it) for every program, and the probe behind 0..PROBE_MAX+1
    ordinary tokens (EOS ids, as a BOS or a template would stand there)."""
    out = [(p.name, list(p.prompt), [*p.script, eos_id]) for p in programs]
    if probe is not None:
        for shift in range(PROBE_MAX + 2):
            out.append((f"probe behind {shift}", [eos_id] * shift + list(probe.prompt),
                        [probe.echo[min(shift, PROBE_MAX)], eos_id]))
    return out


def check_margins(state: dict[str, np.ndarray], config: dict[str, Any], programs: Sequence[Program], eos_id: int,
                  probe: Probe | None = None, dtypes: Sequence[str] = DTYPES) -> dict[str, Margin]:
    """Per dtype, the margins of every program's steps (its script, then EOS) and the probe's.

    Raises ProgramError naming the dtype, program and step where greedy would leave the script, or
    where a gate keeps less than a quarter of its designed margin.
    """
    out = {}
    runs = _runs(programs, eos_id, probe)
    used = np.abs(state["model.layers.0.mlp.gate_proj.weight"]).sum(axis=1) > 0  # not the padding neurons
    for dtype in dtypes:
        worst_logit, worst_gate, where, steps = math.inf, math.inf, "", 0
        passes = forward_many(rounded(state, dtype), config, [[*prompt, *want[:-1]] for _, prompt, want in runs], dtype)
        for (name, prompt, want), (logits, gates) in zip(runs, passes):
            for i, target in enumerate(want):
                row = logits[len(prompt) - 1 + i]
                gap = float(row[target] - np.delete(row, target).max())
                if not gap > 0:
                    what = ("the logits are NaN (a value left the dtype's range)" if np.isnan(row).any() else
                            f"greedy picks {int(row.argmax())}, not {target} (gap {gap:.3g})")
                    raise ProgramError(f"{dtype}: program {name}: at output step {i + 1} {what}")
                top = np.sort(gates[len(prompt) - 1 + i, used])[::-1]
                fires = target != eos_id or top[0] > 0  # a scripted EOS is voted for like any token
                g = min(top[0], -top[1]) / GATE if fires else -top[0] / GATE
                worst_logit = min(worst_logit, gap)
                if g < worst_gate:
                    worst_gate, where = g, f"{name} step {i + 1}"
                steps += 1
        if worst_gate < 0.25:
            raise ProgramError(f"{dtype}: at {where} a gate keeps {worst_gate:.2f} of its margin, under a quarter")
        out[dtype] = Margin(dtype, worst_logit, worst_gate, steps, where)
    return out
