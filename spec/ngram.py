"""N-gram (prompt lookup) proposer.

For each request, with ``S = all_token_ids`` (prompt + output) and ``L = len(S)``: for n from
``max_n`` down to ``min_n``, take the suffix n-gram ``S[L-n:L]``; if it occurred earlier (ending
at some ``j < L``, i.e. ``S[j-n:j] == S[L-n:L]``), propose the k tokens that followed it,
``S[j:j+k]``. The longest matching n wins.

Overlapping matches are copied LZ77-style: when ``j + k > L`` the continuation runs into the
tokens being proposed, so draft i is ``S[j+i]`` if ``j+i < L`` else draft ``i - (L-j)``. This
predicts that a repeating run keeps repeating with period ``L - j`` (without it, a match inside
a run of repeats could propose only ``L - j`` tokens). Stated as a property:
``P == (S + P)[j : j + len(P)]``.

Which occurrence: the most recent (largest j), by default. vLLM (KMP-like scan) and
TensorRT-LLM (``is_use_oldest=True``) take the earliest. We prefer the most recent because
(a) generation tends to continue the latest copy of a passage: in code editing the newest
version of a function is the one being rewritten, in multi-turn chat the last answer is the one
being revised, and in loops the latest iteration carries the current variable values; (b) it is
what an overwrite-on-insert hash index gives for free. A proxy measurement on Spec-Bench found
no difference overall (benches/RESULTS.md, "n-gram index"); the proxy has no model outputs, so it
cannot show the edit-style workloads that motivate recency. So recency is the default and
``prefer="earliest"`` stays available.

Implementation: an incremental per-request hash index ``{n-gram tuple: end position j}`` for
every n in [min_n, max_n], holding n-grams whose continuation exists (``j <= L-1``). Each step
only the new tokens are indexed (O(new tokens × (max_n-min_n+1)) dict writes) and the lookup is
(max_n-min_n+1) dict probes plus a k-token slice: O(1) in L. A batched numpy sliding-window
compare over a padded [B, L] array (``ngram_propose_reference``'s approach) is O(B·L·n) per
step, which at L = 2000 costs far more than the hash probes even vectorised (figures:
benches/RESULTS.md, "n-gram index"). Memory: ~(max_n-min_n+1)·L dict entries per running
request, freed when it finishes.

The indexes are the records of ``NgramProposer.indexes`` (a ``RequestTable``), and the one kind
of record that changes in place: an index is a cache of its request's committed tokens, which
``sync`` brings up to date from whatever it holds (rebuilding it if the tokens diverged), so a
rolled-back step leaves it in step with the same committed tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import numpy as np

from tokenbudget.request_table import RequestTable
from tokenbudget.scheduler.drafts import draft_limit
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.proposer import BaseProposer, Proposal

Prefer = Literal["recent", "earliest"]


def _copy_continuation(tokens: Sequence[int], j: int, k: int) -> list[int]:
    """``(S + P)[j : j + k]`` where P is the result itself (overlapping copy)."""
    L = len(tokens)
    out = list(tokens[j:min(L, j + k)])
    period = L - j
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


class NgramIndex:
    """Incremental n-gram index over one growing token sequence.

    Safe to ``lookup`` after ``sync(tokens)`` with the current sequence. ``sync`` accepts any
    extension of the previously synced sequence; anything else (a shorter or different
    sequence) triggers a rebuild.
    """

    __slots__ = ("min_n", "max_n", "prefer", "table", "tokens", "num_indexed", "_last")

    def __init__(self, min_n: int, max_n: int, prefer: Prefer = "recent") -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if prefer not in ("recent", "earliest"):
            raise ValueError(f"prefer must be 'recent' or 'earliest', got {prefer!r}")
        self.min_n, self.max_n, self.prefer = min_n, max_n, prefer
        self.table: dict[tuple[int, ...], int] = {}
        self.tokens: list[int] = []
        self.num_indexed = 0  # the sequence length at the last sync
        self._last: int | None = None

    def sync(self, tokens: list[int]) -> None:
        """Index the tokens appended since the last sync (rebuild if ``tokens`` diverged)."""
        n_old = self.num_indexed
        if len(tokens) < n_old or (n_old and tokens[n_old - 1] != self._last) \
                or (tokens is not self.tokens and tokens[:n_old] != self.tokens[:n_old]):
            self.table.clear()
            n_old = 0
        self.tokens = tokens
        table, L = self.table, len(tokens)
        if L - n_old <= 16:  # steady state: a few new tokens, plain loop is cheapest
            recent, lo, hi = self.prefer == "recent", self.min_n, self.max_n
            for j in range(max(n_old, lo), L):
                for n in range(lo, min(hi, j) + 1):
                    key = tuple(tokens[j - n:j])
                    if recent:
                        table[key] = j
                    elif key not in table:
                        table[key] = j
            self.num_indexed, self._last = L, (tokens[-1] if tokens else None)
            return
        # n-grams ending at j (exclusive) that have a continuation: j in [n, L-1]; built with
        # zip over shifted slices (C speed) rather than one tuple(slice) per position.
        for n in range(self.min_n, self.max_n + 1):
            start = max(n_old, n)
            if start >= L:
                continue
            seg = tokens[start - n:L - 1]
            keys = zip(*(seg[i:len(seg) - n + 1 + i] for i in range(n)))
            if self.prefer == "recent":
                table.update(zip(keys, range(start, L)))
            else:
                for key, j in zip(keys, range(start, L)):
                    table.setdefault(key, j)
        self.num_indexed = len(tokens)
        self._last = tokens[-1] if tokens else None

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens following the longest earlier occurrence of the current suffix."""
        return self.match(k)[0]

    def match(self, k: int) -> tuple[list[int], int]:
        """``lookup``'s draft and the length n of the suffix it matched (0: no match)."""
        tokens, L = self.tokens, self.num_indexed
        if k <= 0 or L < 2:
            return [], 0
        table = self.table
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            j = table.get(tuple(tokens[L - n:L]))
            if j is not None:
                return _copy_continuation(tokens, j, k), n
        return [], 0


