"""tokenbudget's public API: LLM (offline), LLMEngine (step loop), AsyncLLM (servers)."""

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, GenerateRequest, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams


def __getattr__(name: str):  # heavy imports (torch, model code) only when asked for
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(name)


__all__ = ["AsyncLLM", "CompletionOutput", "EngineConfig", "GenerateRequest", "LLM", "LLMEngine",
           "RequestMetrics", "RequestOutput", "SamplingParams"]
