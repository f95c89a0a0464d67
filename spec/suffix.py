"""Suffix decoding (Oliaro et al., arXiv 2411.04975), pure Python.

Two sources of continuations, as in the paper and Arctic Inference:

* local: the request's own tokens (prompt + output so far);
* global: the outputs of earlier finished requests (each kept with the last
  ``max_tree_depth`` tokens of its prompt, so a repeated prompt can draft its first output
  tokens), at most ``max_cached_requests`` of them, evicted least recently used (a cached
  request is "used" when it supplies a draft).

Drafting, per source: match the longest suffix of the context (up to ``max_tree_depth``
tokens) against earlier text; for each match length m found, the occurrences matching at least
m tokens form a suffix-tree node, and the draft greedily walks its most frequent child,
multiplying the empirical probabilities (child count / node count) and stopping when the
product falls below ``min_token_prob`` or the draft reaches
``min(k, max_spec_factor * m + max_spec_offset)``. The draft with the highest score
(sum of the path probabilities) over all m and both sources wins. Proposal lengths therefore
vary with how often and how consistently a continuation was seen.

Why no suffix tree: a depth-bounded trie in Python costs one node object per (token, depth),
~24 nodes × ~300 B per token at depth 24 (megabytes per prompt, gigabytes for a global cache of
a thousand outputs). We keep the equivalent information lazily: token lists plus a bigram
index ``{(a, b): positions following a b}``, O(1) entries per token, and rebuild the node (the
occurrence set) at query time from the ``max_candidates`` most recent occurrences of the
context's last bigram. Consequences: matches shorter than 2 tokens are not used (with the
default factor 1.0 they could draft one token at most), and a very frequent bigram is judged
by its most recent ``max_candidates`` occurrences only.

Cost: Python loops over candidates, most on highly repetitive text (64 candidates all matching
24 tokens, 24-token drafts), still well below a forward pass (figures:
benches/RESULTS.md, "Figures behind decisions in the source").

Arctic Inference 0.3.0 (PyPI) was considered as a fast path and rejected: it is published as an
sdist only; building it needs a C++ toolchain, cmake, nanobind and ``torch>=2.10`` in the build
environment, and the package is a vLLM plugin. ``arctic_inference.suffix_decoding`` (a nanobind
extension plus a thin Python wrapper) is the only part that would apply here.

State: each request's local index is a record of ``local`` (a ``RequestTable``; like the n-gram
index, a cache of the committed tokens that ``sync`` keeps up to date in place). The global cache
changes only outside a step: a finished request's output joins it (``on_finished``), and the
cached sequences that supplied a step's drafts (the proposal's ``receipt``) become most recent
when that step commits (``on_commit``); a failed step's drafts touch nothing.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenbudget.request_table import RequestTable
from tokenbudget.scheduler.drafts import draft_limit
from tokenbudget.scheduler.request import Request
from tokenbudget.spec.proposer import BaseProposer, CommittedStep, Proposal

Bigram = tuple[int, int]


@dataclass(slots=True)
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: int | None = None  # None: the request itself; else the cached sequence id


class _LocalIndex:
    """Bigram index over one request's growing token list (positions with a continuation)."""

    __slots__ = ("tokens", "num_indexed", "index")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.num_indexed = 0
        self.index: dict[Bigram, list[int]] = {}

    def sync(self, tokens: list[int]) -> None:
        n_old = self.num_indexed
        if len(tokens) < n_old or (tokens is not self.tokens and tokens[:n_old] != self.tokens[:n_old]):
            self.index.clear()
            n_old = 0
        self.tokens = tokens
        index = self.index
        for p in range(max(n_old, 2), len(tokens)):
            key = (tokens[p - 2], tokens[p - 1])
            lst = index.get(key)
            if lst is None:
                index[key] = [p]
            else:
                lst.append(p)
        self.num_indexed = len(tokens)


def _match_len(seq: Sequence[int], p: int, ctx: Sequence[int], cap: int) -> int:
    """Length of the common suffix of seq[:p] and ctx (at most cap)."""
    m, n_ctx = 0, len(ctx)
    while m < cap and m < p and m < n_ctx and seq[p - 1 - m] == ctx[n_ctx - 1 - m]:
        m += 1
    return m


def _walk(cands: list[tuple[Sequence[int], int]], max_len: int, min_prob: float
          ) -> tuple[list[int], list[float], float]:
    """Greedy most-frequent-child walk from the node whose occurrences are ``cands``."""
    draft: list[int] = []
    probs: list[float] = []
    prob, score, active = 1.0, 0.0, cands
    for depth in range(max_len):
        counts = Counter(s[p + depth] for s, p in active if p + depth < len(s))
        if not counts:
            break
        tok, c = counts.most_common(1)[0]  # ties: the most recent occurrence's token
        prob *= c / len(active)
        if prob < min_prob:
            break
        draft.append(tok)
        probs.append(prob)
        score += prob
        active = [(s, p) for s, p in active if p + depth < len(s) and s[p + depth] == tok]
    return draft, probs, score


def match_kind(match_len: int) -> int:
    """The label of a draft after a match of ``match_len`` tokens: 2, 3, 4 (4-7) or 8 (8 or more);
    0 for no match. Coarse above 4, so each class gets evidence."""
    return match_len if match_len < 4 else (4 if match_len < 8 else 8)


