"""An agent whose engine is idle reads its metrics less often (it costs next to nothing
at rest) and heartbeats only as often as its lease needs; its /health probes still go
every load interval, so that a dead engine is found as soon as ever, and an event ends
the wait."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplane.core.config import ControlPlaneSettings, IndexSettings
from kvplane.core.serving import cancel_task, free_port
from router.app import RunningRouter, running_router
from simulations.local_workers import local_worker
from tests.router.proxy.conftest import ADMIN_TOKEN, router_settings
from tests.simulations.engine_sim.conftest import engine_sim
from tests.waiting import wait_until
from tests.worker_agent.test_agent_end_to_end import Fleet, agent_settings, sim_options, start_agent
from worker_agent.agent import is_idle
from worker_agent.events import EngineLoad

IDLE = EngineLoad(running=0, waiting=0, kv_usage=0.1)


def test_an_engine_is_idle_with_nothing_to_do_and_no_new_events() -> None:
    assert is_idle(IDLE, last_batch_at=5.0, seen_at=5.0)
    assert is_idle(IDLE, last_batch_at=None, seen_at=None)
    assert not is_idle(IDLE, last_batch_at=6.0, seen_at=5.0)  # events since the last probe
    assert not is_idle(EngineLoad(1, 0, 0.1), last_batch_at=5.0, seen_at=5.0)
    assert not is_idle(EngineLoad(0, 2, 0.1), last_batch_at=5.0, seen_at=5.0)


@pytest.mark.slow
async def test_an_idle_engines_metrics_are_read_less_often_and_its_heartbeats_go_on() -> None:
    lease_s = 1.5  # an unchanged load goes again every half second
    settings = router_settings(lease_s=lease_s)
    async with (
        running_router(settings) as router,
        local_worker(
            "worker-1",
            control_plane=ControlPlaneSettings(block_size=16),
            control_plane_address=f"127.0.0.1:{router.grpc_port}",
            sim_options={"time_scale": 0.0},
            load_interval_s=0.1,
            idle_metrics_interval_s=1.0,
        ) as worker,
        httpx.AsyncClient(timeout=5) as client,
    ):
        await wait_until("the worker is routable", lambda: len(router.pool.candidates()) == 1)

        async def over(seconds: float) -> tuple[int, float]:
            """The metrics reads and the load reports received meanwhile."""
            reads, reports = worker.agent.metrics_reads, await _reports(router)
            await asyncio.sleep(seconds)
            return worker.agent.metrics_reads - reads, await _reports(router) - reports

        idle_reads, idle_reports = await over(2.0)
        assert 1 <= idle_reads <= 2.0 / 1.0 + 1  # at the load interval: about 20
        # The heartbeats went on (the lease holds), a third of the lease apart rather
        # than at every probe (about 20 in these 2 s).
        assert 2 <= idle_reports <= 2.0 / (lease_s / 3) + 1

        async def busy() -> None:  # new prompts: each one's blocks are new events
            deadline = time.monotonic() + 2.0
            turn = 0
            while time.monotonic() < deadline:
                prompt = f"request {turn} of a busy engine, block after block " * 4
                await client.post(
                    worker.base_url + "/v1/completions",
                    json={"model": "kvplane-tiny", "prompt": prompt, "max_tokens": 1},
                )
                turn += 1
                await asyncio.sleep(0.05)

        traffic = asyncio.create_task(busy())
        busy_reads, _ = await over(2.0)
        await traffic
        assert busy_reads > 2 * idle_reads  # events end the wait: the load interval
        assert len(router.pool.candidates()) == 1


async def _reports(router: RunningRouter) -> float:
    async with httpx.AsyncClient(timeout=5) as client:
        text = (
            await client.get(
                f"http://127.0.0.1:{router.http_port}/metrics",
                headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
            )
        ).text
    for family in text_string_to_metric_families(text):
        if family.name == "kvplane_load_lag_seconds":
            return sum(s.value for s in family.samples if s.name.endswith("_count"))
    return 0.0


async def test_an_idle_engine_that_dies_is_found_down_at_the_load_interval() -> None:
    async with contextlib.AsyncExitStack() as engine_life:
        sim = await engine_life.enter_async_context(engine_sim(**sim_options()))
        settings = agent_settings(sim, free_port(), IndexSettings())
        settings = settings.model_copy(
            update={
                "control_plane": settings.control_plane.model_copy(update={"lease_s": 30.0}),
                "agent": settings.agent.model_copy(update={"idle_metrics_interval_s": 60.0}),
            }
        )
        async with running_router(settings) as router:
            agent, task = start_agent(settings)
            try:
                running = Fleet(sim, router, settings, agent, task)
                await wait_until("the agent registers", running.registered)
                reads = agent.metrics_reads
                await asyncio.sleep(1.0)  # ten load intervals: idle, its metrics wait
                assert agent.metrics_reads - reads <= 1
                await engine_life.aclose()  # the engine dies
                await wait_until("the agent finds it down", lambda: agent.engine_is_down, 3.0)
            finally:
                await cancel_task(task)
