"""Predicted entries never outlive a real removal: the control plane tells the planner
of every removal it applies, of a cleared cache and of a new incarnation. The same
removals, on the device tier, are what the planner counts as a worker's evictions."""

from __future__ import annotations

import time

import grpc.aio

from kvplane.core.types import AllBlocksCleared, BlocksRemoved, Tier
from kvplane.wire.codec import events_message, register_message
from kvplane.wire.stream import AgentStream
from router.app import RunningRouter
from tests.router.conftest import prompt_keys, stored, worker

KEYS = prompt_keys(7, blocks=4)


def predicted_blocks(router: RunningRouter, worker_id: str = "w1") -> int:
    return router.planner.predicted.match(KEYS, time.monotonic()).get(worker_id, 0)


async def test_removals_and_new_incarnations_drop_predicted_entries(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    stream = AgentStream(channel)
    await stream.request(register_message(worker()))
    assert (await stream.request(events_message(1, [stored(KEYS)]))).ack.sequence == 1
    router.planner.predicted.record("w1", KEYS, time.monotonic())
    assert predicted_blocks(router) == 4

    # The engine evicted the third block: the prediction stops before it.
    await stream.request(events_message(2, [BlocksRemoved(keys=[KEYS[2]], tier=Tier.DEVICE)]))
    assert predicted_blocks(router) == 2

    router.planner.predicted.record("w1", KEYS, time.monotonic())
    await stream.request(events_message(3, [AllBlocksCleared()]))
    assert predicted_blocks(router) == 0

    router.planner.predicted.record("w1", KEYS, time.monotonic())
    await stream.close()
    restarted = AgentStream(channel)
    await restarted.request(register_message(worker(incarnation=2)))
    assert predicted_blocks(router) == 0  # a new incarnation holds none of it
    await restarted.close()


async def test_device_removals_count_as_evictions_until_the_cache_is_cleared(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    def evicted_share() -> float:
        return router.pool.evictions.share("w1", capacity_blocks=8, now=time.monotonic())

    stream = AgentStream(channel)
    await stream.request(register_message(worker(kv_capacity_blocks=8)))
    await stream.request(events_message(1, [stored(KEYS)]))
    assert evicted_share() == 0.0
    # Offloaded to host memory: still reusable, not an eviction.
    await stream.request(events_message(2, [BlocksRemoved(keys=KEYS[2:], tier=Tier.HOST)]))
    assert evicted_share() == 0.0
    await stream.request(events_message(3, [BlocksRemoved(keys=KEYS[2:], tier=Tier.DEVICE)]))
    assert 0.24 < evicted_share() <= 0.25  # 2 of 8 blocks, barely decayed
    await stream.request(events_message(4, [AllBlocksCleared()]))
    assert evicted_share() == 0.0
    await stream.close()
