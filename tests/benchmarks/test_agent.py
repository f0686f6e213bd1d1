"""`kvplane bench agent` end to end with tiny parameters, flooded and paced: the
report's shape, and figures that are measurements (positive), not their size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplane.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("rate", [None, 100.0])
def test_bench_agent_reports_throughput_and_cpu_a_batch(
    tmp_path: Path, rate: float | None, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "agent.json"
    paced = [] if rate is None else ["--rate", str(rate)]
    status = main(
        ["bench", "agent", "--json", str(report_path), "--events", "30",
         "--blocks-per-event", "2", *paced]
    )  # fmt: skip
    assert status == 0
    report = json.loads(report_path.read_text())
    assert report["stored_blocks"] == 60
    assert report["rate_per_s"] == rate
    assert report["stored_blocks_per_s"] > 0
    assert report["cpu_us_per_batch"] > 0
    # The router's CPU is read in clock ticks (10 ms): 30 batches may cost it less.
    assert report["router_cpu_us_per_batch"] >= 0
    out = capsys.readouterr().out
    assert "of the agent's CPU a batch and" in out
    assert "of the control plane's" in out
