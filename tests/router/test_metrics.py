"""RouterMetrics' kept children: counted like labels() children, and never a pruned one."""

from __future__ import annotations

from prometheus_client import generate_latest

from router.metrics import RouterMetrics


def series(metrics: RouterMetrics, outcome: str, worker: str) -> float | None:
    return metrics.registry.get_sample_value(
        "kvplane_requests_total", {"outcome": outcome, "worker": worker}
    )


def test_a_kept_child_counts_where_labels_would() -> None:
    metrics = RouterMetrics()
    metrics.child(metrics.requests, outcome="ok", worker="w1").inc()
    metrics.requests.labels(outcome="ok", worker="w1").inc()
    metrics.child(metrics.requests, outcome="ok", worker="w1").inc(2)
    metrics.child(metrics.requests, outcome="router_busy", worker="w1").inc()
    assert series(metrics, "ok", "w1") == 4
    assert series(metrics, "router_busy", "w1") == 1


def test_a_pruned_workers_series_comes_back_counted_afresh() -> None:
    """After retain_workers removed a worker's series, a kept child would count into a
    series no scrape shows: the worker's next request must start a new one."""
    metrics = RouterMetrics()
    metrics.child(metrics.requests, outcome="ok", worker="w1").inc(5)
    metrics.child(metrics.requests, outcome="ok", worker="w2").inc()
    metrics.retain_workers(["w2"])
    assert 'worker="w1"' not in generate_latest(metrics.registry).decode()
    metrics.child(metrics.requests, outcome="ok", worker="w1").inc()
    metrics.child(metrics.requests, outcome="ok", worker="w2").inc()
    assert series(metrics, "ok", "w1") == 1
    assert series(metrics, "ok", "w2") == 2
