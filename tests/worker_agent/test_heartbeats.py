"""A load report that says nothing new goes only as often as the lease needs: the router
tells each agent its lease when it registers, and an idle engine's agent then
heartbeats every third of it instead of every probe, and on its own where probes come
further apart than the lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from kvplane.core.config import AgentSettings, ControlPlaneSettings
from kvplane.core.serving import cancel_task
from kvplane.core.types import EventsState, ReplayState, WiringReport
from kvplane.wire.codec import register_message
from kvplane.wire.stream import AgentStream
from router.app import RunningRouter, running_router
from router.control_plane import service as control_plane_service
from router.index.base import WorkerState
from tests.router.conftest import (
    BLOCK_SIZE,
    MODEL,
    make_settings,
    router_with_channel,
    worker,
)
from tests.waiting import wait_until
from worker_agent.events import EngineLoad
from worker_agent.publisher import ControlPlanePublisher, WorkerIdentity

LEASE_S = 3.0  # a repeated load goes again after a second
PROBES = 10
PROBE_GAP_S = 0.05  # ten probes within half a second: well inside a third of the lease


def _loads_received(router: RunningRouter) -> float:
    """Load reports the router took (each carries the agent's clock, which it times)."""
    value = router.metrics.registry.get_sample_value("kvplane_load_lag_seconds_count")
    return value or 0.0


@asynccontextmanager
async def _connected_agent(router: RunningRouter) -> AsyncIterator[ControlPlanePublisher]:
    publisher = ControlPlanePublisher(
        WorkerIdentity("w1", "http://127.0.0.1:1", MODEL, BLOCK_SIZE, 0, "vllm", "", {}),
        AgentSettings(control_plane_address=f"127.0.0.1:{router.grpc_port}"),
        ControlPlaneSettings(block_size=BLOCK_SIZE),
        snapshot=list,
    )
    task = asyncio.create_task(publisher.run())
    try:
        await publisher.wait_connected()
        yield publisher
    finally:
        await cancel_task(task)


async def _probe(publisher: ControlPlanePublisher, load_at: Callable[[int], EngineLoad]) -> None:
    for probe in range(PROBES):
        publisher.report_load(load_at(probe))
        await asyncio.sleep(PROBE_GAP_S)


async def test_the_register_ack_carries_the_lease() -> None:
    async with router_with_channel(make_settings(lease_s=LEASE_S)) as (_, channel):
        reply = await AgentStream(channel).request(register_message(worker()))
        assert reply.ack.lease_ms == LEASE_S * 1000


async def test_a_load_that_stands_still_goes_once_until_the_lease_needs_it() -> None:
    async with (
        running_router(make_settings(lease_s=LEASE_S)) as router,
        _connected_agent(router) as publisher,
    ):
        before = _loads_received(router)
        await _probe(publisher, lambda probe: EngineLoad(0, 0, 0.0))
        await wait_until("the first report", lambda: _loads_received(router) > before)
        await asyncio.sleep(0.2)  # any repeat that went would have arrived by now
        assert _loads_received(router) - before == 1
        # A third of the lease later the same load goes again, as the heartbeat.
        await asyncio.sleep(LEASE_S / 3)
        publisher.report_load(EngineLoad(0, 0, 0.0))
        await wait_until("the heartbeat", lambda: _loads_received(router) - before == 2)


async def test_every_load_that_changed_goes() -> None:
    async with (
        running_router(make_settings(lease_s=LEASE_S)) as router,
        _connected_agent(router) as publisher,
    ):
        before = _loads_received(router)
        await _probe(publisher, lambda probe: EngineLoad(probe % 2, 0, 0.5))
        await wait_until("every report", lambda: _loads_received(router) - before == PROBES)


async def test_an_agent_told_no_lease_sends_every_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router older than Ack.lease_ms: the field reads 0 there."""
    monkeypatch.setattr(control_plane_service, "_MAX_LEASE_MS", 0)
    async with (
        running_router(make_settings(lease_s=LEASE_S)) as router,
        _connected_agent(router) as publisher,
    ):
        before = _loads_received(router)
        await _probe(publisher, lambda probe: EngineLoad(0, 0, 0.0))
        await wait_until("every report", lambda: _loads_received(router) - before == PROBES)


async def test_the_same_load_with_changed_wiring_goes_at_once() -> None:
    """What the router shows of an agent's wiring must not wait for the heartbeat."""
    async with (
        running_router(make_settings(lease_s=LEASE_S)) as router,
        _connected_agent(router) as publisher,
    ):
        before = _loads_received(router)
        publisher.report_load(EngineLoad(0, 0, 0.0))
        await wait_until("the first report", lambda: _loads_received(router) - before == 1)
        publisher.report_wiring(WiringReport(EventsState.SILENT, ReplayState.OK, 16))
        publisher.report_load(EngineLoad(0, 0, 0.0))
        await wait_until("the changed wiring", lambda: _loads_received(router) - before == 2)


@pytest.mark.slow
async def test_probes_further_apart_than_the_lease_do_not_let_it_run_out() -> None:
    """The control plane sets the lease, the agent its load interval: an interval longer
    than the lease once let the worker drop out of routing and the index between
    probes, and register again under a new incarnation, over and over."""
    lease_s = 0.9  # a heartbeat every 0.6 s, two thirds of it
    async with (
        running_router(make_settings(lease_s=lease_s)) as router,
        _connected_agent(router) as publisher,
    ):
        before = _loads_received(router)
        publisher.report_load(EngineLoad(0, 0, 0.0))  # the only probe
        await asyncio.sleep(3 * lease_s)
        assert _loads_received(router) - before >= 4  # the report, then the heartbeats
        states = [(status.info.worker_id, status.state) for status in await router.index.workers()]
        assert states == [("w1", WorkerState.LIVE)]
        assert publisher.incarnations_started == 1
