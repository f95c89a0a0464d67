"""Stage 3: the target's tap states for every token of every conversation, in shards.

One teacher-forced forward per batch of conversations (``TapForward``: Contract 2's states, the
input of each tap layer), stored float16 (the residual stream of SmolLM2 reaches ~2.4e4, inside
float16's range). A shard is written whole and atomically, so an interrupted run resumes at the
first missing shard.
"""

from __future__ import annotations

import os

import torch

from tokenbudget.training.data import Conversation
from tokenbudget.training.target_forward import TapForward


class FeatureSet:
    """Conversations flattened: ``tokens [N]`` int64, ``aux [N, 3H_t]`` float16, ``offsets
    [n + 1]``, ``prompt_lens [n]``, ``kinds``."""

    def __init__(self, tokens, aux, offsets, prompt_lens, kinds):
        self.tokens, self.aux, self.offsets, self.prompt_lens, self.kinds = tokens, aux, offsets, prompt_lens, kinds

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        torch.save({"tokens": self.tokens, "aux": self.aux, "offsets": self.offsets,
                    "prompt_lens": self.prompt_lens, "kinds": self.kinds}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> FeatureSet:
        d = torch.load(path, weights_only=True)
        return cls(d["tokens"], d["aux"], d["offsets"], d["prompt_lens"], d["kinds"])

    @classmethod
    def concat(cls, parts: list[FeatureSet]) -> FeatureSet:
        offsets, base = [torch.zeros(1, dtype=torch.int64)], 0
        for p in parts:
            offsets.append(p.offsets[1:] + base)
            base += int(p.offsets[-1])
        return cls(torch.cat([p.tokens for p in parts]), torch.cat([p.aux for p in parts]), torch.cat(offsets),
                   torch.cat([p.prompt_lens for p in parts]), [k for p in parts for k in p.kinds])


def clip(conv: Conversation, max_len: int) -> list[int]:
    return (conv.prompt_ids + conv.response_ids)[:max_len]


def extract(forward: TapForward, convs: list[Conversation], max_len: int, batch_tokens: int = 4096) -> FeatureSet:
    """Tap states for ``convs`` (each clipped to ``max_len`` tokens), batched by length."""
    seqs = [clip(c, max_len) for c in convs]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    aux: list[torch.Tensor | None] = [None] * len(seqs)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(seqs[order[end]]) <= batch_tokens:
            end += 1
        group = order[start:end]
        t = len(seqs[group[-1]])
        ids = torch.zeros(len(group), t, dtype=torch.int64)
        for r, i in enumerate(group):
            ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
        states, _ = forward(ids, final=False)
        for r, i in enumerate(group):
            aux[i] = states[r, :len(seqs[i])].to(torch.float16)
        start = end
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    return FeatureSet(torch.tensor([x for s in seqs for x in s], dtype=torch.int64), torch.cat(aux),
                      torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                      torch.tensor([min(len(c.prompt_ids), max_len) for c in convs], dtype=torch.int64),
                      [c.kind for c in convs])
