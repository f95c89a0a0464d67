"""The front-ends over ``EngineCore``: ``LLM`` (offline batches), ``LLMEngine`` (a step loop of
the caller's own), ``AsyncLLM`` (servers) and its ``RequestStream``. The options and outputs they
take and give are in ``tokenbudget.api``."""
