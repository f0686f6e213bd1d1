"""The simulator's `/metrics`, with vLLM's metric names and labels.

Agents and routers scrape these exactly as they scrape vLLM: `model_name` and `engine`
labels on every series, counters exposed with `_total`.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

# vLLM's buckets for time to first token (v1 engine).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_LABELS = ("model_name", "engine")


class EngineMetrics:
    def __init__(
        self, model_name: str, cache_config: dict[str, str], engine_index: int = 0
    ) -> None:
        self._arguments = (model_name, cache_config, engine_index)
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # process_start_time_seconds, as vLLM
        labels = {"model_name": model_name, "engine": str(engine_index)}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=self.registry).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens."
        )
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Prompt tokens served from the prefix cache."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced.")
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, in seconds.",
            _LABELS,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency, in seconds.",
            _LABELS,
            registry=self.registry,
        ).labels(**labels)
        Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            [*cache_config, "engine"],
            registry=self.registry,
        ).labels(**cache_config, engine=str(engine_index)).set(1)

    def fresh(self) -> EngineMetrics:
        """New metrics with the same labels, every counter at zero (a restarted engine)."""
        return EngineMetrics(*self._arguments)

    def render(self) -> bytes:
        return generate_latest(self.registry)
