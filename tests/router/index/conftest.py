"""`make_index`: one fixture that builds every LocationIndex backend, so each test in
this folder runs against the in-memory index, Redis and Redis Cluster alike (each in
both layouts: with and without group directories), and the in-memory index wrapped as
the router wraps its index (metrics and spans), which must keep the contract too; and
`pass_time`, which lets their leases run."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from opentelemetry import trace
from redis.asyncio.cluster import RedisCluster

from router.index.base import LocationIndex
from router.index.instrumented import InstrumentedIndex
from router.index.memory import MemoryLocationIndex
from router.metrics import RouterMetrics
from tests.clock import ManualClock

IndexFactory = Callable[..., Awaitable[LocationIndex]]
PassTime = Callable[[float], Awaitable[None]]

BACKENDS = [
    "memory",
    "instrumented-memory",
    "redis",
    "redis-cluster",
    "redis-directory",
    "redis-cluster-directory",
]


def redis_url_for(backend: str, request: pytest.FixtureRequest) -> str | None:
    """The Redis a backend name stands for (None: not a Redis one)."""
    if not backend.startswith("redis"):
        return None
    cluster = backend.startswith("redis-cluster")
    return str(request.getfixturevalue("redis_cluster_url" if cluster else "redis_url"))


def open_redis_index(backend: str, url: str, prefix: str, **options: Any) -> LocationIndex:
    from router.index.redis import RedisLocationIndex

    return RedisLocationIndex.from_url(
        url,
        cluster=backend.startswith("redis-cluster"),
        directory=backend.endswith("directory"),
        prefix=prefix,
        **options,
    )


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> ManualClock:
    """The memory index's clock (Redis keeps leases on the server's own)."""
    return ManualClock()


@pytest.fixture
def pass_time(backend: str, clock: ManualClock) -> PassTime:
    """Let `seconds` go by for the indexes' leases: at once on the memory index's
    clock; on Redis, whose leases run on the server's clock, by sleeping."""

    async def pass_seconds(seconds: float) -> None:
        if backend.endswith("memory"):
            clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)

    return pass_seconds


@pytest.fixture
async def make_index(
    backend: str, clock: ManualClock, request: pytest.FixtureRequest
) -> AsyncIterator[IndexFactory]:
    created: list[LocationIndex] = []
    prefix = f"kvptest-{uuid.uuid4().hex[:10]}"
    url = redis_url_for(backend, request)

    async def factory(*, max_entries: int | None = None) -> LocationIndex:
        index: LocationIndex
        if backend == "memory":
            index = MemoryLocationIndex(max_entries=max_entries, clock=clock)
        elif backend == "instrumented-memory":
            memory = MemoryLocationIndex(max_entries=max_entries, clock=clock)
            index = InstrumentedIndex(memory, RouterMetrics(), trace.NoOpTracer())
        else:
            assert url is not None
            index = open_redis_index(backend, url, prefix, max_entries=max_entries)
        created.append(index)
        return index

    yield factory
    for index in created:
        await index.close()
    if url is not None:
        await delete_prefix(url, backend.startswith("redis-cluster"), prefix)


async def delete_prefix(url: str, cluster: bool, prefix: str) -> None:
    client: aioredis.Redis | RedisCluster
    client = RedisCluster.from_url(url) if cluster else aioredis.Redis.from_url(url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        for key in keys:
            await client.delete(key)
    finally:
        await client.aclose()
