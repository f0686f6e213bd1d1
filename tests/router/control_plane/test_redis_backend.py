"""The control plane over the Redis index (router/index/redis.py, opened lazily through
open_index like `kvplane router --index redis` does)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import httpx
import pytest
import redis.asyncio as aioredis

from kvplane.core.config import IndexSettings
from kvplane.core.serving import free_port
from kvplane.wire.codec import events_message, register_message
from kvplane.wire.stream import AgentStream
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.app import running_router
from router.index.base import WorkerState
from router.index.redis import KeyLayout
from tests.clock import ManualClock
from tests.router.conftest import (
    body,
    make_settings,
    prompt_keys,
    router_with_channel,
    snapshot,
    stored,
    worker,
)
from tests.waiting import wait_until

KEYS_A = prompt_keys(1)
KEYS_B = prompt_keys(2)


@pytest.fixture
async def redis_index(redis_url: str) -> AsyncIterator[IndexSettings]:
    prefix = f"kvptest-cp-{uuid.uuid4().hex[:10]}"
    yield IndexSettings(backend="redis", redis_url=redis_url, redis_prefix=prefix)
    client = aioredis.Redis.from_url(redis_url)
    try:
        async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            await client.delete(key)
    finally:
        await client.aclose()


async def test_stream_semantics_over_redis(redis_index: IndexSettings) -> None:
    async with router_with_channel(make_settings(redis_index)) as (router, channel):
        stream = AgentStream(channel)
        assert (await stream.request(register_message(worker("w1", 3)))).ack.sequence == 0
        assert (await stream.request(events_message(1, [stored(KEYS_A)]))).ack.sequence == 1
        assert (await stream.request(events_message(1, [stored(KEYS_B)]))).ack.sequence == 1
        assert (await router.index.lookup(KEYS_A))["w1"].blocks == len(KEYS_A)
        assert await router.index.lookup(KEYS_B) == {}
        before = await snapshot(router.index, [KEYS_A, KEYS_B])

        stale = AgentStream(channel)
        await stale.send(register_message(worker("w1", 2)))
        assert (await stale.reply()).reject.code == pb.REJECT_CODE_STALE_INCARNATION
        oversized = AgentStream(channel)
        await oversized.send(register_message(worker("w1", 3, block_size=64)))
        assert (await oversized.reply()).reject.code == pb.REJECT_CODE_INCOMPATIBLE
        assert await snapshot(router.index, [KEYS_A, KEYS_B]) == before

        reply = await stream.request(events_message(5, [stored(KEYS_B)]))
        assert body(reply) == "resync"
        assert await router.index.lookup(KEYS_A) == {}
        assert (await router.index.stats()).entries == 0


async def test_an_agent_resumes_on_another_router_where_the_first_left_it(
    redis_index: IndexSettings,
) -> None:
    """A router that restarts, or a sibling the agent moves to, reads the sequence the
    shared index recorded: the agent resumes instead of sending its whole state again."""
    async with router_with_channel(make_settings(redis_index)) as (_, first_channel):
        first = AgentStream(first_channel)
        await first.request(register_message(worker("w1", 3)))
        await first.send(events_message(1, [stored(KEYS_A)], ack_deferred=True))
        assert (await first.request(events_message(2, []))).ack.sequence == 2
    async with router_with_channel(make_settings(redis_index)) as (router, channel):
        stream = AgentStream(channel)
        assert (await stream.request(register_message(worker("w1", 3)))).ack.sequence == 2
        assert (await stream.request(events_message(3, [stored(KEYS_B)]))).ack.sequence == 3
        assert {w: m.blocks for w, m in (await router.index.lookup(KEYS_A)).items()} == {
            "w1": len(KEYS_A)
        }
        assert set(await router.index.lookup(KEYS_B)) == {"w1"}


async def test_an_agent_back_on_a_router_whose_view_of_it_went_stale_resumes(
    redis_index: IndexSettings,
) -> None:
    """Router A last saw the worker before it moved to router B, which kept its lease:
    A's own view says the lease ran out, the shared index says it did not, and the index
    is the judge."""
    clock = ManualClock()
    async with (
        router_with_channel(make_settings(redis_index), clock=clock) as (a, a_channel),
        router_with_channel(make_settings(redis_index)) as (_, b_channel),
    ):
        first = AgentStream(a_channel)
        await first.request(register_message(worker("w1", 3)))
        await first.request(events_message(1, [stored(KEYS_A)]))
        await first.close()
        second = AgentStream(b_channel)
        assert (await second.request(register_message(worker("w1", 3)))).ack.sequence == 1
        assert (await second.request(events_message(2, [stored(KEYS_B)]))).ack.sequence == 2
        await second.close()
        clock.advance(make_settings(redis_index).control_plane.lease_s + 1)

        def dead_in_a() -> bool:
            record = a.workers.get("w1")
            return record is not None and record.state is WorkerState.DEAD

        await wait_until("router A's view to give up on the worker", dead_in_a)
        third = AgentStream(a_channel)
        reply = await third.request(register_message(worker("w1", 3)))

        assert body(reply) == "ack"
        assert reply.ack.sequence == 2
        assert (await third.request(events_message(3, []))).ack.sequence == 3
        assert set(await a.index.lookup(KEYS_B)) == {"w1"}


async def test_a_late_batch_of_a_stream_the_agent_left_leaves_the_worker_whole(
    redis_index: IndexSettings,
) -> None:
    """Router A still holds the agent's old stream when a batch of it arrives after the
    agent moved to router B, which applied that sequence and more: A refuses the stream
    as stale and drops nothing."""
    async with (
        router_with_channel(make_settings(redis_index)) as (_, a_channel),
        router_with_channel(make_settings(redis_index)) as (b, b_channel),
    ):
        old = AgentStream(a_channel)
        await old.request(register_message(worker("w1", 3)))
        await old.request(events_message(1, [stored(KEYS_A)]))
        moved = AgentStream(b_channel)
        assert (await moved.request(register_message(worker("w1", 3)))).ack.sequence == 1
        await moved.request(events_message(2, [stored(KEYS_B)]))

        reason = await _rejected_with(old, events_message(2, [stored(KEYS_B)]))

        assert "sequence 2" in reason
        assert set(await b.index.lookup(KEYS_A)) == set(await b.index.lookup(KEYS_B)) == {"w1"}
        assert (await moved.request(events_message(3, []))).ack.sequence == 3


async def _rejected_with(stream: AgentStream, message: pb.AgentMessage) -> str:
    reply = await stream.request(message)
    assert body(reply) == "reject", reply
    assert reply.reject.code == pb.REJECT_CODE_STALE_INCARNATION
    return reply.reject.reason


async def test_writes_the_index_lost_make_the_worker_resync(redis_index: IndexSettings) -> None:
    """A Redis failover to a replica that had not received the last batches (as
    tests/router/index/test_redis_failover.py makes happen) leaves the worker's hash a
    sequence behind this router: the next batch finds it, and the worker resyncs."""
    async with router_with_channel(make_settings(redis_index)) as (router, channel):
        stream = AgentStream(channel)
        await stream.request(register_message(worker("w1", 3)))
        await stream.request(events_message(1, [stored(KEYS_A)]))
        await stream.request(events_message(2, [stored(KEYS_B)]))
        client = aioredis.Redis.from_url(redis_index.redis_url)
        try:  # what the promoted replica holds: batch 1 recorded, batch 2 never seen
            layout = KeyLayout(redis_index.redis_prefix)
            await client.hset(layout.worker("w1"), "meta.applied", "1")  # type: ignore[misc]
        finally:
            await client.aclose()

        reply = await stream.request(events_message(3, []))

        assert body(reply) == "resync"
        assert "index_lost_writes" in reply.resync.reason
        assert await router.index.lookup(KEYS_A) == {}
        resyncs = router.metrics.registry.get_sample_value(
            "kvplane_resyncs_total", {"reason": "index_lost_writes"}
        )
        assert resyncs == 1
        reply = await stream.request(register_message(worker("w1", 4)))
        assert reply.ack.sequence == 0
        assert (await stream.request(events_message(1, [stored(KEYS_A)]))).ack.sequence == 1
        assert set(await router.index.lookup(KEYS_A)) == {"w1"}


async def test_expired_worker_is_purged_from_redis(redis_index: IndexSettings) -> None:
    settings = make_settings(redis_index, lease_s=0.4)
    async with router_with_channel(settings) as (router, channel):
        stream = AgentStream(channel)
        await stream.request(register_message(worker("w1")))
        await stream.request(events_message(1, [stored(KEYS_A)]))
        await stream.close()

        async def purged() -> bool:
            return await router.index.workers() == []

        await wait_until("the reaper to purge the expired worker", purged)
        assert await router.index.lookup(KEYS_A) == {}


async def test_unreachable_redis() -> None:
    down = IndexSettings(backend="redis", redis_url=f"redis://127.0.0.1:{free_port()}/0")
    async with running_router(make_settings(down)) as router:
        async with httpx.AsyncClient() as client:
            ready = await client.get(f"http://127.0.0.1:{router.http_port}/readyz")
            metrics = await client.get(f"http://127.0.0.1:{router.http_port}/metrics")
        # Still ready: the proxy serves on load alone while the index is down.
        assert ready.status_code == 200
        assert ready.json()["grpc"] == "serving"
        assert ready.json()["index"].startswith("unreachable")
        assert ready.json()["routing"] == "load-only"
        assert "kvplane_index_up 0.0" in metrics.text

        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
            stream = AgentStream(channel)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stream.request(register_message(worker()))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