class SuffixProposer(BaseProposer):
    """Suffix-decoding drafts; ``propose`` clips each request to ``draft_limit``."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, max_model_len: int = 2048,
                 max_candidates: int = 64) -> None:
        if max_tree_depth < 2 or max_candidates < 1 or max_cached_requests < -1:
            raise ValueError("need max_tree_depth >= 2, max_candidates >= 1, "
                             "max_cached_requests >= -1")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.max_model_len = max_model_len
        self.max_candidates = max_candidates
        self.local: RequestTable[_LocalIndex] = RequestTable("suffix indexes")
        self.tables = (self.local,)
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # LRU: oldest first
        self._global: dict[Bigram, list[tuple[int, int]]] = {}
        self._num_global_entries = 0  # entries in _global, dead ones included
        self._num_live_entries = 0
        self._next_seq_id = 0

    @classmethod
    def from_config(cls, spec_config, max_model_len: int) -> SuffixProposer:
        c = spec_config
        return cls(c.suffix_max_tree_depth, c.suffix_max_cached_requests, c.suffix_max_spec_factor,
                   c.suffix_max_spec_offset, c.suffix_min_token_prob, max_model_len)

    # ---- Proposer interface ----
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> Proposal:
        """Drafts labelled with their match length, in classes (``match_kind``; ``spec.proposer``)."""
        if len(requests) != len(num_tokens):
            raise ValueError(f"num_tokens has {len(num_tokens)} entries for {len(requests)} requests")
        out, kinds, used = [], [], []
        for req, k in zip(requests, num_tokens):
            k = draft_limit(req, self.max_model_len, k)
            local = self.local.get(req.request_id)
            if local is None:
                local = _LocalIndex()
                self.local.set(req.request_id, local)
            local.sync(req.all_token_ids)
            d = self.speculate(local, k) if k > 0 else SuffixDraft()
            out.append(d.token_ids)
            kinds.append(match_kind(d.match_len))
            if d.source is not None:
                used.append(d.source)
        return Proposal(out, kinds=kinds, receipt=used or None)

    def on_commit(self, step: CommittedStep) -> None:
        """The step committed: the cached sequences that supplied its drafts become most recent."""
        for used in step.receipts:
            for seq_id in used:
                if seq_id in self._cached:
                    self._cached.move_to_end(seq_id)

    def on_finished(self, request: Request) -> None:
        if self.max_cached_requests != 0 and request.num_output_tokens > 0:
            tail = request.prompt_token_ids[-self.max_tree_depth:]
            self.add_cached_sequence(tail + request.output_token_ids)

    # ---- global cache ----
    def add_cached_sequence(self, tokens: Sequence[int]) -> int:
        """Add a finished sequence to the global cache (evicting LRU ones); returns its id."""
        seq_id, self._next_seq_id = self._next_seq_id, self._next_seq_id + 1
        seq = list(tokens)
        self._cached[seq_id] = seq
        for p in range(2, len(seq)):
            self._global.setdefault((seq[p - 2], seq[p - 1]), []).append((seq_id, p))
        n = max(0, len(seq) - 2)
        self._num_global_entries += n
        self._num_live_entries += n
        while 0 <= self.max_cached_requests < len(self._cached):
            _, old = self._cached.popitem(last=False)
            self._num_live_entries -= max(0, len(old) - 2)
        if self._num_global_entries > 2 * self._num_live_entries + 1024:
            self._compact()
        return seq_id

    def _compact(self) -> None:
        """Drop index entries of evicted sequences (keeps memory O(live tokens))."""
        cached, new = self._cached, {}
        for key, lst in self._global.items():
            live = [e for e in lst if e[0] in cached]
            if live:
                new[key] = live
        self._global = new
        self._num_global_entries = self._num_live_entries = sum(map(len, new.values()))

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    @property
    def num_index_entries(self) -> int:
        """Global index entries held (live + not yet compacted); bounded by ~2x live tokens."""
        return self._num_global_entries

    # ---- drafting ----
    def speculate(self, local: _LocalIndex, k: int) -> SuffixDraft:
        ctx = local.tokens  # synced: len(ctx) == local.num_indexed
        best = SuffixDraft()
        if k <= 0 or len(ctx) < 2:
            return best
        key = (ctx[-2], ctx[-1])
        positions = local.index.get(key, [])[-self.max_candidates:]
        best = self._best_draft([(ctx, p) for p in reversed(positions)], ctx, k, None)
        entries = self._global.get(key)
        if entries:
            cands, ids = [], []
            for seq_id, p in reversed(entries):
                seq = self._cached.get(seq_id)
                if seq is not None:
                    cands.append((seq, p))
                    ids.append(seq_id)
                    if len(cands) == self.max_candidates:
                        break
            g = self._best_draft(cands, ctx, k, ids)
            if g.score > best.score:
                best = g
        return best

    def _best_draft(self, cands: list[tuple[Sequence[int], int]], ctx: list[int], k: int,
                    ids: list[int] | None) -> SuffixDraft:
        if not cands:
            return SuffixDraft()
        cap = self.max_tree_depth
        lens = [_match_len(s, p, ctx, cap) for s, p in cands]
        order = sorted(range(len(cands)), key=lambda i: -lens[i])  # stable: recent first
        best = SuffixDraft()
        for pos, i in enumerate(order):
            m = lens[i]
            if pos + 1 < len(order) and lens[order[pos + 1]] == m:
                continue  # evaluate each node (distinct match length) once, with all its members
            max_len = min(k, int(self.max_spec_factor * m + self.max_spec_offset))
            if max_len <= 0 or best.score >= max_len:
                break  # max_len only shrinks with m, and a score is at most max_len
            node = [cands[j] for j in order[:pos + 1]]
            draft, probs, score = _walk(node, max_len, self.min_token_prob)
            if score > best.score:
                src = None if ids is None else ids[order[0]]
                best = SuffixDraft(draft, probs, score, m, src)
        return best
