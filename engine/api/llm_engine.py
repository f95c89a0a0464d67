"""LLMEngine: add requests, step, stream outputs. The loop DESIGN.md draws, and nothing else.

Construction (model loading, KV sizing, component wiring) lives in ``engine.builder``; text
handling in ``engine.output_processor``; speculation in ``spec.speculator``.
"""

from __future__ import annotations

from typing import Any

from tokenbudget.engine.api.config import EngineConfig
from tokenbudget.engine.api.outputs import RequestOutput
from tokenbudget.engine.api.sampling_params import SamplingParams
from tokenbudget.engine.core.prompts import PromptInput, make_request
from tokenbudget.engine.core.wiring import EngineParts, load_and_wire
from tokenbudget.engine.loader.target import TargetModel


class LLMEngine:
    """``model`` (or ``config.model``): a .gguf file, an HF directory, None for the default model,
    or an already loaded ``TargetModel`` (``engine.loader.target.load_target_model``), which
    several engines may share."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        target = kwargs.pop("model", None) if isinstance(kwargs.get("model"), TargetModel) else None
        if target is not None:
            kwargs["model"] = target.source
        if config is None:
            config = EngineConfig.from_kwargs(**kwargs)
        elif kwargs:
            raise ValueError("pass either an EngineConfig or keyword options, not both")
        parts: EngineParts = load_and_wire(config, target)
        self.config = config
        self.parts = parts
        self.tokenizer = parts.tokenizer
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.speculator = parts.speculator
        self.output_processor = parts.output_processor
        self.max_model_len = parts.scheduler.config.max_model_len

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptInput,
                    sampling_params: SamplingParams | None = None, priority: int = 0) -> None:
        """Queue a request. Raises ValueError (changing nothing) for a bad prompt, bad params,
        a prompt longer than ``max_model_len`` or a duplicate ``request_id``."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if self.output_processor.has(request_id):
            raise ValueError(f"duplicate request_id {request_id!r}: a request with this id is still running")
        text, request = make_request(request_id, prompt, params, priority, self.tokenizer,
                                     self.parts.model_config.vocab_size)
        self.scheduler.add_request(request)
        self.output_processor.add_request(request_id, text, request.prompt_token_ids, params)

    def abort_request(self, request_id: str, missing_ok: bool = False) -> RequestOutput | None:
        """Abort a running or waiting request; its blocks return to the pool at once.

        An id that is not (or no longer) in flight raises ValueError unless ``missing_ok``.
        Returns the request's final output (``finish_reason="abort"``) when it was in flight.
        """
        if not self.output_processor.has(request_id):
            if missing_ok:
                return None
            raise ValueError(f"unknown request_id {request_id!r}: no such request is running or waiting")
        self.scheduler.abort_requests([request_id])
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        out = self.runner.execute(sched)
        core = self.scheduler.update_from_output(sched, out)
        outputs, stopped = self.output_processor.process(core, sched)
        self.scheduler.abort_requests(stopped)  # finished by a stop string
        self.speculator.after_step(core, self.scheduler, self.runner)
        return outputs

    # ------------------------------------------------------------------ metrics
    def get_spec_stats(self):
        """Engine-wide speculative-decoding figures (``SpecDecodingStats``), or None."""
        return self.speculator.stats if self.speculator.enabled else None

    def get_kv_cache_usage(self):
        return self.scheduler.kv.usage()
