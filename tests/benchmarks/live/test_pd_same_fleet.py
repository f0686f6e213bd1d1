"""The `pd` situation's same-fleet rows: kvplane splitting where it pays, always and
never in front of four engines that each take either leg (`pd-both`); their command
lines and settings, their evidence, and how the tables and the same-fleet comparison
show them beside the two prefill + two decode fleet."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

import pytest

from benchmarks.live import routers
from benchmarks.live.bakeoff import CellResult, _pd_in_play, run_cell
from benchmarks.live.engines import (
    FLEET_AGGREGATED,
    FLEET_BOTH,
    FLEET_PD,
    Engine,
    EngineShape,
    RunningEngines,
)
from benchmarks.live.grid import PD_FLEET_REFERENCES, PROFILES, Cell, cells, select
from benchmarks.live.processes import Child, Children
from benchmarks.live.report import render_summary_markdown, render_tables
from benchmarks.live.routers import PD_ROUTERS, ROUTERS, RouterSpec, kvplane_agent_argv
from benchmarks.live.standings import render_same_fleet, same_fleet, standings
from benchmarks.live.workloads import Workload

BOTH_MODES = {
    "kvplane both-conditional": "conditional",
    "kvplane both-always": "always",
    "kvplane both-never": "never",
}


def _router(name: str) -> RouterSpec:
    return next(router for router in (*ROUTERS, *PD_ROUTERS) if router.name == name)


def test_the_both_rows_run_in_the_pd_situation_only_on_four_engines_taking_either_leg() -> None:
    full = cells(PROFILES["full"])
    both = [cell for cell in full if cell.router.fleet == FLEET_BOTH]
    assert {cell.router.name for cell in both} == set(BOTH_MODES)
    assert {cell.situation for cell in both} == {"pd"}
    assert select(full, [["both-"]]) == both
    # never is that fleet's reference; nothing else is anyone's.
    assert [r.name for r in PD_ROUTERS if r.reference] == ["kvplane both-never"]
    assert not any(router.reference for router in ROUTERS)
    assert PD_FLEET_REFERENCES == {
        FLEET_PD: "vllm-router pd-cache_aware",
        FLEET_BOTH: "kvplane both-never",
    }
    base = EngineShape()
    shape = Cell(_router("kvplane both-never"), "shared-8", "medium", "pd", 1).shape(base)
    assert shape.engines == base.engines == 4
    assert shape.kv_both
    assert shape.connector
    assert not shape.disaggregated
    assert shape.fleet == FLEET_BOTH
    assert {shape.role(n) for n in range(1, 5)} == {"both"}
    assert [shape.engine_name(n) for n in range(1, 5)] == [f"engine-{n}" for n in range(1, 5)]
    pools = Cell(_router("kvplane pd-always"), "shared-8", "medium", "pd", 1).shape(base)
    assert (pools.fleet, pools.connector) == (FLEET_PD, True)
    assert (base.fleet, base.connector) == (FLEET_AGGREGATED, False)


class _Recorded(Children):
    """Children that record what they would launch, and launch nothing."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.launched: list[tuple[str, list[str], dict[str, str]]] = []

    def launch(
        self, name: str, command: Sequence[str], env: Mapping[str, str] | None = None
    ) -> Child:
        self.launched.append((name, list(command), dict(env or {})))
        return Child(name, list(command), cast(subprocess.Popen[bytes], None), Path("unused"))


def _engines(shape: EngineShape) -> RunningEngines:
    return RunningEngines(
        [
            Engine(shape.engine_name(n), cast(Child, None), f"http://127.0.0.1:{8000 + n}",
                   f"tcp://127.0.0.1:{9000 + n}", f"tcp://127.0.0.1:{9100 + n}",
                   shape.role(n), shape.connector)
            for n in range(1, shape.engines + 1)
        ],
        cast(Children, None),
    )  # fmt: skip


def _launch(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, list[str], dict[str, str]]]:
    """What starting the router `name` in front of its cell's fleet launches: (process
    name, command line, environment besides the machine's), nothing started."""
    monkeypatch.setattr(routers, "wait_ready", lambda *args, **kwargs: None)
    monkeypatch.setattr(routers, "_wait_registered", lambda *args, **kwargs: None)
    monkeypatch.setattr(routers, "check_wiring", lambda url: {"ok": True})
    spec = _router(name)
    shape = Cell(spec, "shared-8", "medium", "pd", 1).shape(EngineShape())
    children = _Recorded(tmp_path)
    spec.start(spec, _engines(shape), children, 1, Workload("shared-8", ()))
    return children.launched