class NgramProposer(BaseProposer):
    """Prompt-lookup drafts for a batch of decoding requests.

    ``propose`` clips every request to ``draft_limit`` (model length, remaining max_tokens,
    ``Request.max_spec_tokens``), so a draft never reaches past ``max_model_len``.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4, max_model_len: int = 2048,
                 prefer: Prefer = "recent") -> None:
        NgramIndex(min_n, max_n, prefer)  # validates the arguments
        self.min_n, self.max_n, self.prefer = min_n, max_n, prefer
        self.max_model_len = max_model_len
        self.indexes: RequestTable[NgramIndex] = RequestTable("ngram indexes")
        self.tables = (self.indexes,)

    @classmethod
    def from_config(cls, spec_config, max_model_len: int) -> NgramProposer:
        return cls(spec_config.prompt_lookup_min, spec_config.prompt_lookup_max, max_model_len)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        """Drafts labelled with the length n of the suffix they matched (0: none; ``spec.proposer``)."""
        if len(requests) != len(num_tokens):
            raise ValueError(f"num_tokens has {len(num_tokens)} entries for {len(requests)} requests")
        out: list[list[int]] = []
        kinds: list[Hashable] = []
        for req, k in zip(requests, num_tokens):
            k = draft_limit(req, self.max_model_len, k)
            index = self.indexes.get(req.request_id)
            if index is None:
                index = NgramIndex(self.min_n, self.max_n, self.prefer)
                self.indexes.set(req.request_id, index)
            index.sync(req.all_token_ids)
            draft, n = index.match(k)
            out.append(draft)
            kinds.append(n)
        return Proposal(out, kinds=kinds)

    @property
    def num_tracked_requests(self) -> int:
        return len(self.indexes)


def ngram_propose_reference(tokens: Sequence[int], k: int, min_n: int, max_n: int,
                            prefer: Prefer = "recent") -> list[int]:
    """Brute-force numpy reference of ``NgramIndex.lookup`` (sliding-window compare)."""
    s = np.asarray(tokens, dtype=np.int64)
    L = len(s)
    if k <= 0 or L < 2:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # windows[i] = s[i:i+n] for i in [0, L-n-1]: n-grams ending at j = i + n <= L - 1.
        windows = np.lib.stride_tricks.sliding_window_view(s[:L - 1], n)
        hits = np.flatnonzero((windows == s[L - n:]).all(axis=1))
        if hits.size:
            j = int(hits[-1] if prefer == "recent" else hits[0]) + n
            return _copy_continuation(list(tokens), j, k)
    return []
