"""`--scheduling-policy` over real HTTP: who a saturated engine serves next, as vLLM 0.32.

vLLM 0.32 takes a request's `priority` (or its `X-Vllm-Priority` header) under either
policy; only `priority` orders by it (lower first, then arrival). A waiting request never
preempts a running one (vllm#40004), so a low-priority request already running finishes
first whatever waits.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

import httpx
import pytest

from simulations.engine_sim.process import spawn_engine_sim
from tests.simulations.engine_sim.conftest import engine_sim, metric, refused_at_start_up
from tests.waiting import wait_until

PROMPT = "Summarise the plot of a novel you like in three sentences."

Queued = tuple[str, dict[str, Any], dict[str, str]]  # a name, body fields, headers


async def serve_in_turn(client: httpx.AsyncClient, queued: list[Queued]) -> list[str]:
    """Occupy the engine's one running slot with a long request of priority 10, queue
    `queued` behind it, each waiting before the next is sent (so arrivals are ordered),
    and return the names in the order they finished, the blocker's included."""
    finished: list[str] = []

    async def send(name: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        response = await client.post(
            "/v1/completions", json={"prompt": PROMPT, **body}, headers=headers
        )
        assert response.status_code == 200, response.text
        finished.append(name)

    sent = [asyncio.create_task(send("blocker", {"max_tokens": 150, "priority": 10}, {}))]
    await wait_until("the blocker runs", partial(is_running, client))
    for count, (name, body, headers) in enumerate(queued, start=1):
        sent.append(asyncio.create_task(send(name, {"max_tokens": 10, **body}, headers)))
        await wait_until(f"{name} waits", partial(waiting, client, count))
    # Else the queue formed behind an engine that had nothing to do: no test of order.
    assert not finished, "the blocker finished before the queue formed: make it longer"
    await asyncio.gather(*sent)
    return finished


async def is_running(client: httpx.AsyncClient) -> bool:
    return await metric(client, "vllm:num_requests_running") == 1


async def waiting(client: httpx.AsyncClient, count: int) -> bool:
    return await metric(client, "vllm:num_requests_waiting") == count


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        ("priority", ["blocker", "urgent", "early", "later"]),
        ("fcfs", ["blocker", "early", "later", "urgent"]),  # priorities taken, not used
    ],
)
async def test_a_saturated_engine_serves_the_lowest_priority_value_first(
    policy: str, order: list[str]
) -> None:
    async with (
        engine_sim(
            scheduling_policy=policy, max_num_seqs=1, time_scale=1.0, decode_step_ms=5.0
        ) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        queued: list[Queued] = [
            ("early", {"priority": 5}, {}),
            ("later", {"priority": 5}, {}),
            ("urgent", {"priority": -1}, {}),
        ]
        assert await serve_in_turn(client, queued) == order
        # Nobody was preempted for the urgent request: the blocker ran to its end.
        assert await metric(client, "vllm:num_preemptions_total") == 0


async def test_the_priority_header_wins_over_the_body_when_it_is_an_integer() -> None:
    async with (
        engine_sim(
            scheduling_policy="priority", max_num_seqs=1, time_scale=1.0, decode_step_ms=5.0
        ) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        queued: list[Queued] = [
            ("body", {"priority": 1}, {}),
            ("header", {"priority": 1}, {"X-Vllm-Priority": "-1"}),
            ("not-a-number", {"priority": 0}, {"X-Vllm-Priority": "soon"}),  # the body's 0
        ]
        assert await serve_in_turn(client, queued) == [
            "blocker",
            "header",
            "not-a-number",
            "body",
        ]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_every_priority_in_range_is_accepted_under_either_policy(policy: str) -> None:
    # vLLM 0.32 refuses none: its fields say "any priority other than 0 will raise an
    # error" without priority scheduling, but no code checks it (V0's engine did).
    async with (
        engine_sim(scheduling_policy=policy) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        for priority in (0, -3, 7, 2**63 - 1):
            for path, body in (
                ("/v1/completions", {"prompt": PROMPT}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
            ):
                response = await client.post(
                    path, json={**body, "max_tokens": 2, "priority": priority}
                )
                assert response.status_code == 200, response.text
        out_of_range = await client.post(
            "/v1/completions", json={"prompt": PROMPT, "priority": 2**63}
        )
        assert out_of_range.status_code == 400
        assert "priority" in out_of_range.json()["error"]["message"]


def test_the_command_takes_vllms_scheduling_policy_flag() -> None:
    with (
        spawn_engine_sim("--scheduling-policy", "priority", "--time-scale", "0") as sim,
        httpx.Client(base_url=sim.base_url) as client,
    ):
        response = client.post("/v1/completions", json={"prompt": PROMPT, "priority": -2})
        assert response.status_code == 200, response.text
    assert "--scheduling-policy" in refused_at_start_up("--scheduling-policy", "lottery")
