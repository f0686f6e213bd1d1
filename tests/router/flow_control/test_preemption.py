"""The gate's preemption against a view of the engines the test sets (the view is the
gate's input here, not under test: router/flow_control/test_gate.py runs it against real
engines). A load report that counts a victim's place after the victim ended must not
cost a second victim."""

from __future__ import annotations

import asyncio

from kvplane.core.config import FlowControlSettings
from router.flow_control.bands import Placement
from router.flow_control.gate import FlowGate, FlowPass
from router.metrics import RouterMetrics
from tests.router.flow_control.engine_view import OneEngine, tenant

MODEL = "m"


async def test_a_waiting_request_costs_one_victim_though_the_report_counts_it_late() -> None:
    engine = OneEngine()
    gate = FlowGate(
        FlowControlSettings(enabled=True, max_engine_waiting=2), engine, RouterMetrics()
    )
    low = tenant("acme")
    passes: list[FlowPass] = []
    cancelled: list[int] = []
    for n in range(3):  # one runs, two wait in the engine: it is full
        flow_pass = await gate.enter(low, MODEL, Placement(0), 10)
        assert flow_pass is not None
        flow_pass.dispatched(10)
        flow_pass.arm(lambda n=n: cancelled.append(n))
        passes.append(flow_pass)
        engine.held += 1
    high = asyncio.ensure_future(gate.enter(tenant("globex"), MODEL, Placement(5), 10))
    await asyncio.sleep(0.05)
    assert cancelled == [2], "the newest of the lower band gives its place"

    # It ended, but the engine's report still counts it: no room yet.
    passes[2].close()
    await asyncio.sleep(0.05)
    assert cancelled == [2], "a second victim for the same waiting request"
    assert not high.done()

    engine.held -= 1  # the next report: its place is free
    gate.dispatch(MODEL)
    let_through = await asyncio.wait_for(high, 1)
    assert let_through is not None
    assert let_through.band == 5
