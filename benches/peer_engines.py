"""The engines ``benches/cpu_peers.py`` compares, behind one call: ``runner(prompt_ids, max_tokens)``.

Every runner is greedy, batch 1 (or a given batch), gets chat-templated token ids (nothing is
re-tokenized and no BOS is added: the ids start with the template's own first token), ignores EOS
so every run generates exactly ``max_tokens`` tokens, and returns a ``benches.common.GenTiming``
whose ``total_s`` includes prefill. Modes (``MODES``, in table order):

* ``tokenbudget-*``: ``LLM(num_threads=T, enable_prefix_caching=False, speculative_config=...)``
  with every other option at its default (``quantization="auto"``: int4 on the Q4_1 GGUF);
  ngram = ``{"method": "ngram", "num_speculative_tokens": 4}``, suffix = ``{"method": "suffix"}``,
  auto = ``{"method": "ngram", "num_speculative_tokens": "auto"}`` (the adaptive draft length).
* ``llamacpp-*``: ``llama_cpp.Llama`` on the same GGUF file, ``n_threads = n_threads_batch = T``;
  ``Llama.generate`` on the token ids with ``temp=0, top_k=1`` (llama.cpp's greedy sampler) and
  no repeat penalty; ``reset()`` before every run so no KV prefix is reused (tokenbudget runs with
  prefix caching off). prompt lookup = ``LlamaPromptLookupDecoding(num_pred_tokens=3)`` as
  ``draft_model`` (the library then keeps logits for every position, its own requirement).
* ``transformers-*``: ``LlamaForCausalLM`` on the same model dequantized to fp32
  (``benches.common.load_hf_model``), ``generate(do_sample=False)``; prompt lookup =
  ``prompt_lookup_num_tokens=10``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence

from benches.common import GenTiming, engine_generate, hf_generate, load_hf_model

TB_SPEC: dict[str, dict | None] = {
    "tokenbudget-plain": None,
    "tokenbudget-ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "tokenbudget-suffix": {"method": "suffix"},
    "tokenbudget-auto": {"method": "ngram", "num_speculative_tokens": "auto"},
}
LLAMA_PLD = {"llamacpp-plain": None, "llamacpp-pld": 3}  # num_pred_tokens
HF_PLD = {"transformers-plain": None, "transformers-pld": 10}  # prompt_lookup_num_tokens
MODES: tuple[str, ...] = (*TB_SPEC, *LLAMA_PLD, *HF_PLD)
LABELS = {
    "tokenbudget-plain": "tokenbudget (default options)",
    "tokenbudget-ngram": "tokenbudget ngram k=4",
    "tokenbudget-suffix": "tokenbudget suffix",
    "tokenbudget-auto": "tokenbudget auto (ngram, adaptive k)",
    "llamacpp-plain": "llama.cpp (same GGUF)",
    "llamacpp-pld": "llama.cpp + prompt lookup (3)",
    "transformers-plain": "transformers fp32",
    "transformers-pld": "transformers + prompt lookup (10)",
}

Runner = Callable[[Sequence[list[int]], int], GenTiming]


def label(mode: str) -> str:
    """The table label of a mode; ``tokenbudget-plain@avx2`` (a kernel variant): ``tokenbudget [avx2]``."""
    if "@" in mode:
        variant = mode.split("@", 1)[1]
        return f"tokenbudget [{'torch kernels' if variant == '0' else variant}]"
    return LABELS[mode]


@contextlib.contextmanager
def native_variant(variant: str):
    """``TOKENBUDGET_NATIVE=variant`` inside the block, the old value after."""
    old = os.environ.get("TOKENBUDGET_NATIVE")
    os.environ["TOKENBUDGET_NATIVE"] = variant
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENBUDGET_NATIVE", None)
        else:
            os.environ["TOKENBUDGET_NATIVE"] = old


class VariantRunner:
    """A tokenbudget runner called with ``TOKENBUDGET_NATIVE=variant`` (the C library is chosen per call)."""

    def __init__(self, engine: TokenbudgetEngine, variant: str) -> None:
        self.engine, self.variant, self.llm = engine, variant, engine.llm

    def __call__(self, prompts: Sequence[list[int]], n: int) -> GenTiming:
        with native_variant(self.variant):
            return self.engine(prompts, n)


def engine_of(mode: str) -> str:
    """``tokenbudget`` / ``llamacpp`` / ``transformers``: whose plain output a mode must equal."""
    return mode.split("-", 1)[0]


def missing_reason(engine: str) -> str | None:
    """Why an optional peer cannot run here (its import error), or None when it can."""
    module = {"llamacpp": "llama_cpp", "vllm": "vllm"}.get(engine)
    if module is None:
        return None
    try:
        __import__(module)
    except (ImportError, OSError, RuntimeError) as exc:  # missing, or a native library that fails to load
        return f"`import {module}` failed ({type(exc).__name__}: {exc})"
    return None


class TokenbudgetEngine:
    """A ``tokenbudget.LLM`` for ``mode``, called as a runner; ``options`` override defaults (batch sizes)."""

    def __init__(self, mode: str, threads: int, **options) -> None:
        from tokenbudget import LLM

        self.llm = LLM(num_threads=threads, enable_prefix_caching=False, speculative_config=TB_SPEC[mode],
                       **options)

    def __call__(self, prompts: Sequence[list[int]], n: int) -> GenTiming:
        return engine_generate(self.llm, prompts, n, ignore_eos=True)


def llama_runner(mode: str, model_path: str, threads: int, n_ctx: int) -> Runner:
    """A ``llama_cpp.Llama`` on ``model_path``; batch 1 only (the library has no batched generate)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    k = LLAMA_PLD[mode]
    draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None
    # logits_all: a draft model makes the library keep every position's logits, but 0.3.36 sizes
    # that buffer from the argument (n_batch rows) and overflows past 512 tokens unless it is set.
    llm = llama_cpp.Llama(model_path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                          draft_model=draft, logits_all=draft is not None, verbose=False)

    def run(prompts: Sequence[list[int]], n: int) -> GenTiming:
        out, ttfts, t0 = [], [], time.perf_counter()
        for p in prompts:  # sequential: llama-cpp-python decodes one sequence per Llama
            llm.reset()
            toks: list[int] = []
            for tok in llm.generate(list(p), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                if not toks:
                    ttfts.append(time.perf_counter() - t0)
                toks.append(int(tok))
                if len(toks) == n:
                    break
            out.append(toks)
        return GenTiming(out, ttfts[0] if ttfts else 0.0, time.perf_counter() - t0)

    return run


class TransformersModel:
    """One fp32 ``LlamaForCausalLM`` shared by the transformers modes (they differ by a kwarg)."""

    def __init__(self, threads: int, pad_id: int) -> None:
        self.model, _ = load_hf_model(threads)
        self.pad_id = pad_id

    def runner(self, mode: str) -> Runner:
        k = HF_PLD[mode]
        extra = {"prompt_lookup_num_tokens": k} if k else {}

        def run(prompts: Sequence[list[int]], n: int) -> GenTiming:
            return hf_generate(self.model, prompts, n, ignore_eos=True, pad_id=self.pad_id, **extra)

        return run



def concat_timings(parts: Sequence[GenTiming]) -> GenTiming:
    """Runs made one after another as one: their outputs in order, their seconds summed."""
    return GenTiming([t for g in parts for t in g.token_ids], parts[0].ttft_s, sum(g.total_s for g in parts))
