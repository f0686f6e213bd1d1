"""The bake-off's `pd` situation: which cells it runs and on which fleet, vllm-router's
P/D command line, the prompt-token figures read from the engines, the evidence that P/D
was in play, and how the tables show them; then one cell of each kind end to end."""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import pytest

from benchmarks.live.bakeoff import CellResult, _pd_in_play, run_cell
from benchmarks.live.engines import (
    PD_KV_TRANSFER_CONFIG,
    Engine,
    EngineShape,
    EngineTotals,
    RunningEngines,
    parse_totals,
)
from benchmarks.live.grid import PD_WORKLOADS, PROFILES, Cell, cells, select
from benchmarks.live.processes import Child, Children
from benchmarks.live.report import render_summary_markdown, render_tables
from benchmarks.live.routers import PD_ROUTERS, ROUTERS, peers_python, vllm_router_pd_argv
from benchmarks.live.standings import standings
from tests import heavy

PD_NAMES = {
    "kvplane pd-conditional",
    "kvplane pd-always",
    "vllm-router pd-cache_aware",
    "kvplane both-conditional",
    "kvplane both-always",
    "kvplane both-never",
}


def test_the_full_grid_runs_pd_on_its_workloads_and_pd_selects_it_alone() -> None:
    full = cells(PROFILES["full"])
    pd = select(full, [["pd"]])
    assert pd == [cell for cell in full if cell.situation == "pd"]
    assert {cell.router.name for cell in pd} == PD_NAMES | {"kvplane kvplane"}
    assert {cell.workload for cell in pd} == set(PD_WORKLOADS) == {"shared-8", "multi-turn"}
    assert {cell.load for cell in pd} == {"medium"}
    assert len(pd) == len(PD_WORKLOADS) * 7 * PROFILES["full"].runs
    # The P/D routers run nowhere else; the default grid has no pd point.
    assert all(cell.situation == "pd" for cell in full if cell.router.disaggregated)
    assert not [cell for cell in cells(PROFILES["default"]) if cell.situation == "pd"]
    assert {router.name for router in PD_ROUTERS} == PD_NAMES
    assert not any(router.disaggregated for router in ROUTERS)


def test_a_pd_router_gets_two_prefill_and_two_decode_engines_the_reference_four_whole() -> None:
    base = EngineShape()
    (conditional, aggregated) = (
        Cell(next(r for r in PD_ROUTERS if r.policy == "pd-conditional"), "shared-8", "medium",
             "pd", 1),
        Cell(next(r for r in ROUTERS if r.name == "kvplane kvplane"), "shared-8", "medium",
             "pd", 1),
    )  # fmt: skip
    shape = conditional.shape(base)
    assert shape.disaggregated
    assert shape.engines == 4
    assert [shape.role(n) for n in range(1, 5)] == ["prefill", "prefill", "decode", "decode"]
    assert [shape.engine_name(n) for n in range(1, 5)] == [
        "prefill-1",
        "prefill-2",
        "decode-1",
        "decode-2",
    ]
    assert aggregated.shape(base) == base
    assert not base.disaggregated
    assert [base.engine_name(n) for n in (1, 4)] == ["engine-1", "engine-4"]
    assert PD_KV_TRANSFER_CONFIG == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def test_vllm_router_pd_command_line() -> None:
    argv = vllm_router_pd_argv(
        "cache_aware", "power_of_two", 8080, ["http://p1", "http://p2"], ["http://d1", "http://d2"]
    )
    assert argv[0].endswith("/bin/vllm-router")
    assert argv[1:] == [
        "--host", "127.0.0.1", "--port", "8080",
        "--vllm-pd-disaggregation",
        "--prefill", "http://p1", "--prefill", "http://p2",
        "--decode", "http://d1", "--decode", "http://d2",
        "--prefill-policy", "cache_aware",
        "--decode-policy", "power_of_two",
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip


def _fleet(*roles: str) -> RunningEngines:
    engines = [
        Engine(f"{role}-{roles[:n].count(role)}", cast(Child, None), f"http://{role}{n}",
               "tcp://e", "tcp://r", role)
        for n, role in enumerate(roles, 1)
    ]  # fmt: skip
    return RunningEngines(engines, cast(Children, None))


def test_prompt_tokens_by_source_are_read_and_banked() -> None:
    series = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="%s"} %s'
    text = "\n".join(
        [
            "# TYPE vllm:prompt_tokens_by_source counter",
            series % ("local_compute", "100.0"),
            series % ("local_cache_hit", "30.0"),
            series % ("external_kv_transfer", "70.0"),
            "# TYPE vllm:prefix_cache_hits counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0',
        ]
    )
    totals = parse_totals(text + "\n")
    assert totals.computed_tokens == 100
    assert totals.pulled_tokens == 70
    assert totals.prompt_tokens_by_source["local_cache_hit"] == 30
    assert totals.hit_tokens == 30
    later = EngineTotals(prompt_tokens_by_source={"local_compute": 150.0})
    later.add(totals)  # a restart banks the earlier life's counts
    assert later.since(totals).prompt_tokens_by_source == {
        "local_compute": 150.0,
        "local_cache_hit": 0.0,
        "external_kv_transfer": 0.0,
    }
    assert parse_totals("").prompt_tokens_by_source == {}  # an engine without them


