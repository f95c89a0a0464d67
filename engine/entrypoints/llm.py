"""``LLM``: offline batch generation, the way vLLM users write it.

    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

``generate`` returns one output per prompt, in input order, always: a request the engine had to
end because of a fault attributable to it comes back with ``finish_reason="error"`` and
``error`` set. If the engine dies (``EngineDeadError``) or the call is interrupted (Ctrl-C), the
call's requests are aborted before the exception propagates, and the ``LLM`` stays usable (a
dead engine stays dead).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec

from tokenbudget.api.outputs import RequestOutput
from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams
from tokenbudget.engine.core.prompts import PromptInput
from tokenbudget.engine.entrypoints.llm_engine import LLMEngine


class LLM:
    def __init__(self, model=None, **options: Any) -> None:
        self.engine = LLMEngine(model=model, **options)
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:  # vLLM's name
        return self.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` use without ``sampling_params``: the model's recommended
        sampling (its generation config) over the neutral defaults, as vLLM's ``LLM``."""
        return self.engine.get_default_sampling_params()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Every prompt is validated before any is queued, so a bad one raises ValueError and
        nothing runs.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and not isinstance(prompts[0], (str, dict, list, tuple))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        engine = self.engine
        final_only = {id(p): _final_only(p) for p in params}
        made = [engine.make_request(f"llm-{next(self._ids)}", prompt, final_only[id(p)], prio)
                for prompt, p, prio in zip(prompts, params, priorities)]  # all checked before any is queued
        ids = [request.request_id for _, request in made]
        try:
            for text, request in made:
                engine.add_made_request(request, text)
            return self._run(ids, use_tqdm and len(ids) > 1)
        except BaseException:  # Ctrl-C, a dead engine, a bad request: leave nothing behind
            for rid in ids:
                engine.core.abort_request(rid)
            raise

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``) to one conversation (or a list of
        them) and generate; the arguments are vLLM's (``chat_template_kwargs``: extra template
        variables such as Qwen3's ``enable_thinking``; ``tools``: JSON-schema tools for the
        template, as transformers passes them). Every conversation is rendered and checked before
        any is queued."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.chat_prompt(c, add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message,
                                              chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                              tools=tools)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while len(final) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]

    def get_stats(self):
        """Engine-wide figures (``EngineStats``: requests, KV blocks, prefix cache, speculation)."""
        return self.engine.get_stats()

    def get_spec_stats(self):
        return self.engine.get_spec_stats()


def _final_only(params: SamplingParams) -> SamplingParams:
    """``generate`` only reads final outputs: no per-step copies of token lists or text."""
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
