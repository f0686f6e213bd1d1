"""Two router replicas sharing a Redis index: agents stream to one of them, and the
other routes on the same locations (its registry is re-read from Redis)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import httpx

from kvplane.core.config import IndexSettings
from router.app import RunningRouter, running_router
from simulations.local_workers import local_workers
from tests.router.proxy.conftest import MODEL, TENANT_KEYS, router_settings
from tests.waiting import wait_until

PROMPT = "Both replicas read the same index, so either one finds the cached prefix. " * 10
AUTH = {"authorization": f"Bearer {TENANT_KEYS['acme']}"}


async def _complete(client: httpx.AsyncClient, base_url: str) -> httpx.Response:
    response = await client.post(
        base_url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
        headers=AUTH,
    )
    assert response.status_code == 200, response.text
    return response


def _routable(router: RunningRouter, workers: int) -> Callable[[], bool]:
    return lambda: len(router.pool.candidates(MODEL)) == workers


async def test_a_second_router_routes_on_what_agents_told_the_first(redis_url: str) -> None:
    index = IndexSettings(
        backend="redis", redis_url=redis_url, redis_prefix=f"shared-{uuid.uuid4().hex[:8]}"
    )
    settings = router_settings(index)
    async with (
        running_router(settings) as first,
        running_router(settings) as second,
        local_workers(2, grpc_port=first.grpc_port, sim_options={"time_scale": 0.0}),
        httpx.AsyncClient(timeout=30) as client,
    ):
        for router in (first, second):
            await wait_until("both workers are routable", _routable(router, 2))
        first_url = f"http://127.0.0.1:{first.http_port}"
        second_url = f"http://127.0.0.1:{second.http_port}"
        holder = (await _complete(client, first_url)).headers["x-kvplane-worker"]

        async def second_sees_the_prefix() -> bool:
            response = await client.post(
                second_url + "/fleet/locality",
                json={"model": MODEL, "prompt": PROMPT, "tenant": "acme"},
                headers={"authorization": "Bearer admin-secret"},
            )
            # The holder must be chosen for its cached prefix, not by a tie at random.
            answer = response.json()
            cached = {row["worker_id"]: row["cached_tokens"] for row in answer["workers"]}
            return bool(answer["chosen"] == holder and cached[holder] > 0)

        await wait_until("the second router's locality names the holder", second_sees_the_prefix)
        repeat = await _complete(client, second_url)
        assert repeat.headers["x-kvplane-worker"] == holder
        assert int(repeat.headers["x-kvplane-cached-tokens"]) > 0
        details = repeat.json()["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] == int(repeat.headers["x-kvplane-cached-tokens"])
