"""What crosses the engine boundary: requests and outputs as msgspec Structs (JSON/msgpack).

What an output carries depends on the request's ``SamplingParams.output_kind``: everything so far
(CUMULATIVE), only what is new since its previous output (DELTA), or everything once, when it
finishes (FINAL_ONLY). ``finish_reason``: "stop" (EOS, a stop token or a stop string), "length"
(max_tokens or the model length), "abort", or "error" (the engine isolated a fault to this
request; ``RequestOutput.error`` says what it was).

Logprobs (vLLM's layout): ``CompletionOutput.logprobs`` has one ``{token_id: Logprob}`` dict per
generated token: the sampled token first, then the ``SamplingParams.logprobs`` most likely tokens
(k entries when the sampled token is among them, else k + 1). ``RequestOutput.prompt_logprobs``
has one entry per prompt token, the first None (nothing predicts it). ``rank`` is 1-based: the
number of tokens at least as likely as this one. With ``n > 1`` one ``RequestOutput`` carries the
completions of several samples, told apart by ``CompletionOutput.index``.
"""

from __future__ import annotations

import msgspec

from tokenbudget.api.sampling_params import SamplingParams


class Logprob(msgspec.Struct):
    """One token's log-probability under the raw model distribution, its 1-based rank in that
    distribution and its text (the token decoded alone, special tokens kept), as vLLM's."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """A request as a server or a JSONL file carries it: a prompt string or token ids."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0


class CompletionOutput(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    cumulative_logprob: float | None = None
    # Per generated token: {token_id: Logprob} for the sampled token and the top-k alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct, kw_only=True):
    """Counts and timestamps of one request. Timestamps are ``time.monotonic()`` seconds (None
    until the event happened): ``arrival_time`` when ``add_request`` accepted it,
    ``first_scheduled_time`` when a step first ran it, ``first_token_time`` / ``last_token_time``
    when its first / latest tokens were committed, ``finished_time`` at its final output. The
    intervals (queue time, TTFT, TPOT, e2e) are properties, so they cannot disagree with the
    timestamps; ITL is the gap between the ``last_token_time`` of successive DELTA outputs."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []
    num_output_tokens: int = 0
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled step."""
        return _gap(self.arrival_time, self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        """Arrival to the first committed token (TTFT)."""
        return _gap(self.arrival_time, self.first_token_time)

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first (TPOT); None with fewer than two."""
        gap = _gap(self.first_token_time, self.last_token_time)
        return gap / (self.num_output_tokens - 1) if gap is not None and self.num_output_tokens > 1 else None

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to the final output."""
        return _gap(self.arrival_time, self.finished_time)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] = []
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    outputs: list[CompletionOutput] = []
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # with finish_reason "error": the fault, as "ExceptionType: message"


def _gap(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None
