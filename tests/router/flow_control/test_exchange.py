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

from router.flow_control.saturation import UNBOUNDED, ReplicaTraffic, SharedReport, room
from router.flow_control.shared import FlowExchange, SharedCounters
from router.index.base import CounterStep
from router.index.redis import RedisLocationIndex
from tests.router.routing.test_pool import MODEL, Setup, load

NOTHING = ReplicaTraffic({}, {}, {})


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
    report = SharedReport(
        incarnation=7, running=4, waiting=1, kv_usage=0.5, batch_limit=4, in_flight_at_report=5
    )
    await there.exchange(
        ReplicaTraffic({"w1": 3}, {"w1": 1}, {"w2": report}), {"m": {0: {"acme": 2}}}, {}
    )
    _, elsewhere, others = await here.exchange(
        ReplicaTraffic({"w1": 1}, {}, {"w1": SharedReport(1, 0, 0, 0.0, math.inf, 0)}), {}, {}
    )
    assert (others.in_flight, others.handed_off) == ({"w1": 3}, {"w1": 1})
    assert others.reports == {"w2": report}  # w1's is this router's own
    assert elsewhere.waiting("m", 0) == {"acme": 2}
    assert elsewhere.higher_band_waits("m", -1)
    assert not elsewhere.higher_band_waits("m", 0)
    await asyncio.sleep(0.3)
    exchanged, elsewhere, others = await here.exchange(NOTHING, {}, {})
    assert list(exchanged.states) == [here.router_id]
    assert (others, elsewhere.backlog) == (NOTHING, {})


async def test_a_state_that_does_not_decode_or_cannot_be_true_is_skipped(
    index: RedisLocationIndex,
) -> None:
    here = FlowExchange(index, refresh_s=1.0)
    await index.exchange_flow("garbage", b"\xc1not msgpack", 10.0, {})
    impossible = msgspec.msgpack.encode(
        [
            {"w1": -5, "w2": 2},
            {
                "w1": [1.0, 0.0, 7.5, 4.0, 1.0],
                "w2": [1.0, 0.0, 0.2, -1.0, 1.0],
                "w3": [1.0, 0.0, 0.2, -1.0, -3.0],
                "w4": [1.0, 0.0, 0.2, -1.0, math.inf],
                "w5": [1.0, 0.0, 0.2, -1.0, 1.0, -5],
            },
            {},
            {"w1": 3, "w2": 5},
        ]
    )
    await index.exchange_flow("liar", impossible, 10.0, {})
    _, _, others = await here.exchange(NOTHING, {}, {"m": []})
    assert here.undecodable == 1
    assert others.in_flight == {"w1": 0, "w2": 2}  # a negative count counts as none
    assert others.handed_off == {"w1": 0, "w2": 2}  # never more than in flight
    # w1's KV use of 750%, w3's -3 requests in flight, w4's infinity and w5's
    # incarnation: out; w2's, from a router too old to name the incarnation: read as before
    assert others.reports == {"w2": SharedReport(-1, 1.0, 0.0, 0.2, math.inf, 1.0)}


class TwoReplicas:
    """Two routers' pools on one worker, exchanging through Redis: its agent reports to
    `here` (once a second, by default), and `there` reads the reports through the
    exchange (twenty times a second)."""

    def __init__(self, index: RedisLocationIndex) -> None:
        self.here, self.there = Setup(), Setup()
        self._exchanges = [
            (replica, FlowExchange(index, refresh_s=1.0)) for replica in (self.here, self.there)
        ]

    async def start(self) -> None:
        for replica, _ in self._exchanges:
            await replica.register("w1")
            await replica.pool.refresh()

    async def exchange(self) -> None:
        """Each replica's state to the other (twice round: the first reads the second's
        last)."""
        for _ in range(2):
            for replica, exchange in self._exchanges:
                _, _, others = await exchange.exchange(replica.pool.local_engines(), {}, {})
                replica.pool.shared_engines(others)

    async def report(self, running: int, waiting: int, incarnation: int = 1) -> None:
        """A load report to `here` (two with requests waiting teach the batch limit)."""
        here = self.here
        here.clock.now += 1.0
        report = load(running=running, waiting=waiting)
        here.view.load("w1", incarnation, report, here.clock.now)
        here.pool.candidates()
        await self.exchange()

    def free_places(self) -> tuple[int, int]:
        """The room each replica sees, with no waiting places beyond the batch."""
        here, there = (
            room(pool.engine_queues(pool.serving_rows(MODEL)), 0, 1.0)
            for pool in (self.here.pool, self.there.pool)
        )
        return here, there


async def test_requests_ended_at_another_replica_free_places_before_the_next_report(
    index: RedisLocationIndex,
) -> None:
    replicas = TwoReplicas(index)
    await replicas.start()
    sent = [replicas.there.pool.sent("w1", "acme", prefill_tokens=10) for _ in range(3)]
    await replicas.exchange()
    for _ in range(2):  # a batch limit of two
        await replicas.report(running=2, waiting=1)
    assert replicas.free_places() == (0, 0)
    for ticket in sent[:2]:
        replicas.there.pool.finished(ticket)
    await replicas.exchange()
    assert replicas.free_places() == (1, 1)
    late = replicas.here.pool.sent("w1", "acme", prefill_tokens=10)  # sent since the report
    await replicas.exchange()
    assert replicas.free_places() == (0, 0)
    for ticket in (sent[2], late):
        (replicas.there if ticket in sent else replicas.here).pool.finished(ticket)
    await replicas.exchange()
    assert replicas.free_places() == (2, 2)


async def test_requests_handed_off_make_no_room_until_a_report_says_they_ended(
    index: RedisLocationIndex,
) -> None:
    # A gateway carries them: `there` stops counting them after `hand_off_s`, the engine
    # may still run them.
    replicas = TwoReplicas(index)
    await replicas.start()
    there = replicas.there
    for _ in range(3):
        there.pool.handed_off(there.pool.sent("w1", "acme", prefill_tokens=10))
    await replicas.exchange()
    for _ in range(2):
        await replicas.report(running=2, waiting=1)
    there.clock.advance(2.0)  # past hand_off_s
    await replicas.exchange()
    assert there.pool.traffic("w1").in_flight == 0
    assert replicas.free_places() == (0, 0)
    await replicas.report(running=1, waiting=0)
    assert replicas.free_places() == (1, 1)


async def test_a_report_of_another_incarnation_is_not_read_as_the_one_listed_here(
    index: RedisLocationIndex,
) -> None:
    # The agent restarted and registered through `here`; `there` lists the old engine
    # until it reads the registry again, and must not take the new engine's report (its
    # batch limit and queue) as the old one's.
    replicas = TwoReplicas(index)
    await replicas.start()
    here = replicas.here
    await here.register("w1", incarnation=2)
    await here.pool.refresh()
    for _ in range(2):
        await replicas.report(running=2, waiting=1, incarnation=2)
    assert replicas.free_places() == (0, UNBOUNDED)
    await replicas.there.register("w1", incarnation=2)
    await replicas.there.pool.refresh()
    await replicas.exchange()
    assert replicas.free_places() == (0, 0)
