"""kvplane against the best peer, run by run: the issue's targets read off the results."""

from __future__ import annotations

import math

import pytest

from benchmarks.live.bakeoff import CellResult
from benchmarks.live.report import render_summary_markdown
from benchmarks.live.standings import render_standings, standings


def _cell(
    router: str,
    run: int,
    hit: float,
    p90: float,
    cpu: float,
    *,
    workload: str = "shared-8",
    error: str | None = None,
    unsalted_blocks: int | None = None,
) -> CellResult:
    family, policy = router.split(" ")
    result = CellResult(router, family, policy, workload, "medium", 15.0, "steady", run)
    result.engine_hit_rate, result.ttft_p90_ms, result.cpu_ms_per_request = hit, p90, cpu
    result.error, result.unsalted_blocks = error, unsalted_blocks
    return result


KVPLANE, SMG, SGLANG = "kvplane kvplane", "smg cache_aware", "sglang-router cache_aware"


def test_each_figure_is_set_against_the_best_peer_of_the_same_run() -> None:
    found = standings(
        [
            _cell(KVPLANE, 1, 0.90, 60.0, 8.0),
            _cell(KVPLANE, 2, 0.80, 90.0, 9.0),
            _cell(SMG, 1, 0.85, 50.0, 4.0),
            _cell(SGLANG, 1, 0.70, 70.0, 2.0),
            _cell(SMG, 2, 0.95, 95.0, 3.0),  # run 2 is held only against run 2
        ]
    )
    first, second = found
    assert (first.run, first.peer_with_hit_rate, first.peer_hit_rate) == (1, SMG, 0.85)
    assert (first.peer_with_ttft_p90, first.peer_ttft_p90_ms) == (SMG, 50.0)
    assert (first.peer_with_cpu, first.peer_cpu_ms_per_request) == (SGLANG, 2.0)
    assert first.highest_hit_rate
    assert not first.lowest_ttft_p90
    assert first.cpu_ratio == 4.0
    assert (second.peer_hit_rate, second.peer_ttft_p90_ms, second.cpu_ratio) == (0.95, 95.0, 3.0)
    assert not second.highest_hit_rate
    assert second.lowest_ttft_p90


@pytest.mark.parametrize(
    ("hit", "p90", "highest", "lowest"),
    [
        (0.9076, 60.4, True, True),  # 90.8 % and 60 ms, as the tables show both
        (0.9064, 60.6, False, False),  # 90.6 % and 61 ms
    ],
)
def test_ties_count_as_the_tables_show_the_figures(
    hit: float, p90: float, highest: bool, lowest: bool
) -> None:
    (found,) = standings([_cell(KVPLANE, 1, hit, p90, 8.0), _cell(SMG, 1, 0.908, 60.0, 2.0)])
    assert (found.highest_hit_rate, found.lowest_ttft_p90) == (highest, lowest)


def test_runs_without_figures_and_points_without_peers_are_left_out() -> None:
    found = standings(
        [
            _cell(KVPLANE, 1, 0.9, 60.0, 8.0),
            _cell(SMG, 1, 0.99, 10.0, 1.0, error="did not start"),
            _cell(SGLANG, 1, 0.8, 70.0, 2.0),
            _cell(KVPLANE, 2, 0.9, 60.0, 8.0, error="engine crashed"),
            _cell(SGLANG, 2, 0.8, 70.0, 2.0),
            _cell(KVPLANE, 1, 0.9, 60.0, 8.0, workload="agent-tree"),  # no peer ran it
            _cell(KVPLANE, 3, 0.9, math.nan, 8.0),  # no request answered, no error
            _cell(SGLANG, 3, 0.8, 70.0, 2.0),
            _cell(KVPLANE, 4, 0.9, 60.0, 8.0),
            _cell(SGLANG, 4, 0.8, math.nan, 2.0),
        ]
    )
    assert [(found.workload, found.run, found.peer_with_hit_rate) for found in found] == [
        ("shared-8", 1, SGLANG)
    ]


def test_a_peer_that_let_tenants_share_cache_is_marked() -> None:
    (found,) = standings(
        [_cell(KVPLANE, 1, 0.90, 60.0, 8.0), _cell(SGLANG, 1, 0.93, 70.0, 2.0, unsalted_blocks=9)]
    )
    assert found.peer_shared_tenants_cache
    text = render_standings([found])
    assert "shared tenants' cache" in text
    assert "the highest hit rate in 0 of 1 runs" in text
    assert "CPU per request 4.0x the least of the peers'" in text


def test_the_rendering_counts_the_runs_that_lead() -> None:
    results = [
        _cell(KVPLANE, 1, 0.90, 60.0, 8.0),
        _cell(KVPLANE, 2, 0.80, 90.0, 9.0),
        _cell(SMG, 1, 0.85, 50.0, 4.0),
        _cell(SMG, 2, 0.95, 95.0, 3.0),
    ]
    text = render_standings(standings(results))
    assert (
        "kvplane kvplane: the highest hit rate in 1 of 2 runs (ties to 0.1 point counted), "
        "the lowest TTFT p90 in 1 of 2, CPU per request 2.0-3.0x the least of the peers'"
    ) in text
    row = next(
        line for line in text.splitlines() if line.startswith("shared-8, steady, medium, run 1")
    )
    assert "90.0 vs 85.0 (smg cache_aware)" in row
    assert "60 vs 50 (smg cache_aware)" in row
    assert "8.0 vs 4.0 (smg cache_aware)" in row
    assert text in render_summary_markdown(results)


def test_nothing_is_rendered_without_peers() -> None:
    results = [_cell(KVPLANE, 1, 0.9, 60.0, 8.0)]
    assert standings(results) == []
    assert render_standings([]) == ""
    assert "```" not in render_summary_markdown(results)


def test_a_peer_that_spent_no_cpu_gives_an_infinite_ratio() -> None:
    (found,) = standings([_cell(KVPLANE, 1, 0.9, 60.0, 8.0), _cell(SMG, 1, 0.9, 60.0, 0.0)])
    assert math.isinf(found.cpu_ratio)
