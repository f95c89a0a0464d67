"""Ray: ``data`` (a ``Dataset.map_batches`` stage and ``build_processor``, offline generation
across a cluster) and ``serve`` (a Ray Serve deployment of the OpenAI server). Needs the
``[ray]`` extra (``ray[data,serve]``). See docs/scaling.md.

    from tokenbudget.integrations.ray import ProcessorConfig, build_processor
"""

from tokenbudget.integrations.ray.data import OUTPUT_COLUMNS, ProcessorConfig, TokenbudgetStage, build_processor

__all__ = ["OUTPUT_COLUMNS", "ProcessorConfig", "TokenbudgetStage", "build_processor"]
