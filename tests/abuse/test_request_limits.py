"""Work a client can make the router do is bounded before it is done: a prompt over the
model's length (as the engines registered it) is refused without tokenising it whole
and without reaching an engine, and a tenant over its rate or its requests in progress
gets a 429 with Retry-After. (The CPU a huge prompt costs before its refusal is shown by
`kvplane bench router --oversized`, not timed here.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from kvplane.core.config import RequestLimits, TenantSpec
from kvplane.core.tokenizer import load_tokenizer
from router.tenants import api_key_digest
from tests.abuse.conftest import ADMIN, SECRET, SIM_OPTIONS, auth
from tests.metrics_text import sample_sum
from tests.router.proxy.conftest import (
    MODEL,
    TENANT_KEYS,
    RoutedFleet,
    routed_fleet,
    router_settings,
    tenant_settings,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
LIMITED_KEY = "sk-limited"
BUSY_KEY = "sk-busy"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[RoutedFleet]:
    tenants = tenant_settings()
    tenants.tenants.extend(
        [
            TenantSpec(
                name="limited",
                api_key_sha256=[api_key_digest(LIMITED_KEY)],
                limits=RequestLimits(requests_per_s=0.2, burst=2),
            ),
            TenantSpec(
                name="busy",
                api_key_sha256=[api_key_digest(BUSY_KEY)],
                limits=RequestLimits(concurrent_requests=1),
            ),
        ]
    )
    # The time the engines model is real, so that a stream stays open a while.
    options = {**SIM_OPTIONS, "time_scale": 1.0, "decode_step_ms": 20.0}
    async with routed_fleet(2, router_settings(tenants=tenants), sim_options=options) as fleet:
        yield fleet


async def requests_total(fleet: RoutedFleet, outcome: str) -> float:
    async with fleet.http() as http:
        text = (await http.get("/metrics", headers=ADMIN)).text
    return sample_sum(text, "kvplane_requests_total", outcome=outcome)


async def engine_prompt_tokens(fleet: RoutedFleet) -> float:
    total = 0.0
    async with httpx.AsyncClient(timeout=5) as client:
        for worker in fleet.workers:
            text = (await client.get(worker.base_url + "/metrics")).text
            total += sample_sum(text, "vllm:prompt_tokens_total")
    return total


def complete(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}


async def test_the_agents_register_their_engines_max_model_len(fleet: RoutedFleet) -> None:
    assert fleet.router.pool.roster.longest_model_len(MODEL) == SIM_OPTIONS["max_model_len"]


async def test_a_prompt_over_the_models_length_is_refused_before_any_engine(
    fleet: RoutedFleet,
) -> None:
    prompt_tokens_before = await engine_prompt_tokens(fleet)
    refused_before = await requests_total(fleet, "prompt_too_long")
    huge = (SECRET + " blocks of sixteen tokens ") * 200_000  # about 9 MB
    async with fleet.http() as http:
        for body in (
            complete(huge),
            {"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 1},
            complete(list(range(5, 600))),  # token ids: counted, not tokenised
        ):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            answer = await http.post(path, json=body, headers=auth("acme"))
            assert answer.status_code == 400, answer.text
            message = answer.json()["error"]["message"]
            assert "maximum context length is 512 tokens" in message
            assert SECRET not in answer.text
            assert "x-kvplane-worker" not in answer.headers
        fits = await http.post("/v1/completions", json=complete("short"), headers=auth("acme"))
        assert fits.status_code == 200
    assert await requests_total(fleet, "prompt_too_long") == refused_before + 3
    short = len(load_tokenizer().completion_tokens("short"))
    assert await engine_prompt_tokens(fleet) == prompt_tokens_before + short  # it alone


async def test_an_engine_that_takes_short_prompts_gets_only_those() -> None:
    # One agent registers a short max_model_len (a small engine, or a lying agent): the
    # model's cap stays the longest engine's, and longer prompts avoid that one only.
    short = {"worker-3": {"max_model_len": 64}}
    async with routed_fleet(3, sim_options=SIM_OPTIONS, worker_sim_options=short) as fleet:
        assert fleet.router.pool.roster.longest_model_len(MODEL) == SIM_OPTIONS["max_model_len"]
        tenant = fleet.router.tenants.authenticate(auth("acme")["authorization"])
        assert tenant is not None
        for length, takers in ((64, {"worker-1", "worker-2", "worker-3"}), (65, None)):
            decision = await fleet.router.planner.decide(
                model=MODEL, tenant=tenant, cache_scope="", tokens=list(range(5, 5 + length))
            )
            ranked = {breakdown.worker_id for breakdown in decision.ranked}
            assert ranked == (takers or {"worker-1", "worker-2"})
        async with fleet.http() as http:
            for turn in range(6):
                prompt = f"turn {turn}: " + "a prompt past the small engine's length " * 12
                answer = await http.post(
                    "/v1/completions", json=complete(prompt), headers=auth("acme")
                )
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["prompt_tokens"] > 64
                assert answer.headers["x-kvplane-worker"] != "worker-3"


async def test_a_tenant_over_its_rate_gets_429_with_retry_after(fleet: RoutedFleet) -> None:
    headers = {"authorization": f"Bearer {LIMITED_KEY}"}
    async with fleet.http() as http:
        answers = [
            await http.post("/v1/completions", json=complete("hello"), headers=headers)
            for _ in range(4)
        ]
        assert [answer.status_code for answer in answers] == [200, 200, 429, 429]
        assert answers[2].headers["retry-after"] == "5"  # one request every five seconds
        assert answers[2].json()["error"]["type"] == "RateLimitError"
        # Other tenants are not held back by it.
        other = await http.post("/v1/completions", json=complete("hello"), headers=auth("acme"))
        assert other.status_code == 200
    assert await requests_total(fleet, "rate_limited") >= 2


async def test_a_tenant_at_its_requests_in_progress_waits_for_its_stream_to_end(
    fleet: RoutedFleet,
) -> None:
    headers = {"authorization": f"Bearer {BUSY_KEY}"}
    body = complete("stream", max_tokens=50, stream=True, ignore_eos=True)
    async with (
        fleet.http() as http,
        http.stream("POST", "/v1/completions", json=body, headers=headers) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        refused = await http.post("/v1/completions", json=complete("hi"), headers=headers)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        async for _ in lines:  # the stream runs to its end
            pass
    async with fleet.http() as http:
        # Its slot was given back when the stream ended.
        for _ in range(20):
            answer = await http.post("/v1/completions", json=complete("hi"), headers=headers)
            if answer.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert answer.status_code == 200
    assert TENANT_KEYS  # the fleet's own tenants are untouched by the extension


async def test_no_agent_lifts_the_configured_cap() -> None:
    # An agent registers a huge max_model_len (a lying one, or a misconfigured engine):
    # the model's cap is then the router's own setting, not the agent's word.
    huge = {"worker-2": {"max_model_len": 1 << 30}}
    settings = router_settings(proxy={"max_prompt_tokens": 600})
    async with routed_fleet(2, settings, sim_options=SIM_OPTIONS, worker_sim_options=huge) as fleet:
        assert fleet.router.pool.roster.longest_model_len(MODEL) == 1 << 30
        prompt = "a prompt past the router's own cap, block after block " * 80
        assert len(load_tokenizer().completion_tokens(prompt)) > 600
        async with fleet.http() as http:
            answer = await http.post("/v1/completions", json=complete(prompt), headers=auth("acme"))
            assert answer.status_code == 400, answer.text
            assert "maximum context length is 600 tokens" in answer.json()["error"]["message"]
            assert "x-kvplane-worker" not in answer.headers
