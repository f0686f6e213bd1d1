"""Envoy in the bake-off: `kvplane-envoy kvplane` (Envoy asking kvplane's endpoint
picker), `envoy round_robin` (Envoy alone, the same bootstrap less the picker) and
`envoy trivial-picker` (Envoy asking a picker that decides nothing).

Pure: the bootstrap without the picker, the refusal without `make envoy-env`, where
kvplane-envoy stands. Then, marked `heavy("envoy")`, both routers in a quick cell in
front of a real fleet, with the evidence that the picker was asked and routed; and a
two-replica multi-tenant cell, each replica with its own Envoy and the tenants' keys
read by the picker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.live import envoy
from benchmarks.live.bakeoff import CellResult, run_cell
from benchmarks.live.engines import EngineShape
from benchmarks.live.grid import Cell
from benchmarks.live.main import DEFAULT_TRACE
from benchmarks.live.report import render_tables
from benchmarks.live.routers import ROUTERS
from benchmarks.live.standings import standings
from router.picker.envoy_config import PICKER_CLUSTER, build_bootstrap
from tests import heavy

REPO = Path(__file__).resolve().parents[3]
KVPLANE_ENVOY, ENVOY_ALONE = "kvplane-envoy kvplane", "envoy round_robin"
TRIVIAL_PICKER = "envoy trivial-picker"


def _http_filters(bootstrap: dict[str, Any]) -> list[str]:
    (listener,) = bootstrap["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    return [f["name"] for f in manager["typed_config"]["http_filters"]]


def test_envoy_alone_is_the_pickers_bootstrap_less_the_picker() -> None:
    endpoints, listen = ["127.0.0.1:8001", "127.0.0.1:8002"], "127.0.0.1:10001"
    alone = envoy.alone_bootstrap(endpoints=endpoints, listen=listen, admin_port=9902)
    full = build_bootstrap(
        endpoints=endpoints, listen=listen, admin_port=9902, pickers=["127.0.0.1:9002"]
    )
    assert _http_filters(full) == [
        "envoy.filters.http.header_mutation",
        envoy.EXT_PROC_FILTER,
        "envoy.filters.http.router",
    ]
    assert _http_filters(alone) == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.router",
    ]
    clusters = alone["static_resources"]["clusters"]
    assert PICKER_CLUSTER not in {cluster["name"] for cluster in clusters}
    # Everything else as build_bootstrap writes it: the same workers' cluster (its
    # override_host policy, which with nothing named falls back to round robin).
    assert clusters == [full["static_resources"]["clusters"][0]]
    assert {k: v for k, v in alone.items() if k != "static_resources"} == {
        k: v for k, v in full.items() if k != "static_resources"
    }


def test_engine_endpoints_are_ip_and_port() -> None:
    assert envoy.engine_endpoints(["http://127.0.0.1:8001", "http://127.0.0.1:8002/"]) == [
        "127.0.0.1:8001",
        "127.0.0.1:8002",
    ]


def test_refuses_without_envoy_and_names_what_runs_here(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "bench", "live", "--quick"],
        cwd=REPO,
        env={
            **os.environ,
            "KVPLANE_ENVOY_VENV": str(tmp_path / "no-envoy"),
            "KVPLANE_PEERS_VENV": str(tmp_path / "no-peers"),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 2
    assert "make envoy-env" in completed.stderr
    assert "make peers-env" in completed.stderr
    # --only matches substrings: "kvplane" would pick kvplane-envoy's cells too, so the
    # hint names each router that runs here instead.
    assert "--only 'kvplane kvplane' --only 'kvplane round-robin')" in completed.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_kvplane_behind_envoy_stands_as_kvplane_and_envoy_alone_is_no_peer() -> None:
    def cell(router: str, hit: float, p90: float, cpu: float) -> CellResult:
        spec = next(spec for spec in ROUTERS if spec.name == router)
        result = CellResult(
            router, spec.family, spec.policy, "shared-8", "medium", 15.0, "steady", 1
        )
        result.engine_hit_rate, result.ttft_p90_ms, result.cpu_ms_per_request = hit, p90, cpu
        return result

    found = standings(
        [
            cell("kvplane kvplane", 0.9, 60.0, 8.0),
            cell(KVPLANE_ENVOY, 0.9, 62.0, 9.0),
            cell(ENVOY_ALONE, 0.2, 400.0, 1.0),
            cell("smg cache_aware", 0.9, 61.0, 3.0),
        ]
    )
    assert [standing.router for standing in found] == ["kvplane kvplane", KVPLANE_ENVOY]
    assert {standing.peer_with_cpu for standing in found} == {"smg cache_aware"}
    assert {standing.peer_with_ttft_p90 for standing in found} == {"smg cache_aware"}


def test_the_table_splits_the_cpu_of_a_router_charged_several_parts() -> None:
    result = CellResult(
        KVPLANE_ENVOY, "kvplane-envoy", "kvplane", "shared-8", "medium", 15.0, "steady", 1
    )
    result.ttft_p90_ms = result.ttft_p50_ms = result.ttft_p99_ms = 50.0
    result.cpu_ms_per_request_by_part = {"envoy": 1.25, "router": 4.0, "agents": 2.0}
    peer = CellResult("smg cache_aware", "smg", "cache_aware", "shared-8", "medium", 15.0,
                      "steady", 1)  # fmt: skip
    peer.cpu_ms_per_request_by_part = {"router": 3.0}
    table = render_tables([result, peer])
    assert f"{KVPLANE_ENVOY}: CPU ms/req by part: envoy 1.2, router 4.0, agents 2.0" in table
    assert "smg cache_aware: CPU ms/req" not in table  # one part: the row says it all


# --- a real Envoy ------------------------------------------------------------------


def _envoy_stats(evidence: dict[str, Any]) -> list[dict[str, int]]:
    return [entry["stats"] for entry in evidence.values() if "stats" in entry]


def _replicas(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    return [entry for entry in evidence.values() if "index_entries" in entry]


@pytest.mark.heavy("envoy")
@pytest.mark.timeout(300)
def test_quick_cells_behind_envoy_show_the_picker_in_play(tmp_path: Path) -> None:
    heavy.envoy_binary()
    report = tmp_path / "live.json"
    command = [
        sys.executable, "-m", "kvplane.cli", "bench", "live", "--quick",
        "--only", KVPLANE_ENVOY, "--only", ENVOY_ALONE, "--only", TRIVIAL_PICKER,
        "--duration", "3",
        "--json", str(report), "--logs", str(tmp_path / "logs"),
    ]  # fmt: skip
    completed = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    cells = {cell["router"]: cell for cell in json.loads(report.read_text())["cells"]}
    assert set(cells) == {KVPLANE_ENVOY, ENVOY_ALONE, TRIVIAL_PICKER}
    for cell in cells.values():
        assert cell["error"] is None, cell
        assert cell["requests"] > 0, cell
        assert cell["failed"] == 0, cell
        assert cell["version"].endswith(envoy.envoy_version()), cell
        assert sum(cell["engine_requests"].values()) == cell["requests"], cell
    picked = cells[KVPLANE_ENVOY]
    (replica,) = _replicas(picked["evidence"])
    assert replica["index_entries"] > 0
    assert replica["live_workers"] == 4
    assert replica["wiring_checked_before"] == {"ok": True, "workers_probed": 4}
    # Every request went through the picker (an ext_proc stream each) and the picker
    # handed each off to the engine it named.
    assert replica["requests_by_outcome"]["handed_off"] == picked["requests"]
    (stats,) = _envoy_stats(picked["evidence"])
    assert stats["http.kvplane.ext_proc.streams_started"] == picked["requests"]
    assert stats["http.kvplane.ext_proc.streams_failed"] == 0
    assert stats["http.kvplane.downstream_rq_2xx"] == picked["requests"]
    # Its CPU in three parts, each process charged to one.
    assert set(picked["cpu_s_by_part"]) == {"envoy", "router", "agents"}
    assert {name.split("-")[0] for name in picked["cpu_s_by_process"]} == {"envoy", "kvplane"}
    assert sum(picked["cpu_s_by_part"].values()) == pytest.approx(picked["router_cpu_s"])
    alone = cells[ENVOY_ALONE]
    assert _replicas(alone["evidence"]) == []
    (stats,) = _envoy_stats(alone["evidence"])
    assert not any(".ext_proc." in name for name in stats)  # no picker in its path
    assert stats["http.kvplane.downstream_rq_2xx"] == alone["requests"]
    assert set(alone["cpu_s_by_part"]) == {"envoy"}
    assert max(alone["engine_requests"].values()) - min(alone["engine_requests"].values()) <= 1
    trivial = cells[TRIVIAL_PICKER]  # the floor under kvplane's picker: asked, no decision
    (stats,) = _envoy_stats(trivial["evidence"])
    assert stats["http.kvplane.ext_proc.streams_started"] == trivial["requests"]
    assert stats["http.kvplane.ext_proc.streams_failed"] == 0
    assert set(trivial["cpu_s_by_part"]) == {"envoy", "router"}
    assert "CPU ms/req by part: envoy" in completed.stdout


@pytest.mark.heavy("envoy")
@pytest.mark.timeout(180)
def test_two_replicas_behind_their_envoys_keep_tenants_apart(tmp_path: Path) -> None:
    heavy.envoy_binary()
    (spec,) = [router for router in ROUTERS if router.name == KVPLANE_ENVOY]
    result = run_cell(
        Cell(spec, "multi-tenant", "light", "two-replicas", 1),
        duration_s=3.0,
        trace=DEFAULT_TRACE,
        log_root=tmp_path,
        shape=EngineShape(),
    )
    assert result.error is None, result.error
    assert result.requests > 0
    assert result.failed == 0
    assert result.unsalted_blocks == 0  # the picker salted every tenant's request
    replicas = _replicas(result.evidence)
    assert len(replicas) == 2
    assert all(replica["index_entries"] > 0 for replica in replicas)
    handed_off = [replica["requests_by_outcome"].get("handed_off", 0) for replica in replicas]
    assert all(count > 0 for count in handed_off)  # the client alternated between them
    assert sum(handed_off) == result.requests
    envoys = _envoy_stats(result.evidence)
    started = [stats["http.kvplane.ext_proc.streams_started"] for stats in envoys]
    assert sorted(started) == sorted(handed_off)  # each Envoy asked its own replica
    assert {name for name in result.cpu_s_by_process if name.startswith("envoy-")} == {
        "envoy-1",
        "envoy-2",
    }
