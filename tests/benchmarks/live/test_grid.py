"""Which cells the bake-off runs."""

from __future__ import annotations

from benchmarks.live.engines import EngineShape
from benchmarks.live.grid import PROFILES, cells, select, traffic_seconds
from benchmarks.live.routers import ROUTERS


def test_quick_runs_every_router_once() -> None:
    quick = cells(PROFILES["quick"])
    assert sorted(cell.router.name for cell in quick) == sorted(r.name for r in ROUTERS)


def test_points_run_whole_and_runs_interleave_within_a_point() -> None:
    default = cells(PROFILES["default"])
    first = default[0].point
    of_first = [cell for cell in default if cell.point == first]
    assert default[: len(of_first)] == of_first  # a point's cells come together
    runs = [cell.run for cell in of_first]
    assert runs == sorted(runs)
    assert {cell.router.name for cell in of_first if cell.run == 1} == {r.name for r in ROUTERS}


def test_the_default_grid_is_part_of_the_full_grid() -> None:
    full = {cell.key for cell in cells(PROFILES["full"])}
    assert {cell.key for cell in cells(PROFILES["default"])} <= full


def test_situations_in_the_default_grid_are_for_cache_aware_routers() -> None:
    situated = [cell for cell in cells(PROFILES["default"]) if cell.situation != "steady"]
    assert situated
    assert all(
        cell.router.policy not in ("round-robin", "round_robin", "trivial-picker")
        for cell in situated
    )
    assert {cell.replicas for cell in situated if cell.situation == "two-replicas"} == {2}


def test_the_full_grid_runs_eviction_on_a_working_set_larger_than_the_cache() -> None:
    full = cells(PROFILES["full"])
    evicting = [cell for cell in full if cell.situation.startswith("eviction")]
    assert {cell.situation for cell in evicting} == {"eviction", "eviction-cpu"}
    assert {(cell.workload, cell.load, cell.rate_per_s) for cell in evicting} == {
        ("zipf-96", "moderate", 8.0)
    }
    assert traffic_seconds(PROFILES["full"].duration_s, "zipf-96") == 30.0
    # Only eviction-cpu's engines have a CPU tier, and only there runs kvplane without
    # its tier credit.
    for cell in full:
        tiered = cell.situation == "eviction-cpu"
        assert (cell.shape(EngineShape()).cpu_offload_blocks > 0) == tiered
        if cell.router.name == "kvplane no-tier-credit":
            assert tiered
    assert any(cell.router.name == "kvplane no-tier-credit" for cell in evicting)
    assert {cell.load for cell in full if cell.situation == "steady"} == {
        "light",
        "medium",
        "heavy",
    }


def test_only_filters_are_ored_and_their_terms_anded() -> None:
    default = cells(PROFILES["default"])
    picked = select(default, [["kvplane kvplane", "shared-8", "steady"], ["SMG", "multi-turn"]])
    assert picked
    assert all(
        ("kvplane kvplane" in c.key and "shared-8" in c.key and c.situation == "steady")
        or (c.router.family == "smg" and c.workload == "multi-turn")
        for c in picked
    )
    assert len(select(default, [])) == len(default)
    assert select(default, [["no such router"]]) == []
