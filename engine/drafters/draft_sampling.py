"""How a model drafter turns its logits into drafts (and q): one rule for every model drafter.

Each drafter row is first prepared like the target's (``logits_processing.prepare_logits``: bans,
bias, logits processors, penalties, with the request's committed output plus the drafts so far as
its context), so a drafter proposes what the request may produce. Greedy requests
(``params.is_greedy``) take the drafter's argmax (ties: lowest id) and get no probabilities
(greedy verification never reads q). Random requests draw from q = softmax of the prepared drafter
logits processed with the request's own temperature / min-p / top-k / top-p
(``logits_processing.compute_target_probs``, the same processing p gets) by the exponential race
with keyed noise (``engine.worker.keyed_random``):

* a request with a user seed uses the target's own noise for that position (stream TARGET), and
  no probabilities are handed over: the sampler verifies it with the coupled rule (accept while
  the draft equals the target's keyed sample), so its output is exactly plain decoding's;
* other random requests use the drafter's stream (DRAFT) and hand q ([k, V] float32) to the
  rejection sampler, which accepts more often; the output distribution is the target's.
"""

from __future__ import annotations

import torch

from tokenbudget.engine.worker.keyed_random import DRAFT, TARGET, keyed_exponential, race_argmax
from tokenbudget.engine.worker.logits_processing import compute_target_probs, prepare_logits
from tokenbudget.engine.worker.sampler import SamplingRow
from tokenbudget.scheduler.request import Request


def wants_probs(request: Request) -> bool:
    """q is handed to the rejection sampler for random requests without a user seed only."""
    return is_random(request) and request.sampling_params.seed is None


def sample_drafts(logits: torch.Tensor, requests, rows: list[int], drafts: list[list[int]],
                  probs: list[list[torch.Tensor] | None]) -> None:
    """Append one draft per row (``logits[r]`` belongs to request ``rows[r]``); ``probs[i]``, a
    list for the requests that hand q over, gets that draft's q row."""
    logits = prepare_logits(logits, [draft_row(requests[i], drafts[i]) for i in rows])
    greedy = [r for r, i in enumerate(rows) if not is_random(requests[i])]
    if greedy:
        idx = torch.tensor(greedy, dtype=torch.long, device=logits.device)
        for r, t in zip(greedy, logits[idx].argmax(dim=-1).tolist()):
            drafts[rows[r]].append(t)
    rand = [r for r, i in enumerate(rows) if is_random(requests[i])]
    if not rand:
        return
    idx = torch.tensor(rand, dtype=torch.long, device=logits.device)
    q = compute_target_probs(logits[idx], [requests[rows[r]].sampling_params for r in rand])
    noise = []
    for r in rand:
        req = requests[rows[r]]
        position = req.num_tokens + len(drafts[rows[r]])  # the index the draft will take
        stream = TARGET if req.sampling_params.seed is not None else DRAFT
        noise.append(keyed_exponential(req.seed, position, q.shape[1], q.device, stream))
    for qi, (r, tok) in enumerate(zip(rand, race_argmax(q, torch.stack(noise)).tolist())):
        i = rows[r]
        drafts[i].append(tok)
        if probs[i] is not None:
            probs[i].append(q[qi])


def draft_row(request: Request, drafts: list[int]) -> SamplingRow:
    """The row preparation context of the request's next draft (after ``drafts``)."""
    params = request.sampling_params
    banned = request.min_tokens_banned
    if params is None or not (params.needs_row_preparation or banned):
        return SamplingRow(params)
    uses_prompt = params.repetition_penalty != 1.0 or params.logits_processors
    return SamplingRow(params, num_output_tokens=request.num_output_tokens + len(drafts), banned_token_ids=banned,
                       prompt_token_ids=request.prompt_token_ids if uses_prompt else (),
                       output_token_ids=request.output_token_ids + drafts,
                       bad_words_token_ids=request.bad_words_token_ids)


def is_random(request: Request) -> bool:
    params = request.sampling_params
    return params is not None and not params.is_greedy
