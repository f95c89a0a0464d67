"""Row preparation: from a verify/decode row's raw logits to the distribution p it samples from.

One place for every transformation of logits before sampling, applied per row of the step's
sampling rows (a (1 + k)-row verify has one row per draft position plus the bonus row):

* ``apply_row_bans``: tokens a request may not produce at that row (``min_tokens``: EOS and stop
  ids while the output is still short; row j of a verify predicts output number
  ``num_output_tokens + j``). Masking p, not just ignoring a sampled EOS, keeps verification
  exact: a draft is judged against the distribution plain decoding samples from.
* ``compute_target_probs``: temperature -> min-p -> top-k -> top-p -> softmax (vLLM V1's order).
  - min-p keeps tokens with ``p >= min_p * max(p)``, p = softmax(logits / temperature);
  - top-k keeps tokens whose logit is >= the k-th largest (ties at the boundary all kept);
  - top-p keeps the smallest set of most likely tokens whose mass reaches top_p: a token is kept
    when the mass sorted strictly before it is < top_p (the most likely token always stays).
"""

from __future__ import annotations

import torch

from tokenbudget.engine.api.sampling_params import SamplingParams


def apply_row_bans(logits: torch.Tensor, rows) -> None:
    """In place: ``-inf`` at each request's banned ids for the rows before ``min_tokens``.

    ``rows``: per sampling request, ``(first_row, num_rows, scheduled_request)``."""
    vocab = logits.shape[-1]
    for first, m, sr in rows:
        if not sr.banned_token_ids or sr.params is None:
            continue
        remaining = sr.params.min_tokens - sr.num_output_tokens
        ids = [t for t in sr.banned_token_ids if 0 <= t < vocab]
        if remaining > 0 and ids:
            logits[first:first + min(remaining, m), ids] = float("-inf")


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
