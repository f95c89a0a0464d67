"""Per-request sampling parameters: frozen, validated at construction and at decode time.

``SamplingParams`` crosses the engine boundary (it is part of a request), so it is a
``msgspec.Struct`` that round-trips through msgspec JSON and msgpack. Every bad value raises
``ValueError`` whose message starts with the field name. (When decoding with msgspec, the
``ValueError`` raised by ``__post_init__`` surfaces as ``msgspec.ValidationError`` carrying the
same message.)

Decisions, where vLLM/SGLang users might expect something else:

* ``stop`` / ``stop_token_ids``: a list. A single ``str`` (or a tuple) given to the Python
  constructor is normalized to a list, ``None`` means none (as in vLLM and the OpenAI API), and
  numpy integers are accepted as token ids; the wire format (JSON / msgpack) requires a list.
* ``seed``: an integer in [0, 2**64), or None. Every request's random numbers are keyed by its
  seed and the position of the token they decide, so a seeded request's output does not depend
  on its batch neighbours or on speculation (``engine.worker.keyed_random``); an unseeded one gets
  a seed from the engine (``EngineConfig.seed`` and its arrival number).
* ``top_k``: within int64 (it becomes a tensor element).
* ``temperature < 1e-5`` (in practice 0) or ``top_k == 1`` means greedy (``is_greedy``): argmax
  of the logits after penalties, bias and bans (before temperature), ties broken by the lowest
  token id; ``seed`` is then irrelevant. (Like vLLM:
  dividing by a tiny temperature would overflow float32 logits.)
* ``top_k``: 0 or -1 disables it; ``top_p == 1`` and ``min_p == 0`` disable those.
* ``logprobs`` / ``prompt_logprobs``: ``None`` returns none; ``k >= 0`` returns, for every
  emitted (prompt) token, its ``Logprob(logprob, rank, decoded_token)`` plus the ``k`` most likely
  tokens; ``-1`` means the whole vocabulary. Logprobs are those of the *raw* model distribution
  (log_softmax of the unprocessed logits, before penalties, bias, temperature...), as vLLM does
  by default. The engine caps ``k`` at ``EngineConfig.max_logprobs`` (checked at ``add_request``).
* ``num_speculative_tokens``: per-request cap on drafts; ``None`` = engine default, ``0`` = no
  speculation for this request.
* ``n``: independent samples of one prompt (child i of a seeded request uses ``seed + i``).
* Penalties (vLLM/OpenAI): ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] count output
  tokens; ``repetition_penalty`` > 0 (CTRL: positive logits divided, negative multiplied) applies
  to tokens of the prompt or the output. ``logit_bias`` (token id -> bias; str keys accepted, as
  in JSON) is clipped to [-100, 100]. ``allowed_token_ids`` (non-empty) and ``bad_words`` (texts,
  banned at their last token once the output ends with the rest) restrict the vocabulary. Token
  ids are checked against the model's vocabulary at ``add_request``.
* ``logits_processors``: callables ``f(output_token_ids, logits)`` or ``f(prompt_token_ids,
  output_token_ids, logits)`` returning the logits row (vLLM's form). Under speculation they are
  called once per verify row with that row's own prefix, so they must be pure functions of their
  arguments. They do not cross the wire (msgspec cannot encode a callable).
* ``truncate_prompt_tokens``: keep only the last k prompt tokens (``-1``: ``max_model_len``).
* ``detokenize=False``: token ids only (empty text, ``decoded_token`` None), as in vLLM.
* ``structured_outputs``: a ``StructuredOutputsParams`` (a dict of its fields is converted), or
  None; ``engine.structured`` enforces it, exactly under speculation.
"""

from __future__ import annotations

import enum
import math
import operator
from typing import Any

import msgspec
from msgspec.structs import force_setattr

from tokenbudget.api.structured_params import StructuredOutputsParams

__all__ = ["GREEDY_TEMPERATURE_EPS", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

GREEDY_TEMPERATURE_EPS = 1e-5


_INT64_MAX = 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value: object) -> object:
    """numpy (and other ``__index__``) integers as ``int``; anything else unchanged (the checks
    that follow reject it by name)."""
    if isinstance(value, bool) or isinstance(value, int):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _normalize_bias(bias: dict) -> dict:
    """Keys as ints (JSON gives strings, numpy integers pass), values clipped to [-100, 100] as
    the OpenAI API does; anything malformed is left for the check that names the field."""
    out = {}
    for t, v in bias.items():
        if isinstance(t, str) and t.strip().lstrip("-").isdigit():
            t = int(t)
        t = _as_int(t)
        if _is_number(v) and math.isfinite(v):
            v = min(100.0, max(-100.0, float(v)))
        out[t] = v
    return out


