"""Who has a backlog, against a view of the engines the test sets: a tenant that asks for
more than its share, whatever it has been served. Flow control's counters give tenants
that all wait the same service, so a flood that waits is served no more than the tenants
beside it; its demand is what tells it from them (router/flow_control/test_gate.py runs
the places and the engines' priorities against real engines). And the places a backlog
leaves are a lighter tenant's at another replica too (their exchange through a real
Redis), and the room is shared between replicas by what waits at each."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable

import pytest

from kvplane.core.config import FlowControlSettings
from router.flow_control.bands import Placement
from router.flow_control.gate import FlowGate, FlowPass
from router.flow_control.saturation import ReplicaTraffic
from router.flow_control.shared import FlowExchange
from router.index.redis import RedisLocationIndex
from router.metrics import RouterMetrics
from tests.router.flow_control.engine_view import OneEngine, tenant
from tests.waiting import wait_until

MODEL = "m"
PROMPT_TOKENS = 100


def gate_on(
    engine: OneEngine, index: RedisLocationIndex | None = None, refresh_s: float = 0.05
) -> FlowGate:
    """A router's gate (a replica's with `index`): one waiting place an engine, none a
    backlog takes before a lighter tenant."""
    settings = FlowControlSettings(
        enabled=True,
        max_engine_waiting=1,
        max_engine_waiting_backlogged=0,
        shared_refresh_s=refresh_s,
    )
    return FlowGate(settings, engine, RouterMetrics(), shared=index)


@contextlib.asynccontextmanager
async def cancelled_after(*awaitables: Awaitable[object]) -> AsyncIterator[None]:
    """The gates' loops and the requests still waiting, stopped once the test is done."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_flood_that_was_served_nothing_yet_has_a_backlog() -> None:
    engine = OneEngine()
    engine.held = 2.0  # one running, one waiting: full with one waiting place
    gate = gate_on(engine)
    noisy, acme = tenant("noisy"), tenant("acme")
    # Noisy's four and then acme's one all wait; none has been served anything, so the
    # counters are level and noisy's first is the first in turn.
    floods = [
        asyncio.ensure_future(gate.enter(noisy, MODEL, Placement(0), PROMPT_TOKENS))
        for _ in range(4)
    ]
    await asyncio.sleep(0)
    light = asyncio.ensure_future(gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS))
    await asyncio.sleep(0)
    assert not any(future.done() for future in [*floods, light])

    engine.held = 1.0  # the waiting place frees: one a backlog may not take
    gate.dispatch(MODEL)
    acme_pass = await asyncio.wait_for(light, 1)
    assert acme_pass is not None
    assert not acme_pass.backlogged
    assert acme_pass.engine_priority == 0
    assert not any(future.done() for future in floods), "noisy asked four times acme's"

    engine.held = 0.0  # room for the flood, acme gone
    gate.dispatch(MODEL)
    await asyncio.sleep(0)
    noisy_pass = floods[0].result()
    assert isinstance(noisy_pass, FlowPass)
    assert noisy_pass.backlogged, "more of its own wait, and it asked for more than its share"
    assert noisy_pass.engine_priority > acme_pass.engine_priority
    for future in floods:
        future.cancel()
    await asyncio.gather(*floods, return_exceptions=True)
    for flow_pass in (acme_pass, noisy_pass):
        flow_pass.close()


async def test_tenants_asking_their_shares_have_no_backlog_whatever_they_were_served() -> None:
    engine = OneEngine()
    engine.held = 2.0
    gate = gate_on(engine)
    acme, globex = tenant("acme"), tenant("globex")
    # acme was served a lot lately, globex nothing; both now ask alike, two requests
    # each. Neither has a backlog: the place a backlog may not take goes to whoever's
    # turn it is, acme's (globex starts waiting lifted to acme's counter, and acme came
    # first), at no lower engine priority.
    gate.charge(MODEL, acme, 100 * PROMPT_TOKENS)
    waiting = [
        asyncio.ensure_future(gate.enter(who, MODEL, Placement(0), PROMPT_TOKENS))
        for who in (acme, globex, acme, globex)
    ]
    await asyncio.sleep(0)
    engine.held = 1.0
    gate.dispatch(MODEL)
    await asyncio.sleep(0)
    let_through = [future.result() for future in waiting if future.done()]
    assert len(let_through) == 1
    assert waiting[0].done(), "acme's first, in its turn"
    first = let_through[0]
    assert isinstance(first, FlowPass)
    assert not first.backlogged
    for future in waiting:
        future.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    first.close()


