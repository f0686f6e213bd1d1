"""Where the bake-off's client sends requests, how it times a streamed answer (TTFT,
inter-token gaps, end to end), and how its tables show runs and errors."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any, cast

import openai
import pytest

from benchmarks.live import client as client_module
from benchmarks.live.bakeoff import CellResult, latencies
from benchmarks.live.client import Outcome, Traffic, inter_token_gaps
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


def test_an_eviction_points_table_shows_the_distinct_blocks_per_tier() -> None:
    def evicting(router: str, situation: str, **blocks: int) -> CellResult:
        result = _cell(router, 1, engine_hit_rate=0.5, distinct_blocks=2000, held_blocks=2010)
        result.workload, result.load, result.situation = "zipf-96", "moderate", situation
        for name, value in blocks.items():
            setattr(result, name, value)
        return result

    device_only = render_tables([evicting("kvplane kvplane", "eviction")])
    assert "distinct blocks" in device_only
    assert "2000" in device_only
    assert "CPU distinct" not in device_only
    tiered = render_tables(
        [
            evicting(
                "kvplane kvplane",
                "eviction-cpu",
                host_held_blocks=4096,
                host_distinct_blocks=4090,
                distinct_blocks_any_tier=4121,
            )
        ]
    )
    assert "CPU distinct" in tiered
    assert "distinct either" in tiered
    assert "4090" in tiered
    assert "4121" in tiered
    # Elsewhere the columns stay out of the table.
    assert "distinct blocks" not in render_tables([_cell("kvplane kvplane", 1)])


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


# --- inter-token and end-to-end latency ----------------------------------------------


def test_inter_token_gaps_are_the_gaps_between_content_chunks_after_the_first() -> None:
    gaps = inter_token_gaps([10.200, 10.250, 10.310, 10.310, 10.400])
    assert gaps == pytest.approx([0.050, 0.060, 0.0, 0.090])
    assert inter_token_gaps([10.2]) == []  # one chunk: a TTFT, no gap
    assert inter_token_gaps([]) == []


def _chunk(content: str | None) -> SimpleNamespace:
    delta = SimpleNamespace(content=content)
    return SimpleNamespace(choices=[SimpleNamespace(delta=delta)], usage=None)


class _Stream:
    """A streamed answer: the role chunk (no content), then `pieces`, then usage."""

    def __init__(self, pieces: list[str]) -> None:
        self._chunks = [_chunk(""), *(_chunk(piece) for piece in pieces)]
        self._chunks.append(SimpleNamespace(choices=[], usage=None))

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> SimpleNamespace:
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop(0)


def test_a_streamed_answer_is_timed_from_its_chunks_arrival(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # perf_counter: sent, then each content chunk as it arrives, then the stream's end.
    clock = iter([10.000, 10.200, 10.250, 10.310, 10.400, 10.500])
    monkeypatch.setattr(
        client_module, "time", SimpleNamespace(perf_counter=lambda: next(clock), time=lambda: 1.0)
    )

    async def create(**body: Any) -> _Stream:
        assert body["stream"] is True
        return _Stream(["a", "b", "c", "d"])

    fake = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    outcome, text = asyncio.run(
        client_module._send(cast(openai.AsyncOpenAI, fake), "m", [], 16, None)
    )
    assert text == "abcd"
    assert outcome.ok
    assert outcome.ttft_s == pytest.approx(0.200)
    assert outcome.itl_s == pytest.approx([0.050, 0.060, 0.090])
    assert outcome.latency_s == pytest.approx(0.500)


def test_a_cells_itl_pools_every_gap_and_e2e_counts_answered_requests() -> None:
    outcomes = [
        Outcome(ok=True, ttft_s=0.1, latency_s=0.3, itl_s=[0.010, 0.010, 0.012]),
        Outcome(ok=True, ttft_s=0.2, latency_s=0.5, itl_s=[0.008, 0.200]),  # a stall
        Outcome(ok=True, ttft_s=0.1, latency_s=0.2, itl_s=[]),  # one token
        Outcome(ok=False, error="timeout"),
    ]
    result = CellResult("r", "f", "p", "shared-8", "medium", 15.0, "pd", 1)
    latencies(result, outcomes)
    assert result.itl_gaps == 5
    # Nearest rank over the five gaps pooled: 8, 10, 10, 12, 200 ms.
    assert result.itl_p50_ms == pytest.approx(10.0)
    assert result.itl_p90_ms == pytest.approx(200.0)
    assert result.e2e_p50_ms == pytest.approx(300.0)
    assert result.e2e_p90_ms == pytest.approx(500.0)
    assert result.ttft_p90_ms == pytest.approx(200.0)
    empty = CellResult("r", "f", "p", "shared-8", "medium", 15.0, "pd", 1)
    latencies(empty, [Outcome(ok=False)])
    assert (empty.itl_gaps, math.isnan(empty.itl_p90_ms), math.isnan(empty.e2e_p90_ms)) == (
        0,
        True,
        True,
    )
    # Every cell's JSON carries them.
    assert {"itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_gaps", "e2e_p90_ms"} <= set(
        result.as_json()
    )
