"""A long bake-off cut short resumes: whole points kept from its JSON, the rest run again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.live.bakeoff import CellResult
from benchmarks.live.grid import LONGER_WORKLOADS, PROFILES, Cell, cells, traffic_seconds
from benchmarks.live.main import resume_points, run_live_benchmark
from benchmarks.live.report import read_json, write_json


def _measured(cell: Cell, **figures: object) -> CellResult:
    result = CellResult(
        cell.router.name,
        cell.router.family,
        cell.router.policy,
        cell.workload,
        cell.load,
        cell.rate_per_s,
        cell.situation,
        cell.run,
        engine_hit_rate=0.9,
        ttft_p90_ms=80.0,
    )
    for name, value in figures.items():
        setattr(result, name, value)
    return result


def test_only_whole_points_with_figures_are_kept() -> None:
    grid = cells(PROFILES["default"])
    points = list(dict.fromkeys(cell.point for cell in grid))
    whole, partial, failed = points[0], points[1], points[2]
    of = {point: [cell for cell in grid if cell.point == point] for point in points}
    previous = [_measured(cell) for cell in of[whole]]
    previous += [_measured(cell) for cell in of[partial][:-1]]  # cut short in this point
    previous += [_measured(cell) for cell in of[failed][1:]]
    previous.append(_measured(of[failed][0], error="the router did not start"))

    kept, to_run = resume_points(grid, previous)

    assert set(kept) == {cell.key for cell in of[whole]}
    assert all(kept[cell.key].ttft_p90_ms == 80.0 for cell in of[whole])
    assert to_run == [cell for cell in grid if cell.point != whole]  # in the grid's order


def test_results_read_back_as_written(tmp_path: Path) -> None:
    cell = cells(PROFILES["quick"])[0]
    written = _measured(cell, cpu_s_by_process={"router": 1.5}, ttft_p99_ms=float("nan"))
    path = tmp_path / "live.json"
    write_json(path, [written], {"profile": "quick", "duration_s": 6.0})
    meta, [read] = read_json(path)
    assert meta["duration_s"] == 6.0
    assert "cells" not in meta
    assert read.key == cell.key
    assert read.cpu_s_by_process == {"router": 1.5}
    assert read.ttft_p90_ms == 80.0


def test_an_older_file_without_newer_fields_still_reads(tmp_path: Path) -> None:
    cell = cells(PROFILES["quick"])[0]
    document = _measured(cell).as_json()
    del document["unsalted_blocks"], document["workload_description"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"duration_s": 6.0, "cells": [document]}))
    assert read_json(path)[1][0].unsalted_blocks is None


def test_resume_refuses_without_a_file_or_with_other_cells(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    only = [["kvplane"]]  # needs no peer environment
    assert run_live_benchmark(profile_name="quick", only=only, resume=True) == 2
    assert "--resume needs --json" in capsys.readouterr().err

    path = tmp_path / "live.json"
    write_json(path, [], {"profile": "quick", "duration_s": 20.0})
    before = path.read_text()
    assert run_live_benchmark(profile_name="quick", only=only, json_path=path, resume=True) == 2
    assert "pass the same --duration" in capsys.readouterr().err
    assert path.read_text() == before  # nothing run, nothing written


def test_mooncake_cells_send_three_times_the_profiles_traffic() -> None:
    assert traffic_seconds(15.0, "mooncake") == 45.0
    assert traffic_seconds(15.0, "shared-8") == 15.0
    assert {cell.workload for cell in cells(PROFILES["full"])} >= set(LONGER_WORKLOADS)
