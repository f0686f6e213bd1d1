"""`kvplane bench scale` end to end at its smallest (four synthetic workers, two
routers, a Redis Cluster with replicas): every figure measured on an index that was in
play; and the histogram readings it rests on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.scale import bucket_quantile, idle_share, machine_cpu_ticks, share_within
from kvplane.cli import main

pytestmark = pytest.mark.slow

CAPACITY, REQUEST, SYSTEM = 256, 32, 64  # blocks: a worker holds 64 + 6 x 32 = 256


def test_bench_scale_measures_a_fleet_that_filled_the_shared_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "scale.json"
    status = main(
        ["bench", "scale", "--workers", "4", "--routers", "2", "--duration", "2",
         "--capacity-blocks", str(CAPACITY), "--request-blocks", str(REQUEST),
         "--batches-per-s", "5", "--request-rate", "20", "--json", str(report_path)]
    )  # fmt: skip
    assert status == 0
    report = json.loads(report_path.read_text())
    assert (report["shape"]["index_directory"], report["shape"]["index_groups"]) == (False, 16)
    (point,) = report["points"]
    assert (point["workers"], point["routers"]) == (4, 2)
    assert point["failed_workers"] == 0
    assert point["reconnects"] == 0
    assert point["entries"] == 4 * CAPACITY  # full: each batch stores one and evicts one
    assert point["index_entries"] == point["entries"]
    assert point["events_per_s"] > 0
    assert point["events_per_s_per_router"] == pytest.approx(point["events_per_s"] / 2, abs=0.1)
    assert point["apply_lag_p99_ms"] >= point["apply_lag_p50_ms"] > 0
    assert point["redis_bytes_per_entry"] > 0
    assert point["requests"] > 0
    assert point["failed_requests"] == 0
    assert 0 < point["decision_p50_ms"] <= point["decision_p99_ms"]
    assert 0 < point["decisions_within_5ms"] <= 1
    assert 0 < point["quiet_decision_p50_ms"] <= point["quiet_decision_p99_ms"]
    for phase in ("rest", "ingest", "quiet"):
        assert 0 <= point[f"idle_share_{phase}"] <= 1, phase
    assert "4 workers, 2 routers" in capsys.readouterr().out


def test_bench_scale_faults_lose_nothing_the_agents_hold(tmp_path: Path) -> None:
    report_path = tmp_path / "faults.json"
    status = main(
        ["bench", "scale", "--faults", "--workers", "4", "--routers", "2", "--duration", "4",
         "--capacity-blocks", str(CAPACITY), "--request-blocks", str(REQUEST),
         "--batches-per-s", "5", "--request-rate", "20", "--directory", "--groups", "3",
         "--json", str(report_path)]
    )  # fmt: skip
    assert status == 0
    report = json.loads(report_path.read_text())
    # The layout whose groups keep one, in three groups: the audits find the routers'
    # keys only where the routers were given the same layout.
    assert (report["shape"]["index_directory"], report["shape"]["index_groups"]) == (True, 3)
    (point,) = report["points"]
    clean = {"settled": True, "workers": 4, "missing": 0, "extra": 0, "wrong_incarnation": 0,
             "mismatched_workers": 0}  # fmt: skip
    failover, restart = point["failover"], point["restart"]
    assert point["audit_before"] == failover["first_audit"] == failover["audit"] == clean
    assert restart["first_audit"] == restart["audit"] == clean
    assert failover["cluster_ok_s"] >= failover["promoted_s"] > 0
    assert failover["requests"] > 0
    assert failover["failed_requests"] == 0  # load-only meanwhile, never refused
    # The restarted router's agents went on through the other under their incarnations
    # (the shared index records where each left off), and it found them in the index.
    assert restart["resumed"] >= 1
    assert restart["new_incarnations"] == 0
    assert restart["on_index_s"] >= restart["healthy_s"] > 0


def test_a_quantile_read_off_cumulative_buckets_is_linear_within_its_bucket() -> None:
    buckets = {0.001: 50.0, 0.005: 90.0, 0.01: 100.0, math.inf: 100.0}
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.001)
    assert bucket_quantile(buckets, 0.7) == pytest.approx(0.003)
    assert bucket_quantile(buckets, 0.99) == pytest.approx(0.0095)
    assert share_within(buckets, 0.005) == pytest.approx(0.9)


def test_a_quantile_beyond_the_last_bound_is_the_last_bound_and_none_is_nan() -> None:
    assert bucket_quantile({0.001: 1.0, math.inf: 10.0}, 0.99) == pytest.approx(0.001)
    assert math.isnan(bucket_quantile({0.001: 0.0, math.inf: 0.0}, 0.5))
    assert math.isnan(share_within({math.inf: 0.0}, 0.005))


def test_the_idle_share_of_a_phase_is_read_off_the_machine_s_ticks() -> None:
    assert idle_share((100, 400), (130, 500)) == pytest.approx(0.3)
    assert math.isnan(idle_share(None, (130, 500)))  # /proc/stat could not be read
    assert math.isnan(idle_share((100, 400), (100, 400)))  # no tick between them
    ticks = machine_cpu_ticks()
    assert ticks is not None
    assert 0 <= ticks[0] <= ticks[1]
