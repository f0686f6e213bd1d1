"""`kvplane bench policies`: each point's standing, a small grid run end to end, and
the errors."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.policy_grid import GRID, Series, _verdict, run_policy_grid
from simulations.fleet_sim.policies import POLICIES
from simulations.fleet_sim.report import PolicyFigures


def _figures(ttft_p90_s: float) -> PolicyFigures:
    return PolicyFigures(
        0.5, 0.9, 0.9, 1000, 0.2, 0.1, ttft_p90_s, 3.0, 1.0, 5.0, 100.0, 1.1, 0, 10, 0
    )


def test_the_standing_compares_kvplane_with_the_best_other_policy() -> None:
    results = {"kvplane": _figures(1.0), "random": _figures(3.0), "dynamo": _figures(1.5)}
    assert _verdict(results, 2.0) == ("dynamo", "1.50", "kvplane best")
    results["kvplane"] = _figures(1.8)
    assert _verdict(results, 2.0) == ("dynamo", "1.50", "dynamo best, kvplane +20%")
    results = {"kvplane": _figures(4.0), "random": _figures(3.0)}
    assert _verdict(results, 2.0) == ("random", "3.00", "none meets the SLO")


def test_every_series_builds_its_workload_at_each_rate() -> None:
    names = [series.name for series in GRID]
    assert len(set(names)) == len(names)
    shared = next(series for series in GRID if series.name == "shared-prefix")
    slow, fast = (shared.build(rate)[0] for rate in shared.rates[:2])
    assert len(slow.requests) == len(fast.requests)
    assert fast.requests[-1].arrival_s < slow.requests[-1].arrival_s
    llmd = next(series for series in GRID if series.name == "llmd-prefix")
    _, config = llmd.build(llmd.rates[0])
    assert config.timing.decode_ms_per_request > 0  # Qwen3-32B on two H100s


def test_a_small_grid_runs_every_policy(tmp_path: Path) -> None:
    tiny = Series(
        "shared-prefix",
        "rate_per_s",
        (5.0, 50.0),
        2,
        65_536,
        workload_args={"groups": 3, "prompts_per_group": 4},
    )
    lines: list[str] = []
    out = tmp_path / "grid.json"
    code = run_policy_grid(
        json_path=out,
        scoring_overrides={"queued_prefill_weight": 0.75},
        grid=[tiny],
        processes=1,
        report=lines.append,
    )
    assert code == 0
    assert "queued_prefill_weight" in lines[0]
    assert lines[1].count("shared-prefix") == 2
    document = json.loads(out.read_text())
    assert document["scoring"]["queued_prefill_weight"] == 0.75
    assert [point["rate"] for point in document["points"]] == [5.0, 50.0]
    for point in document["points"]:
        assert set(point["policies"]) == set(POLICIES)
