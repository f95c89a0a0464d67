"""LLMEngine: add requests, step, read outputs. A thin front of ``EngineCore`` that speaks text.

    engine = LLMEngine(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    engine.add_request("a", "Hello", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ...

Construction is ``engine.core.wiring`` (load the model, size the KV pool, wire the parts); the
step loop and its fault handling are ``engine.core.engine_core``; text handling is
``engine.core.output_processor``.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenbudget.api.config import EngineConfig
from tokenbudget.api.outputs import RequestOutput
from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.core.prompts import PromptInput, make_request
from tokenbudget.engine.core.stats import EngineStats, check_admission, request_grammar_ms
from tokenbudget.engine.core.wiring import load_and_wire
from tokenbudget.engine.loader.generation_defaults import describe, sampling_defaults
from tokenbudget.engine.loader.target import TargetModel
from tokenbudget.engine.worker.keyed_random import mix64
from tokenbudget.scheduler.validation import check_request_fits

logger = logging.getLogger("tokenbudget")


class LLMEngine:
    """``model`` (or ``config.model``): a .gguf file, an HF directory, None for the default model,
    or an already loaded ``TargetModel`` (``engine.loader.target.load_target_model``), which
    several engines may share. Options are ``EngineConfig`` fields."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        target = kwargs.pop("model", None) if isinstance(kwargs.get("model"), TargetModel) else None
        if target is not None:
            kwargs["model"] = target.source
        if config is None:
            config = EngineConfig.from_kwargs(**kwargs)
        elif kwargs:
            raise ValueError("pass either an EngineConfig or keyword options, not both")
        wired = load_and_wire(config, target)
        self.config = config
        self.core = wired.core
        self.target = wired.target
        self.tokenizer = wired.target.tokenizer
        self.model_config = wired.target.config
        # the model's recommended sampling for the fields a request leaves unset (vLLM's
        # --generation-config auto; engine/loader/generation_defaults.py)
        self.sampling_defaults = sampling_defaults(self.target.source) if config.generation_config == "auto" else {}
        if self.sampling_defaults:
            logger.info("tokenbudget: sampling defaults from the model's generation config: %s (where a request "
                        "does not set them; generation_config='none' / --generation-config none for the "
                        "engine's)", describe(self.sampling_defaults))
        self._num_added = 0  # requests accepted so far: keys the seed of each unseeded one

    # ------------------------------------------------------------------ parts
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.runner

    @property
    def speculator(self):
        return self.core.speculator

    @property
    def max_model_len(self) -> int:
        return self.core.scheduler.config.max_model_len

    # ------------------------------------------------------------------ requests
    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without ``SamplingParams`` gets: the model's recommended sampling
        (``sampling_defaults``) over the engine's neutral defaults (vLLM's name)."""
        return SamplingParams(**self.sampling_defaults)

    def make_request(self, request_id: str, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                     priority: int = 0):
        """Validate, tokenize and compile the grammar: ``(prompt text, Request)``; ValueError naming
        what is wrong. Touches no engine state, so it may run outside the thread that steps the
        engine (``AsyncLLM.make_request`` runs it in a worker thread, off the event loop)."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, request = make_request(request_id, prompt, params, priority, self.tokenizer,
                                     self.model_config.vocab_size, max_model_len=self.max_model_len,
                                     max_logprobs=self.config.max_logprobs)
        check_request_fits(request, self.scheduler.config, self.scheduler.kv.num_blocks)
        request.grammar = self.core.structured.compile(request)  # the costly part, here and not in a step
        return text, request

    def add_request(self, request_id: str, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        """Queue a request. Raises ValueError (changing nothing) for a bad prompt, bad params, a
        prompt longer than ``max_model_len`` or a duplicate ``request_id``; EngineOverloadedError
        past ``max_queued_requests`` / ``max_queued_tokens``. With ``n > 1`` the step outputs carry
        ``request_id`` and completions with ``index`` 0..n-1."""
        text, request = self.make_request(request_id, prompt, sampling_params, priority)
        if self.config.admission_control:
            stats = self.core.get_stats()
            check_admission(self.config, stats.num_waiting, stats.num_waiting_tokens, request.num_prompt_tokens,
                            request.sampling_params.n, stats.grammar_mask_ms, request_grammar_ms(request))
        self.add_made_request(request, text)

    def add_made_request(self, request, prompt_text: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request from ``make_request``. A request without a user seed gets one keyed by
        the engine's ``seed`` and the number of requests accepted before it."""
        if request.sampling_params.seed is None:
            request.seed = mix64(self.config.seed, self._num_added)
        self.core.add_request(request, prompt_text, arrival_time)
        self._num_added += 1

    def abort_request(self, request_id: str, missing_ok: bool = False) -> RequestOutput | None:
        """Abort a running or waiting request; its blocks return to the pool at once.

        Returns the request's final output (``finish_reason="abort"``). An id that is not (or no
        longer) in flight raises ValueError unless ``missing_ok``.
        """
        out = self.core.abort_request(request_id)
        if out is None and not missing_ok:
            raise ValueError(f"unknown request_id {request_id!r}: no such request is running or waiting")
        return out

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.core.get_num_unfinished_requests()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """One engine step (see ``EngineCore.step``); raises ``EngineDeadError`` once dead."""
        return self.core.step()

    def is_healthy(self) -> bool:
        return self.core.is_healthy()

    def get_stats(self) -> EngineStats:
        """Running/waiting/preempted requests, KV blocks, prefix-cache hits, speculation, tokens/s."""
        return self.core.get_stats()

    # ------------------------------------------------------------------ metrics
    def get_spec_stats(self):
        """Engine-wide speculative-decoding figures (``SpecDecodingStats``), or None."""
        return self.speculator.stats if self.speculator.enabled else None
