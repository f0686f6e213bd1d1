"""Two router replicas on one Redis index (and on a Redis Cluster), each receiving one
tenant's flood: together they keep the tenants' configured shares of the engines (where
each router alone would serve its own tenant whenever it saw room)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from kvplane.core.config import IndexSettings
from router.app import RunningRouter, running_router
from simulations.local_workers import local_workers
from tests.router.flow_control.test_gate import (
    SLOW,
    complete,
    engine_queues,
    flow_settings,
    learn_batch_limits,
)
from tests.router.proxy.conftest import MODEL, RoutedFleet
from tests.waiting import wait_until

FLOOD_S = 12.0  # 8 s gave a loaded machine 89 requests to read a share from, too few
OUTSTANDING = 12  # each tenant's requests in progress at all times


async def flood(url: str, tenant: str, until: float, served: list[tuple[float, str]]) -> None:
    """Requests one after another, each noted when it completes, until `until`."""
    n = 0
    while time.monotonic() < until:
        n += 1
        response = await complete(
            url, tenant, f"{tenant} asks {n} {uuid.uuid4().hex}", max_tokens=2
        )
        assert response.status_code == 200, response.text
        served.append((time.monotonic(), tenant))


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_two_replicas_keep_the_configured_shares(
    backend: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_url" if backend == "redis" else "redis_cluster_url")
    index = IndexSettings(
        backend=backend, redis_url=url, redis_prefix=f"flow-{uuid.uuid4().hex[:8]}"
    )
    # initech's share is twice acme's; each tenant reaches the fleet through its own router.
    settings = flow_settings(index, max_engine_waiting=1, fairness_slack_tokens=32)
    async with (
        running_router(settings) as first,
        running_router(settings) as second,
        local_workers(2, grpc_port=first.grpc_port, sim_options=SLOW) as workers,
    ):
        routers = [first, second]
        for router in routers:
            await wait_until("both workers are routable", lambda r=router: _routable(r))
        fleet = RoutedFleet(first, workers)
        await learn_batch_limits(fleet, routers)  # the second learns them from the first
        served: list[tuple[float, str]] = []
        until = time.monotonic() + FLOOD_S
        urls = {"initech": _url(first), "acme": _url(second)}
        await asyncio.gather(
            *(
                flood(urls[tenant], tenant, until, served)
                for tenant in urls
                for _ in range(OUTSTANDING)
            )
        )

    # Read while both were backlogged: after the first second, before the floods end.
    start = served[0][0] + 1.0
    window = [tenant for at, tenant in served if start <= at <= until]
    share = window.count("initech") / len(window)
    assert len(window) >= 40, len(window)
    assert abs(share - 2 / 3) <= 2 / 3 * 0.1, (share, len(window))


def _routable(router: RunningRouter) -> bool:
    return len(engine_queues(router).reported) == 2 and len(router.pool.candidates(MODEL)) == 2


def _url(router: RunningRouter) -> str:
    return f"http://127.0.0.1:{router.http_port}"
