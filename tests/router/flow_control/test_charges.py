"""What a request is charged on its tenant's counter, against a view of the engines the
test sets: its answer at the grant, as long as its tenant's answers lately (no longer
than its client allows), then corrected to what it generated; each generated token also
for the context it holds."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvplane.core.config import FlowControlSettings
from router.flow_control.bands import Placement
from router.flow_control.gate import MAX_ANSWERS, MAX_PROMPTS, FlowGate, answer_cost
from router.lifecycle.bodies import Endpoint, ParsedRequest
from router.metrics import RouterMetrics
from router.tenants import Tenant
from tests.router.flow_control.engine_view import OneEngine, tenant

MODEL = "m"
PROMPT_TOKENS = 100
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
    # Three answers of four tokens share the prompt, each holds its own answer.
    assert answer_cost(SETTINGS, 100, 12, 3) == pytest.approx(3 * answer_cost(SETTINGS, 100, 4))


async def answered(gate: FlowGate, who: Tenant, tokens: int) -> None:
    """One of `who`'s requests let through, `tokens` generated, ended."""
    flow_pass = await gate.enter(who, MODEL, Placement(0), PROMPT_TOKENS)
    assert flow_pass is not None
    flow_pass.dispatched(PROMPT_TOKENS)
    flow_pass.generated(tokens)
    flow_pass.close()


def charged(tokens: int) -> float:
    """A request's charge with an answer of `tokens`."""
    return PROMPT_TOKENS + answer_cost(SETTINGS, PROMPT_TOKENS, tokens)


async def test_an_answer_is_charged_ahead_as_long_as_the_tenants_answers_lately() -> None:
    gate = FlowGate(SETTINGS, OneEngine(), RouterMetrics())
    acme = tenant("acme")
    await answered(gate, acme, 6)  # no answer before: charged as it streamed
    assert gate.counters.value(MODEL, "acme") == pytest.approx(charged(6))

    longer = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS, answer_limit=10)
    assert longer is not None
    assert gate.counters.value(MODEL, "acme") == pytest.approx(charged(6) * 2)  # ahead: 6
    longer.dispatched(PROMPT_TOKENS)
    longer.generated(8)  # past what was charged ahead: as it streams
    assert gate.counters.value(MODEL, "acme") == pytest.approx(charged(6) + charged(8))
    longer.close()

    before = gate.counters.value(MODEL, "acme")
    capped = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS, answer_limit=2)
    assert capped is not None
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before + charged(2))
    capped.dispatched(PROMPT_TOKENS)
    capped.generated(1)
    capped.close()  # shorter than charged: refunded
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before + charged(1))

    never_sent = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS, answer_limit=10)
    assert never_sent is not None
    never_sent.close()
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before + charged(1))
    served = {flow.tenant: flow.service_tokens for flow in gate.snapshot().tenants}
    assert served == {"acme": pytest.approx(charged(6) + charged(8) + charged(1))}


