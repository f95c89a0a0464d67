"""Speculative-decoding configuration: frozen, validated at construction.

Keys follow vLLM's ``speculative_config`` so a vLLM user's dict works unchanged where the
method exists here:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    {"method": "suffix", "num_speculative_tokens": 16}
    {"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 3}
    {"method": "self_draft", "draft_num_layers": 6, "num_speculative_tokens": "auto"}
    {"method": "eagle3", "model": "/path/to/eagle3-head", "num_speculative_tokens": "auto"}
    {"method": "eagle3", "enable_suffix_decoding": True}   # + suffix drafts where text repeats

Decisions (where vLLM is silent or arbitrary):

* ``num_speculative_tokens`` is the most drafts one request may verify per step. ``"auto"``, the
  default for every method (None means the same), hands the per-step choice to the
  speculation-length controller (``spec.adaptive``), whose bound ``max_spec_tokens`` is then
  ``suffix_max_tree_depth`` for ``suffix`` (vLLM's default k there) and ``AUTO_MAX_SPEC_TOKENS``
  for the others. An integer fixes k; ``adaptive=True`` with an integer makes it the
  controller's bound. vLLM requires an integer for the non-suffix methods; here a fixed k loses
  to plain decoding wherever drafts are poor or the batch is large (benches/RESULTS.md,
  "Adaptive draft length"), which the controller does not, so it is what a user gets unasked.
* ``prompt_lookup_min`` / ``prompt_lookup_max``: vLLM defaults both to 5 ("arbitrarily
  chosen", says its source) and, when only one is given, copies it into the other. We keep the
  copy rule in ``from_dict`` (so a vLLM dict means the same thing here) but default to 2..4 when
  neither is given: a 2-gram already identifies a position in most text, longer n-grams rarely
  match in fresh output, and transformers' prompt lookup (max n = 2) shows short n-grams work.
  A 1-gram match proposes too often on common tokens and wastes verify compute.
* Suffix options carry a ``suffix_`` prefix; vLLM's ``suffix_decoding_`` spellings are accepted
  by ``from_dict`` as aliases.
* ``enable_suffix_decoding`` (Arctic Inference's key for the same idea): with ``eagle3``, a
  request whose suffix-decoding draft is long (the text repeats: code edits, summaries) verifies
  that draft instead of the head's; under ``"auto"`` the controller's bound is then the suffix
  tree depth, as for ``suffix``.
* Derived values are properties (``max_spec_tokens``, ``is_adaptive``); nothing is written back.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Method = Literal["ngram", "suffix", "draft_model", "self_draft", "eagle3"]
METHODS: tuple[str, ...] = ("ngram", "suffix", "draft_model", "self_draft", "eagle3")
# Upper bound of the adaptive controller for non-suffix methods under "auto".
AUTO_MAX_SPEC_TOKENS = 8

_METHOD_ALIASES = {"[ngram]": "ngram", "prompt_lookup": "ngram", "suffix_decoding": "suffix",
                   "draft": "draft_model", "self_speculative": "self_draft",
                   "eagle-3": "eagle3", "eagle_3": "eagle3"}
_KEY_ALIASES = {
    "suffix_decoding_max_tree_depth": "suffix_max_tree_depth",
    "suffix_decoding_max_cached_requests": "suffix_max_cached_requests",
    "suffix_decoding_max_spec_factor": "suffix_max_spec_factor",
    "suffix_decoding_min_token_prob": "suffix_min_token_prob",
}


class SpecConfigError(ValueError):
    """A bad speculative-config value; ``key`` names the offending field."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key} {detail}")
        self.key = key
        self.detail = detail


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to speculate. Safe to read anywhere once constructed (validated, immutable).

    method: "ngram" (prompt lookup), "suffix" (suffix decoding), "draft_model" (a separate small
        model at ``model``), "self_draft" (the first ``draft_num_layers`` layers of the target),
        "eagle3" (an EAGLE-3 draft head at ``model`` reading the target's hidden states; ``model``
        omitted = the head shipped for the default model).
    num_speculative_tokens: drafts per request per step (>= 1), or "auto" (the default; None means
        the same): the controller chooses per step and request.
    adaptive: alias for num_speculative_tokens="auto"; with an int, that int is the upper bound.
    prompt_lookup_min / prompt_lookup_max: n-gram sizes tried by "ngram", longest first.
    model: draft model path ("draft_model"), EAGLE-3 head directory ("eagle3", optional).
    draft_num_layers: target layers used as the drafter ("self_draft").
    suffix_max_tree_depth: longest context suffix / continuation kept in suffix trees.
    suffix_max_cached_requests: finished requests kept in the global suffix cache (LRU);
        0 disables the global cache, -1 means unbounded.
    suffix_max_spec_factor / suffix_max_spec_offset: a suffix draft is at most
        ``factor * match_length + offset`` tokens (longer matches earn longer drafts).
    suffix_min_token_prob: stop the greedy walk when the continuation's empirical probability
        (child count / parent count, multiplied along the path) drops below this.
    enable_suffix_decoding: "eagle3" only: also draft by suffix decoding (the ``suffix_*`` keys),
        taking the suffix draft where it is long.
    """

    method: Method = "ngram"
    num_speculative_tokens: int | Literal["auto"] | None = "auto"
    adaptive: bool = False
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_num_layers: int | None = None
    suffix_max_tree_depth: int = 24
    suffix_max_cached_requests: int = 1000
    suffix_max_spec_factor: float = 1.0
    suffix_max_spec_offset: float = 0.0
    suffix_min_token_prob: float = 0.1
    enable_suffix_decoding: bool = False

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived, never stored ----
    @property
    def is_adaptive(self) -> bool:
        return self.adaptive or not _is_int(self.num_speculative_tokens)

    @property
    def max_spec_tokens(self) -> int:
        """Most drafts one request may get in one step (the controller's upper bound if adaptive)."""
        k = self.num_speculative_tokens
        if _is_int(k):
            return k
        if self.method == "suffix" or self.enable_suffix_decoding:
            return self.suffix_max_tree_depth
        return AUTO_MAX_SPEC_TOKENS

    @property
    def uses_draft_kv(self) -> bool:
        """True for drafters that run a model and write KV ahead (need lookahead slots)."""
        return self.method in ("draft_model", "self_draft")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """Build from a vLLM-style dict; a bad key or value raises ValueError naming the key
        as ``speculative_config['<key>'] ...``."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        fields = set(cls.__struct_fields__)
        kwargs: dict[str, Any] = {}
        origin: dict[str, str] = {}  # field -> the key the user wrote (errors name it)
        for key, value in d.items():
            name = _KEY_ALIASES.get(key, key)
            if name not in fields:
                raise ValueError(f"speculative_config[{key!r}] is not a known key; "
                                 f"known keys: {sorted(fields)}")
            if name in kwargs:
                raise ValueError(f"speculative_config[{key!r}] is given twice (alias of {name!r})")
            kwargs[name] = value
            origin[name] = key
        method = kwargs.get("method", "ngram")
        if isinstance(method, str):
            kwargs["method"] = _METHOD_ALIASES.get(method, method)
        # vLLM rule: one lookup bound given -> the other equals it.
        if "prompt_lookup_min" in kwargs and "prompt_lookup_max" not in kwargs:
            kwargs["prompt_lookup_max"] = kwargs["prompt_lookup_min"]
            origin["prompt_lookup_max"] = "prompt_lookup_min"
        elif "prompt_lookup_max" in kwargs and "prompt_lookup_min" not in kwargs:
            kwargs["prompt_lookup_min"] = kwargs["prompt_lookup_max"]
            origin["prompt_lookup_min"] = "prompt_lookup_max"
        try:
            return cls(**kwargs)
        except SpecConfigError as e:
            key = origin.get(e.key, e.key)
            raise ValueError(f"speculative_config[{key!r}] {e.detail}") from None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _validate(c: SpeculativeConfig) -> None:
    if c.method not in METHODS:
        raise SpecConfigError("method", f"must be one of {list(METHODS)}, got {c.method!r}")
    k = c.num_speculative_tokens
    if not (k is None or k == "auto" or (_is_int(k) and k >= 1)):
        raise SpecConfigError("num_speculative_tokens",
                              f"must be an integer >= 1 or 'auto', got {k!r}")
    if not isinstance(c.adaptive, bool):
        raise SpecConfigError("adaptive", f"must be a bool, got {c.adaptive!r}")
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        v = getattr(c, name)
        if not _is_int(v) or v < 1:
            raise SpecConfigError(name, f"must be an integer >= 1, got {v!r}")
    depth = c.suffix_max_tree_depth
    if not _is_int(depth) or depth < 2:  # a suffix match needs two tokens (spec.suffix)
        raise SpecConfigError("suffix_max_tree_depth", f"must be an integer >= 2, got {depth!r}")
    if c.prompt_lookup_min > c.prompt_lookup_max:
        raise SpecConfigError("prompt_lookup_min", f"({c.prompt_lookup_min}) must be <= "
                              f"prompt_lookup_max ({c.prompt_lookup_max})")
    n = c.suffix_max_cached_requests
    if not _is_int(n) or n < -1:
        raise SpecConfigError("suffix_max_cached_requests",
                              f"must be an integer >= -1 (-1 = unbounded), got {n!r}")
    if not _is_num(c.suffix_max_spec_factor) or c.suffix_max_spec_factor < 0:
        raise SpecConfigError("suffix_max_spec_factor",
                              f"must be a non-negative number, got {c.suffix_max_spec_factor!r}")
    if not _is_num(c.suffix_max_spec_offset):
        raise SpecConfigError("suffix_max_spec_offset",
                              f"must be a number, got {c.suffix_max_spec_offset!r}")
    p = c.suffix_min_token_prob
    if not _is_num(p) or not 0.0 <= p <= 1.0:
        raise SpecConfigError("suffix_min_token_prob", f"must be a number in [0, 1], got {p!r}")
    _validate_method(c)


def _validate_method(c: SpeculativeConfig) -> None:
    if c.model is not None and not (isinstance(c.model, str) and c.model):
        raise SpecConfigError("model", f"must be a non-empty path string, got {c.model!r}")
    if c.method == "draft_model" and c.model is None:
        raise SpecConfigError("model", "is required when method is 'draft_model'")
    if c.method not in ("draft_model", "eagle3") and c.model is not None:
        raise SpecConfigError("model", f"is only used by methods 'draft_model' and 'eagle3', not {c.method!r}")
    layers = c.draft_num_layers
    if layers is not None and (not _is_int(layers) or layers < 1):
        raise SpecConfigError("draft_num_layers", f"must be an integer >= 1, got {layers!r}")
    if not isinstance(c.enable_suffix_decoding, bool):
        raise SpecConfigError("enable_suffix_decoding", f"must be a bool, got {c.enable_suffix_decoding!r}")
    if c.enable_suffix_decoding and c.method != "eagle3":
        raise SpecConfigError("enable_suffix_decoding", f"is only used by method 'eagle3', not {c.method!r}")
    if c.method == "self_draft" and layers is None:
        raise SpecConfigError("draft_num_layers", "is required when method is 'self_draft'")
    if c.method != "self_draft" and layers is not None:
        raise SpecConfigError("draft_num_layers",
                              f"is only used by method 'self_draft', not {c.method!r}")
