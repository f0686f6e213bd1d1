"""`kvplane bench picker` runs every route and prints and writes its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import heavy

REPO = Path(__file__).resolve().parents[2]
ROUTES = ["engine", "envoy alone", "envoy + trivial picker", "envoy + kvplane picker",
          "kvplane proxy"]  # fmt: skip


@pytest.mark.heavy("envoy")
@pytest.mark.timeout(240)
def test_every_route_is_measured_and_charged_its_processes(tmp_path: Path) -> None:
    heavy.envoy_binary()
    report = tmp_path / "picker.json"
    completed = subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "bench", "picker", "--requests", "10",
         "--repeats", "1", "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=220, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    routes = {route["route"]: route for route in json.loads(report.read_text())["routes"]}
    assert list(routes) == ROUTES
    for route in routes.values():
        assert route["requests"] == 10
        assert 0 < route["latency_p50_ms"] <= route["latency_p90_ms"]
    assert set(routes["envoy + trivial picker"]["cpu_ms_per_request"]) == {"envoy", "picker"}
    assert set(routes["envoy + kvplane picker"]["cpu_ms_per_request"]) == {"envoy", "router"}
    assert routes["envoy + kvplane picker"]["cpu_ms_per_request"]["router"] > 0
    for route in ROUTES:
        assert route in completed.stdout
