"""Which cells the bake-off runs."""

from __future__ import annotations

from benchmarks.live.grid import PROFILES, cells, select
from benchmarks.live.routers import ROUTERS


def test_quick_runs_every_router_once() -> None:
    quick = cells(PROFILES["quick"])
    assert sorted(cell.router.name for cell in quick) == sorted(r.name for r in ROUTERS)


def test_runs_are_interleaved_so_a_slow_spell_hits_every_router() -> None:
    default = cells(PROFILES["default"])
    first_run_two = next(n for n, cell in enumerate(default) if cell.run == 2)
    assert all(cell.run == 1 for cell in default[:first_run_two])
    assert {cell.router.name for cell in default[:first_run_two]} == {r.name for r in ROUTERS}


def test_situations_in_the_default_grid_are_for_cache_aware_routers() -> None:
    situated = [cell for cell in cells(PROFILES["default"]) if cell.situation != "steady"]
    assert situated
    assert all(cell.router.policy not in ("round-robin", "round_robin") for cell in situated)
    assert {cell.replicas for cell in situated if cell.situation == "two-replicas"} == {2}


def test_the_full_grid_runs_eviction_on_a_working_set_larger_than_the_cache() -> None:
    full = cells(PROFILES["full"])
    assert {cell.workload for cell in full if cell.situation == "eviction"} == {"shared-64"}
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
