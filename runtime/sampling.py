"""choose(): greedy and sampled token selection with a per-request seeded generator (§4.2, §4.3).

The decoder state of §4.2 includes the sampler: its parameters, its torch.Generator and the RNG
cursor (draws so far). Every sampled choice consumes exactly one uniform draw (inverse-CDF over
the kept tokens), so the cursor counts choices and `SamplerState` + `Sampler.resume` continue a
preempted request with the very same draws (§4.8). Greedy (temperature 0) draws nothing.

Order of the filters: temperature, then top-k (the k highest; ties keep the lower id), then
top-p on the renormalised top-k distribution (the smallest prefix of the sorted tokens whose
mass reaches top_p). Sorting is stable, so equal logits rank by lower id everywhere.
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


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Decoding parameters of one request. temperature 0 means greedy (argmax, lowest id on ties)."""

    temperature: float = attrs.field(default=0.0, validator=_temperature)
    top_k: int | None = attrs.field(default=None, validator=_top_k)
    top_p: float | None = attrs.field(default=None, validator=_top_p)
    seed: int | None = attrs.field(default=None, validator=_seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    """Per-request choose(). `seed` None picks a fresh random seed and records it (`self.seed`)."""

    __slots__ = ("params", "greedy", "vocab_size", "device", "seed", "draws", "_gen")

    def __init__(self, params: SamplingParams, vocab_size: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise SamplingError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.params = params
        self.greedy = params.greedy  # read per row and step by greedy_rows
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.draws = 0
        self._gen = torch.Generator(device=self.device).manual_seed(self.seed)

    def state(self) -> SamplerState:
        return SamplerState(seed=self.seed, draws=self.draws, rng_state=self._gen.get_state(),
                            vocab_size=self.vocab_size, device=str(self.device))

    @classmethod
    def resume(cls, params: SamplingParams, state: SamplerState) -> Sampler:
        """A sampler that continues exactly where `state` was taken (same future draws)."""
        s = cls(attrs.evolve(params, seed=state.seed), state.vocab_size, state.device)
        s._gen.set_state(state.rng_state)
        s.draws = state.draws
        return s

    def allowed(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept token ids (most probable first) and their renormalised probabilities."""
        p = self.params
        if p.greedy:
            return torch.argmax(logits).view(1), torch.ones(1, dtype=torch.float64, device=logits.device)
        z = logits.double()
        probs = torch.softmax((z - z.max()) / p.temperature, dim=-1)
        probs, ids = torch.sort(probs, descending=True, stable=True)
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
        if self.params.greedy:
            return int(torch.argmax(logits))  # first maximum: lowest id on ties
        if not bool(torch.isfinite(logits.max())):  # +inf (or all -inf): no distribution to draw from (D20)
            raise SamplingError(f"logits have no finite maximum ({float(logits.max())}): nothing to sample from")
        ids, probs = self.allowed(logits)
        u = torch.rand((), generator=self._gen, device=self.device, dtype=torch.float64)
        self.draws += 1
        cdf = probs.cumsum(0)
        cdf = cdf / cdf[-1]  # exactly 1.0 at the end, so u < 1 always lands on a kept token
        return int(ids[int(torch.searchsorted(cdf, u.to(cdf.device), right=True))])


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
