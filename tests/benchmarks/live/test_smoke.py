"""`kvplane bench live --quick`: every router, kvplane's, the real peers' (from
`make peers-env`) and Envoy's (from `make envoy-env`), produced figures in front of a
real fleet; and the command refuses clearly when the peers' environment is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from benchmarks.live import envoy
from benchmarks.live.bakeoff import REQUESTS_FILE
from benchmarks.live.routers import ROUTERS, peers_python
from tests import heavy

REPO = Path(__file__).resolve().parents[3]


def _bench_live(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if "KVPLANE_PEERS_VENV" not in (env or {}):
        heavy.require("peers")  # the command runs the peer routers from .peers-venv
    return subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "bench", "live", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_refuses_without_the_peers_environment_and_says_how_to_build_it(tmp_path: Path) -> None:
    completed = _bench_live("--quick", env={"KVPLANE_PEERS_VENV": str(tmp_path / "none")})
    assert completed.returncode == 2
    assert "make peers-env" in completed.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.heavy("peers", "envoy")
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not peers_python().exists() or not envoy.envoy_binary().exists(),
    reason="needs `make peers-env` and `make envoy-env` (make test builds them)",
)
def test_quick_gives_every_router_figures(tmp_path: Path) -> None:
    report = tmp_path / "live.json"
    logs = tmp_path / "logs"
    completed = _bench_live(
        "--quick", "--json", str(report), "--plot", str(tmp_path / "live.png"), "--logs", str(logs)
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    cells = json.loads(report.read_text())["cells"]
    assert sorted(cell["router"] for cell in cells) == sorted(router.name for router in ROUTERS)
    for cell in cells:
        assert cell["error"] is None, cell
        assert cell["version"] not in ("", "unknown"), cell
        assert cell["commands"], cell
        assert cell["requests"] > 0, cell
        assert cell["failed"] == 0, cell
        assert cell["ttft_p90_ms"] > 0, cell
        assert cell["ttft_p90_ms_by_turn"]["0"] > 0, cell
        assert cell["router_cpu_s"] > 0, cell
        assert sum(cell["engine_requests"].values()) == cell["requests"], cell
    kvplane = next(cell for cell in cells if cell["router"] == "kvplane kvplane")
    (evidence,) = kvplane["evidence"].values()
    assert evidence["live_workers"] == 4
    assert evidence["index_entries"] > 0
    assert evidence["wiring_checked_before"] == {"ok": True, "workers_probed": 4}
    assert evidence["blind_workers_after"] == 0
    assert evidence["routing_after"] == {"kvplane-tiny": "cache_aware"}
    pieces = evidence["tokenisation"]  # the system prompts were tokenised once each
    assert pieces["kvplane_prompt_piece_tokens{source=reused}"] > 0
    assert pieces["kvplane_piecewise_tokenisation_checks{result=different}"] == 0
    assert evidence["events"]["kvplane_batches_applied_total"] > 0
    routing = evidence["routing"]  # every request decided, and engines reported its hits
    decided = sum(v for k, v in routing.items() if k.startswith("kvplane_routing_decisions"))
    assert decided >= kvplane["requests"]
    assert sum(v for k, v in routing.items() if k.startswith("kvplane_reported_cached")) > 0
    assert kvplane["rest_cpu_ms_per_s"] > 0
    assert (tmp_path / "live.png").stat().st_size > 0
    assert "hit %" in completed.stdout  # the table
    assert _processes_marked(logs) == []  # it stopped everything it started
    # Each cell's requests beside its logs, one line each, to line up with the logs.
    requests = sorted(logs.glob(f"*/{REQUESTS_FILE}"))
    assert len(requests) == len(cells)
    for path in requests:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(lines) in {cell["requests"] for cell in cells}
        assert all(line["ok"] and line["ttft_s"] > 0 and line["sent_at"] > 0 for line in lines)
        assert {line["turn"] for line in lines} >= {0}


def _processes_marked(logs: Path) -> list[str]:
    """Processes a cell under `logs` started that are still running."""
    left = []
    for process in psutil.process_iter(["cmdline", "environ"]):
        marker = (process.info["environ"] or {}).get("KVPLANE_BENCH_LIVE_LOGS", "")
        if marker.startswith(str(logs)):
            left.append(" ".join(process.info["cmdline"] or []))
    return left
