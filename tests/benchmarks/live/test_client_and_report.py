"""Where the bake-off's client sends requests, and how its tables show runs and errors."""

from __future__ import annotations

from benchmarks.live.bakeoff import CellResult
from benchmarks.live.client import Traffic
from benchmarks.live.report import render_summary_markdown, render_tables


def test_requests_alternate_between_replicas() -> None:
    traffic = Traffic(["http://a/v1", "http://b/v1"])
    assert [traffic.next_router_url() for _ in range(4)] == ["http://a/v1", "http://b/v1"] * 2
    assert traffic.route_conversation() is None  # nothing goes around the router


def test_a_share_of_conversations_goes_straight_to_the_engines() -> None:
    traffic = Traffic(["http://router/v1"], ["http://e1", "http://e2"], direct_share=0.25, seed=3)
    picks = [traffic.route_conversation() for _ in range(2000)]
    direct = [pick for pick in picks if pick is not None]
    assert 400 < len(direct) < 600
    assert set(direct) == {"http://e1/v1", "http://e2/v1"}


def _cell(router: str, run: int, **figures: float | str | None) -> CellResult:
    result = CellResult(router, "x", "p", "shared-8", "medium", 15.0, "steady", run)
    for name, value in figures.items():
        setattr(result, name, value)
    return result


def test_tables_show_every_run_and_say_why_a_router_has_no_figures() -> None:
    table = render_tables(
        [
            _cell(
                "kvplane kvplane",
                1,
                engine_hit_rate=0.9,
                client_cached_share=0.93,
                ttft_p90_ms=84.0,
            ),
            _cell(
                "kvplane kvplane",
                2,
                engine_hit_rate=0.8,
                client_cached_share=0.91,
                ttft_p90_ms=134.0,
            ),
            _cell("smg cache_aware", 1, error="the peers' environment is missing"),
            _cell("sglang-router round_robin", 1, unsalted_blocks=12),
            _cell("smg round_robin", 1, unsalted_blocks=0),
        ]
    )
    assert "shared-8, steady, medium (15 req/s offered)" in table
    row = next(line for line in table.splitlines() if line.startswith("kvplane kvplane"))
    assert "90.0 / 80.0" in row
    assert "93.0 / 91.0" in row  # the answers' cached share beside the engines' counters
    assert "84 / 134" in row
    assert "smg cache_aware: no figures: the peers' environment is missing" in table
    assert "sglang-router round_robin: tenants SHARED cache" in table
    assert "smg round_robin: tenants" not in table


def test_the_markdown_summary_has_a_column_per_load_and_per_situation() -> None:
    def at(router: str, run: int, load: str, situation: str = "steady") -> CellResult:
        result = _cell(router, run, engine_hit_rate=0.5 + run / 10, ttft_p90_ms=100.0 * run)
        result.cpu_ms_per_request = 10.0 * run
        result.load, result.situation = load, situation
        return result

    summary = render_summary_markdown(
        [
            at("kvplane kvplane", 1, "light"),
            at("kvplane kvplane", 2, "light"),
            at("kvplane kvplane", 1, "heavy"),
            at("kvplane kvplane", 1, "medium", "bypass"),
            _cell("smg cache_aware", 1, error="did not start"),
            _cell(
                "sglang-router cache_aware",
                1,
                engine_hit_rate=0.9,
                ttft_p90_ms=80.0,
                unsalted_blocks=5,
            ),
        ]
    )
    lines = summary.splitlines()
    assert "| router | light | heavy | medium |" in lines
    assert "| kvplane kvplane | 60.0 / 70.0 % · 100 / 200 ms | 60.0 % · 100 ms |  |" in lines
    assert "| router | bypass (shared-8, medium) |" in lines
    assert "| smg cache_aware |  |  | no figures |" in lines
    assert any("90.0 % · 80 ms (tenants shared cache)" in line for line in lines)
    cpu = lines[lines.index(next(line for line in lines if line.startswith("CPU ms"))) :]
    assert "| kvplane kvplane | 10.0 / 20.0 | 10.0 |  |" in cpu