def _pd_result(router: str, family: str, **figures: object) -> CellResult:
    result = CellResult(router, family, "p", "shared-8", "medium", 15.0, "pd", 1, "pd")
    for name, value in figures.items():
        setattr(result, name, value)
    return result


_PULLED = {
    "prefill-1": {"local_compute": 5000.0, "external_kv_transfer": 0.0},
    "decode-1": {"local_compute": 300.0, "external_kv_transfer": 4000.0},
}


def test_pd_in_play_needs_pulls_and_for_kvplane_splits() -> None:
    fleet = _fleet("prefill", "decode")
    split = {
        "kvplane_legs_decided_total{reason=split_cheaper,split=true}": 12.0,
        "kvplane_legs_decided_total{reason=whole_cheaper,split=false}": 30.0,
        "kvplane_disaggregation_fallbacks_total{reason=no_kv_params}": 2.0,
    }
    kvplane = _pd_result("kvplane pd-conditional", "kvplane",
                         prompt_tokens_by_engine=_PULLED, pd_counters=split)  # fmt: skip
    _pd_in_play(kvplane, fleet, kvplane_counters=True)
    assert kvplane.pd_in_play is True
    assert kvplane.pd_not_in_play == ""
    assert (kvplane.split_requests, kvplane.whole_requests, kvplane.fallbacks) == (12, 30, 2)

    whole = {"kvplane_legs_decided_total{reason=whole_cheaper,split=false}": 40.0}
    never = _pd_result("kvplane pd-conditional", "kvplane",
                       prompt_tokens_by_engine=_PULLED, pd_counters=whole)  # fmt: skip
    _pd_in_play(never, fleet, kvplane_counters=True)
    assert never.pd_in_play is False
    assert "no request split (whole: whole_cheaper 40)" in never.pd_not_in_play

    unpulled = {name: {"local_compute": 9.0} for name in _PULLED}
    peer = _pd_result("vllm-router pd-cache_aware", "vllm-router",
                      prompt_tokens_by_engine=unpulled)  # fmt: skip
    _pd_in_play(peer, fleet, kvplane_counters=False)
    assert peer.pd_in_play is False
    assert peer.pd_not_in_play == "the decode engines pulled no prompt token"
    blind = _pd_result("vllm-router pd-cache_aware", "vllm-router")
    _pd_in_play(blind, fleet, kvplane_counters=False)
    assert blind.pd_not_in_play == "the engines do not count prompt tokens by source"