@pytest.fixture
async def index(redis_url: str) -> AsyncIterator[RedisLocationIndex]:
    backend = RedisLocationIndex.from_url(redis_url, prefix=f"backlog-{uuid.uuid4().hex[:8]}")
    yield backend
    await backend.close()


async def asked_once(gate: FlowGate, name: str) -> None:
    """One request of `name` let through and ended: the replica has seen it ask."""
    flow_pass = await gate.enter(tenant(name), MODEL, Placement(0), PROMPT_TOKENS)
    assert flow_pass is not None
    flow_pass.close()


async def sees_waiting_elsewhere(gate: FlowGate, name: str) -> None:
    await wait_until(
        f"{name} seen waiting at another replica",
        lambda: any(
            name in waiting
            for flow in gate.snapshot().models
            for waiting in flow.waiting_elsewhere.values()
        ),
    )


def waiting_in(gate: FlowGate, name: str, count: int) -> list[asyncio.Future[FlowPass | None]]:
    return [
        asyncio.ensure_future(gate.enter(tenant(name), MODEL, Placement(0), PROMPT_TOKENS))
        for _ in range(count)
    ]


@contextlib.asynccontextmanager
async def noisy_here_acme_there(
    here: FlowGate, there: FlowGate, engine: OneEngine
) -> AsyncIterator[tuple[list[asyncio.Future[FlowPass | None]], asyncio.Future[FlowPass | None]]]:
    """acme seen asking here; then, `here`'s engine full, four of noisy's requests
    waiting here and one of acme's there, and `here` seeing acme's."""
    await asked_once(here, "acme")
    engine.held = 2.0
    floods = waiting_in(here, "noisy", 4)
    light = waiting_in(there, "acme", 1)
    async with cancelled_after(here.run_forever(), there.run_forever(), *floods, *light):
        await sees_waiting_elsewhere(here, "acme")
        yield floods, light[0]


async def test_a_backlog_leaves_its_places_to_a_lighter_tenant_at_another_replica(
    index: RedisLocationIndex,
) -> None:
    engine = OneEngine()  # both replicas route to the same engine
    here, there = gate_on(engine, index, 0.1), gate_on(engine, index, 0.1)
    async with noisy_here_acme_there(here, there, engine) as (floods, light):
        engine.held = 1.0  # the waiting place frees: one a backlog may not take
        acme_pass = await asyncio.wait_for(asyncio.shield(light), 2)
        assert isinstance(acme_pass, FlowPass)
        assert not any(future.done() for future in floods), "acme's place went to the flood"
        acme_pass.close()


async def test_a_flood_at_each_replica_is_let_through(index: RedisLocationIndex) -> None:
    # Each replica knows only its own flood: the other's might be a lighter tenant, but
    # one never seen asking is not left the places.
    engine = OneEngine()
    here, there = gate_on(engine, index, 0.02), gate_on(engine, index, 0.02)
    engine.held = 2.0
    floods = waiting_in(here, "noisy", 4) + waiting_in(there, "rowdy", 4)
    async with cancelled_after(here.run_forever(), there.run_forever(), *floods):
        await sees_waiting_elsewhere(here, "rowdy")
        await sees_waiting_elsewhere(there, "noisy")
        engine.held = 1.0
        done, _ = await asyncio.wait(floods, timeout=2, return_when=asyncio.FIRST_COMPLETED)
        assert done, "both replicas left the place to each other"
        for future in done:
            flow_pass = future.result()
            assert flow_pass is not None
            flow_pass.close()


async def test_places_left_to_another_replica_that_does_not_take_them_come_back(
    index: RedisLocationIndex,
) -> None:
    engine, full_there = OneEngine(), OneEngine()
    full_there.held = 2.0  # the other replica sees no room: acme waits on there
    here, there = gate_on(engine, index, 0.02), gate_on(full_there, index, 0.02)
    async with noisy_here_acme_there(here, there, engine) as (floods, light):
        engine.held = 1.0
        noisy_pass = await asyncio.wait_for(asyncio.shield(floods[0]), 2)
        assert isinstance(noisy_pass, FlowPass)
        assert not light.done()
        noisy_pass.close()


