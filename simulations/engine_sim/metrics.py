"""The simulator's `/metrics`, with vLLM's metric names and labels.

Agents and routers scrape these exactly as they scrape vLLM: `model_name` and `engine`
labels on every series, counters exposed with `_total`. Prompt tokens are split by
source as vLLM 0.34 splits them (v1/metrics/loggers.py): computed here, hits on this
engine's prefix cache, and tokens a KV connector brought in (counted apart from the
local prefix cache). With a KV connector, its metrics too: for NixlConnector the P/D
transfers, vLLM's names (its `nixl/stats.py`) where vLLM has one, `kvplane_sim:` where
it has none; for OffloadingConnector the copies to and from the CPU tier and the tier's
use, as vLLM 0.32 names them (kv_connector/v1/offloading/metrics.py, kv_offload/cpu/);
and, on an engine that consumes KV (any role but `kv_producer`), vLLM's gauge of
requests by KV-fetch stage. vLLM labels no metric with its connector or role: those
families are what tell a scraper (a producer has the NixlConnector families and no
fetch gauge).
"""

from __future__ import annotations

from typing import Any

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
# vLLM's NixlConnector buckets: transfer seconds, and bytes (2 KiB to 8 GiB, x4 apart).
_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_XFER_BYTES_BUCKETS = tuple(2 ** (10 + step) for step in range(1, 25, 2))
# vLLM's offloading connector's buckets: bytes a copy moves.
_OFFLOAD_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
_LABELS = ("model_name", "engine")

# vllm:prompt_tokens_by_source's sources (vLLM's PromptTokenStats.ALL_SOURCES).
LOCAL_COMPUTE = "local_compute"
LOCAL_CACHE_HIT = "local_cache_hit"
EXTERNAL_KV_TRANSFER = "external_kv_transfer"
# vllm:prompt_tokens_cached_by_source's sources (vLLM's CacheHitSource, in its order):
# hits on this engine's cache are `device`, NixlConnector's are `p2p`.
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
# vllm:num_requests_kv_fetch_by_stage's stages (vLLM's KV_FETCH_STAGES).
KV_FETCH_WAITING_TO_START = "waiting_to_start"
KV_FETCH_IN_PROGRESS = "in_progress"
KV_FETCH_COMPLETED_WAITING = "completed_waiting"
KV_FETCH_STAGES = (KV_FETCH_WAITING_TO_START, KV_FETCH_IN_PROGRESS, KV_FETCH_COMPLETED_WAITING)
# The kv_role values that make an engine consume KV (vLLM's KVConsumer).
_CONSUMER_ROLES = ("kv_consumer", "kv_both")
NIXL_CONNECTOR = "NixlConnector"
OFFLOADING_CONNECTOR = "OffloadingConnector"


class KVTransferMetrics:
    """P/D transfers: pulls on the decode side, lapsed leases on the prefill side."""

    def __init__(self, registry: CollectorRegistry | None, labels: dict[str, str]) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=registry).labels(
                **labels
            )

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=registry).labels(**labels)

        # One observation per pull: their _count is the number of pulls.
        self.xfer_time = histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            _XFER_TIME_BUCKETS,
        )
        self.bytes_transferred = histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            _XFER_BYTES_BUCKETS,
        )
        self.pulled_blocks = counter(
            "kvplane_sim:kv_pulled_blocks", "KV blocks pulled from prefill engines."
        )
        self.failed_transfers = counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers."
        )
        self.expired_leases = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Requests whose KV blocks expired before the decode engine read them.",
        )


# vLLM's transfer types (the label of its earlier offload metrics).
LOAD, STORE = "CPU_to_GPU", "GPU_to_CPU"


