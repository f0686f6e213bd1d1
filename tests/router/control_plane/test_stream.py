"""The Connect stream over real gRPC against a real router with the in-memory index."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

from kvplane.core.keys import SCHEME_VERSION
from kvplane.core.types import AllBlocksCleared, BlocksRemoved, BlocksStored, Tier
from kvplane.wire.codec import drain_message, events_message, load_message, register_message
from kvplane.wire.stream import CONNECT_METHOD, AgentStream
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.app import RunningRouter
from router.index.base import WorkerState
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
PROBES = [KEYS_A, KEYS_B]


async def registered(channel: grpc.aio.Channel, worker_id: str = "w1", inc: int = 1) -> AgentStream:
    stream = AgentStream(channel)
    reply = await stream.request(register_message(worker(worker_id, inc)))
    assert reply.ack.sequence == 0
    return stream


async def assert_rejected(stream: AgentStream, code: int, status: grpc.StatusCode) -> str:
    """The next reply is a Reject with `code`, then the stream ends with `status`."""
    reply = await stream.reply()
    assert body(reply) == "reject", reply
    assert reply.reject.code == code
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await stream.reply()
    assert ended.value.code() == status
    return reply.reject.reason


async def test_register_apply_and_lookup(router: RunningRouter, channel: grpc.aio.Channel) -> None:
    stream = await registered(channel)
    reply = await stream.request(events_message(1, [stored(KEYS_A)]))
    assert reply.ack.sequence == 1
    reply = await stream.request(
        events_message(
            2,
            [
                BlocksStored(
                    keys=KEYS_B[1:], tier=Tier.HOST, first_position=1, parent_key=KEYS_B[0]
                ),
                BlocksRemoved(keys=KEYS_A[2:], tier=Tier.DEVICE),
            ],
        )
    )
    assert reply.ack.sequence == 2

    matches = await router.index.lookup(KEYS_A)
    assert matches["w1"].blocks == 2
    assert (await router.index.stats()).entries == 2 + 2
    record = router.workers.get("w1")
    assert record is not None
    assert record.applied == 2
    assert record.state is WorkerState.LIVE


async def test_duplicate_batch_is_acked_again_and_not_applied(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    stream = await registered(channel)
    assert (await stream.request(events_message(1, [stored(KEYS_A)]))).ack.sequence == 1
    assert (await stream.request(events_message(2, [AllBlocksCleared()]))).ack.sequence == 2
    before = await snapshot(router.index, PROBES)

    # Sequence 1 again would store KEYS_A again if it were applied.
    reply = await stream.request(events_message(1, [stored(KEYS_A)]))

    assert reply.ack.sequence == 2
    assert await snapshot(router.index, PROBES) == before


async def test_sequence_gap_drops_the_worker_and_asks_for_a_resync(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    stream = await registered(channel)
    await stream.request(events_message(1, [stored(KEYS_A)]))

    reply = await stream.request(events_message(3, [stored(KEYS_B)]))

    assert body(reply) == "resync"
    assert "sequence_gap" in reply.resync.reason
    assert await router.index.workers() == []
    assert await router.index.lookup(KEYS_A) == {}
    # Batches still in flight from the dropped incarnation are ignored ...
    await stream.send(events_message(4, [stored(KEYS_B)]))
    # ... and the same stream registers a higher incarnation and starts again at 1.
    reply = await stream.request(register_message(worker("w1", 2)))
    assert reply.ack.sequence == 0
    assert (await stream.request(events_message(1, [stored(KEYS_B)]))).ack.sequence == 1
    assert set(await router.index.lookup(KEYS_B)) == {"w1"}
    assert await router.index.lookup(KEYS_A) == {}


async def test_a_deferred_ack_is_covered_by_the_next_ack_asked_for(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    stream = AgentStream(channel)
    reply = await stream.request(register_message(worker("w1", 1)))
    assert reply.ack.defers_acks  # the agent may mark batches ack_deferred

    await stream.send(events_message(1, [stored(KEYS_A)], ack_deferred=True))
    await stream.send(events_message(2, [stored(KEYS_B)], ack_deferred=True))
    await wait_until("both deferred batches applied", lambda: _applied(router) == 2)
    record = router.workers.get("w1")
    assert record is not None
    events_at = record.last_event_at
    # An empty batch only asks: its Ack is the first reply since the Register's.
    reply = await stream.request(events_message(3, []))

    assert reply.ack.sequence == 3
    assert set(await router.index.lookup(KEYS_A)) == set(await router.index.lookup(KEYS_B))
    assert set(await router.index.lookup(KEYS_B)) == {"w1"}
    assert record.last_event_at == events_at  # no event came with it
    assert router.metrics.registry.get_sample_value("kvplane_batches_applied_total") == 2


def _applied(router: RunningRouter) -> int:
    record = router.workers.get("w1")
    return 0 if record is None else record.applied


async def test_reconnect_with_the_same_incarnation_resumes(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    first = await registered(channel)
    await first.request(events_message(1, [stored(KEYS_A)]))
    await first.request(events_message(2, [stored(KEYS_B)]))
    await first.close()

    second = AgentStream(channel)
    reply = await second.request(register_message(worker("w1", 1)))

    assert reply.ack.sequence == 2
    assert set(await router.index.lookup(KEYS_A)) == {"w1"}
    assert (await second.request(events_message(3, [AllBlocksCleared()]))).ack.sequence == 3


async def test_newer_stream_supersedes_an_open_one(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    old = await registered(channel)
    await old.request(events_message(1, [stored(KEYS_A)]))
    new = AgentStream(channel)
    assert (await new.request(register_message(worker("w1", 1)))).ack.sequence == 1
    before = await snapshot(router.index, PROBES)

    await old.send(events_message(2, [stored(KEYS_B)]))

    await assert_rejected(
        old, pb.REJECT_CODE_STALE_INCARNATION, grpc.StatusCode.FAILED_PRECONDITION
    )
    assert await snapshot(router.index, PROBES) == before
    # The old stream's end leaves the worker to the new one.
    assert (await new.request(events_message(2, [stored(KEYS_B)]))).ack.sequence == 2


async def test_higher_incarnation_replaces_the_old_one(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    old = await registered(channel, inc=5)
    await old.request(events_message(1, [stored(KEYS_A)]))

    new = AgentStream(channel)
    assert (await new.request(register_message(worker("w1", 6)))).ack.sequence == 0

    assert await router.index.lookup(KEYS_A) == {}
    await old.send(events_message(2, [stored(KEYS_A)]))
    await assert_rejected(
        old, pb.REJECT_CODE_STALE_INCARNATION, grpc.StatusCode.FAILED_PRECONDITION
    )
    assert await router.index.lookup(KEYS_A) == {}


async def test_stale_incarnation_register_is_rejected(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    current = await registered(channel, inc=7)
    await current.request(events_message(1, [stored(KEYS_A)]))
    before = await snapshot(router.index, PROBES)

    stale = AgentStream(channel)
    await stale.send(register_message(worker("w1", 6)))
    # Sent after the Register; never read, since a Reject closes the stream.
    await stale.send(events_message(1, [stored(KEYS_B)]))

    reason = await assert_rejected(
        stale, pb.REJECT_CODE_STALE_INCARNATION, grpc.StatusCode.FAILED_PRECONDITION
    )
    assert "older" in reason
    assert await snapshot(router.index, PROBES) == before
    assert (await current.request(events_message(2, [stored(KEYS_B)]))).ack.sequence == 2


@pytest.mark.parametrize(
    "message",
    [
        events_message(1, [stored(KEYS_A)]),
        load_message(running=1, waiting=0, kv_usage=0.5),
        drain_message(),
    ],
    ids=["kv_events", "load", "drain"],
)
async def test_messages_before_register_are_rejected(
    router: RunningRouter, channel: grpc.aio.Channel, message: pb.AgentMessage
) -> None:
    other = await registered(channel, worker_id="other")
    await other.request(events_message(1, [stored(KEYS_B)]))
    before = await snapshot(router.index, PROBES)

    stream = AgentStream(channel)
    await stream.send(message)

    await assert_rejected(
        stream, pb.REJECT_CODE_NOT_REGISTERED, grpc.StatusCode.FAILED_PRECONDITION
    )
    assert await snapshot(router.index, PROBES) == before


@pytest.mark.parametrize(
    ("register", "code"),
    [
        (register_message(worker(block_size=8)), pb.REJECT_CODE_INCOMPATIBLE),
        (
            register_message(worker(), key_scheme_version=SCHEME_VERSION + 1),
            pb.REJECT_CODE_INCOMPATIBLE,
        ),
        (register_message(worker(worker_id="bad id")), pb.REJECT_CODE_INVALID_MESSAGE),
    ],
    ids=["block_size", "key_scheme", "worker_id"],
)
async def test_bad_register_is_rejected(
    router: RunningRouter, channel: grpc.aio.Channel, register: pb.AgentMessage, code: int
) -> None:
    stream = AgentStream(channel)
    await stream.send(register)
    await assert_rejected(stream, code, _STATUS[code])
    assert await router.index.workers() == []
    assert router.workers.get("w1") is None


_STATUS: dict[int, grpc.StatusCode] = {
    pb.REJECT_CODE_INCOMPATIBLE: grpc.StatusCode.FAILED_PRECONDITION,
    pb.REJECT_CODE_INVALID_MESSAGE: grpc.StatusCode.INVALID_ARGUMENT,
}


async def test_invalid_event_rejects_the_whole_batch(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    stream = await registered(channel)
    await stream.request(events_message(1, [stored(KEYS_A)]))
    before = await snapshot(router.index, PROBES)
    batch = events_message(2, [stored(KEYS_B), AllBlocksCleared()])
    batch.kv_events.events[0].stored.tier = pb.TIER_UNSPECIFIED  # the first event is bad

    await stream.send(batch)

    reason = await assert_rejected(
        stream, pb.REJECT_CODE_INVALID_MESSAGE, grpc.StatusCode.INVALID_ARGUMENT
    )
    assert "event 0" in reason
    assert await snapshot(router.index, PROBES) == before
    record = router.workers.get("w1")
    assert record is not None
    assert record.applied == 1


async def test_oversized_batches_are_rejected() -> None:
    settings = make_settings(max_batch_events=2, max_batch_blocks=5)
    async with router_with_channel(settings) as (router, channel):
        stream = await registered(channel)
        await stream.request(events_message(1, [stored(KEYS_A)]))
        before = await snapshot(router.index, PROBES)

        too_many_events = AgentStream(channel)
        await too_many_events.request(register_message(worker("w2")))
        await too_many_events.send(events_message(1, [stored(KEYS_B[:1])] * 3))
        await assert_rejected(
            too_many_events, pb.REJECT_CODE_BATCH_TOO_LARGE, grpc.StatusCode.RESOURCE_EXHAUSTED
        )

        too_many_blocks = AgentStream(channel)
        await too_many_blocks.request(register_message(worker("w3")))
        await too_many_blocks.send(events_message(1, [stored(KEYS_B), stored(KEYS_B)]))
        await assert_rejected(
            too_many_blocks, pb.REJECT_CODE_BATCH_TOO_LARGE, grpc.StatusCode.RESOURCE_EXHAUSTED
        )

        # Registrations are all that changed: neither batch left an entry.
        after = await snapshot(router.index, PROBES)
        assert (after.keys, after.entries, after.lookups) == (
            before.keys,
            before.entries,
            before.lookups,
        )


async def test_message_over_the_grpc_size_limit_fails_the_call() -> None:
    async with router_with_channel(make_settings(max_message_bytes=1024)) as (router, channel):
        stream = await registered(channel)
        await stream.request(events_message(1, [stored(KEYS_A)]))
        before = await snapshot(router.index, PROBES)

        huge = prompt_keys(3, blocks=200)  # 200 fixed64 keys: about 1.8 KB
        await stream.send(events_message(2, [stored(huge)]))

        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stream.reply()
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await snapshot(router.index, PROBES) == before
        # The server carries on: the worker reconnects and resumes.
        again = AgentStream(channel)
        assert (await again.request(register_message(worker()))).ack.sequence == 1


_REGISTER_BYTES = register_message(worker("w9")).SerializeToString()


@pytest.mark.parametrize(
    "payload",
    [b"\xff\xff\xff\xff", b"", _REGISTER_BYTES[: len(_REGISTER_BYTES) // 2], bytes(range(256))],
    ids=["corrupt", "no_body", "truncated", "noise"],
)
async def test_garbage_bytes_are_rejected_and_change_nothing(
    router: RunningRouter, channel: grpc.aio.Channel, payload: bytes
) -> None:
    stream = await registered(channel)
    await stream.request(events_message(1, [stored(KEYS_A)]))
    before = await snapshot(router.index, PROBES)
    connect = channel.stream_stream(
        CONNECT_METHOD,
        request_serializer=lambda raw: raw,
        response_deserializer=pb.ControlMessage.FromString,
    )
    call = connect()

    await call.write(payload)

    reply = await call.read()
    assert isinstance(reply, pb.ControlMessage)
    assert body(reply) == "reject"
    assert reply.reject.code == pb.REJECT_CODE_INVALID_MESSAGE
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await snapshot(router.index, PROBES) == before
    assert (await stream.request(events_message(2, [stored(KEYS_B)]))).ack.sequence == 2


async def test_load_renews_the_lease_and_is_recorded(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    stream = await registered(channel)
    await stream.send(load_message(running=3, waiting=2, kv_usage=0.75))
    # Load gets no reply; a Register of the same incarnation does, after it.
    assert (await stream.request(register_message(worker()))).ack.sequence == 0

    record = router.workers.get("w1")
    assert record is not None
    assert record.last_load is not None
    assert (record.last_load.running, record.last_load.waiting) == (3, 2)
    assert record.last_load.kv_usage == pytest.approx(0.75)
    assert record.last_heartbeat_at is not None


async def test_bad_load_is_rejected(router: RunningRouter, channel: grpc.aio.Channel) -> None:
    stream = await registered(channel)
    await stream.send(load_message(running=1, waiting=0, kv_usage=1.5))
    await assert_rejected(stream, pb.REJECT_CODE_INVALID_MESSAGE, grpc.StatusCode.INVALID_ARGUMENT)


@pytest.mark.parametrize("abrupt", [False, True], ids=["half_close", "cancel"])
async def test_drained_worker_is_dropped_when_its_stream_ends(
    router: RunningRouter, channel: grpc.aio.Channel, abrupt: bool
) -> None:
    stream = await registered(channel)
    await stream.request(events_message(1, [stored(KEYS_A)]))
    await stream.send(drain_message())
    assert (await stream.request(events_message(1, [stored(KEYS_A)]))).ack.sequence == 1

    [status] = await router.index.workers()
    assert status.state is WorkerState.DRAINING
    assert set(await router.index.lookup(KEYS_A)) == {"w1"}  # still routable until it leaves

    if abrupt:
        stream.call.cancel()  # as when the agent dies
    else:
        await stream.close()

    async def dropped() -> bool:
        return await router.index.workers() == []

    await wait_until("the drained worker to be dropped", dropped)
    assert await router.index.lookup(KEYS_A) == {}
    record = router.workers.get("w1")
    assert record is not None
    assert record.state is WorkerState.DEAD


# In the lease tests below the router runs on a manual clock: a lease runs out when the
# test moves the clock past it, and the reaper (every quarter lease of real time, so
# leases stay short) purges it on its next round.


async def test_disconnected_worker_keeps_entries_until_its_lease_ends() -> None:
    clock = ManualClock()
    async with router_with_channel(make_settings(lease_s=0.3), clock=clock) as (router, channel):
        stream = await registered(channel)
        await stream.request(events_message(1, [stored(KEYS_A)]))
        await stream.close()
        clock.advance(0.29)  # just short of the lease
        assert set(await router.index.lookup(KEYS_A)) == {"w1"}
        clock.advance(0.29)  # well past it

        async def purged() -> bool:
            return await router.index.workers() == []

        await wait_until("the reaper to purge the expired worker", purged)
        assert await router.index.lookup(KEYS_A) == {}
        assert (await router.index.stats()).entries == 0
        record = router.workers.get("w1")
        assert record is not None
        assert record.state is WorkerState.DEAD

        # Its incarnation's entries are gone: the index says it holds nothing of it (an
        # agent that had batch 1 acknowledged then starts a new incarnation) ...
        again = AgentStream(channel)
        reply = await again.request(register_message(worker("w1", 1)))
        assert reply.ack.sequence == 0
        # ... and a higher one starts afresh.
        assert (await again.request(register_message(worker("w1", 2)))).ack.sequence == 0


async def test_an_engine_down_load_drains_and_lets_the_lease_run_out() -> None:
    clock = ManualClock()
    # A lease longer than the reconnect margin, so that the second Register reconnects.
    async with router_with_channel(make_settings(lease_s=0.6), clock=clock) as (
        router,
        channel,
    ):
        stream = await registered(channel)
        await stream.request(events_message(1, [stored(KEYS_A)]))
        await stream.send(load_message(0, 0, 0.0, engine_down=True))
        assert (await stream.request(register_message(worker()))).ack.sequence == 1

        [status] = await router.index.workers()
        assert status.state is WorkerState.DRAINING
        record = router.workers.get("w1")
        assert record is not None
        assert record.last_load is not None
        assert record.last_load.engine_down

        async def purged() -> bool:
            # More engine-down reports keep coming, and renew nothing.
            await stream.send(load_message(0, 0, 0.0, engine_down=True))
            return await router.index.workers() == []

        clock.advance(0.6)
        await wait_until("the engine-down worker's lease to run out", purged)
        assert await router.index.lookup(KEYS_A) == {}


async def test_a_load_after_the_lease_ran_out_ends_the_stream() -> None:
    clock = ManualClock()
    async with router_with_channel(make_settings(lease_s=0.3), clock=clock) as (router, channel):
        stream = await registered(channel)

        async def purged() -> bool:
            return await router.index.workers() == []

        clock.advance(0.3)
        await wait_until("the reaper to purge the silent worker", purged)
        # Load gets no reply, so a Resync here would be taken for the reply to the
        # agent's next request; the stream ends instead.
        await stream.send(load_message(1, 0, 0.5))
        await assert_rejected(
            stream, pb.REJECT_CODE_NOT_REGISTERED, grpc.StatusCode.FAILED_PRECONDITION
        )


async def test_loads_renew_the_lease_a_quarter_lease_apart() -> None:
    # A fleet's agents report every second: a renewal (an index write) each would be
    # a thousand Redis round trips a second for a thousand workers.
    clock = ManualClock()
    async with router_with_channel(make_settings(lease_s=4.0), clock=clock) as (router, channel):
        stream = await registered(channel)

        async def lease_left() -> float:
            (status,) = await router.index.workers()
            return status.lease_remaining_s

        clock.advance(0.5)
        await stream.send(load_message(1, 0, 0.5))
        # Load gets no reply: an empty batch's Ack says it was handled (the batch
        # renews nothing this early, and its repeat nothing at all: a duplicate).
        await stream.request(events_message(1, []))
        assert await lease_left() == pytest.approx(3.5)  # not renewed
        clock.advance(0.5)  # a quarter lease since the registration
        await stream.send(load_message(1, 0, 0.5))
        await stream.request(events_message(1, []))
        assert await lease_left() == pytest.approx(4.0)  # renewed
        assert router.workers.get("w1").last_load is not None


async def test_kv_events_keep_the_lease_alive() -> None:
    clock = ManualClock()
    async with router_with_channel(make_settings(lease_s=0.5), clock=clock) as (router, channel):
        stream = await registered(channel)
        for sequence in range(1, 21):  # two leases of events, and no Load
            await stream.request(events_message(sequence, [stored(prompt_keys(sequence, 1))]))
            clock.advance(0.05)
        assert [w.state for w in await router.index.workers()] == [WorkerState.LIVE]


async def test_one_stream_speaks_for_one_worker(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    stream = await registered(channel)
    await stream.send(register_message(worker("w2")))
    await assert_rejected(stream, pb.REJECT_CODE_INVALID_MESSAGE, grpc.StatusCode.INVALID_ARGUMENT)
    assert [w.info.worker_id for w in await router.index.workers()] == ["w1"]


async def test_silent_connected_worker_expires_and_must_resync() -> None:
    clock = ManualClock()
    async with router_with_channel(make_settings(lease_s=0.3), clock=clock) as (router, channel):
        stream = await registered(channel)
        await stream.request(events_message(1, [stored(KEYS_A)]))

        async def purged() -> bool:
            return await router.index.workers() == []

        clock.advance(0.3)
        await wait_until("the reaper to purge the silent worker", purged)
        reply = await stream.request(events_message(2, [stored(KEYS_B)]))

        assert body(reply) == "resync"
        assert "lease_expired" in reply.resync.reason
        assert await router.index.lookup(KEYS_B) == {}


async def test_lag_is_the_agents_timestamp_against_the_routers_wall_clock() -> None:
    async with router_with_channel(make_settings(), wall_clock=lambda: 1000.0) as (
        router,
        channel,
    ):
        stream = await registered(channel)
        events = events_message(1, [stored(KEYS_A)])
        events.kv_events.timestamp_ms = 999_750
        load = load_message(1, 0, 0.5)
        load.load.timestamp_ms = 999_500
        await stream.request(events)
        await stream.send(load)
        await stream.request(events_message(2, []))  # handled in order: the Load is in
        registry = router.metrics.registry
        assert registry.get_sample_value("kvplane_event_lag_seconds_sum") == pytest.approx(0.25)
        assert registry.get_sample_value("kvplane_load_lag_seconds_sum") == pytest.approx(0.5)
