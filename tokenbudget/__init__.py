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

import os

# Before anything loads torch (and with it libgomp, which reads this once): OpenMP threads - torch's
# and the C kernels', one runtime - sleep when they wait instead of spinning. On a busy machine a
# spinning team member takes the core the working thread needs (batch-1 decode at 2 threads beside
# other processes: benches/RESULTS.md, "Threads under contention"). An OMP_WAIT_POLICY already set
# is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenbudget.api.config import EngineConfig  # noqa: E402
from tokenbudget.api.errors import EngineDeadError, EngineOverloadedError, RequestError  # noqa: E402
from tokenbudget.api.outputs import CompletionOutput, GenerateRequest, Logprob, RequestMetrics, RequestOutput  # noqa: E402
from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from tokenbudget.api.structured_params import StructuredOutputsParams  # noqa: E402
from tokenbudget.engine.core.stats import EngineStats  # noqa: E402

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