class RequestOutputKind(enum.IntEnum):
    """What each output of a request carries (vLLM's names and meaning).

    CUMULATIVE: everything so far (token ids, text, logprobs), every step.
    DELTA: only what is new since the request's previous output.
    FINAL_ONLY: nothing until the request finishes, then everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request's output; see the module docstring for the conventions."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | None = []
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    logits_processors: list[Any] | None = None
    num_speculative_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._check_ints()
        self._check_floats()
        self._check_lists_and_flags()
        self._check_logits_fields()
        self._check_structured_outputs()

    # -- validation helpers (each raises ValueError naming the field) --

    def _normalize(self) -> None:
        if self.stop is None:
            force_setattr(self, "stop", [])
        elif isinstance(self.stop, str):
            force_setattr(self, "stop", [self.stop])
        elif isinstance(self.stop, tuple):
            force_setattr(self, "stop", list(self.stop))
        if self.stop_token_ids is None:
            force_setattr(self, "stop_token_ids", [])
        elif not isinstance(self.stop_token_ids, (str, bytes, dict)) and hasattr(self.stop_token_ids, "__iter__"):
            force_setattr(self, "stop_token_ids", [_as_int(t) for t in self.stop_token_ids])
        if self.seed is not None and not isinstance(self.seed, bool):
            force_setattr(self, "seed", _as_int(self.seed))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if _is_int(value):
                force_setattr(self, name, float(value))
        if isinstance(self.bad_words, str):
            force_setattr(self, "bad_words", [self.bad_words])
        elif isinstance(self.bad_words, tuple):
            force_setattr(self, "bad_words", list(self.bad_words))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, (str, bytes, dict)) \
                and hasattr(self.allowed_token_ids, "__iter__"):
            force_setattr(self, "allowed_token_ids", [_as_int(t) for t in self.allowed_token_ids])
        if isinstance(self.logit_bias, dict):
            force_setattr(self, "logit_bias", _normalize_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                force_setattr(self, name, _as_int(value))

    def _check_ints(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)) or self.top_k > _INT64_MAX:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or an integer in [1, 2**63), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(f"{name} must be None, -1 (the whole vocabulary) or an integer >= 0, got {value!r}")
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (not _is_int(tpt) or (tpt < 1 and tpt != -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an integer >= 1, got {tpt!r}")
        nst = self.num_speculative_tokens
        if nst is not None and (not _is_int(nst) or nst < 0):
            raise ValueError(f"num_speculative_tokens must be None or an integer >= 0, got {nst!r}")

    def _check_floats(self) -> None:
        t = self.temperature
        if not _is_number(t) or not (t >= 0.0) or t == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not (rp > 0.0) or not math.isfinite(rp):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rp!r}")

    def _check_lists_and_flags(self) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain the empty string")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {ids!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")

    def _check_logits_fields(self) -> None:
        bias = self.logit_bias
        if bias is not None and (not isinstance(bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_number(v) and math.isfinite(v) for t, v in bias.items())):
            raise ValueError(f"logit_bias must map token ids >= 0 to finite numbers, got {bias!r}")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list) or not all(_is_int(t) and t >= 0 for t in allowed):
                raise ValueError(f"allowed_token_ids must be a list of non-negative ints, got {allowed!r}")
            if not allowed:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        words = self.bad_words
        if words is not None and (not isinstance(words, list) or not all(isinstance(w, str) and w.strip()
                                                                          for w in words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")
        procs = self.logits_processors
        if procs is not None and (not isinstance(procs, list) or not all(callable(f) for f in procs)):
            raise ValueError(f"logits_processors must be a list of callables, got {procs!r}")

    def _check_structured_outputs(self) -> None:
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                force_setattr(self, "structured_outputs", StructuredOutputsParams(**so))
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, got {so!r}")

    # -- derived values --

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax of the prepared logits (temperature ~0 or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_row_preparation(self) -> bool:
        """True when a row's logits are changed before temperature (``logits_processing``)."""
        return bool(self.has_penalties or self.logit_bias or self.allowed_token_ids or self.bad_words
                    or self.logits_processors)

    @property
    def uses_default_processing(self) -> bool:
        """True when p is plain softmax(logits): temperature 1, no top-k / top-p / min-p."""
        return (
            self.temperature == 1.0 and self.top_k in (0, -1) and self.top_p == 1.0 and self.min_p == 0.0
        )
