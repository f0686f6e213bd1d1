"""An engine's KV connector and role as its metrics show them (worker_agent/engines/vllm.py
parse_kv_transfer_config), and the families of a Prometheus exposition
(worker_agent/engines/base.py metric_families). The expositions are rendered by
prometheus_client, as vLLM's own are, with vLLM's names and per-engine labels."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvplane.core.kv_transfer import KvTransferConfig
from worker_agent.engines.base import metric_families
from worker_agent.engines.sglang import SglangAdapter
from worker_agent.engines.vllm import VllmAdapter

VLLM = VllmAdapter()
MODEL = "meta-llama/Llama-3.1-8B"
LABELS = ("model_name", "engine")


def exposition(*, nixl: bool, kv_fetch: bool, engines: int = 1, children: bool = True) -> str:
    """vLLM's /metrics: its load gauges, NixlConnector's families where it has that
    connector (one child per data-parallel engine, as vLLM creates them at start-up), and
    the KV-fetch gauge where it consumes KV. `children=False`: families declared only."""
    registry = CollectorRegistry()
    running = Gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        LABELS,
        registry=registry,
    )
    Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=registry)
    per_engine = []
    if nixl:
        per_engine += [
            Histogram(
                "vllm:nixl_xfer_time_seconds",
                "Histogram of transfer duration for NIXL KV Cache transfers.",
                LABELS,
                buckets=(0.001, 0.01, 0.1, 1.0),
                registry=registry,
            ),
            Histogram(
                "vllm:nixl_bytes_transferred",
                "Histogram of bytes transferred per NIXL KV Cache transfers.",
                LABELS,
                buckets=(2**20, 2**25, 2**30),
                registry=registry,
            ),
            Counter(
                "vllm:nixl_num_failed_transfers",
                "Number of failed NIXL KV Cache transfers.",
                LABELS,
                registry=registry,
            ),
            Counter(
                "vllm:nixl_num_failed_notifications",
                "Number of failed NIXL KV Cache notifications.",
                LABELS,
                registry=registry,
            ),
        ]
    fetch = None
    if kv_fetch:
        fetch = Gauge(
            "vllm:num_requests_kv_fetch_by_stage",
            "Number of requests fetching remote KV, by stage.",
            (*LABELS, "stage"),
            registry=registry,
        )
    for engine in range(engines):
        values = (MODEL, str(engine))
        running.labels(*values).set(2)
        if not children:
            continue
        for metric in per_engine:
            metric.labels(*values)
        if fetch is not None:
            for stage in ("waiting_to_start", "in_progress", "completed_waiting"):
                fetch.labels(*values, stage).set(0)
    return generate_latest(registry).decode()


# -- VllmAdapter.parse_kv_transfer_config -----------------------------------------------


def test_an_engine_without_nixl_families_shows_no_connector() -> None:
    assert VLLM.parse_kv_transfer_config(exposition(nixl=False, kv_fetch=False)) is None


def test_the_kv_fetch_gauge_alone_shows_no_connector() -> None:
    assert VLLM.parse_kv_transfer_config(exposition(nixl=False, kv_fetch=True)) is None


def test_nixl_families_and_the_kv_fetch_gauge_read_as_a_nixl_kv_both_engine() -> None:
    text = exposition(nixl=True, kv_fetch=True)
    assert "vllm:nixl_num_failed_transfers_total{" in text  # as vLLM renders its counter
    expected = KvTransferConfig("NixlConnector", "kv_both")
    assert VLLM.parse_kv_transfer_config(text) == expected


def test_nixl_families_without_the_kv_fetch_gauge_read_as_a_producer() -> None:
    text = exposition(nixl=True, kv_fetch=False)
    assert VLLM.parse_kv_transfer_config(text) == KvTransferConfig("NixlConnector", "kv_producer")


@pytest.mark.parametrize("kv_fetch", [True, False])
def test_families_declared_before_any_engine_reports_still_count(kv_fetch: bool) -> None:
    text = exposition(nixl=True, kv_fetch=kv_fetch, children=False)
    assert "vllm:nixl_num_failed_transfers_total{" not in text  # no sample yet
    role = "kv_both" if kv_fetch else "kv_producer"
    assert VLLM.parse_kv_transfer_config(text) == KvTransferConfig("NixlConnector", role)


def test_data_parallel_engines_read_as_one_connector() -> None:
    text = exposition(nixl=True, kv_fetch=True, engines=4)
    assert VLLM.parse_kv_transfer_config(text) == KvTransferConfig("NixlConnector", "kv_both")


def test_sglang_shows_no_connector_whatever_its_metrics() -> None:
    assert SglangAdapter().parse_kv_transfer_config(exposition(nixl=True, kv_fetch=True)) is None


# -- metric_families ----------------------------------------------------------------------


def test_metric_families_are_the_declared_families_and_their_sample_names() -> None:
    families = metric_families(exposition(nixl=True, kv_fetch=True))
    assert {
        "vllm:num_requests_running",
        "vllm:prompt_tokens_total",  # a counter's family, as the text format names it
        "vllm:nixl_xfer_time_seconds",
        "vllm:nixl_xfer_time_seconds_bucket",
        "vllm:nixl_bytes_transferred",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:nixl_num_failed_notifications_total",
        "vllm:num_requests_kv_fetch_by_stage",
    } <= families
    assert all(name.startswith("vllm:") for name in families)
    # Nothing from the help texts or labels.
    assert not families & {"Number", "Histogram", "", "#", "HELP", "TYPE", "model_name"}


def test_metric_families_include_a_family_with_no_sample_yet() -> None:
    text = exposition(nixl=True, kv_fetch=False, children=False)
    families = metric_families(text)
    assert "vllm:nixl_num_failed_transfers_total" in families  # from its `# TYPE` line
    assert "vllm:nixl_xfer_time_seconds" in families
    assert "vllm:nixl_xfer_time_seconds_bucket" not in families  # no sample yet
    assert "vllm:num_requests_kv_fetch_by_stage" not in families


def test_metric_families_of_bare_samples_and_nothing() -> None:
    text = 'vllm:num_requests_waiting{engine="0"} 3.0\nvllm:nixl_num_descriptors_count 7\n'
    assert metric_families(text) == {"vllm:num_requests_waiting", "vllm:nixl_num_descriptors_count"}
    assert metric_families("") == set()
    assert metric_families("# HELP vllm:x Something.\n\n") == set()


def _load_exposition(*, nixl: bool) -> str:
    registry = CollectorRegistry()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        Gauge(name, name, LABELS, registry=registry).labels(MODEL, "0").set(1)
    Gauge("vllm:kv_cache_usage_perc", "usage", LABELS, registry=registry).labels(MODEL, "0").set(
        0.5
    )
    if nixl:
        failed = Counter("vllm:nixl_num_failed_transfers", "failed", LABELS, registry=registry)
        expired = Counter("vllm:nixl_num_kv_expired_reqs", "expired", LABELS, registry=registry)
        failed.labels(MODEL, "0").inc(2)
        failed.labels(MODEL, "1").inc(3)
        expired.labels(MODEL, "0").inc(1)
    return generate_latest(registry).decode()


def test_the_load_carries_nixls_failure_counts_summed_over_engines() -> None:
    load = VLLM.parse_load(_load_exposition(nixl=True))
    assert (load.kv_load_failures, load.kv_leases_expired) == (5, 1)


def test_an_engine_without_nixl_reports_no_failures() -> None:
    load = VLLM.parse_load(_load_exposition(nixl=False))
    assert (load.running, load.kv_load_failures, load.kv_leases_expired) == (1, 0, 0)
