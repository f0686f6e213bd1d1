"""`kvplane bench live`: pick the cells, run them one after another, print the tables,
write the JSON and the plot."""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.live.bakeoff import CellResult, default_log_root, run_cell
from benchmarks.live.capacity import CAPACITY_ROUTER, Capacity, measure_capacity
from benchmarks.live.engines import FLEET_AGGREGATED, EngineShape
from benchmarks.live.grid import (
    CALIBRATED,
    LONGER_WORKLOADS,
    PD,
    PROFILES,
    Cell,
    cells,
    select,
    traffic_seconds,
)
from benchmarks.live.processes import StartFailed
from benchmarks.live.report import (
    read_json,
    render_summary_markdown,
    render_tables,
    write_json,
    write_plot,
)
from benchmarks.live.routers import ROUTERS
from benchmarks.live.standings import render_same_fleet, render_standings, same_fleet, standings
from router.check import BlindFleet

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "simulations/traces/mooncake/conversation_trace.jsonl"
)


def resume_points(
    chosen: Sequence[Cell], previous: Sequence[CellResult]
) -> tuple[dict[str, CellResult], list[Cell]]:
    """What an earlier, cut-short run already measured, and the cells still to run.

    A point is kept only whole, every cell with figures: its routers' runs were
    interleaved in one sitting, and a point pieced together from two sittings would
    compare one router's quiet spell with another's busy one. Any other point runs
    again, whole."""
    measured = {result.key: result for result in previous if result.error is None}
    points: dict[tuple[str, str, str], list[Cell]] = {}
    for cell in chosen:
        points.setdefault(cell.point, []).append(cell)
    kept: dict[str, CellResult] = {}
    to_run: list[Cell] = []
    for point_cells in points.values():
        if all(cell.key in measured for cell in point_cells):
            kept.update((cell.key, measured[cell.key]) for cell in point_cells)
        else:
            to_run += point_cells
    return kept, to_run


def _blocks_line(result: CellResult) -> str:
    """The fleet's cached blocks at the cell's end: distinct of held, per tier."""
    text = f"{result.distinct_blocks} distinct of {result.held_blocks} cached blocks"
    if result.host_held_blocks:
        text += (
            f", CPU tier {result.host_distinct_blocks} of {result.host_held_blocks}, "
            f"{result.distinct_blocks_any_tier} distinct on either"
        )
    return text


def _pd_line(result: CellResult) -> str:
    """What a cell's progress line adds in the `pd` situation (inter-token and
    end-to-end latency), in front of a fleet that can split, or for a point whose
    engines count prompt tokens by source: computed, pulled, split."""
    text = ""
    if result.situation == PD:
        text += f", ITL p90 {result.itl_p90_ms:.1f} ms, e2e p90 {result.e2e_p90_ms:.0f} ms"
    if math.isnan(result.prompt_tokens_computed) and result.fleet == FLEET_AGGREGATED:
        return text
    text += (
        f", prompt tokens computed {result.prompt_tokens_computed:.0f}, "
        f"pulled {result.prompt_tokens_pulled:.0f}"
    )
    if result.pd_counters:
        text += f", split {result.split_requests:.0f}, fallbacks {result.fallbacks:.0f}"
    if result.pd_unexpected:
        text += f"; {result.pd_unexpected}"
    return text


CAPACITY_KEY = "noisy_tenant_capacity"
"""Where the run's JSON keeps C, the noisy-tenant situation's measured capacity."""


def _capacity(earlier: dict[str, Any], shape: EngineShape, logs: Path) -> Capacity:
    """C for this sitting: the one an earlier, cut-short run measured (a resumed run
    goes on with the same rates), or measured now on a fleet of `shape` behind kvplane
    without flow control."""
    if CAPACITY_KEY in earlier:
        capacity = Capacity.from_json(earlier[CAPACITY_KEY])
        print(f"noisy-tenant: C = {capacity.requests_per_s:.1f} req/s, as measured before")
        return capacity
    router = next(router for router in ROUTERS if router.name == CAPACITY_ROUTER)
    print("noisy-tenant: measuring C, the fleet's sustainable rate ...", flush=True)
    capacity = measure_capacity(router, shape, logs / "calibration")
    print(
        f"noisy-tenant: C = {capacity.requests_per_s:.1f} req/s ({capacity.completed} "
        f"requests answered in {capacity.measured_s:g} s, {capacity.concurrency} clients in "
        f"a closed loop through {capacity.router}, engines {capacity.time_scale:g}x "
        "slower than the timing model)",
        flush=True,
    )
    return capacity


