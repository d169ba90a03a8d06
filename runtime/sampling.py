"""choose(): greedy and sampled token selection with a per-request seeded generator (§4.2, §4.3).

The decoder state of §4.2 includes the sampler: its parameters, its torch.Generator and the RNG
cursor (draws so far). Every sampled choice consumes exactly one uniform draw (inverse-CDF over
the kept tokens), so the cursor counts choices and `SamplerState` + `Sampler.resume` continue a
preempted request with the very same draws (§4.8). Greedy (temperature 0) draws nothing.

Before any of it the logits are *shaped* by the request (DECISIONS D32), in vLLM's order: the
logit bias is added; while fewer than `min_tokens` tokens are chosen, EOS and the one-id stops are
masked (-inf) unless that would leave nothing to choose (then the lifecycle table's finish-check
guard decides, D31); then the repetition penalty (a logit of a token seen in the prompt or the
output is divided by it when positive, multiplied when not), the frequency penalty (minus it
times the token's count in the output) and the presence penalty (minus it once the token is in
the output). Greedy is the argmax of the shaped logits.

Order of the filters: temperature, then min-p (tokens below min_p times the top probability go),
then top-k (the k highest; ties keep the lower id), then top-p on the renormalised distribution
(the smallest prefix of the sorted tokens whose mass reaches top_p). Sorting is stable, so equal
logits rank by lower id everywhere.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import attrs
import torch


class SamplingError(ValueError):
    """Bad sampling parameters or logits (NaN, wrong shape)."""


def _temperature(_i: object, _a: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise SamplingError(f"temperature must be a finite number >= 0, got {value!r}")


def _top_k(_i: object, _a: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SamplingError(f"top_k must be None or an int >= 1, got {value!r}")


def _top_p(_i: object, _a: attrs.Attribute, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise SamplingError(f"top_p must be None or in (0, 1], got {value!r}")


def _seed(_i: object, _a: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise SamplingError(f"seed must be None or an int >= 0, got {value!r}")


def _min_p(_i: object, _a: attrs.Attribute, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
        raise SamplingError(f"min_p must be None or in [0, 1], got {value!r}")


def _finite(_i: object, a: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise SamplingError(f"{a.name} must be a finite number, got {value!r}")


def _repetition(_i: object, a: attrs.Attribute, value: float) -> None:
    _finite(_i, a, value)
    if value <= 0:
        raise SamplingError(f"repetition_penalty must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Decoding parameters of one request. temperature 0 means greedy (argmax, lowest id on ties).

    The shaping fields (D32) default to doing nothing; `min_tokens_ids` are the ids masked while
    fewer than `min_tokens` tokens are chosen (EOS and the one-id stops, given by the runner);
    `score` keeps the sum of the chosen tokens' log-probabilities (`Sampler.logprob_sum`)."""

    temperature: float = attrs.field(default=0.0, validator=_temperature)
    top_k: int | None = attrs.field(default=None, validator=_top_k)
    top_p: float | None = attrs.field(default=None, validator=_top_p)
    seed: int | None = attrs.field(default=None, validator=_seed)
    min_p: float | None = attrs.field(default=None, validator=_min_p)
    presence_penalty: float = attrs.field(default=0.0, validator=_finite)
    frequency_penalty: float = attrs.field(default=0.0, validator=_finite)
    repetition_penalty: float = attrs.field(default=1.0, validator=_repetition)
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()
    score: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shapes(self) -> bool:
        """Do the logits change before the choice (D32)? Then a batch's argmax is not the answer."""
        return bool(self.logit_bias or (self.min_tokens and self.min_tokens_ids) or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1 or self.score)


@attrs.frozen
class SamplerState:
    """The RNG part of the step state (§4.2): seed used, draws so far, generator state and the
    vocabulary size and device the sampler was made for."""

    seed: int
    draws: int
    rng_state: torch.Tensor = attrs.field(eq=False, repr=False)
    vocab_size: int
    device: str