def test_tables_show_the_pd_figures_and_say_where_pd_was_not_in_play() -> None:
    counters = {
        "kvplane_legs_decided_total{reason=split_cheaper,split=true}": 12.0,
        "kvplane_legs_decided_total{reason=whole_cheaper,split=false}": 30.0,
        "kvplane_disaggregation_fallbacks_total{reason=no_kv_params}": 2.0,
    }
    common = {"ttft_p90_ms": 90.0, "engine_hit_rate": 0.5, "cpu_ms_per_request": 3.0}
    results = [
        _pd_result("kvplane kvplane", "kvplane", fleet="aggregated", prompt_tokens_computed=20000.0,
                   prompt_tokens_pulled=0.0, **common),
        _pd_result("kvplane pd-conditional", "kvplane", prompt_tokens_computed=15000.0,
                   prompt_tokens_pulled=4000.0, pd_counters=counters, pd_in_play=True, **common),
        _pd_result("vllm-router pd-cache_aware", "vllm-router", prompt_tokens_computed=30000.0,
                   prompt_tokens_pulled=0.0, pd_in_play=False,
                   pd_not_in_play="the decode engines pulled no prompt token", **common),
    ]  # fmt: skip
    table = render_tables(results)
    assert "computed ktok" in table
    assert "split / whole" in table
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert "15.0" in rows["kvplane pd-conditional"]
    assert "12/30" in rows["kvplane pd-conditional"]
    assert "20.0" in rows["kvplane kvplane"]
    assert "kvplane pd-conditional run 1: fallbacks: no_kv_params 2" in table
    assert (
        "vllm-router pd-cache_aware run 1: P/D NOT in play: the decode engines pulled no "
        "prompt token" in table
    )
    markdown = render_summary_markdown(results)
    assert "**pd**" in markdown
    assert (
        "| kvplane pd-conditional | 90 ms · ITL - ms · e2e - ms · 15.0 · 4.0 · split 12 |"
        in markdown
    )
    assert "(P/D not in play)" in markdown
    # The P/D rows stand against the P/D peer; the aggregated reference has none there.
    assert {standing.router for standing in standings(results)} == {"kvplane pd-conditional"}
    # An aggregated point keeps its columns.
    steady = CellResult("kvplane kvplane", "kvplane", "p", "shared-8", "medium", 15.0,
                        "steady", 1)  # fmt: skip
    assert "computed ktok" not in render_tables([steady])
    assert math.isnan(steady.prompt_tokens_computed)


def _run(cell: Cell, tmp_path: Path) -> CellResult:
    return run_cell(
        cell,
        duration_s=4.0,
        trace=Path("unused"),
        log_root=tmp_path,
        shape=EngineShape(),
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kvplane_always_splits_in_front_of_a_pd_fleet(tmp_path: Path) -> None:
    router = next(r for r in PD_ROUTERS if r.policy == "pd-always")
    result = _run(Cell(router, "shared-4", "light", "pd", 1), tmp_path)
    assert result.error is None, result.error
    assert result.fleet == "pd"
    assert result.failed == 0
    assert result.requests > 0
    assert set(result.prompt_tokens_by_engine) == {"prefill-1", "prefill-2", "decode-1", "decode-2"}
    assert result.pd_in_play is True, result.pd_not_in_play
    assert result.split_requests > 0
    assert result.prompt_tokens_pulled > 0
    assert result.prompt_tokens_computed > 0
    (evidence,) = result.evidence.values()
    assert evidence["workers_by_role"] == {"prefill": 2, "decode": 2}
    assert result.whole_requests == 0  # always: every request split
    assert any("--role prefill" in command for command in result.commands)


@pytest.mark.heavy("peers")
@pytest.mark.timeout(300)
def test_vllm_router_pd_pulls_in_front_of_a_pd_fleet(tmp_path: Path) -> None:
    heavy.require("peers")
    if not peers_python().exists():
        pytest.skip("needs `make peers-env`")
    router = next(r for r in PD_ROUTERS if r.family == "vllm-router")
    result = _run(Cell(router, "shared-4", "light", "pd", 1), tmp_path)
    assert result.error is None, result.error
    assert result.failed == 0
    assert result.requests > 0
    assert result.pd_in_play is True, result.pd_not_in_play
    assert result.prompt_tokens_pulled > 0
    assert not result.pd_counters
    assert any("--vllm-pd-disaggregation" in command for command in result.commands)