class KVOffloadMetrics:
    """Copies between the device and the CPU tier, and how much of the tier they pin.
    A copy is one request's read, or one request's writes offered in one step (vLLM's
    transfer jobs)."""

    def __init__(self, registry: CollectorRegistry | None, labels: dict[str, str]) -> None:
        def family(kind: type[Any], name: str, doc: str, *extra: str, **more: Any) -> Any:
            return kind(name, doc, [*_LABELS, *extra], registry=registry, **more)

        # vLLM's earlier names, by transfer type, which it still exports for its CPU tier.
        old = (
            family(
                Counter,
                "vllm:kv_offload_total_bytes",
                "Number of bytes offloaded by KV connector",
                "transfer_type",
            ),
            family(
                Counter,
                "vllm:kv_offload_total_time",
                "Total time measured by all KV offloading operations",
                "transfer_type",
            ),
            family(
                Histogram,
                "vllm:kv_offload_size",
                "Histogram of KV offload transfer size, in bytes.",
                "transfer_type",
                buckets=_OFFLOAD_SIZE_BUCKETS,
            ),
        )
        # Each transfer type's (bytes, seconds, size histogram), under both names.
        self._copies: dict[str, list[tuple[Any, ...]]] = {}
        for transfer_type, op, done, way in (
            (LOAD, "load", "loaded", "from offload storage to GPU"),
            (STORE, "store", "stored", "from GPU to offload storage"),
        ):
            flat = (
                family(Counter, f"vllm:kv_offload_{op}_bytes", f"Total bytes {done} {way}."),
                family(
                    Counter, f"vllm:kv_offload_{op}_time", f"Total {op} time {way}, in seconds."
                ),
                family(
                    Histogram,
                    f"vllm:kv_offload_{op}_size",
                    f"Histogram of KV offload {op} operation size, in bytes.",
                    buckets=_OFFLOAD_SIZE_BUCKETS,
                ),
            )
            self._copies[transfer_type] = [
                tuple(metric.labels(**labels) for metric in flat),
                tuple(metric.labels(**labels, transfer_type=transfer_type) for metric in old),
            ]
        self.allocation_failures: Counter = family(
            Counter,
            "vllm:kv_offload_allocation_failure",
            "Number of KV offload store allocation attempts that failed.",
        ).labels(**labels)
        # Blocks that copies pin (not the blocks held), over the tier's size.
        self.cpu_cache_usage, self.cpu_cache_write_usage, self.cpu_cache_read_usage = (
            family(Gauge, f"vllm:kv_offload_cpu_cache{part}_usage_perc", doc).labels(**labels)
            for part, doc in (
                ("", "Fraction of CPU KV-cache space currently pinned by active transfers."),
                ("_write", "Fraction of CPU KV-cache space currently pinned by in-flight stores."),
                ("_read", "Fraction of CPU KV-cache space currently pinned by in-flight loads."),
            )
        )

    def copied(self, transfer_type: str, num_bytes: int, seconds: float) -> None:
        """One completed copy: a load (`CPU_to_GPU`) or a store (`GPU_to_CPU`)."""
        for total_bytes, total_seconds, sizes in self._copies[transfer_type]:
            total_bytes.inc(num_bytes)
            total_seconds.inc(seconds)
            sizes.observe(num_bytes)


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        cache_config: dict[str, str],
        engine_index: int = 0,
        kv_connector: str | None = None,
        kv_role: str | None = None,
    ) -> None:
        """`kv_connector` and its `kv_role`: None without a connector (no connector
        metrics are exported then, as vLLM exports none)."""
        self._arguments = (model_name, cache_config, engine_index, kv_connector, kv_role)
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # process_start_time_seconds, as vLLM
        labels = {"model_name": model_name, "engine": str(engine_index)}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=self.registry).labels(**labels)

        def by_label(
            kind: type[Counter] | type[Gauge],
            name: str,
            doc: str,
            label: str,
            values: tuple[str, ...],
        ) -> dict[str, Any]:
            family = kind(name, doc, [*_LABELS, label], registry=self.registry)
            return {value: family.labels(**labels, **{label: value}) for value in values}

        self.running = gauge("vllm:num_requests_running", "Requests in model execution.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens."
        )
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        # vLLM exports these with or without a connector (0 without).
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.prompt_tokens_by_source: dict[str, Counter] = by_label(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            (LOCAL_COMPUTE, LOCAL_CACHE_HIT, EXTERNAL_KV_TRANSFER),
        )
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.prompt_tokens_cached_by_source: dict[str, Counter] = by_label(
            Counter,
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local "
            "HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM "
            "instance) or external_unspecified. Counted at admission; sums to "
            "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            "source",
            CACHE_HIT_SOURCES,
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
        nixl = kv_connector == NIXL_CONNECTOR
        self.kv_transfer = KVTransferMetrics(self.registry if nixl else None, labels)
        offloading = kv_connector == OFFLOADING_CONNECTOR
        self.kv_offload = KVOffloadMetrics(self.registry if offloading else None, labels)
        # Only on an engine that consumes KV, as vLLM (kv_transfer_config.is_kv_consumer).
        self.kv_fetch_by_stage: dict[str, Gauge] = {}
        if kv_role in _CONSUMER_ROLES:
            self.kv_fetch_by_stage = by_label(
                Gauge,
                "vllm:num_requests_kv_fetch_by_stage",
                "Number of waiting requests by async KV load stage. Stage labels: "
                "'waiting_to_start' = needs an async KV load that has not started; "
                "'in_progress' = load started and not yet reported finished; "
                "'completed_waiting' = load finished, request not running yet.",
                "stage",
                KV_FETCH_STAGES,
            )

    def fresh(self) -> EngineMetrics:
        """New metrics with the same labels, every counter at zero (a restarted engine)."""
        return EngineMetrics(*self._arguments)

    def render(self) -> bytes:
        return generate_latest(self.registry)
