"""tokenbudget: an LLM inference engine with token-budget continuous batching, a paged KV cache
and speculative decoding whose output is exactly the target model's.

    from tokenbudget import LLM, SamplingParams
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=16))[0].outputs[0].text)

The subpackages live in folders of the repository root and install under this namespace, bottom
layer first: ``tokenbudget.api`` (options, outputs, errors), ``tokenbudget.kv_cache``,
``tokenbudget.scheduler``, ``tokenbudget.spec``, ``tokenbudget.kernels``, ``tokenbudget.engine``
(model code, loading, worker, EngineCore, the front-ends, the server), ``tokenbudget.testing``,
``tokenbudget.cli``. docs/DESIGN.md draws the layers and maps import paths to folders.
"""

from tokenbudget.api.config import EngineConfig
from tokenbudget.api.errors import EngineDeadError, EngineOverloadedError, RequestError
from tokenbudget.api.outputs import CompletionOutput, GenerateRequest, Logprob, RequestMetrics, RequestOutput
from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams
from tokenbudget.api.structured_params import StructuredOutputsParams
from tokenbudget.engine.core.stats import EngineStats

_LAZY = {  # heavy (torch, model code): imported on first use
    "LLM": "tokenbudget.engine.entrypoints.llm",
    "LLMEngine": "tokenbudget.engine.entrypoints.llm_engine",
    "AsyncLLM": "tokenbudget.engine.entrypoints.async_llm",
    "EngineCore": "tokenbudget.engine.core.engine_core",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenbudget' has no attribute {name!r}")


__all__ = ["AsyncLLM", "CompletionOutput", "EngineConfig", "EngineCore", "EngineDeadError",
           "EngineOverloadedError", "EngineStats", "GenerateRequest", "LLM", "LLMEngine", "Logprob", "RequestError",
           "RequestMetrics", "RequestOutput", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