def _tenancy_line(result: CellResult) -> str:
    """What a noisy-tenant cell's progress line adds: each group's TTFT p90, the
    requests shed, the throughput over the schedule."""
    tenancy = result.tenancy
    if tenancy is None:
        return ""
    p90s = ", ".join(
        f"{group} TTFT p90 {figures['p90']:.0f} ms"
        for group, figures in tenancy.ttft_ms_by_group.items()
    )
    return (
        f"; {p90s}, {tenancy.shed} shed, {tenancy.span_requests_per_s:.1f} req/s answered "
        "over the schedule"
    )


def _longer(chosen: Sequence[Cell], duration_s: float) -> str:
    """What the start line says of the workloads that run longer than the others."""
    longer = sorted({cell.workload for cell in chosen if cell.workload in LONGER_WORKLOADS})
    return "".join(
        f" ({workload}: {traffic_seconds(duration_s, workload):g} s)" for workload in longer
    )


def render_live_json(
    json_path: Path, *, markdown_path: Path | None = None, plot_path: Path | None = None
) -> int:
    """The report of a run already made, from its JSON, running nothing: the tables and
    the standings on stdout, and the Markdown summary and the plot where asked."""
    if not json_path.exists():
        print(f"kvplane bench live: no such file: {json_path}", file=sys.stderr)
        return 2
    meta, results = read_json(json_path)
    if not results:
        print(f"kvplane bench live: {json_path} holds no cell", file=sys.stderr)
        return 2
    complete = "" if meta.get("complete", True) else ", cut short"
    profile = meta.get("profile", "?")
    print(f"kvplane bench live: {len(results)} cells from {json_path} ({profile}{complete})")
    _report(results, markdown_path=markdown_path, plot_path=plot_path)
    return 0


def _report(
    results: Sequence[CellResult], *, markdown_path: Path | None, plot_path: Path | None
) -> None:
    """The tables and the standings on stdout; the plot and the Markdown where asked."""
    print()
    print(render_tables(results))
    against_peers = render_standings(standings(results))
    if against_peers:
        print(f"\n{against_peers}")
    on_one_fleet = render_same_fleet(same_fleet(results))
    if on_one_fleet:
        print(f"\n{on_one_fleet}")
    if plot_path is not None:
        write_plot(plot_path, results)
    if markdown_path is not None:
        markdown_path.write_text(render_summary_markdown(results))


