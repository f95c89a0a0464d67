"""What users hold: ``LLM`` (offline batches), ``LLMEngine`` (a step loop of their own),
``AsyncLLM`` (servers), the options (``EngineConfig``, ``SamplingParams``) and the outputs."""
