"""The figures LLM routers score a replica by, under vLLM's Prometheus names.

SMG, vllm-router, llm-d's endpoint picker and vLLM's production-stack router read a replica's
``/metrics`` as if it were vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (a fraction 0-1; SMG's least-load policy refuses a vLLM worker
without it) and its older alias ``vllm:gpu_cache_usage_perc``, ``vllm:cache_config_info``
(``block_size``, ``num_gpu_blocks`` as labels, value 1), prefix-cache query/hit counters (under
vLLM v1's names and the older ``vllm:gpu_prefix_cache_*`` ones: routers and dashboards read
either) and token counters, each with a ``model_name`` label. They are read from ``AsyncLLM.get_stats()`` at
scrape time, the same snapshot the native ``tokenbudget_*`` names come from, so the two sets
always agree.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class VllmNamesCollector:
    """A prometheus_client collector: engine-wide figures under vLLM's names."""

    def __init__(self, llm, model_name: str) -> None:
        self.llm, self.model_name = llm, model_name

    def collect(self):
        s = self.llm.get_stats()
        labels, values = ["model_name"], [self.model_name]
        gauges = (("vllm:num_requests_running", "Requests running in the engine.", s.num_running),
                  ("vllm:num_requests_waiting", "Requests waiting to run.", s.num_waiting),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
                  ("vllm:gpu_cache_usage_perc", "KV-cache usage (the older name of vllm:kv_cache_usage_perc).",
                   s.kv_usage))
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            yield g
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config (value 1).",
                                 labels=["block_size", "num_gpu_blocks", "model_name"])
        info.add_metric([str(self.llm.engine.config.block_size), str(s.kv_blocks_total), self.model_name], 1)
        yield info
        counters = (("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     s.prefix_cache_queries),
                    ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits),
                    ("vllm:gpu_prefix_cache_queries", "The older name of vllm:prefix_cache_queries.",
                     s.prefix_cache_queries),
                    ("vllm:gpu_prefix_cache_hits", "The older name of vllm:prefix_cache_hits.", s.prefix_cache_hits),
                    ("vllm:prompt_tokens", "Prompt tokens of the accepted requests.", s.num_prompt_tokens_total),
                    ("vllm:generation_tokens", "Output tokens committed.", s.num_generation_tokens_total),
                    ("vllm:num_preemptions", "Preemptions.", s.num_preemptions_total))
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c