def run_live_benchmark(
    *,
    profile_name: str,
    only: Sequence[Sequence[str]] = (),
    runs: int | None = None,
    duration_s: float | None = None,
    json_path: Path | None = None,
    resume: bool = False,
    plot_path: Path | None = None,
    markdown_path: Path | None = None,
    log_dir: Path | None = None,
    trace: Path = DEFAULT_TRACE,
) -> int:
    profile = PROFILES[profile_name]
    if runs is not None:
        profile = replace(profile, runs=runs)
    if duration_s is not None:
        profile = replace(profile, duration_s=duration_s)
    chosen = select(cells(profile), only)
    if not chosen:
        print("kvplane bench live: --only picks no cell", file=sys.stderr)
        return 2
    missing = sorted({reason for cell in chosen if (reason := cell.router.unavailable())})
    if missing:
        # --only matches names' substrings ("kvplane" picks kvplane-envoy's too): name
        # each router that runs here.
        runnable = dict.fromkeys(
            cell.router.name for cell in chosen if cell.router.unavailable() is None
        )
        picks = " ".join(f"--only '{name}'" for name in runnable)
        hint = f"(or pick the routers that run here: {picks})" if runnable else ""
        for reason in missing:
            print(f"kvplane bench live: {reason} {hint}".rstrip(), file=sys.stderr)
        return 2
    previous: list[CellResult] = []
    earlier: dict[str, Any] = {}
    if resume:
        if json_path is None:
            print("kvplane bench live: --resume needs --json FILE", file=sys.stderr)
            return 2
        if json_path.exists():
            earlier, previous = read_json(json_path)
            if earlier.get("duration_s") != profile.duration_s:
                print(
                    f"kvplane bench live: {json_path} holds cells of {earlier.get('duration_s')} "
                    f"s of traffic, this run's are {profile.duration_s:g} s: pass the same "
                    "--duration or another --json file",
                    file=sys.stderr,
                )
                return 2
    done, to_run = resume_points(chosen, previous)
    chosen_keys = {cell.key for cell in chosen}
    elsewhere = [result for result in previous if result.key not in chosen_keys]
    logs = log_dir or default_log_root()
    shape = EngineShape()
    print(
        f"kvplane bench live ({profile.name}): {len(to_run)} cells to run"
        + (f" ({len(done)} kept from {json_path})" if done else "")
        + f", {profile.duration_s:g} s of traffic each{_longer(chosen, profile.duration_s)}, "
        f"{shape.engines} engine simulators ({shape.kv_blocks} KV blocks each); logs in {logs}",
        flush=True,
    )
    meta: dict[str, Any] = {
        "profile": profile.name,
        "duration_s": profile.duration_s,
        "runs": profile.runs,
    }
    if CAPACITY_KEY in earlier:  # kept with the cells measured at that rate
        meta[CAPACITY_KEY] = earlier[CAPACITY_KEY]
    started = time.monotonic()
    calibrated = [cell for cell in to_run if cell.load == CALIBRATED]
    if calibrated:
        try:
            capacity = _capacity(earlier, calibrated[0].shape(shape), logs)
        except (StartFailed, BlindFleet, OSError, RuntimeError) as error:
            print(
                f"kvplane bench live: C, the noisy-tenant situation's rate unit, could not "
                f"be measured ({type(error).__name__}: {error}); logs in {logs}",
                file=sys.stderr,
            )
            return 1
        meta[CAPACITY_KEY] = capacity.as_json()
        to_run = [
            replace(cell, capacity_per_s=capacity.requests_per_s)
            if cell.load == CALIBRATED
            else cell
            for cell in to_run
        ]
    for number, cell in enumerate(to_run, 1):
        result = run_cell(
            cell,
            duration_s=traffic_seconds(profile.duration_s, cell.workload),
            trace=trace,
            log_root=logs,
            shape=shape,
        )
        done[cell.key] = result
        figures = (
            f"error: {result.error.splitlines()[0]}"
            if result.error
            else f"hit {result.engine_hit_rate:.1%}, TTFT p90 {result.ttft_p90_ms:.0f} ms, "
            f"{result.failed} failed, {result.cpu_ms_per_request:.1f} CPU ms/req, "
            f"{result.rest_cpu_ms_per_s:.1f} CPU ms/s at rest, "
            f"{_blocks_line(result)}{_pd_line(result)}{_tenancy_line(result)}"
        )
        print(f"[{number}/{len(to_run)}] {cell.key}: {figures}", flush=True)
        if json_path is not None:  # after every cell: a run cut short keeps what it measured
            measured = [done[picked.key] for picked in chosen if picked.key in done]
            complete = number == len(to_run)
            write_json(json_path, measured + elsewhere, {**meta, "complete": complete})
    results = [done[cell.key] for cell in chosen]
    _report(results, markdown_path=markdown_path, plot_path=plot_path)
    print(f"\n{len(to_run)} cells run in {time.monotonic() - started:.0f} s")
    failed = [result for result in results if result.error]
    if log_dir is None and not failed:
        shutil.rmtree(logs, ignore_errors=True)
    return 1 if failed else 0
