"""A request's random numbers as a pure function of (seed, position, stream).

Every random number the engine draws for a request is keyed by the request's seed, the absolute
position of the token it decides (index into prompt + output) and a stream id. Consequences:

* a request's tokens depend on nothing but its own history: not on its batch neighbours, not on
  how many drafts a step verified, not on which step (or retry of a step) computed them;
* plain decoding and draft verification of the same position use the same noise, which is what
  makes seeded sampling with speculation reproduce plain sampling token for token
  (``engine.worker.sampler``);
* the sampler and the runner keep no per-request RNG state, so a failed step leaves nothing to
  roll back and a finished request leaves nothing to free.

Streams: ``TARGET`` (the target's sample at a position), ``ACCEPT`` (rejection-test uniforms),
``RESIDUAL`` (the recovered/bonus sample of a rejection-sampled verify), ``DRAFT`` (a model
drafter's own samples for requests without a user seed).

Cost: one generator re-seed per (request, position) plus ``V`` uniforms and a log (figures:
benches/RESULTS.md, "Figures behind decisions in the source").
"""

from __future__ import annotations

import torch

TARGET, ACCEPT, RESIDUAL, DRAFT = 0, 1, 2, 3
_MASK = (1 << 64) - 1


def mix64(*values: int) -> int:
    """splitmix64 over the values; the result is a 63-bit non-negative int (a torch seed)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 29
    return h & 0x7FFF_FFFF_FFFF_FFFF


def _generator(seed: int, position: int, stream: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(mix64(seed, position, stream))
    return g


def keyed_exponential(seed: int, position: int, vocab_size: int, device: torch.device,
                      stream: int = TARGET) -> torch.Tensor:
    """Exp(1) noise ``[vocab_size]`` float32 (``-log(1 - u)``, u uniform in [0, 1))."""
    u = torch.empty(vocab_size, dtype=torch.float32, device=device)
    u.uniform_(generator=_generator(seed, position, stream, device))
    return u.neg_().log1p_().neg_()


def keyed_uniform(seed: int, position: int, device: torch.device, stream: int = ACCEPT) -> torch.Tensor:
    """One uniform in [0, 1) as a 0-d float32 tensor."""
    return torch.rand((), generator=_generator(seed, position, stream, device), device=device)


def race_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race, row-wise: ``argmax_v p(v) / E(v)`` over tokens with ``p(v) > 0``
    (ties to the lowest id). An exact sample from ``probs`` when ``noise`` is i.i.d. Exp(1)."""
    score = torch.where(probs > 0, probs / noise, torch.full_like(probs, -1.0))
    return score.argmax(dim=-1)
