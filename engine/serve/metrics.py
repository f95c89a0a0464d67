"""``GET /metrics``: Prometheus text format, every name in the ``tokenbudget_`` namespace
(modelled on vLLM's ``vllm:`` names), and next to them the ``vllm:`` names routers read
(``router_metrics``).

Engine-wide figures are read from ``AsyncLLM.get_stats()`` at scrape time by a collector, so
they are never out of step with the engine (gauges: running/waiting/preempted requests, KV
usage, tokens/s; counters: prompt and generation tokens, prefix-cache queries and hits,
preemptions, drafts and accepted tokens, accepted tokens by position). Per-request figures are
histograms observed once, when a request finishes: TTFT, TPOT, e2e latency, queue time, prompt
and generation tokens, and a counter of finished requests by finish reason.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenbudget.api.outputs import RequestOutput
from tokenbudget.engine.serve.router_metrics import VllmNamesCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _EngineCollector:
    def __init__(self, llm) -> None:
        self.llm = llm

    def collect(self):
        s = self.llm.get_stats()
        gauges = {"num_requests_running": ("Requests running in the engine.", s.num_running),
                  "num_requests_waiting": ("Requests waiting to run (preempted ones included).", s.num_waiting),
                  "num_requests_preempted": ("Waiting requests that were preempted.", s.num_preempted),
                  "kv_cache_usage_perc": ("Fraction of KV blocks in use (1 = full).", s.kv_usage),
                  "kv_cache_blocks_used": ("KV blocks in use.", s.kv_blocks_used),
                  "kv_cache_blocks_total": ("KV blocks in the pool.", s.kv_blocks_total),
                  "generation_tokens_per_second": ("Output tokens/s over the last seconds.",
                                                   s.generation_tokens_per_s),
                  "engine_healthy": ("1 while the engine serves, 0 once it is dead.", int(s.healthy))}
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"tokenbudget_{name}", doc, value=value)
        counters = {"prompt_tokens": ("Prompt tokens of the accepted requests.", s.num_prompt_tokens_total),
                    "generation_tokens": ("Output tokens committed.", s.num_generation_tokens_total),
                    "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
                    "prefix_cache_hits": ("Prompt tokens served from the prefix cache.", s.prefix_cache_hits),
                    "num_preemptions": ("Preemptions.", s.num_preemptions_total),
                    "spec_decode_num_drafts": ("Verify steps with drafts.", s.spec_num_drafts),
                    "spec_decode_num_draft_tokens": ("Draft tokens proposed.", s.spec_num_draft_tokens),
                    "spec_decode_num_accepted_tokens": ("Draft tokens accepted.", s.spec_num_accepted_tokens)}
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"tokenbudget_{name}", doc, value=value)
        by_pos = CounterMetricFamily("tokenbudget_spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by draft position.", labels=["position"])
        drafted = CounterMetricFamily("tokenbudget_spec_decode_num_draft_tokens_per_pos",
                                      "Draft tokens proposed, by draft position.", labels=["position"])
        for i, (a, d) in enumerate(zip(s.spec_accepted_per_pos, s.spec_drafted_per_pos)):
            by_pos.add_metric([str(i)], a)
            drafted.add_metric([str(i)], d)
        yield by_pos
        yield drafted


class ServerMetrics:
    def __init__(self, llm, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(llm))
        self.registry.register(VllmNamesCollector(llm, model_name))
        r = self.registry
        self.ttft = Histogram("tokenbudget_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tokenbudget_time_per_output_token_seconds", "Mean time per output token after the "
                              "first.", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tokenbudget_e2e_request_latency_seconds", "Arrival to final output.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("tokenbudget_request_queue_time_seconds", "Arrival to first scheduled step.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("tokenbudget_request_prompt_tokens", "Prompt tokens per request.",
                                       buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("tokenbudget_request_generation_tokens", "Output tokens per request.",
                                           buckets=_TOKEN_BUCKETS, registry=r)
        self.finished = Counter("tokenbudget_request_success", "Finished requests, by finish reason.",
                                ["finished_reason"], registry=r)

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request (its final output)."""
        m = out.metrics
        self.finished.labels(out.outputs[0].finish_reason or "unknown").inc()
        if m is None:
            return
        for hist, value in ((self.ttft, m.time_to_first_token), (self.tpot, m.time_per_output_token),
                            (self.e2e, m.e2e_latency), (self.queue, m.queue_time)):
            if value is not None:
                hist.observe(value)
        self.prompt_tokens.observe(m.num_prompt_tokens)
        self.generation_tokens.observe(m.num_output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
