"""The sampler: one entry point for plain decoding and for draft verification.

Plain sampling is verification with zero drafts. ``Sampler.__call__`` takes the raw target
logits of every row that needs sampling this step and one ``SamplingRow`` per request (with the
token ids its rows' preparation needs), prepares every row with its own prefix
(``logits_processing.prepare_logits``) and returns per request its accepted drafts plus one new
token. ``kernels.rejection_ref.rejection_sample_reference`` (with a Triton twin on CUDA) applies
the verification rule.

Three kinds of request, each lossless (the output distribution is the target's):

* greedy (``params.is_greedy`` or no params): the target token of a row is the argmax of its
  prepared logits (ties: lowest id); drafts are accepted while they equal it.
* random, *coupled* (a user seed, or drafts without drafter probabilities, i.e. n-gram/suffix or
  plain decoding): the target token of row j is drawn by the exponential race
  ``argmax p_j / E_j`` with noise ``E_j`` keyed by (seed, position of the token, TARGET)
  (``keyed_random``), and drafts are accepted while they equal it. Accepting a drafted x exactly
  when the target's own sample is x has probability p(x), the rejection-sampling rate for a
  drafter with q(x) = 1, and the emitted token is the target's sample; so the output does not
  depend on the drafts at all: a seeded request gives the same text alone, in any batch, with
  any speculation method, as in plain decoding.
* random with drafter probabilities q and no user seed (a draft model): classic rejection
  sampling, accept x_j when ``u_j * q_j(x_j) < p_j(x_j)``, else sample ``max(p_j - q_j, 0)``;
  if all are accepted, the bonus token from p. It accepts more than the coupled rule
  (sum_x min(p, q) instead of the chance that two races agree). ``u_j`` are keyed by
  (seed, position, ACCEPT) and the recovered/bonus noise by (seed, first position, RESIDUAL).

p is the processed distribution: the prepared row (bans, bias, processors, penalties) through
``logits_processing.compute_target_probs`` (temperature, min-p, top-k, top-p). Logprobs (when
``params.logprobs`` is not None) are those of the raw distribution ``log_softmax(logits)`` of the
row that predicted each emitted token, as vLLM returns by default, with the token's rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.worker.keyed_random import (
    ACCEPT,
    RESIDUAL,
    TARGET,
    keyed_exponential,
    keyed_uniform,
    race_argmax,
)
from tokenbudget.engine.worker.logits_processing import compute_target_probs, prepare_logits
from tokenbudget.kernels.rejection_ref import PLACEHOLDER_TOKEN_ID
from tokenbudget.kernels.rejection_triton import rejection_sample  # Triton on CUDA, torch reference elsewhere

__all__ = ["SamplingRow", "SamplerOutput", "TokenLogprob", "Sampler"]


@dataclass(slots=True)
class SamplingRow:
    """One request of this step's batch that needs sampling.

    ``seed`` keys its random numbers; ``position``: absolute index (prompt + output) of the token
    its first row predicts (row j predicts ``position + j``). ``draft_token_ids``: its k drafts
    (possibly none). ``draft_probs``: ``[k, V]`` drafter probabilities q, or None for a drafter
    without probabilities.

    Row preparation context (``logits_processing``): ``num_output_tokens`` outputs are committed
    (``min_tokens`` bans ``banned_token_ids`` while short of it); ``prompt_token_ids`` and
    ``output_token_ids`` are the committed tokens, given when the request's parameters look at
    them (penalties, bad words, logits processors), else empty; ``bad_words_token_ids`` are the
    token sequences of ``params.bad_words``.
    """

    params: SamplingParams | None
    seed: int = 0
    position: int = 0
    draft_token_ids: list[int] | None = None
    draft_probs: torch.Tensor | None = None
    num_output_tokens: int = 0
    banned_token_ids: tuple[int, ...] = ()
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    request_id: str = ""  # names the request in a ``RequestFault`` from its row preparation

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids) if self.draft_token_ids else 0

    @property
    def is_greedy(self) -> bool:
        return self.params is None or self.params.is_greedy

    @property
    def uses_rejection(self) -> bool:
        """Classic rejection sampling (see the module docstring), else greedy or coupled."""
        return (not self.is_greedy and self.draft_probs is not None and self.num_drafts > 0
                and self.params.seed is None)


class TokenLogprob(NamedTuple):
    """Logprob of one token, its 1-based rank (tokens at least as likely, itself included) and the
    ``k`` most likely (id, logprob) pairs of the same row, most likely first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    """Per request: accepted drafts (a prefix of its drafts) followed by exactly one new token.

    ``logprobs`` is None when no request asked for logprobs; otherwise entry i is None for a
    request that did not ask, else one ``TokenLogprob`` per token of ``token_ids[i]``.
    """

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob] | None] | None = None


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
        vocab, dev = logits.shape[1], logits.device
        flat = [t for r in rows for t in (r.draft_token_ids or ())]
        if flat and (min(flat) < 0 or max(flat) >= vocab):  # checked on the host: no device sync
            raise ValueError(f"draft_token_ids must lie in [0, {vocab})")
        raw, logits = logits, prepare_logits(logits, rows)
        target = logits.argmax(dim=-1)
        rejection = [r.uses_rejection for r in rows]
        any_rejection = any(rejection)
        target_probs = draft_probs = noise = drafts = uniforms = None
        if any_rejection:
            drafts = torch.tensor(flat, dtype=torch.int64, device=dev)
            uniforms = torch.zeros(drafts.numel(), dtype=torch.float32, device=dev)
        starts = _row_starts(num_drafts)
        random_rows = [i for i, r in enumerate(rows) if not r.is_greedy]
        if random_rows:
            target_probs = _target_probs(logits, rows, num_drafts, starts, random_rows)
            coupled = [i for i in random_rows if not rejection[i]]
            if coupled:
                _race_targets(target, target_probs, rows, num_drafts, starts, coupled)
            if any_rejection:
                draft_probs = _flat_draft_probs(rows, drafts, vocab, dev)
                noise = torch.ones(len(rows), vocab, dtype=torch.float32, device=dev)
                _draw_rejection_randoms(rows, num_drafts, rejection, uniforms, noise)
        if any_rejection:
            is_greedy = torch.tensor([not x for x in rejection], dtype=torch.bool, device=dev)
            out = rejection_sample(target_probs, target, drafts,
                                   torch.tensor(num_drafts, dtype=torch.int64, device=dev),
                                   draft_probs, is_greedy, uniforms, noise, max_num_draft_tokens=max(num_drafts))
            token_ids = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()]
        else:
            token_ids = _accept_matching(target.tolist(), rows, starts)
        return SamplerOutput(token_ids=token_ids, logprobs=_logprobs(raw, rows, starts, token_ids))


