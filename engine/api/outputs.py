"""What crosses the engine boundary: requests and outputs as msgspec Structs (JSON/msgpack).

What an output carries depends on the request's ``SamplingParams.output_kind``: everything so far
(CUMULATIVE), only what is new since its previous output (DELTA), or everything once, when it
finishes (FINAL_ONLY). ``finish_reason``: "stop" (EOS, a stop token or a stop string), "length"
(max_tokens or the model length), "abort", or "error" (the engine isolated a fault to this
request; ``RequestOutput.error`` says what it was).
"""

from __future__ import annotations

import msgspec

from tokenbudget.engine.api.sampling_params import SamplingParams


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
    # Per generated token: {token_id: logprob} for the sampled token and the top-n alternatives.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct, kw_only=True):
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] = []
    outputs: list[CompletionOutput] = []
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # with finish_reason "error": the fault, as "ExceptionType: message"