@pytest.mark.parametrize(("name", "mode"), sorted(BOTH_MODES.items()))
def test_a_both_row_starts_kvplane_in_its_mode_with_every_agent_role_both(
    name: str, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched = _launch(name, tmp_path, monkeypatch)
    (router,) = [(command, env) for process, command, env in launched if "router" in process]
    command, env = router
    assert env["KVPLANE_DISAGGREGATION__MODE"] == mode
    assert command[command.index("--policy") + 1] == "kvplane"
    agents = {process: command for process, command, _ in launched if "agent" in process}
    assert sorted(agents) == [f"kvplane-agent-engine-{n}" for n in range(1, 5)]
    for command in agents.values():
        assert command[command.index("--role") + 1] == "both"


def test_the_pool_rows_name_their_pools_and_the_aggregated_reference_no_role(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched = _launch("kvplane pd-conditional", tmp_path, monkeypatch)
    roles = {
        process: command[command.index("--role") + 1]
        for process, command, _ in launched
        if "agent" in process
    }
    assert roles == {
        "kvplane-agent-prefill-1": "prefill",
        "kvplane-agent-prefill-2": "prefill",
        "kvplane-agent-decode-1": "decode",
        "kvplane-agent-decode-2": "decode",
    }
    (env,) = [env for process, _, env in launched if "router" in process]
    assert env["KVPLANE_DISAGGREGATION__MODE"] == "conditional"
    plain = _launch("kvplane kvplane", tmp_path / "plain", monkeypatch)
    assert not any("--role" in command for _, command, _ in plain)
    assert not any("KVPLANE_DISAGGREGATION__MODE" in env for _, _, env in plain)


def test_an_agent_names_its_role_only_beside_an_engine_with_a_connector() -> None:
    def engine(role: str, connector: bool) -> Engine:
        return Engine("e", cast(Child, None), "http://e", "tcp://e", "tcp://r", role, connector)

    def role(argv: list[str]) -> str | None:
        return argv[argv.index("--role") + 1] if "--role" in argv else None

    assert role(kvplane_agent_argv(engine("both", True), "127.0.0.1:1")) == "both"
    assert role(kvplane_agent_argv(engine("decode", True), "127.0.0.1:1")) == "decode"
    assert role(kvplane_agent_argv(engine("both", False), "127.0.0.1:1")) is None


# --- evidence ------------------------------------------------------------------------


def _both_fleet() -> RunningEngines:
    return _engines(EngineShape(kv_both=True))


def _result(router: str, *, reference: bool = False, **figures: object) -> CellResult:
    result = CellResult(router, "kvplane", "p", "shared-8", "medium", 15.0, "pd", 1, FLEET_BOTH,
                        reference)  # fmt: skip
    for name, value in figures.items():
        setattr(result, name, value)
    return result


_SPLIT = {
    "kvplane_legs_decided_total{reason=split_cheaper,split=true}": 20.0,
    "kvplane_legs_decided_total{reason=whole_cheaper,split=false}": 22.0,
}
_NEVER = {"kvplane_legs_decided_total{reason=never,split=false}": 42.0}


def _by_engine(pulled: float) -> dict[str, dict[str, float]]:
    return {
        f"engine-{n}": {"local_compute": 5000.0, "external_kv_transfer": pulled if n == 3 else 0.0}
        for n in range(1, 5)
    }


def test_on_the_both_fleet_conditional_is_in_play_when_it_split_and_some_engine_pulled() -> None:
    fleet = _both_fleet()
    split = _result("kvplane both-conditional", pd_counters=_SPLIT,
                    prompt_tokens_by_engine=_by_engine(3000.0))  # fmt: skip
    _pd_in_play(split, fleet, kvplane_counters=True)
    assert (split.pd_in_play, split.pd_not_in_play, split.pd_unexpected) == (True, "", "")

    unpulled = _result("kvplane both-always", pd_counters=_SPLIT,
                       prompt_tokens_by_engine=_by_engine(0.0))  # fmt: skip
    _pd_in_play(unpulled, fleet, kvplane_counters=True)
    assert unpulled.pd_in_play is False
    assert unpulled.pd_not_in_play == "no engine pulled a prompt token"
    assert unpulled.pd_unexpected == "P/D NOT in play: no engine pulled a prompt token"


def test_the_never_reference_splitting_nothing_is_no_error_and_splitting_is_flagged() -> None:
    fleet = _both_fleet()
    whole = _result("kvplane both-never", reference=True, pd_counters=_NEVER,
                    prompt_tokens_by_engine=_by_engine(0.0))  # fmt: skip
    _pd_in_play(whole, fleet, kvplane_counters=True, reference=True)
    assert whole.pd_in_play is False
    assert whole.pd_unexpected == ""
    assert "no request split (whole: never 42)" in whole.pd_not_in_play  # the evidence

    split = _result(
        "kvplane both-never",
        reference=True,
        pd_counters=_SPLIT,
        prompt_tokens_by_engine=_by_engine(800.0),
        prompt_tokens_pulled=800.0,
    )
    _pd_in_play(split, fleet, kvplane_counters=True, reference=True)
    assert split.pd_in_play is True
    assert split.pd_unexpected == (
        "P/D in play in the never-split reference: split 20, pulled 800 prompt tokens"
    )


# --- the tables ----------------------------------------------------------------------


def _measured(router: str, family: str, fleet: str, run: int, **figures: object) -> CellResult:
    result = CellResult(router, family, "p", "shared-8", "medium", 15.0, "pd", run, fleet,
                        router == "kvplane both-never")  # fmt: skip
    base: dict[str, object] = {"engine_hit_rate": 0.5, "cpu_ms_per_request": 3.0,
                               "prompt_tokens_pulled": 0.0}  # fmt: skip
    for name, value in {**base, **figures}.items():
        setattr(result, name, value)
    return result


def _point() -> list[CellResult]:
    """A `pd` point's seven routers, two runs, in the order a JSON might hold them."""
    found = []
    figures = {
        # router: (family, fleet, TTFT p90, ITL p50, ITL p90, e2e p90, computed, split)
        "kvplane both-never": ("kvplane", FLEET_BOTH, 100.0, 8.0, 20.0, 400.0, 40000.0, 0.0),
        "kvplane kvplane": ("kvplane", FLEET_AGGREGATED, 90.0, 8.0, 19.0, 380.0, 39000.0, 0.0),
        "kvplane pd-conditional": ("kvplane", FLEET_PD, 150.0, 8.0, 9.0, 300.0, 45000.0, 30.0),
        "kvplane pd-always": ("kvplane", FLEET_PD, 200.0, 8.0, 10.0, 350.0, 50000.0, 60.0),
        "vllm-router pd-cache_aware": ("vllm-router", FLEET_PD, 400.0, 8.0, 12.0, 600.0,
                                       100000.0, 0.0),
        "kvplane both-conditional": ("kvplane", FLEET_BOTH, 80.0, 8.0, 10.0, 300.0, 36000.0,
                                     25.0),
        "kvplane both-always": ("kvplane", FLEET_BOTH, 120.0, 8.0, 9.5, 320.0, 48000.0, 60.0),
    }  # fmt: skip
    for run in (1, 2):
        for router, (family, fleet, ttft, itl50, itl90, e2e, computed, split) in figures.items():
            counters = (
                {"kvplane_legs_decided_total{reason=split_cheaper,split=true}": split}
                if split
                else {}
            )
            found.append(
                _measured(router, family, fleet, run, ttft_p90_ms=ttft * run, itl_p50_ms=itl50,
                          itl_p90_ms=itl90, e2e_p90_ms=e2e, prompt_tokens_computed=computed,
                          pd_counters=counters,
                          pd_in_play=None if fleet == FLEET_AGGREGATED
                          else router != "kvplane both-never")
            )  # fmt: skip
    return found


def _rows(table: str) -> dict[str, str]:
    return {line.split("  ")[0]: line for line in table.splitlines() if "  " in line}


def test_the_pd_table_shows_each_fleet_and_the_latencies_beside_ttft() -> None:
    table = render_tables(_point())
    header = next(line for line in table.splitlines() if line.startswith("router"))
    titles = [title.strip() for title in header.split("  ") if title.strip()]
    assert titles[:2] == ["router", "fleet"]
    p90 = titles.index("TTFT p90 ms")
    assert titles[p90 + 2 : p90 + 5] == ["ITL p50 ms", "ITL p90 ms", "e2e p90 ms"]
    rows = _rows(table)
    assert "4 both" in rows["kvplane both-never"]
    assert "2P+2D" in rows["vllm-router pd-cache_aware"]
    assert "4 plain" in rows["kvplane kvplane"]
    assert "10.0 / 10.0" in rows["kvplane both-conditional"]  # ITL p90, both runs
    assert "300 / 300" in rows["kvplane both-conditional"]  # e2e p90
    assert "0/0 / 0/0" in rows["kvplane both-never"]  # counted: nothing split
    # Fleet by fleet: the aggregated engines, the pools, the engines taking either leg.
    order = [line.split("  ")[0] for line in table.splitlines()[3:10]]
    assert order == [
        "kvplane kvplane",
        "kvplane pd-conditional",
        "kvplane pd-always",
        "vllm-router pd-cache_aware",
        "kvplane both-never",
        "kvplane both-conditional",
        "kvplane both-always",
    ]
    assert "NOT in play" not in table  # the reference's staying whole is no warning
    # Only the pools' kvplane rows stand against the peer; the both fleet has none.
    assert {s.router for s in standings(_point())} == {"kvplane pd-conditional",
                                                       "kvplane pd-always"}  # fmt: skip


def test_the_same_fleet_comparison_reads_each_router_against_its_fleets_reference() -> None:
    found = same_fleet(_point())
    pairs = {(item.router, item.reference, item.run) for item in found}
    assert pairs == {
        (router, reference, run)
        for run in (1, 2)
        for router, reference in (
            ("kvplane pd-conditional", "vllm-router pd-cache_aware"),
            ("kvplane pd-always", "vllm-router pd-cache_aware"),
            ("kvplane both-conditional", "kvplane both-never"),
            ("kvplane both-always", "kvplane both-never"),
        )
    }
    text = render_same_fleet(found)
    assert "on one fleet (4 kv_both, role both), against kvplane both-never" in text
    assert "on one fleet (2 prefill + 2 decode), against vllm-router pd-cache_aware" in text
    rows = {line.split("  ")[0]: line for line in text.splitlines()}
    row = rows["shared-8, medium, run 1: kvplane both-conditional"]
    assert [cell.strip() for cell in row.split("  ") if cell.strip()][1:] == [
        "25",  # split
        "80 vs 100", "0.80",  # TTFT p90
        "10.0 vs 20.0", "0.50",  # ITL p90
        "300 vs 400", "0.75",  # e2e p90
        "36.0 vs 40.0", "0.90",  # computed ktok
    ]  # fmt: skip
    assert (
        "kvplane both-conditional against kvplane both-never, 2 runs, ratios: TTFT p90 0.80, "
        "ITL p90 0.50, e2e p90 0.75, computed 0.90" in text
    )
    assert (
        "kvplane pd-always against vllm-router pd-cache_aware, 2 runs, ratios: TTFT p90 0.50, "
        "ITL p90 0.83, e2e p90 0.58, computed 0.50" in text
    )
    markdown = render_summary_markdown(_point())
    assert "on one fleet (4 kv_both, role both)" in markdown
    assert (
        "| kvplane both-conditional | 80 / 160 ms · ITL 10.0 / 10.0 ms · e2e 300 / 300 ms · "
        "36.0 / 36.0 · 0.0 / 0.0 · split 25 / 25 |" in markdown
    )


def test_the_same_fleet_comparison_flags_a_reference_that_split() -> None:
    point = _point()
    never = next(r for r in point if r.router == "kvplane both-never" and r.run == 1)
    never.pd_in_play = True
    never.pd_counters = {"kvplane_legs_decided_total{reason=never,split=true}": 3.0}
    never.prompt_tokens_pulled = 900.0
    text = render_same_fleet(same_fleet(point))
    flagged = (
        "shared-8, medium, run 1: kvplane both-never: P/D in play in the never-split "
        "reference: split 3, pulled 900 prompt tokens"
    )
    assert text.count(flagged) == 1
    assert "kvplane both-never run 1: P/D in play in the never-split reference" in render_tables(
        point
    )
    assert "(the never-split reference split)" in render_summary_markdown(point)
    # Without the fleet's reference measured there is nothing to compare.
    assert (
        render_same_fleet(same_fleet([r for r in point if r.fleet != FLEET_BOTH])).count(
            "on one fleet"
        )
        == 1
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kvplane_both_always_splits_in_front_of_four_engines_taking_either_leg(
    tmp_path: Path,
) -> None:
    result = run_cell(
        Cell(_router("kvplane both-always"), "shared-4", "light", "pd", 1),
        duration_s=4.0,
        trace=Path("unused"),
        log_root=tmp_path,
        shape=EngineShape(),
    )
    assert result.error is None, result.error
    assert result.fleet == FLEET_BOTH
    assert result.failed == 0
    assert result.pd_in_play is True, result.pd_not_in_play
    assert result.split_requests > 0
    assert result.prompt_tokens_pulled > 0
    assert result.itl_gaps > 0
    assert result.itl_p90_ms > 0
    assert result.e2e_p90_ms >= result.ttft_p90_ms
    (evidence,) = result.evidence.values()
    assert evidence["workers_by_role"] == {"both": 4}
    assert any("--role both" in command for command in result.commands)
