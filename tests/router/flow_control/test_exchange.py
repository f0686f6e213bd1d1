"""Flow control's exchange between router replicas, through a real Redis: counters
charged and clamped by several replicas add up, states expire with their replica, and
a state another replica put that does not decode, or a report that cannot be true, is
skipped; and a replica's reading of the engines, from another's load report, counts what
every replica sent and saw end since the report."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest

from router.flow_control.saturation import SharedReport, room
from router.flow_control.shared import FlowExchange, SharedCounters
from router.index.base import CounterStep
from router.index.redis import RedisLocationIndex
from tests.router.routing.test_pool import MODEL, Setup, load


@pytest.fixture
async def index(redis_url: str) -> AsyncIterator[RedisLocationIndex]:
    backend = RedisLocationIndex.from_url(redis_url, prefix=f"exchange-{uuid.uuid4().hex[:8]}")
    yield backend
    await backend.close()


async def test_replicas_charges_add_up_and_clamps_apply_after_them(
    index: RedisLocationIndex,
) -> None:
    first, second = SharedCounters(), SharedCounters()
    first.charge("m", "acme", 100.0)
    first.charge("m", "globex", 10.0)
    second.charge("m", "acme", 50.0)
    for counters in (first, second):
        exchanged = await index.exchange_flow(
            uuid.uuid4().hex, b"", 1.0, counters.take_changes(["m"])
        )
        counters.absorb(exchanged.counters)
    assert second.values("m") == {"acme": 150.0, "globex": 10.0}
    second.clamp("m", "globex", 120.0, 140.0)  # globex starts waiting beside acme
    second.charge("m", "globex", 5.0)  # charged after the clamp: counted on top
    exchanged = await index.exchange_flow("x", b"", 1.0, second.take_changes([]))
    assert exchanged.counters["m"]["globex"] == 125.0


async def test_a_failed_exchange_keeps_its_changes_for_the_next() -> None:
    counters = SharedCounters()
    counters.charge("m", "acme", 7.0)
    changes = counters.take_changes([])
    counters.charge("m", "acme", 1.0)
    counters.restore(changes)
    assert counters.take_changes([])["m"] == [CounterStep("acme", 7.0), CounterStep("acme", 1.0)]
    assert counters.value("m", "acme") == 8.0


async def test_other_replicas_states_are_summed_and_expire(index: RedisLocationIndex) -> None:
    here = FlowExchange(index, refresh_s=0.01)  # states live 0.2 s
    there = FlowExchange(index, refresh_s=0.01)
    report = SharedReport(running=4, waiting=1, kv_usage=0.5, batch_limit=4, in_flight_at_report=5)
    await there.exchange({"w1": 3}, {"w2": report}, {"m": {0: {"acme": 2}}}, {})
    _, elsewhere, in_flight, reports = await here.exchange(
        {"w1": 1}, {"w1": SharedReport(0, 0, 0.0, math.inf, 0)}, {}, {}
    )
    assert in_flight == {"w1": 3}
    assert reports == {"w2": report}  # w1's is this router's own
    assert elsewhere.waiting("m", 0) == {"acme": 2}
    assert elsewhere.higher_band_waits("m", -1)
    assert not elsewhere.higher_band_waits("m", 0)
    await asyncio.sleep(0.3)
    exchanged, elsewhere, in_flight, _ = await here.exchange({}, {}, {}, {})
    assert list(exchanged.states) == [here.router_id]
    assert (in_flight, elsewhere.backlog) == ({}, {})


async def test_a_state_that_does_not_decode_or_cannot_be_true_is_skipped(
    index: RedisLocationIndex,
) -> None:
    here = FlowExchange(index, refresh_s=1.0)
    await index.exchange_flow("garbage", b"\xc1not msgpack", 10.0, {})
    impossible = msgspec.msgpack.encode(
        [
            {"w1": -5},
            {
                "w1": [1.0, 0.0, 7.5, 4.0, 1.0],
                "w2": [1.0, 0.0, 0.2, -1.0, 1.0],
                "w3": [1.0, 0.0, 0.2, -1.0, -3.0],
            },
            {},
        ]
    )
    await index.exchange_flow("liar", impossible, 10.0, {})
    _, _, in_flight, reports = await here.exchange({}, {}, {}, {"m": []})
    assert here.undecodable == 1
    assert in_flight == {"w1": 0}  # a negative count counts as none
    # w1's KV use of 750% and w3's -3 requests in flight: out
    assert reports == {"w2": SharedReport(1.0, 0.0, 0.2, math.inf, 1.0)}


async def test_requests_ended_at_another_replica_free_places_before_the_next_report(
    index: RedisLocationIndex,
) -> None:
    # The agent reports to `here` (once a second, by default); `there` reads its report
    # through the exchange (twenty times a second). Three of `there`'s requests ending
    # after the report free their places at both replicas, without waiting for the next.
    here, there = Setup(), Setup()
    replicas = [(replica, FlowExchange(index, refresh_s=1.0)) for replica in (here, there)]

    async def exchange() -> None:
        """Each replica's state to the other (twice round: the first reads the second's
        last)."""
        for _ in range(2):
            for replica, exchange in replicas:
                _, _, in_flight, reports = await exchange.exchange(
                    *replica.pool.local_engines(), {}, {}
                )
                replica.pool.shared_engines(in_flight, reports)

    def free_places(replica: Setup) -> int:
        pool = replica.pool
        return room(pool.engine_queues(pool.serving_rows(MODEL)), 0, 1.0)

    for replica in (here, there):
        await replica.register("w1")
        await replica.pool.refresh()
    sent = [there.pool.sent("w1", "acme", prefill_tokens=10) for _ in range(3)]
    await exchange()
    for _ in range(2):  # two running and one waiting, twice: a batch limit of two
        here.clock.now += 1.0
        here.view.load("w1", 1, load(running=2, waiting=1), here.clock.now)
        here.pool.candidates()
    await exchange()
    assert (free_places(here), free_places(there)) == (0, 0)
    for ticket in sent:
        there.pool.finished(ticket)
    await exchange()
    assert (free_places(here), free_places(there)) == (2, 2)
