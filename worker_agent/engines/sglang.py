"""SGLang: the same ZMQ framing as vLLM 0.26+, signed 64-bit hashes; `sglang:*` metrics.

Its events changed shape twice, and every shape decodes: up to 0.5.17 positional arrays
that end at the medium (no salt: those releases hash identical prompts of different
tenants alike); 0.5.18 and 0.5.19 the same arrays with a metadata map at position 7
(`{"cache_salt": ...}`) on salted stores; from 0.5.20 tagged maps with a `cache_salt`
field."""

from __future__ import annotations

from kvplane.core.kv_transfer import KvTransferConfig
from kvplane.core.types import Tier
from worker_agent.engines.base import (
    mean,
    metric_samples,
    prefix_cache_counters,
    release_of,
    total,
)
from worker_agent.engines.kv_event_wire import DecodedBatch, WireDialect, decode_batch
from worker_agent.events import (
    EngineCacheConfig,
    EngineLoad,
    PrefixCacheCounters,
)

SGLANG_DIALECT = WireDialect(
    stored_fields=(
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "cache_salt", "session_id", "lora_name",
    ),
    removed_fields=("block_hashes", "medium"),
    mediums={
        "GPU": Tier.DEVICE, "CPU_PINNED": Tier.HOST, "DISK": Tier.DISK, "EXTERNAL": Tier.REMOTE,
    },
    salt_field="cache_salt",
)  # fmt: skip


_LOAD_METRICS = frozenset(
    {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"}
)

# Prompt tokens processed, and those served from cache (by cache_source: summed).
_PROMPT_TOKENS = ("sglang:prompt_tokens_total",)
_CACHED_TOKENS = ("sglang:cached_tokens_total",)
_PREFILLED = "sglang:time_to_first_token_seconds_count"


class SglangAdapter:
    kind = "sglang"
    version_path = "/server_info"

    def decode_batch(self, payload: bytes) -> DecodedBatch:
        return decode_batch(payload, SGLANG_DIALECT)

    def parse_load(self, metrics_text: str) -> EngineLoad:
        samples = metric_samples(metrics_text, _LOAD_METRICS)
        running = total(samples, "sglang:num_running_reqs")
        waiting = total(samples, "sglang:num_queue_reqs")
        usage = mean(samples, "sglang:token_usage")
        if running is None or waiting is None or usage is None:
            raise ValueError("the engine's metrics lack SGLang's request and token gauges")
        return EngineLoad(int(running), int(waiting), min(max(usage, 0.0), 1.0))

    def parse_cache_config(self, metrics_text: str) -> EngineCacheConfig | None:
        return None  # SGLang's metrics count tokens, not blocks of a known size

    def parse_kv_transfer_config(self, metrics_text: str) -> KvTransferConfig | None:
        return None  # SGLang's bootstrap protocol is not routed (docs/pd-disaggregation.md)

    def parse_prefix_cache(self, metrics_text: str) -> PrefixCacheCounters | None:
        return prefix_cache_counters(metrics_text, _PROMPT_TOKENS, _CACHED_TOKENS, _PREFILLED)

    def release_warnings(self, version: str) -> list[str]:
        release = release_of(version)
        if release is None or release >= (0, 5, 18):
            return []
        return [
            f"SGLang {version} hashes identical prompts of different tenants alike and sends "
            "no cache salt in its events: tenants that share this engine share its cache "
            "(and the agent keys every block in the shared scope); SGLang 0.5.18 or later "
            "keeps salted prefixes apart"
        ]
