"""vLLM: KV events from its ZMQ publisher (every wire form since 0.9), load and cache
configuration from its Prometheus metrics (current names and the pre-0.12 `gpu_` ones)."""

from __future__ import annotations

from kvplane.core.kv_transfer import KvTransferConfig, kv_transfer_config
from kvplane.core.types import Tier
from worker_agent.engines.base import (
    mean,
    metric_families,
    metric_samples,
    prefix_cache_counters,
    total,
)
from worker_agent.engines.kv_event_wire import DecodedBatch, WireDialect, decode_batch
from worker_agent.events import (
    EngineCacheConfig,
    EngineLoad,
    PrefixCacheCounters,
)

VLLM_DIALECT = WireDialect(
    stored_fields=(
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx",
    ),
    removed_fields=("block_hashes", "medium", "group_idx"),
    mediums={"GPU": Tier.DEVICE, "CPU": Tier.HOST, "STORAGE": Tier.DISK},
    salt_field=None,
)  # fmt: skip


# NixlConnector's failures (vLLM 0.34 nixl/stats.py), where the engine has them.
_NIXL_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"
_NIXL_EXPIRED_LEASES = "vllm:nixl_num_kv_expired_reqs_total"
_LOAD_METRICS = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        _NIXL_FAILED_TRANSFERS,
        _NIXL_EXPIRED_LEASES,
    }
)

# Counters in tokens; before 0.12 they were named `gpu_prefix_cache_*`.
_PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_PREFILLED = "vllm:time_to_first_token_seconds_count"
_NIXL_PREFIX = "vllm:nixl_"
_KV_FETCH_GAUGE = "vllm:num_requests_kv_fetch_by_stage"


class VllmAdapter:
    kind = "vllm"
    version_path = "/version"

    def decode_batch(self, payload: bytes) -> DecodedBatch:
        return decode_batch(payload, VLLM_DIALECT)

    def parse_load(self, metrics_text: str) -> EngineLoad:
        samples = metric_samples(metrics_text, _LOAD_METRICS)
        running = total(samples, "vllm:num_requests_running")
        waiting = total(samples, "vllm:num_requests_waiting")
        usage = mean(samples, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
        if running is None or waiting is None or usage is None:
            raise ValueError("the engine's metrics lack vLLM's request and KV cache gauges")
        return EngineLoad(
            int(running),
            int(waiting),
            min(max(usage, 0.0), 1.0),
            kv_load_failures=int(total(samples, _NIXL_FAILED_TRANSFERS) or 0),
            kv_leases_expired=int(total(samples, _NIXL_EXPIRED_LEASES) or 0),
        )

    def parse_cache_config(self, metrics_text: str) -> EngineCacheConfig | None:
        for sample in metric_samples(metrics_text, ("vllm:cache_config_info",)):
            if sample.name == "vllm:cache_config_info":
                return EngineCacheConfig(
                    block_size=_int_label(sample.labels.get("block_size")),
                    num_blocks=_int_label(sample.labels.get("num_gpu_blocks")),
                )
        return None

    def parse_kv_transfer_config(self, metrics_text: str) -> KvTransferConfig | None:
        """vLLM labels no metric with its connector or role; their families tell part of
        it (vLLM 0.34, vllm/v1/metrics/loggers.py): NixlConnector's `vllm:nixl_*` exist
        only with that connector, and the KV-fetch gauge only on an engine that consumes
        KV (kv_consumer or kv_both, which the metrics cannot tell apart: both read as
        kv_both, and agent.role names a decode pool)."""
        families = metric_families(metrics_text)
        if not any(name.startswith(_NIXL_PREFIX) for name in families):
            return None
        consumes = _KV_FETCH_GAUGE in families
        return kv_transfer_config("NixlConnector", "kv_both" if consumes else "kv_producer")

    def parse_prefix_cache(self, metrics_text: str) -> PrefixCacheCounters | None:
        return prefix_cache_counters(metrics_text, _PREFIX_QUERIES, _PREFIX_HITS, _PREFILLED)

    def release_warnings(self, version: str) -> list[str]:
        return []  # the agent keys blocks itself: vLLM's per-process hash seeds do not matter


def _int_label(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None  # "None" before the cache is profiled
