"""Stages 1-2: prompts (self-written + templates + package text) and the target's own responses.

Both go through the engine (``LLM.generate`` with every prompt at once: continuous batching makes
that far faster than one by one). Responses are greedy, so each response token is the target's
argmax at its position: the label the head learns and the token acceptance is measured against.
"""

from __future__ import annotations

import random

import msgspec

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.training.prompts import clean_written, meta_prompts, template_prompts


class Conversation(msgspec.Struct, frozen=True):
    """One training or held-out example: prompt ids (chat template applied) and response ids."""

    kind: str
    prompt_ids: list[int]
    response_ids: list[int]


class PromptSet(msgspec.Struct, frozen=True):
    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]


def make_prompts(llm, n_train: int, n_heldout: int, seed: int, self_written: float = 0.5,
                 use_tqdm: bool = True) -> PromptSet:
    """``n_train + n_heldout`` distinct (kind, prompt) pairs, about ``self_written`` of them
    written by the target (temperature 0.9), the rest from templates; split at random."""
    rng = random.Random(seed)
    total = n_train + n_heldout
    asks = meta_prompts(int(total * self_written * 1.3) + 1, rng)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=96, seed=seed)
    outs = llm.generate([llm.tokenizer.apply_chat_template([{"role": "user", "content": a}]) for _, a in asks],
                        params, use_tqdm=use_tqdm)
    written = [(kind, clean_written(kind, o.outputs[0].text, rng)) for (kind, _), o in zip(asks, outs)]
    pairs = [(k, p) for k, p in written if p][:int(total * self_written)]
    pairs += template_prompts(total, rng)
    seen, unique = set(), []
    for kind, p in pairs:
        if p not in seen:
            seen.add(p)
            unique.append((kind, p))
    unique = unique[:total] if len(unique) >= total else unique
    rng.shuffle(unique)
    return PromptSet(train=unique[n_heldout:], heldout=unique[:n_heldout])


def make_responses(llm, prompts: list[tuple[str, str]], max_tokens: int, use_tqdm: bool = True) -> list[Conversation]:
    """The target's greedy chat response to each prompt (one ``generate`` call for all). A prompt
    that leaves no room for a response within the engine's ``max_model_len`` is left out (a small
    model's context, or a byte-level tokenizer's long rendering of a package paragraph)."""
    texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for _, p in prompts]
    fits = [len(llm.tokenizer.encode(t)) < llm.engine.max_model_len for t in texts]
    prompts = [p for p, ok in zip(prompts, fits) if ok]
    outs = llm.generate([t for t, ok in zip(texts, fits) if ok], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=use_tqdm)
    return [Conversation(kind, list(o.prompt_token_ids), list(o.outputs[0].token_ids))
            for (kind, _), o in zip(prompts, outs) if o.outputs and o.outputs[0].token_ids]