class Sampler:
    """Per-request choose(). `seed` None picks a fresh random seed and records it (`self.seed`).

    `history` is the request's output tokens so far (a list the caller appends to; the penalties
    and min_tokens read it) and `prompt` its prompt ids (the repetition penalty counts them)."""

    __slots__ = ("params", "greedy", "vocab_size", "device", "seed", "draws", "logprob_sum", "_gen", "_history",
                 "_prompt", "_bias")

    def __init__(self, params: SamplingParams, vocab_size: int, device: str | torch.device = "cpu", *,
                 history: Sequence[int] = (), prompt: Sequence[int] = ()) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise SamplingError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.params = params
        self.greedy = params.greedy and not params.shapes  # read per row and step by greedy_rows
        self.logprob_sum = 0.0
        self._history, self._prompt = history, prompt
        bad = [t for t, _ in params.logit_bias if t >= vocab_size]
        if bad:
            raise SamplingError(f"logit_bias names token {bad[0]}, outside the vocabulary (0..{vocab_size - 1})")
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.draws = 0
        self._gen = torch.Generator(device=self.device).manual_seed(self.seed)

    def state(self) -> SamplerState:
        return SamplerState(seed=self.seed, draws=self.draws, rng_state=self._gen.get_state(),
                            vocab_size=self.vocab_size, device=str(self.device))

    @classmethod
    def resume(cls, params: SamplingParams, state: SamplerState, *, history: Sequence[int] = (),
               prompt: Sequence[int] = ()) -> Sampler:
        """A sampler that continues exactly where `state` was taken (same future draws)."""
        s = cls(attrs.evolve(params, seed=state.seed), state.vocab_size, state.device, history=history, prompt=prompt)
        s._gen.set_state(state.rng_state)
        s.draws = state.draws
        return s

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits as the request shapes them (D32; see the module docstring), in float64."""
        p = self.params
        z = logits.double()  # a copy: the caller's logits stay as they are
        if p.logit_bias:
            if self._bias is None or self._bias[0].device != z.device:
                ids, vals = zip(*p.logit_bias)
                self._bias = (torch.tensor(ids, device=z.device), torch.tensor(vals, dtype=torch.float64, device=z.device))
            z.index_add_(0, self._bias[0], self._bias[1])
        out = self._history
        if p.min_tokens and p.min_tokens_ids and len(out) < p.min_tokens:
            masked = z.clone()
            masked[list(p.min_tokens_ids)] = float("-inf")
            if bool(torch.isfinite(masked).any()):  # else nothing would be left: the guard decides (D31)
                z = masked
        if p.repetition_penalty != 1 and (out or self._prompt):
            seen = torch.tensor(sorted({*self._prompt, *out}), device=z.device)
            v = z[seen]
            z[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and out:
            counts = torch.bincount(torch.tensor(list(out), device=z.device), minlength=z.shape[0])[: z.shape[0]].double()
            z -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).double()
        return z

    def allowed(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept token ids (most probable first) and their renormalised probabilities (of logits
        already shaped)."""
        p = self.params
        if p.greedy:
            return torch.argmax(logits).view(1), torch.ones(1, dtype=torch.float64, device=logits.device)
        z = logits.double()
        probs = torch.softmax((z - z.max()) / p.temperature, dim=-1)
        probs, ids = torch.sort(probs, descending=True, stable=True)
        if p.min_p:
            keep = int((probs >= p.min_p * probs[0]).sum())
            probs, ids = probs[:keep], ids[:keep]
            probs = probs / probs.sum()
        if p.top_k is not None:
            probs, ids = probs[: p.top_k], ids[: p.top_k]
            probs = probs / probs.sum()
        if p.top_p is not None and p.top_p < 1:
            before = probs.cumsum(0) - probs  # mass strictly before each token
            keep = int((before < p.top_p).sum())
            probs, ids = probs[:keep], ids[:keep]
            probs = probs / probs.sum()
        return ids, probs

    def choose(self, logits: torch.Tensor) -> int:
        """Select the next token from logits [V] (§4.3 `choose`)."""
        if logits.dim() != 1 or logits.shape[0] != self.vocab_size:
            raise SamplingError(f"logits must have shape [{self.vocab_size}], got {tuple(logits.shape)}")
        if torch.isnan(logits).any():
            raise SamplingError("logits contain NaN")
        if self.greedy:
            return int(torch.argmax(logits))  # first maximum: lowest id on ties
        z = self.shape(logits)
        if self.params.greedy:
            token = int(torch.argmax(z))
        else:
            if not bool(torch.isfinite(z.max())):  # +inf (or all -inf): no distribution to draw from (D20)
                raise SamplingError(f"logits have no finite maximum ({float(z.max())}): nothing to sample from")
            ids, probs = self.allowed(z)
            u = torch.rand((), generator=self._gen, device=self.device, dtype=torch.float64)
            self.draws += 1
            cdf = probs.cumsum(0)
            cdf = cdf / cdf[-1]  # exactly 1.0 at the end, so u < 1 always lands on a kept token
            token = int(ids[int(torch.searchsorted(cdf, u.to(cdf.device), right=True))])
        if self.params.score:  # the choice's log-probability under the shaped logits (D34)
            self.logprob_sum += float(torch.log_softmax(z, dim=-1)[token])
        return token


def greedy_rows(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int | None]:
    """The greedy rows' choices of logits [B, V] from one reduction over the batch (§4.4).

    Row b gets `samplers[b]`'s greedy choice (argmax, lowest id on ties; no draw), or None when
    that sampler samples, when the row holds a NaN (max propagates it) or has another size than
    the sampler's vocabulary, or for every row when logits is not [B, V]: `Sampler.choose` on such
    a row raises the precise error.
    """
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        return [None] * len(samplers)
    vocab = logits.shape[1]
    greedy = [s.greedy and s.vocab_size == vocab for s in samplers]
    if not any(greedy):
        return [None] * len(samplers)
    top, ids = logits.max(dim=-1)  # first maximum of each row, as torch.argmax
    return [tok if g and v == v else None for tok, v, g in zip(ids.tolist(), top.tolist(), greedy)]


def choose_batch(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """One choice per row of logits [B, V], each with its own request's sampler."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise SamplingError(f"logits must be [{len(samplers)}, V], got {tuple(logits.shape)}")
    picks = greedy_rows(logits, samplers)
    return [s.choose(row) if tok is None else tok for s, row, tok in zip(samplers, logits, picks)]
