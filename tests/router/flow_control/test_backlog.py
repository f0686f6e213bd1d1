"""Who has a backlog, against a view of the engines the test sets: a tenant that asks for
more than its share, whatever it has been served. Flow control's counters give tenants
that all wait the same service, so a flood that waits is served no more than the tenants
beside it; its demand is what tells it from them (router/flow_control/test_gate.py runs
the places and the engines' priorities against real engines)."""

from __future__ import annotations

import asyncio

from kvplane.core.config import FlowControlSettings
from router.flow_control.bands import Placement
from router.flow_control.gate import FlowGate, FlowPass
from router.metrics import RouterMetrics
from tests.router.flow_control.engine_view import OneEngine, tenant

MODEL = "m"
PROMPT_TOKENS = 100


async def test_a_flood_that_was_served_nothing_yet_has_a_backlog() -> None:
    engine = OneEngine()
    engine.held = 2.0  # one running, one waiting: full with one waiting place
    settings = FlowControlSettings(
        enabled=True, max_engine_waiting=1, max_engine_waiting_backlogged=0
    )
    gate = FlowGate(settings, engine, RouterMetrics())
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


async def test_tenants_asking_their_shares_have_no_backlog() -> None:
    engine = OneEngine()
    engine.held = 2.0
    settings = FlowControlSettings(
        enabled=True, max_engine_waiting=1, max_engine_waiting_backlogged=0
    )
    gate = FlowGate(settings, engine, RouterMetrics())
    # Two requests each: equal demands, so neither has a backlog, and the place a backlog
    # may not take goes to whoever's turn it is.
    waiting = [
        asyncio.ensure_future(gate.enter(tenant(name), MODEL, Placement(0), PROMPT_TOKENS))
        for name in ("acme", "globex", "acme", "globex")
    ]
    await asyncio.sleep(0)
    engine.held = 1.0
    gate.dispatch(MODEL)
    await asyncio.sleep(0)
    let_through = [future.result() for future in waiting if future.done()]
    assert len(let_through) == 1
    first = let_through[0]
    assert isinstance(first, FlowPass)
    assert not first.backlogged
    for future in waiting:
        future.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    first.close()
