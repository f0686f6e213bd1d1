"""`kvplane demo` end to end, in process: both policies run and the table is printed."""

from __future__ import annotations

import re

import pytest

from simulations.demo import RunResult, render_table, run_demo


@pytest.mark.slow
async def test_demo_runs_both_policies_and_kvplane_hits_more(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert await run_demo() == 0

    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "round-robin" in line and "kvplane" in line)
    assert header.split() == ["kvplane", "round-robin"]
    hit_line = next(line for line in out.splitlines() if line.startswith("cache hit rate"))
    kvplane_rate, round_robin_rate = (float(v) for v in re.findall(r"([\d.]+)%", hit_line))
    assert kvplane_rate > round_robin_rate
    failed = next(line for line in out.splitlines() if line.startswith("failed requests"))
    assert failed.split()[-2:] == ["0", "0"]
    assert "demo finished" in out
    # Each policy's fleet was proven wired before anything was measured on it.
    assert out.count("wiring checked: 3 workers, no check failed") == 2


def test_the_table_lines_up() -> None:
    first, second = RunResult("kvplane"), RunResult("round-robin")
    first.per_worker["worker-1"] = 3
    second.per_worker["worker-2"] = 12
    lines = render_table([first, second]).splitlines()
    assert len({len(line) for line in lines}) == 1  # every row as wide as the header
    assert any(line.startswith("requests on worker-2") for line in lines)