def _accept_matching(target: list[int], rows: list[SamplingRow], starts: list[int]) -> list[list[int]]:
    """What ``rejection_sample`` returns when no request uses rejection (greedy or coupled rows,
    whose row targets are final): each request keeps its drafts up to the first that differs from
    its row's target, then emits that row's target. On the host: a plain decode step (no drafts)
    or an all-greedy verify then costs one ``tolist`` instead of the kernel's tensors (benches/
    RESULTS.md, "Figures behind decisions in the source")."""
    out = []
    for r, s in zip(rows, starts):
        drafts = r.draft_token_ids or ()
        n = 0
        while n < len(drafts) and drafts[n] == target[s + n]:
            n += 1
        out.append([*drafts[:n], target[s + n]])
    return out


def _row_starts(num_drafts: list[int]) -> list[int]:
    starts, s = [], 0
    for k in num_drafts:
        starts.append(s)
        s += k + 1
    return starts


def _target_probs(logits: torch.Tensor, rows: list[SamplingRow], num_drafts: list[int], starts: list[int],
                  random_rows: list[int]) -> torch.Tensor:
    """[T, V] processed probabilities; rows of greedy requests are left at zero."""
    row_idx: list[int] = []
    row_params: list[SamplingParams] = []
    for i in random_rows:
        row_idx.extend(range(starts[i], starts[i] + num_drafts[i] + 1))
        row_params.extend([rows[i].params] * (num_drafts[i] + 1))
    if len(row_idx) == logits.shape[0]:
        return compute_target_probs(logits, row_params)
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    idx = torch.tensor(row_idx, dtype=torch.int64, device=logits.device)
    probs[idx] = compute_target_probs(logits[idx], row_params)
    return probs


def _race_targets(target: torch.Tensor, probs: torch.Tensor, rows: list[SamplingRow], num_drafts: list[int],
                  starts: list[int], coupled: list[int]) -> None:
    """In place: the target token of every row of a coupled request, by the keyed race."""
    vocab, dev = probs.shape[1], probs.device
    idx: list[int] = []
    noise: list[torch.Tensor] = []
    for i in coupled:
        r = rows[i]
        for j in range(num_drafts[i] + 1):
            idx.append(starts[i] + j)
            noise.append(keyed_exponential(r.seed, r.position + j, vocab, dev, TARGET))
    at = torch.tensor(idx, dtype=torch.int64, device=dev)
    target[at] = race_argmax(probs[at], torch.stack(noise))


def _flat_draft_probs(rows: list[SamplingRow], drafts: torch.Tensor, vocab: int, dev: torch.device) -> torch.Tensor:
    """[D, V] drafter probabilities for the rejection test; other requests get one-hot rows
    (q(x) = 1), which they never read."""
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
            one_hot[torch.arange(k, device=dev), drafts[offset: offset + k]] = 1.0
            parts.append(one_hot)
        offset += k
    return torch.cat(parts, dim=0)


def _draw_rejection_randoms(rows: list[SamplingRow], num_drafts: list[int], rejection: list[bool],
                            uniforms: torch.Tensor, noise: torch.Tensor) -> None:
    """In place: keyed uniforms per draft and one keyed Exp(1) vector per rejection request."""
    vocab, dev = noise.shape[1], noise.device
    offset = 0
    for i, (r, k) in enumerate(zip(rows, num_drafts)):
        if rejection[i]:
            for j in range(k):
                uniforms[offset + j] = keyed_uniform(r.seed, r.position + j, dev, ACCEPT)
            noise[i] = keyed_exponential(r.seed, r.position, vocab, dev, RESIDUAL)
        offset += k


def _logprobs(logits: torch.Tensor, rows: list[SamplingRow], starts: list[int],
              token_ids: list[list[int]]) -> list[list[TokenLogprob] | None] | None:
    if all(r.params is None or r.params.logprobs is None for r in rows):
        return None
    result: list[list[TokenLogprob] | None] = []
    for r, start, toks in zip(rows, starts, token_ids):
        k = None if r.params is None else r.params.logprobs
        result.append(None if k is None else token_logprobs(logits[start: start + len(toks)], toks, k))
    return result


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Per row of raw ``logits`` ([N, V]): the logprob and rank of ``token_ids[i]`` and the top
    ``k`` (``-1``: the whole vocabulary) of the row's log_softmax."""
    lp = logits.to(torch.float32).log_softmax(dim=-1)
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])
    ranks = (lp >= chosen).sum(dim=-1).tolist()
    k = lp.shape[1] if k == -1 else min(k, lp.shape[1])
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return [TokenLogprob(c, rank, list(zip(ti, tv)))
            for c, rank, ti, tv in zip(chosen[:, 0].tolist(), ranks, top_i.tolist(), top_v.tolist())]