async def test_a_lighter_tenant_goes_before_a_backlog_served_less_at_another_replica(
    index: RedisLocationIndex,
) -> None:
    refresh_s = 0.02
    engine = OneEngine()
    gate = gate_on(engine, index, refresh_s)
    acme = tenant("acme")
    for _ in range(4):  # noisy's asked here too, while there was room
        await asked_once(gate, "noisy")
    other_replica = FlowExchange(index, refresh_s)

    async def noisy_waits_there() -> None:
        while True:
            await other_replica.exchange(ReplicaTraffic({}, {}, {}), {MODEL: {0: {"noisy": 4}}}, {})
            await asyncio.sleep(refresh_s)

    engine.held = 2.0
    light = asyncio.ensure_future(gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS))
    async with cancelled_after(gate.run_forever(), noisy_waits_there(), light):
        await sees_waiting_elsewhere(gate, "noisy")
        # Served well beyond the slack while it waits (its other requests' answers):
        # noisy, served nothing, would go first, but for its backlog.
        gate.charge(MODEL, acme, 10 * gate.settings.fairness_slack_tokens)
        engine.held = 1.0  # the waiting place frees: one a backlog may not take
        acme_pass = await asyncio.wait_for(asyncio.shield(light), 2)
        assert isinstance(acme_pass, FlowPass)
        acme_pass.close()


async def test_replicas_share_the_room_by_what_waits_at_each(index: RedisLocationIndex) -> None:
    # The replica that sees room first would take all of it, and acme's requests at the
    # other would wait the longer.
    engine = OneEngine()
    here, there = gate_on(engine, index, 0.02), gate_on(engine, index, 0.02)
    engine.held = 2.0
    waiting_here, waiting_there = waiting_in(here, "acme", 3), waiting_in(there, "acme", 3)
    async with cancelled_after(*waiting_here, *waiting_there):
        async with cancelled_after(here.run_forever(), there.run_forever()):
            await sees_waiting_elsewhere(here, "acme")
            await sees_waiting_elsewhere(there, "acme")
        engine.held = 0.0  # room for two, as both replicas see it
        here.dispatch(MODEL)
        there.dispatch(MODEL)
        await asyncio.sleep(0)
        let_through = {
            gate: [future.result() for future in futures if future.done()]
            for gate, futures in ((here, waiting_here), (there, waiting_there))
        }
        assert [len(passes) for passes in let_through.values()] == [1, 1], "half each"
        for flow_pass in let_through[here] + let_through[there]:
            assert flow_pass is not None
            flow_pass.close()


async def test_a_replica_whose_requests_go_first_takes_all_the_room(
    index: RedisLocationIndex,
) -> None:
    # A higher band's requests here: the other replica's waiting requests do not go
    # before them, so they take no share of the room.
    engine = OneEngine()
    here, there = gate_on(engine, index, 0.02), gate_on(engine, index, 0.02)
    engine.held = 2.0
    urgent = [
        asyncio.ensure_future(here.enter(tenant("acme"), MODEL, Placement(1), PROMPT_TOKENS))
        for _ in range(2)
    ]
    waiting_there = waiting_in(there, "globex", 6)
    async with cancelled_after(*urgent, *waiting_there):
        async with cancelled_after(here.run_forever(), there.run_forever()):
            await sees_waiting_elsewhere(here, "globex")
        engine.held = 0.0  # room for two
        here.dispatch(MODEL)
        await asyncio.sleep(0)
        assert all(future.done() for future in urgent), "band 1 waits nowhere else"
        for future in urgent:
            flow_pass = future.result()
            assert flow_pass is not None
            flow_pass.close()


async def test_a_tenant_waiting_at_another_replica_is_not_lifted_here(
    index: RedisLocationIndex,
) -> None:
    # Its requests reach both replicas. Brought down to the counters waiting here each
    # time none of its own waited here, a flood spread over two replicas shed its debt.
    engine = OneEngine()
    here, there = gate_on(engine, index, 0.02), gate_on(engine, index, 0.02)
    engine.held = 2.0  # full: whatever comes waits
    acme_here, noisy_there = waiting_in(here, "acme", 1), waiting_in(there, "noisy", 2)
    async with cancelled_after(here.run_forever(), there.run_forever(), *acme_here, *noisy_there):
        await sees_waiting_elsewhere(here, "noisy")
        here.charge(MODEL, tenant("noisy"), 100 * PROMPT_TOKENS)  # served far more than acme
        before = here.counters.value(MODEL, "noisy")
        async with cancelled_after(*waiting_in(here, "noisy", 1)):
            await wait_until(
                "noisy waiting here", lambda: "noisy" in here.snapshot().models[0].waiting[0]
            )
            assert here.counters.value(MODEL, "noisy") == before
