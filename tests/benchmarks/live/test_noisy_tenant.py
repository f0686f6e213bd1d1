"""The noisy-tenant situation: its cells, its workloads' rates, bursts and tenants, the
client's sheds, C kept for a resumed run, and the report with issue 49's targets."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import re
import tomllib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx2
import openai
import pytest

from benchmarks.live import client as client_module
from benchmarks.live import main as main_module
from benchmarks.live.bakeoff import CellResult
from benchmarks.live.capacity import Capacity, calibration_requests, completed_rate
from benchmarks.live.client import SHED_UNLABELLED, Outcome
from benchmarks.live.engines import EngineShape
from benchmarks.live.fairness import NOISY_GROUP, WELL_BEHAVED_GROUP, TenantFigures
from benchmarks.live.grid import (
    CALIBRATED,
    NOISY_SITUATION,
    NOISY_TIME_SCALE,
    PROFILES,
    cells,
    select,
    traffic_seconds,
)
from benchmarks.live.main import resume_points
from benchmarks.live.noisy import floods, render_noisy_tenant
from benchmarks.live.report import read_json, render_summary_markdown, render_tables, write_json
from benchmarks.live.routers import (
    FLOW_CONTROL_SETTINGS,
    FLOW_WAIT_EVIDENCE,
    api_key,
    flow_waits,
    tenants_file,
)
from benchmarks.live.standings import standings
from benchmarks.live.workloads import (
    BURST_OFF_S,
    BURST_ON_S,
    LONG_FACTOR,
    NOISY_SOLO,
    NOISY_TENANT,
    SHARES,
    SHARES_WORKLOAD,
    WELL_BEHAVED_TENANTS,
    build_workload,
    burst_starts,
)
from router.tenants import api_key_digest
from tests.router.flow_control.test_gate import complete, engines_idle, slow_fleet
from tests.router.proxy.conftest import ADMIN_TOKEN
from tests.waiting import wait_until

C = 20.0  # req/s, the fleet's sustainable rate in these tests
FLOW, FLOW_X2, KVPLANE, SMG = (
    "kvplane flow-control",
    "kvplane flow-control x2",
    "kvplane kvplane",
    "smg cache_aware",
)


# --- the cells ---------------------------------------------------------------------


def test_only_noisy_tenant_picks_the_situation_of_the_full_profile() -> None:
    full = cells(PROFILES["full"])
    picked = select(full, [[NOISY_SITUATION]])
    assert picked == [cell for cell in full if cell.situation == NOISY_SITUATION]
    routers = {cell.router.name for cell in picked}
    assert routers == {
        FLOW,
        FLOW_X2,
        KVPLANE,
        SMG,
        "sglang-router cache_aware",
        "vllm-router cache_aware",
        "vllm-router kv_aware",
    }
    assert all(cell.load == CALIBRATED for cell in picked)
    assert not any(cell.situation == NOISY_SITUATION for cell in cells(PROFILES["default"]))
    # The shares measurement runs on kvplane with flow control alone.
    shares = {cell.router.name for cell in picked if cell.workload == SHARES_WORKLOAD}
    assert shares == {FLOW, FLOW_X2}
    assert {cell.replicas for cell in picked if cell.router.name == FLOW_X2} == {2}
    assert {cell.replicas for cell in picked if cell.router.name != FLOW_X2} == {1}


def test_each_routers_solo_run_goes_just_before_its_floods_in_one_point() -> None:
    picked = select(cells(PROFILES["full"]), [[NOISY_SITUATION]])
    flood = [cell for cell in picked if cell.workload != SHARES_WORKLOAD]
    assert len({cell.point for cell in flood}) == 1  # resumed whole, never split
    first = [(cell.router.name, cell.workload) for cell in flood if cell.run == 1][:3]
    assert first == [(FLOW, NOISY_SOLO), (FLOW, "noisy-same"), (FLOW, "noisy-long")]
    assert [cell.run for cell in flood] == sorted(cell.run for cell in flood)


def test_its_rates_come_from_c_and_its_engines_run_slower() -> None:
    cell = select(cells(PROFILES["full"]), [[NOISY_SITUATION, "noisy-same"]])[0]
    assert math.isnan(cell.rate_per_s)  # until measured
    measured = dataclasses.replace(cell, capacity_per_s=C)
    assert measured.rate_per_s == C
    assert measured == cell  # C is not part of what the cell is
    assert cell.shape(EngineShape()).time_scale == NOISY_TIME_SCALE
    assert traffic_seconds(15.0, "noisy-same") == 50.0
    assert traffic_seconds(15.0, SHARES_WORKLOAD) == 50.0
    assert FLOW_CONTROL_SETTINGS["KVPLANE_FLOW_CONTROL__ENABLED"] == "true"


# --- the workloads -----------------------------------------------------------------


def test_bursts_run_at_their_rate_and_only_while_on() -> None:
    starts = list(burst_starts(random.Random(1), 10.0, 100.0, 20.0, 10.0))
    period = 30.0
    assert all(start % period < 20.0 for start in starts)
    assert starts == sorted(starts)
    assert max(starts) < 100.0
    # On for 20 + 20 + 20 + 10 = 70 s at 10 a second.
    assert 600 < len(starts) < 800
    assert any(start > 90.0 for start in starts)  # the last, shorter burst too


def _by_tenant(name: str, duration_s: float = 200.0) -> dict[str | None, list[Any]]:
    workload = build_workload(name, C, duration_s, trace=Path("unused"))
    tenants: dict[str | None, list[Any]] = {}
    for conversation in workload.conversations:
        tenants.setdefault(conversation.tenant, []).append(conversation)
    return tenants


def test_well_behaved_tenants_send_015_c_each_and_the_noisy_one_8_times_that_in_bursts() -> None:
    tenants = _by_tenant("noisy-same")
    assert set(tenants) == {*WELL_BEHAVED_TENANTS, NOISY_TENANT}
    for tenant in WELL_BEHAVED_TENANTS:
        assert 0.85 * 0.15 * C * 200 < len(tenants[tenant]) < 1.15 * 0.15 * C * 200
    noisy_starts = [conversation.start_s for conversation in tenants[NOISY_TENANT]]
    on_s = 200.0 / (BURST_ON_S + BURST_OFF_S) * BURST_ON_S  # 6 bursts and a 20 s third
    assert 0.9 * 8 * 0.15 * C * on_s < len(noisy_starts) < 1.1 * 8 * 0.15 * C * on_s
    assert all(start % (BURST_ON_S + BURST_OFF_S) < BURST_ON_S for start in noisy_starts)
    # Each tenant its own two system prompts, no other tenant's text.
    prompts = {tenant: {c.system for c in found} for tenant, found in tenants.items()}
    assert all(len(systems) == 2 for systems in prompts.values())
    assert len(set.union(*prompts.values())) == 2 * len(prompts)


def test_the_long_variant_sends_the_same_tokens_in_fewer_longer_requests() -> None:
    same, long = _by_tenant("noisy-same"), _by_tenant("noisy-long")
    assert 0.8 / LONG_FACTOR < len(long[NOISY_TENANT]) / len(same[NOISY_TENANT]) < 1.2 / LONG_FACTOR
    short_request, long_request = same[NOISY_TENANT][0], long[NOISY_TENANT][0]
    assert long_request.root.max_tokens == LONG_FACTOR * short_request.root.max_tokens
    ratio = len(long_request.system + long_request.root.text) / len(
        short_request.system + short_request.root.text
    )
    assert 3.5 < ratio < 4.5
    for tenant in WELL_BEHAVED_TENANTS:  # the well-behaved tenants' requests unchanged
        assert long[tenant] == same[tenant]


def test_solo_is_the_well_behaved_tenants_very_requests_alone() -> None:
    solo, same = _by_tenant(NOISY_SOLO, 50.0), _by_tenant("noisy-same", 50.0)
    assert NOISY_TENANT not in solo
    assert {tenant: found for tenant, found in same.items() if tenant != NOISY_TENANT} == solo


def test_the_shares_workload_floods_with_every_tenant_and_names_the_shares() -> None:
    workload = build_workload(SHARES_WORKLOAD, C, 50.0, trace=Path("unused"))
    assert workload.shares == SHARES == {"tenant-a": 2.0, "tenant-b": 1.0, "tenant-c": 1.0}
    counts = Counter(conversation.tenant for conversation in workload.conversations)
    assert set(counts) == set(SHARES)
    assert all(0.8 * 0.8 * C * 50 < count < 1.2 * 0.8 * C * 50 for count in counts.values())


def test_kvplanes_tenants_file_carries_the_configured_shares(tmp_path: Path) -> None:
    path = tenants_file(("tenant-a", "tenant-b"), tmp_path, {"tenant-a": 2.0})
    tenants = tomllib.loads(path.read_text())["tenants"]
    assert tenants[0] == {
        "name": "tenant-a",
        "api_key_sha256": [api_key_digest(api_key("tenant-a"))],
        "share": 2.0,
    }
    assert "share" not in tenants[1]


# --- C -------------------------------------------------------------------------------


def test_c_counts_the_answers_of_the_measured_window_only() -> None:
    outcomes = [
        Outcome(ok=True, sent_at=100.0 + start, latency_s=1.0) for start in (3.0, 5.0, 9.0, 20.0)
    ]
    outcomes.append(Outcome(ok=False, sent_at=105.0, latency_s=1.0))  # not answered
    # Ends at 4, 6, 10 and 21 s: two in the window from 5 to 15 s.
    assert completed_rate(outcomes, 100.0, 5.0, 15.0) == (2, 0.2)


def test_calibration_sends_the_situations_shape_from_all_five_tenants_alike() -> None:
    requests = calibration_requests(100)
    assert Counter(request.tenant for request in requests) == dict.fromkeys(
        (*WELL_BEHAVED_TENANTS, NOISY_TENANT), 20
    )
    flood = _by_tenant("noisy-same", 50.0)
    assert {request.system for request in requests} == {
        c.system for found in flood.values() for c in found
    }


def test_a_resumed_run_keeps_the_c_it_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    measured = Capacity(21.3, 320, 15.0, 128, KVPLANE, NOISY_TIME_SCALE)

    def never(*_: object) -> Capacity:
        raise AssertionError("measured again")

    monkeypatch.setattr(main_module, "measure_capacity", never)
    earlier = {main_module.CAPACITY_KEY: measured.as_json()}
    assert main_module._capacity(earlier, EngineShape(), tmp_path) == measured
    assert "21.3 req/s, as measured before" in capsys.readouterr().out


# --- the client's sheds --------------------------------------------------------------


def _refusing(headers: dict[str, str]) -> openai.AsyncOpenAI:
    calls = []

    async def create(**_: Any) -> None:
        calls.append(1)
        if len(calls) > 1:
            raise AssertionError("retried")
        request = httpx2.Request("POST", "http://router/v1/chat/completions")
        response = httpx2.Response(429, headers=headers, request=request)
        raise openai.RateLimitError("shed", response=response, body=None)

    fake = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    return cast(openai.AsyncOpenAI, fake)


def test_a_429_is_a_shed_request_with_its_reason_never_retried() -> None:
    headers = {"retry-after": "1", "x-kvplane-shed-reason": "queue_timeout"}
    outcome, text = asyncio.run(client_module._send(_refusing(headers), "m", [], 16, "noisy"))
    assert (outcome.ok, outcome.shed, outcome.shed_reason, text) == (
        False,
        True,
        "queue_timeout",
        "",
    )
    assert outcome.latency_s is not None  # how long it waited for its 429
    unlabelled, _ = asyncio.run(client_module._send(_refusing({}), "m", [], 16, "noisy"))
    assert unlabelled.shed_reason == SHED_UNLABELLED


def test_requests_left_unanswered_are_failures_of_their_own_tenant() -> None:
    workload = build_workload("noisy-same", C, 10.0, trace=Path("unused"))
    sent = [Outcome(ok=True, tenant=conversation.tenant) for conversation in workload.conversations]
    # The noisy tenant's last three and one well-behaved request never came back.
    noisy_last = [i for i, o in enumerate(sent) if o.tenant == NOISY_TENANT][-3:]
    well_behaved = next(i for i, o in enumerate(sent) if o.tenant != NOISY_TENANT)
    kept = [o for i, o in enumerate(sent) if i not in {*noisy_last, well_behaved}]
    missing = client_module.unfinished(workload, kept)
    assert Counter(outcome.tenant for outcome in missing) == {
        NOISY_TENANT: 3,
        sent[well_behaved].tenant: 1,
    }
    assert not any(outcome.ok for outcome in missing)
    assert client_module.unfinished(workload, sent) == []


# --- the report ----------------------------------------------------------------------


def _run(
    router: str,
    workload: str,
    run: int = 1,
    *,
    p90: float = 1000.0,
    noisy_p90: float = 9000.0,
    shed: dict[str, dict[str, int]] | None = None,
    tokens_per_s: float = 300.0,
    hit: float = 0.85,
    answered_hit: float = 0.8,
    waits: list[dict[str, dict[str, float]]] | None = None,
) -> CellResult:
    family, _, policy = router.partition(" ")
    result = CellResult(router, family, policy, workload, CALIBRATED, C, NOISY_SITUATION, run)
    groups = {WELL_BEHAVED_GROUP: {"p50": p90 / 2, "p90": p90, "p99": p90 * 2}}
    if workload != NOISY_SOLO:
        groups[NOISY_GROUP] = {"p50": noisy_p90 / 2, "p90": noisy_p90, "p99": noisy_p90}
    result.tenancy = TenantFigures(
        ttft_ms_by_group=groups,
        shed_by_tenant=shed or {},
        span_requests_per_s=tokens_per_s / 16,
        span_output_tokens_per_s=tokens_per_s,
        backlogged_s={NOISY_TENANT: 30.0},
        backlogged_share={NOISY_TENANT: 0.4},
        hit_rate_by_group={WELL_BEHAVED_GROUP: 0.9, NOISY_GROUP: 0.5},
    )
    result.client_cached_share = answered_hit
    result.engine_hit_rate, result.capacity_per_s, result.ttft_p90_ms = hit, C, p90
    # Each router replica's flow-control waits, as the evidence holds them.
    result.evidence = {
        f"replica-{n}": {FLOW_WAIT_EVIDENCE: wait} for n, wait in enumerate(waits or [])
    }
    return result


def _flood_results() -> list[CellResult]:
    return [
        _run(FLOW, NOISY_SOLO, p90=1000.0),
        _run(FLOW, "noisy-same", p90=1200.0, shed={NOISY_TENANT: {"queue_timeout": 300}}),
        _run(
            FLOW,
            "noisy-long",
            p90=1300.0,
            shed={NOISY_TENANT: {"queue_full": 5}, "tenant-2": {"displaced": 1}},
            tokens_per_s=250.0,
        ),
        _run(KVPLANE, NOISY_SOLO, p90=900.0),
        _run(KVPLANE, "noisy-same", p90=15000.0),
        _run(KVPLANE, "noisy-long", p90=9000.0, hit=0.95, answered_hit=0.82),
        _run(SMG, NOISY_SOLO, p90=4000.0),
    ]


def test_each_flood_is_read_against_its_solo_run_and_kvplane_without_flow_control() -> None:
    found = {(flood.run.router, flood.run.workload): flood for flood in floods(_flood_results())}
    same = found[(FLOW, "noisy-same")]
    assert same.p90_ratio == pytest.approx(1.2)
    assert same.throughput_ratio == pytest.approx(1.0)
    assert same.targets() == dict.fromkeys(same.targets(), True)
    long = found[(FLOW, "noisy-long")]
    assert long.p90_ratio == pytest.approx(1.3)
    assert long.throughput_ratio == pytest.approx(250 / 300)
    assert long.hit_points == pytest.approx(-10.0)
    assert long.answered_hit_points == pytest.approx(-2.0)
    assert (long.shed_well_behaved, long.shed_noisy) == (1, 5)
    assert not any(long.targets().values())
    assert found[(KVPLANE, "noisy-same")].p90_ratio == pytest.approx(15000 / 900)
    assert (SMG, "noisy-same") not in found  # no flood run: no row


def test_the_report_shows_the_situation_in_its_own_tables() -> None:
    results = _flood_results()
    text = render_noisy_tenant(results)
    assert "noisy-same (C = 20.0 req/s)" in text
    same = text[text.index("noisy-same (") : text.index("noisy-long (")]
    row = next(line for line in same.splitlines() if line.startswith(f"{FLOW}, run 1  "))
    assert " 1.20 " in row  # p90 over solo's
    assert row.index(" 90.0 ") < row.index(" 50.0 ")  # the WB tenants' hit rate, the noisy's
    assert f"{FLOW}, run 1: targets: 4 of 4 met" in text
    assert "0 of 4 met" in text  # the long variant's
    assert f"{FLOW}, run 1: shed noisy queue_full 5; tenant-2 displaced 1" in text
    assert f"{KVPLANE}, run 1: targets" not in text  # only flow control is judged
    assert "noisy-solo (well-behaved tenants alone)" in text
    # The generic tables and the standings leave it to its own tables.
    tables = render_tables(results)
    assert "noisy-same, noisy-tenant" not in tables
    assert tables.startswith(NOISY_SITUATION)
    assert standings(results) == []
    assert f"Flow control (`{NOISY_SITUATION}`)" in render_summary_markdown(results)


def test_the_well_behaved_tenants_wait_in_the_router_is_read_over_every_replica() -> None:
    waits: list[dict[str, dict[str, float]]] = [
        {"tenant-1": {"seconds": 3.0, "requests": 10.0}, "noisy": {"seconds": 90, "requests": 9}},
        {"tenant-2": {"seconds": 1.0, "requests": 10.0}, "tenant-3": {"requests": 5.0}},
    ]
    results = [
        _run(FLOW_X2, NOISY_SOLO),
        _run(FLOW_X2, "noisy-same", waits=waits),
        _run(KVPLANE, "noisy-same"),
    ]
    (flood, without) = floods(results)
    assert flood.router_wait_ms(WELL_BEHAVED_GROUP) == pytest.approx(4.0 / 25 * 1000)
    assert flood.router_wait_ms(NOISY_GROUP) == pytest.approx(10_000)
    assert math.isnan(without.router_wait_ms(WELL_BEHAVED_GROUP))  # no flow control
    lines = render_noisy_tenant(results).splitlines()
    at = next(n for n, line in enumerate(lines) if line.startswith("noisy-same ("))
    header, row = lines[at], lines[at + 2]
    columns = dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", row), strict=True))
    assert columns["WB wait ms"] == "160"


async def test_the_evidence_counts_each_tenants_wait_in_flow_control() -> None:
    async with slow_fleet(max_engine_waiting=0) as fleet:
        running = asyncio.ensure_future(complete(fleet, "acme", "running", max_tokens=12))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        waited = await complete(fleet, "globex", "waiting for it")
        assert (await running).status_code == waited.status_code == 200
        waits = await asyncio.to_thread(flow_waits, fleet.url, ADMIN_TOKEN)
    # acme's found room at once, and never queued; globex's waited for it to end.
    assert list(waits) == ["globex"]
    assert waits["globex"]["requests"] == 1
    assert 0.1 < waits["globex"]["seconds"] < 5  # acme's 12 tokens of 25 ms


def test_the_shares_table_sets_measured_against_configured_shares() -> None:
    result = _run(FLOW, SHARES_WORKLOAD)
    assert result.tenancy is not None
    result.tenancy.all_backlogged_s = 40.0
    result.tenancy.all_backlogged_shares = {"tenant-a": 0.52, "tenant-b": 0.25, "tenant-c": 0.23}
    result.tenancy.configured_shares = {"tenant-a": 0.5, "tenant-b": 0.25, "tenant-c": 0.25}
    skewed = _run(FLOW_X2, SHARES_WORKLOAD)
    assert skewed.tenancy is not None
    skewed.tenancy.all_backlogged_shares = {"tenant-a": 0.4, "tenant-b": 0.3, "tenant-c": 0.3}
    skewed.tenancy.configured_shares = result.tenancy.configured_shares
    text = render_noisy_tenant([result, skewed])
    row = next(line for line in text.splitlines() if line.startswith(f"{FLOW}, run 1"))
    assert "0.520 / 0.500" in row
    assert row.endswith("8.0%         yes")
    assert text.splitlines()[-1].endswith("20.0%          no")


def test_its_figures_read_back_from_the_json(tmp_path: Path) -> None:
    written = _run(FLOW, "noisy-same", shed={NOISY_TENANT: {"queue_timeout": 3}})
    path = tmp_path / "live.json"
    write_json(path, [written], {"duration_s": 15.0})
    _, [read] = read_json(path)
    assert read.tenancy == written.tenancy
    assert read.capacity_per_s == C
    assert read.tenancy is not None
    assert read.tenancy.shed == 3


def test_a_cut_short_flood_runs_again_whole() -> None:
    picked = select(cells(PROFILES["full"]), [[NOISY_SITUATION]])
    flood = [cell for cell in picked if cell.workload != SHARES_WORKLOAD]
    previous = [_run(cell.router.name, cell.workload, cell.run) for cell in flood[:-1]]
    kept, to_run = resume_points(picked, previous)
    assert kept == {}
    assert to_run == picked
