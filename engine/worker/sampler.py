"""The sampler: one entry point for plain decoding and for draft verification.

Plain sampling is verification with zero drafts. ``Sampler.__call__`` takes the target logits of
every row that needs sampling this step and one ``SamplingRow`` per request, turns the logits
into the processed target distribution p (temperature, min-p, top-k, top-p; vectorized over the
batch), draws the random numbers each request needs from its own generator, and hands everything
to ``spec.rejection_sampler.rejection_sample_reference`` (the torch reference a Triton kernel is
checked against).

Processing order (as vLLM V1): temperature -> min-p -> top-k -> top-p -> softmax.
* min-p keeps tokens with ``p >= min_p * max(p)``, p = softmax(logits / temperature).
* top-k keeps tokens whose logit is >= the k-th largest logit (ties at the boundary are all kept).
* top-p keeps the smallest set of most likely tokens whose mass reaches top_p: a token is kept
  when the mass of the tokens sorted strictly before it is < top_p (the most likely token is
  always kept).
Greedy requests (``params.is_greedy``) take the argmax of the raw logits (ties: lowest id).

Random numbers, per random request, in this fixed order: ``k`` uniforms (float32), then one
Exp(1) vector of size V. A request with a ``generator`` draws them from it, so its tokens do not
depend on its batch neighbours; requests without one share the global torch RNG (drawn in one
batched call: uniforms of all such requests, then their noise). Greedy requests draw nothing.

Logprobs (when ``params.logprobs`` is not None) are taken from the raw distribution
``log_softmax(logits)`` of the row that predicted each emitted token — before temperature and
the top-k/top-p/min-p masks, as vLLM returns by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from tokenbudget.engine.api.sampling_params import SamplingParams
from tokenbudget.kernels.rejection_triton import (
    rejection_sample,  # Triton on CUDA, torch reference elsewhere
)
from tokenbudget.spec.rejection_sampler import PLACEHOLDER_TOKEN_ID

__all__ = [
    "SamplingRow",
    "SamplerOutput",
    "TokenLogprob",
    "Sampler",
    "apply_sampling_params",
    "compute_target_probs",
]


@dataclass(slots=True)
class SamplingRow:
    """One request of this step's batch that needs sampling.

    ``generator``: the request's own RNG, created once from ``params.seed`` by the engine (None =
    the global torch RNG). ``draft_token_ids``: its k drafts (possibly none). ``draft_probs``:
    [k, V] drafter probabilities q, or None for a drafter without probabilities (q(x) = 1 for the
    drafted token).
    """

    params: SamplingParams
    generator: torch.Generator | None = None
    draft_token_ids: list[int] | None = None
    draft_probs: torch.Tensor | None = None

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids) if self.draft_token_ids else 0


class TokenLogprob(NamedTuple):
    """Logprob of one emitted token and the ``params.logprobs`` most likely (id, logprob) pairs."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    """Per request: accepted drafts (a prefix of its drafts) followed by exactly one new token.

    ``logprobs`` is None when no request asked for logprobs; otherwise entry i is None for a
    request that did not ask, else one ``TokenLogprob`` per token of ``token_ids[i]``.
    """

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob] | None] | None = None

    def num_accepted(self, i: int) -> int:
        return len(self.token_ids[i]) - 1


def apply_sampling_params(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Processed logits ([R, V] float32, excluded tokens at -inf) for per-row parameters ([R]).

    ``temperature`` must be > 0 (greedy rows are handled elsewhere); ``top_k <= 0`` disables
    top-k; ``top_p == 1`` and ``min_p == 0`` disable those. Stages no row uses are skipped.
    """
    out = logits.to(torch.float32)
    if bool((temperature != 1.0).any()):
        out = out / temperature[:, None].to(out.dtype)
    if bool((min_p > 0).any()):
        probs = out.softmax(dim=-1)
        thresh = min_p[:, None].to(probs.dtype) * probs.amax(dim=-1, keepdim=True)
        out = out.masked_fill(probs < thresh, float("-inf"))
    vocab = out.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp_max(vocab), vocab).to(torch.int64)
    if bool((k < vocab).any()):
        max_k = int(k.max())
        kth = out.topk(max_k, dim=-1).values.gather(1, (k - 1)[:, None])
        kth = torch.where((k < vocab)[:, None], kth, torch.full_like(kth, float("-inf")))
        out = out.masked_fill(out < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        out = _apply_top_p(out, top_p)
    return out


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Rows with top_p == 1 must keep everything even when the float cumsum exceeds 1.
    drop_sorted = (mass_before >= top_p[:, None].to(sorted_probs.dtype)) & (top_p < 1.0)[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def compute_target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax of ``apply_sampling_params`` with one ``SamplingParams`` per row (non-greedy)."""
    if all(p.uses_default_processing for p in params):
        return logits.to(torch.float32).softmax(dim=-1)
    dev = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
    return apply_sampling_params(logits, temperature, top_k, top_p, min_p).softmax(dim=-1)


class Sampler:
    """Samples (k = 0) or verifies drafts (k > 0) for a batch of requests; stateless."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``logits``: [sum(1 + k_i), V]; request i owns 1 + k_i consecutive rows (row j is the
        target's distribution for draft j's slot, row k_i the bonus slot)."""
        num_drafts = [r.num_drafts for r in rows]
        total_rows = sum(num_drafts) + len(rows)
        if logits.dim() != 2 or logits.shape[0] != total_rows:
            raise ValueError(f"logits must have shape [{total_rows}, V], got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=None)
        vocab = logits.shape[1]
        dev = logits.device
        drafts = torch.tensor(
            [t for r in rows for t in (r.draft_token_ids or ())], dtype=torch.int64, device=dev
        )
        if drafts.numel() and (int(drafts.min()) < 0 or int(drafts.max()) >= vocab):
            raise ValueError(f"draft_token_ids must lie in [0, {vocab})")
        k = torch.tensor(num_drafts, dtype=torch.int64, device=dev)
        greedy = [r.params.is_greedy for r in rows]
        target_argmax = logits.argmax(dim=-1)
        target_probs = draft_probs = None
        uniforms = torch.zeros(drafts.numel(), dtype=torch.float32, device=dev)
        noise = None
        if not all(greedy):
            target_probs = self._target_probs(logits, rows, num_drafts, greedy)
            draft_probs = _flat_draft_probs(rows, drafts, vocab, dev)
            noise = torch.ones(len(rows), vocab, dtype=torch.float32, device=dev)
            _draw_random(rows, num_drafts, greedy, uniforms, noise)
        is_greedy = torch.tensor(greedy, dtype=torch.bool, device=dev)
        out = rejection_sample(
            target_probs, target_argmax, drafts, k, draft_probs, is_greedy, uniforms, noise
        )
        token_ids = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()]
        return SamplerOutput(token_ids=token_ids, logprobs=_logprobs(logits, rows, num_drafts, token_ids))

    @staticmethod
    def _target_probs(
        logits: torch.Tensor, rows: list[SamplingRow], num_drafts: list[int], greedy: list[bool]
    ) -> torch.Tensor:
        """[T, V] processed probabilities; rows of greedy requests are left at zero."""
        row_idx: list[int] = []
        row_params: list[SamplingParams] = []
        start = 0
        for r, k, g in zip(rows, num_drafts, greedy):
            if not g:
                row_idx.extend(range(start, start + k + 1))
                row_params.extend([r.params] * (k + 1))
            start += k + 1
        if len(row_idx) == logits.shape[0]:
            return compute_target_probs(logits, row_params)
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        idx = torch.tensor(row_idx, dtype=torch.int64, device=logits.device)
        probs[idx] = compute_target_probs(logits[idx], row_params)
        return probs


def _flat_draft_probs(
    rows: list[SamplingRow], drafts: torch.Tensor, vocab: int, dev: torch.device
) -> torch.Tensor | None:
    """[D, V] drafter probabilities, or None when no request has any. A request whose drafter
    gives no probabilities gets one-hot rows (q(x) = 1), which is the same rule."""
    if not any(r.draft_probs is not None and r.num_drafts for r in rows):
        return None
    parts = []
    offset = 0
    for r in rows:
        k = r.num_drafts
        if r.draft_probs is not None and k:
            if tuple(r.draft_probs.shape) != (k, vocab):
                raise ValueError(f"draft_probs must have shape [{k}, {vocab}], got {tuple(r.draft_probs.shape)}")
            parts.append(r.draft_probs.to(device=dev, dtype=torch.float32))
        elif k:
            one_hot = torch.zeros(k, vocab, dtype=torch.float32, device=dev)
            one_hot[torch.arange(k, device=dev), drafts[offset : offset + k]] = 1.0
            parts.append(one_hot)
        offset += k
    return torch.cat(parts, dim=0)


def _draw_random(
    rows: list[SamplingRow],
    num_drafts: list[int],
    greedy: list[bool],
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> None:
    """Fill the uniforms and Exp(1) noise of random requests in place (order: module docstring)."""
    vocab = noise.shape[1]
    dev = noise.device
    shared_u: list[int] = []
    shared_rows: list[int] = []
    offset = 0
    for i, (r, k, g) in enumerate(zip(rows, num_drafts, greedy)):
        if not g:
            if r.generator is None:
                shared_u.extend(range(offset, offset + k))
                shared_rows.append(i)
            else:
                if k:
                    uniforms[offset : offset + k] = torch.rand(k, generator=r.generator, device=dev)
                noise[i].exponential_(generator=r.generator)
        offset += k
    if shared_rows:
        if shared_u:
            uniforms[torch.tensor(shared_u, device=dev)] = torch.rand(len(shared_u), device=dev)
        noise[torch.tensor(shared_rows, device=dev)] = torch.empty(
            len(shared_rows), vocab, device=dev
        ).exponential_()


def _logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], num_drafts: list[int], token_ids: list[list[int]]
) -> list[list[TokenLogprob] | None] | None:
    if all(r.params.logprobs is None for r in rows):
        return None
    result: list[list[TokenLogprob] | None] = []
    start = 0
    for r, k, toks in zip(rows, num_drafts, token_ids):
        n = r.params.logprobs
        if n is None:
            result.append(None)
        else:
            lp = logits[start : start + len(toks)].to(torch.float32).log_softmax(dim=-1)
            chosen = lp.gather(1, torch.tensor(toks, device=lp.device)[:, None])[:, 0].tolist()
            n = min(n, lp.shape[1])
            top_v, top_i = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
            result.append(
                [
                    TokenLogprob(c, list(zip(ti, tv)))
                    for c, ti, tv in zip(chosen, top_i.tolist(), top_v.tolist())
                ]
            )
        start += k + 1
    return result
