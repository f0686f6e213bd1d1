"""`kvplane bench live --from-json`: the report of a run already made, running nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.cli import main
from benchmarks.live.bakeoff import CellResult
from benchmarks.live.report import write_json


def _cell(router: str, run: int, hit: float, p90: float, cpu: float, **where: str) -> CellResult:
    family, policy = router.split(" ")
    result = CellResult(
        router,
        family,
        policy,
        where.get("workload", "shared-8"),
        where.get("load", "medium"),
        15.0,
        where.get("situation", "steady"),
        run,
    )
    result.engine_hit_rate, result.ttft_p90_ms, result.cpu_ms_per_request = hit, p90, cpu
    return result


def _run(tmp_path: Path) -> Path:
    path = tmp_path / "live.json"
    cells = [
        _cell("kvplane kvplane", 1, 0.908, 84.0, 19.5),
        _cell("smg cache_aware", 1, 0.850, 71.0, 3.7),
        _cell("kvplane kvplane", 2, 0.905, 134.0, 19.8),
        _cell("smg cache_aware", 2, 0.908, 121.0, 2.4),
        _cell("kvplane kvplane", 1, 0.159, 407.0, 32.0, workload="shared-64", situation="eviction"),
        _cell("smg cache_aware", 1, 0.065, 1590.0, 3.2, workload="shared-64", situation="eviction"),
    ]
    write_json(path, cells, {"profile": "full", "duration_s": 15.0, "runs": 2, "complete": True})
    return path


def test_the_markdown_comes_from_the_json_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    markdown = tmp_path / "summary.md"
    # No peer routers, no engines: nothing may start, or this would fail or hang.
    assert main(["live", "--from-json", str(_run(tmp_path)), "--markdown", str(markdown)]) == 0
    text = markdown.read_text()
    assert "**shared-8** (steady)" in text
    assert "| router | medium |" in text
    assert "| kvplane kvplane | 90.8 / 90.5 % · 84 / 134 ms |" in text
    assert "| smg cache_aware | 85.0 / 90.8 % · 71 / 121 ms |" in text
    assert "| router | eviction (shared-64, medium) |" in text
    assert "| kvplane kvplane | 15.9 % · 407 ms |" in text
    assert "| kvplane kvplane | 19.5 / 19.8 |" in text  # CPU ms a request, every run
    assert "kvplane kvplane: the highest hit rate in 2 of 3 runs" in text
    printed = capsys.readouterr().out
    assert "6 cells from" in printed
    assert "(full)" in printed
    assert "shared-8, steady, medium (15 req/s offered)" in printed  # the tables
    assert "kvplane kvplane against the best peer" in printed  # the standings


def test_it_refuses_to_write_a_json_or_resume(tmp_path: Path) -> None:
    source = _run(tmp_path)
    assert main(["live", "--from-json", str(source), "--json", str(tmp_path / "x.json")]) == 2
    assert main(["live", "--from-json", str(source), "--resume"]) == 2


def test_a_missing_file_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["live", "--from-json", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err
