"""What a request is charged on its tenant's counter, against a view of the engines the
test sets: its answer at the grant, as long as its client allows, then corrected to
what it generated; each generated token also for the context it holds."""

from __future__ import annotations

import math

import pytest

from kvplane.core.config import FlowControlSettings
from router.flow_control.bands import Placement
from router.flow_control.gate import FlowGate, answer_cost
from router.lifecycle.bodies import ParsedRequest
from router.metrics import RouterMetrics
from tests.router.flow_control.engine_view import OneEngine, tenant

MODEL = "m"
SETTINGS = FlowControlSettings(
    enabled=True, input_token_cost=1.0, output_token_cost=2.0, context_token_cost=0.01
)


def test_each_generated_token_costs_the_context_it_holds() -> None:
    # The first token holds the 100-token prompt, the fourth the prompt and three more.
    assert answer_cost(SETTINGS, 100, 4) == pytest.approx(4 * 2.0 + (100 + 101 + 102 + 103) * 0.01)
    assert answer_cost(SETTINGS, 100, 0) == 0.0
    # Four times the prompt and the answer: ten times the cost, not four.
    short, long = answer_cost(SETTINGS, 1152, 16), answer_cost(SETTINGS, 4608, 64)
    assert long / short > 10


async def test_an_answer_is_charged_at_the_grant_then_as_it_was() -> None:
    gate = FlowGate(SETTINGS, OneEngine(), RouterMetrics())
    acme = tenant("acme")
    limited = await gate.enter(acme, MODEL, Placement(0), 100, answer_tokens=10)
    assert limited is not None
    assert gate.counters.value(MODEL, "acme") == pytest.approx(100 + answer_cost(SETTINGS, 100, 10))
    limited.dispatched(100)
    limited.generated(4)  # within what was charged
    assert gate.counters.value(MODEL, "acme") == pytest.approx(100 + answer_cost(SETTINGS, 100, 10))
    limited.close()  # four, in the end
    assert gate.counters.value(MODEL, "acme") == pytest.approx(100 + answer_cost(SETTINGS, 100, 4))

    unlimited = await gate.enter(tenant("globex"), MODEL, Placement(0), 100)
    assert unlimited is not None
    assert gate.counters.value(MODEL, "globex") == 100  # its answer as it streams
    unlimited.dispatched(100)
    unlimited.generated(6)
    assert gate.counters.value(MODEL, "globex") == pytest.approx(
        100 + answer_cost(SETTINGS, 100, 6)
    )
    unlimited.close()

    never_sent = await gate.enter(tenant("initech"), MODEL, Placement(0), 100, answer_tokens=10)
    assert never_sent is not None
    never_sent.close()
    assert gate.counters.value(MODEL, "initech") == pytest.approx(0.0, abs=1e-9)
    served = {flow.tenant: flow.service_tokens for flow in gate.snapshot().tenants}
    assert served == {
        "acme": pytest.approx(100 + answer_cost(SETTINGS, 100, 4)),
        "globex": pytest.approx(100 + answer_cost(SETTINGS, 100, 6)),
    }


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"max_tokens": 16}, 16),
        ({"max_completion_tokens": 8, "max_tokens": 16}, 8),
        ({}, 0),
        ({"max_tokens": 0}, 0),
        ({"max_tokens": -3}, 0),
        ({"max_tokens": True}, 0),
        ({"max_tokens": "16"}, 0),
        ({"max_tokens": 16.0}, 0),
        ({"max_tokens": math.inf}, 0),
    ],
)
def test_the_answer_limit_is_the_clients_when_it_is_a_positive_whole_number(
    body: dict[str, object], limit: int
) -> None:
    assert ParsedRequest("completions", "m", stream=False, body=body).answer_limit == limit
