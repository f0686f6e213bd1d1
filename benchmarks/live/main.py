"""`kvplane bench live`: pick the cells, run them one after another, print the tables,
write the JSON and the plot."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from benchmarks.live.bakeoff import CellResult, default_log_root, run_cell
from benchmarks.live.fleet import FleetShape
from benchmarks.live.grid import PROFILES, cells, select
from benchmarks.live.report import render_tables, write_json, write_plot

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "simulations/traces/mooncake/conversation_trace.jsonl"
)


def run_live_benchmark(
    *,
    profile_name: str,
    only: Sequence[Sequence[str]] = (),
    runs: int | None = None,
    duration_s: float | None = None,
    json_path: Path | None = None,
    plot_path: Path | None = None,
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
        hint = "(or pick kvplane's cells with --only kvplane)"
        for reason in missing:
            print(f"kvplane bench live: {reason} {hint}", file=sys.stderr)
        return 2
    logs = log_dir or default_log_root()
    shape = FleetShape()
    print(
        f"kvplane bench live ({profile.name}): {len(chosen)} cells, {profile.duration_s:g} s of "
        f"traffic each, {shape.engines} engine simulators ({shape.kv_blocks} KV blocks each); "
        f"logs in {logs}",
        flush=True,
    )
    results: list[CellResult] = []
    meta = {"profile": profile.name, "duration_s": profile.duration_s, "runs": profile.runs}
    started = time.monotonic()
    for number, cell in enumerate(chosen, 1):
        result = run_cell(
            cell, duration_s=profile.duration_s, trace=trace, log_root=logs, shape=shape
        )
        results.append(result)
        figures = (
            f"error: {result.error.splitlines()[0]}"
            if result.error
            else f"hit {result.engine_hit_rate:.1%}, TTFT p90 {result.ttft_p90_ms:.0f} ms, "
            f"{result.failed} failed, {result.cpu_ms_per_request:.1f} CPU ms/req"
        )
        print(f"[{number}/{len(chosen)}] {cell.key}: {figures}", flush=True)
        if json_path is not None:  # after every cell: a run cut short keeps what it measured
            write_json(json_path, results, {**meta, "complete": number == len(chosen)})
    print()
    print(render_tables(results))
    print(f"\n{len(results)} cells in {time.monotonic() - started:.0f} s")
    if plot_path is not None:
        write_plot(plot_path, results)
    failed = [result for result in results if result.error]
    if log_dir is None and not failed:
        shutil.rmtree(logs, ignore_errors=True)
    return 1 if failed else 0
