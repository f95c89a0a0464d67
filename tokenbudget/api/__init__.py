"""The types every layer may import: the options (``EngineConfig``, ``SamplingParams``,
``StructuredOutputsParams``, ``SpeculativeConfig``), the outputs (``RequestOutput``, ...), the
errors, and the one cache root. The bottom of the stack (docs/DESIGN.md, "Layers"): nothing
here imports another tokenbudget package, so any of them can import these.
"""
