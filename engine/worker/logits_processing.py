"""Row preparation: from a verify/decode row's raw logits to the distribution p it samples from.

One place for every transformation of logits before sampling, applied per row of the step's
sampling rows (a (1 + k)-row verify has one row per draft position plus the bonus row).

**Every row is prepared with its own prefix.** Row j of request i predicts the token after
``prompt + output + drafts[:j]``, so everything that looks at the context sees exactly that: the
penalties count those tokens, bad words and logits processors see them, ``min_tokens`` counts
``num_output_tokens + j`` outputs. Row j is then the distribution plain decoding would sample
from after committing ``drafts[:j]``, which is what makes verification against it exact (greedy:
the same tokens; random: the same distribution, ``engine.worker.sampler``). A draft that the
prepared row forbids has p = 0 and is rejected like any other.

``prepare_logits`` (before temperature; in vLLM V1's order):

1. ``allowed_token_ids``: every other token -> -inf;
2. ``bad_words``: a word's last token -> -inf when the row's output context (committed output +
   drafts[:j], not the prompt, as vLLM) ends with the word's other tokens;
3. ``min_tokens``: EOS and stop ids -> -inf while fewer than ``min_tokens`` outputs precede the row;
4. ``logit_bias``: added;
5. ``logits_processors``: the user's callables, in order, on the row with that row's token ids
   (a token set to +inf is forced: the row keeps only the +inf tokens, equally likely); a
   processor that raises, or returns something else than the row, is its request's fault
   (``RequestFault``): that request ends, the step goes on without it;
6. presence / frequency / repetition penalties (``engine.worker.penalties``, vectorized).

A prepared row that allows no token at all (``allowed_token_ids`` and a grammar that disagree,
``min_tokens`` banning the only token a grammar allows) is its request's ``RequestFault``.

Greedy is the argmax of the prepared logits. ``compute_target_probs`` then applies temperature ->
min-p -> top-k -> top-p -> softmax (vLLM V1's order):
  - min-p keeps tokens with ``p >= min_p * max(p)``, p = softmax(logits / temperature);
  - top-k keeps tokens whose logit is >= the k-th largest (ties at the boundary all kept);
  - top-p keeps the smallest set of most likely tokens whose mass reaches top_p: a token is kept
    when the mass sorted strictly before it is < top_p (the most likely token always stays).
"""

from __future__ import annotations

import inspect

import torch

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.worker.penalties import apply_penalties
from tokenbudget.scheduler.request_fault import RequestFault


def prepare_logits(logits: torch.Tensor, rows) -> torch.Tensor:
    """The prepared logits ([T, V] float32) of a step's sampling rows; ``logits`` itself is never
    written (the raw rows give the logprobs), and is returned as is when no row needs anything.

    ``rows``: ``SamplingRow``s (``engine.worker.sampler``), request i owning ``1 + num_drafts``
    consecutive rows."""
    out: torch.Tensor | None = None
    penalized = []
    first = 0
    for r in rows:
        m = r.num_drafts + 1
        start, first = first, first + m
        params = r.params
        if params is None or not (params.needs_row_preparation or r.bad_words_token_ids or _bans_apply(r)):
            continue
        if out is None:
            out = logits.to(torch.float32, copy=True)
        block = out[start:start + m]
        if params.allowed_token_ids:
            keep = torch.zeros(block.shape[1], dtype=torch.bool, device=block.device)
            keep[torch.tensor(params.allowed_token_ids, device=block.device)] = True
            block.masked_fill_(~keep, float("-inf"))
        if r.bad_words_token_ids:
            _ban_bad_words(block, r)
        if _bans_apply(r):
            ids = [t for t in r.banned_token_ids if 0 <= t < block.shape[1]]
            block[:min(params.min_tokens - r.num_output_tokens, m), ids] = float("-inf")
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=block.device)
            block[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=block.dtype, device=block.device)
        if params.logits_processors:
            try:
                _call_processors(block, r)
            except Exception as exc:  # the user's code: the fault of this request alone
                raise RequestFault({r.request_id: f"logits_processors: {type(exc).__name__}: {exc}"}) from exc
        if bool(torch.isneginf(block).all(dim=-1).any()):  # e.g. min_tokens bans the only token allowed
            raise RequestFault({r.request_id: "no token is allowed by the sampling parameters (and grammar) "
                                              "at this position"})
        if params.has_penalties:
            penalized.append((start, m, params, r.prompt_token_ids, r.output_token_ids, r.draft_token_ids or ()))
    if penalized:
        apply_penalties(out, penalized)
    return logits if out is None else out


def _bans_apply(r) -> bool:
    return bool(r.banned_token_ids) and r.params.min_tokens > r.num_output_tokens


def _row_context(r, j: int, tail: int | None = None) -> tuple[int, ...]:
    """Output token ids seen by row j (committed output + drafts[:j]); only the last ``tail``."""
    drafts = tuple(r.draft_token_ids[:j]) if j else ()
    out = r.output_token_ids
    if tail is not None:
        keep = max(tail - len(drafts), 0)
        out = out[len(out) - keep:] if keep else ()
    return tuple(out) + drafts


def _ban_bad_words(block: torch.Tensor, r) -> None:
    """A word's last token is banned where the context ends with the rest of the word."""
    words = r.bad_words_token_ids
    longest = max(len(w) for w in words) - 1
    for j in range(block.shape[0]):
        ctx = _row_context(r, j, longest)
        banned = [w[-1] for w in words if len(w) - 1 <= len(ctx) and ctx[len(ctx) - (len(w) - 1):] == w[:-1]]
        if banned:
            block[j, banned] = float("-inf")


def _call_processors(block: torch.Tensor, r) -> None:
    """vLLM's per-request processors: ``f(output_ids, logits)`` or ``f(prompt_ids, output_ids,
    logits)``, each returning the row; called once per row with that row's own output ids."""
    prompt = tuple(r.prompt_token_ids)
    for j in range(block.shape[0]):
        ctx = _row_context(r, j)
        row = block[j]
        for fn in r.params.logits_processors:
            row = fn(prompt, ctx, row) if _num_params(fn) == 3 else fn(ctx, row)
            if not isinstance(row, torch.Tensor) or row.shape != block[j].shape:
                raise ValueError(f"logits_processors: {fn!r} must return the logits row, a tensor of shape "
                                 f"{tuple(block[j].shape)}")
        if row.data_ptr() != block[j].data_ptr():
            block[j] = row
        forced = torch.isposinf(block[j])
        if bool(forced.any()):  # +inf forces a token: the row keeps only those (NaN-free softmax)
            block[j] = torch.where(forced, 0.0, float("-inf"))


def _num_params(fn) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: the two-argument form
        return 2


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