async def test_a_tenant_brought_down_to_the_others_keeps_its_charges_ahead() -> None:
    # Brought down to globex's counter as it starts waiting, with a long answer charged
    # ahead in it: once that answer comes out short and is refunded, it would be in
    # credit against globex.
    engine = OneEngine()
    gate = FlowGate(SETTINGS, engine, RouterMetrics())
    acme, globex = tenant("acme"), tenant("globex")
    await answered(gate, acme, 100)  # acme's answers are long
    running = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS)
    assert running is not None
    engine.held = 3.0  # the engine full (one running, two waiting): what comes now waits
    waiting = [
        asyncio.ensure_future(gate.enter(who, MODEL, Placement(0), PROMPT_TOKENS))
        for who in (globex, acme)
    ]
    await asyncio.sleep(0)
    running.dispatched(PROMPT_TOKENS)
    running.generated(1)
    running.close()
    assert gate.counters.value(MODEL, "acme") >= gate.counters.value(MODEL, "globex")
    for future in waiting:
        future.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_request_for_several_answers_is_charged_ahead_for_each() -> None:
    gate = FlowGate(SETTINGS, OneEngine(), RouterMetrics())
    acme = tenant("acme")
    await answered(gate, acme, 6)  # acme's answers: 6 tokens lately
    before = gate.counters.value(MODEL, "acme")

    three = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS, answers=3)
    assert three is not None
    each = answer_cost(SETTINGS, PROMPT_TOKENS, 6)
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before + PROMPT_TOKENS + 3 * each)
    three.dispatched(PROMPT_TOKENS)
    three.generated(15)  # five each: one short of what was charged ahead
    three.close()
    five_each = 3 * answer_cost(SETTINGS, PROMPT_TOKENS, 5)
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before + PROMPT_TOKENS + five_each)

    # Its answers were five tokens each, not fifteen: the next single answer is charged
    # ahead for about six (the moving mean), capped per answer by the client's limit.
    after = gate.counters.value(MODEL, "acme")
    single = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS)
    assert single is not None
    assert gate.counters.value(MODEL, "acme") == pytest.approx(after + charged(6))
    single.close()
    capped = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS, answer_limit=2, answers=4)
    assert capped is not None
    capped_ahead = answer_cost(SETTINGS, PROMPT_TOKENS, 8, 4)
    assert gate.counters.value(MODEL, "acme") == pytest.approx(after + PROMPT_TOKENS + capped_ahead)
    capped.close()

    # An absurd n is charged ahead as MAX_ANSWERS answers, and the counter comes back
    # whole when it is refunded (never sent).
    before = gate.counters.value(MODEL, "acme")
    absurd = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS, answers=10**18)
    assert absurd is not None
    most = answer_cost(SETTINGS, PROMPT_TOKENS, 6 * MAX_ANSWERS, MAX_ANSWERS)
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before + PROMPT_TOKENS + most)
    absurd.close()
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before)


async def test_a_batch_is_charged_for_every_prompt_and_its_answers() -> None:
    # Routing reads the first prompt; the others are charged as long, and each is
    # answered (n answers each).
    gate = FlowGate(SETTINGS, OneEngine(), RouterMetrics())
    acme = tenant("acme")
    await answered(gate, acme, 6)  # acme's answers: 6 tokens lately
    before = gate.counters.value(MODEL, "acme")
    batch = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS, answers=2, prompts=3)
    assert batch is not None
    ahead = answer_cost(SETTINGS, PROMPT_TOKENS, 6 * 6, 6)
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before + 3 * PROMPT_TOKENS + ahead)
    batch.dispatched(40)  # the first prompt mostly cached: the others, charged as it
    batch.generated(6 * 5)
    batch.close()
    answers = answer_cost(SETTINGS, PROMPT_TOKENS, 6 * 5, 6)
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before + 3 * 40 + answers)

    # A batch of millions (only the body's size bounds it) is counted as MAX_PROMPTS,
    # and comes back whole when refunded.
    before = gate.counters.value(MODEL, "acme")
    huge = await gate.enter(acme, MODEL, Placement(0), PROMPT_TOKENS, prompts=10**7)
    assert huge is not None
    answers = answer_cost(SETTINGS, PROMPT_TOKENS, 6 * MAX_PROMPTS, MAX_PROMPTS)
    most = MAX_PROMPTS * PROMPT_TOKENS + answers
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before + most)
    huge.close()
    assert gate.counters.value(MODEL, "acme") == pytest.approx(before)


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("one", 1),
        ([1, 2, 3], 1),
        (["one", "two"], 2),
        ([[1, 2], [3], [4]], 3),
        ([], 1),
    ],
)
def test_a_completions_batch_counts_its_prompts(prompt: object, prompts: int) -> None:
    body = {"prompt": prompt}
    assert ParsedRequest(Endpoint.COMPLETIONS, "m", stream=False, body=body).prompts == prompts
    assert ParsedRequest(Endpoint.CHAT, "m", stream=False, body=body).prompts == 1


@pytest.mark.parametrize(
    ("body", "answers"),
    [
        ({"n": 3}, 3),
        ({}, 1),
        ({"n": None}, 1),
        ({"n": 0}, 1),
        ({"n": -2}, 1),
        ({"n": True}, 1),
        ({"n": "3"}, 1),
        ({"n": 3.0}, 1),
    ],
)
def test_the_answers_asked_for_are_the_clients_n_when_it_is_a_positive_whole_number(
    body: dict[str, object], answers: int
) -> None:
    assert ParsedRequest("completions", "m", stream=False, body=body).answers == answers


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"max_tokens": 16}, 16),
        ({"max_completion_tokens": 8, "max_tokens": 16}, 8),
        ({"max_completion_tokens": None, "max_tokens": 16}, 16),
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
