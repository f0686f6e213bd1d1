"""The router in front of simulated engines, over loopback: it sends a prefix where it
is cached, spreads a hot prefix once its holder queues, keeps tenants apart, speaks
OpenAI to the official client, and explains itself (fleet API, metrics, spans)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvplane.core.config import TenantSettings
from router.lifecycle.tokens import CHECKED_FIRST_USES
from tests.metrics_text import sample_sum
from tests.router.proxy.conftest import (
    ADMIN_TOKEN,
    MODEL,
    RoutedFleet,
    routed_fleet,
    router_settings,
    tenant_settings,
)
from tests.waiting import wait_until

SECRET_PHRASE = "purple-elephant-quartz"  # must never show up in spans, logs or errors
PROMPT = f"{SECRET_PHRASE} The cache remembers what the model has already read. " * 12
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


async def _complete(
    fleet: RoutedFleet, prompt: str, tenant: str = "acme", **extra: Any
) -> httpx.Response:
    async with fleet.http() as client:
        response = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra},
            headers={"authorization": f"Bearer sk-{tenant}"},
        )
    assert response.status_code == 200, response.text
    return response


def _reported(response: httpx.Response) -> int:
    """The engine's cached tokens (vLLM, like the simulator, leaves the details out at 0)."""
    details = response.json()["usage"]["prompt_tokens_details"]
    return 0 if details is None else int(details["cached_tokens"])


async def _metric(fleet: RoutedFleet, name: str, **labels: str) -> float:
    async with fleet.http() as client:
        text = (await client.get("/metrics", headers=ADMIN)).text
    return sample_sum(text, name, **labels)


async def test_a_repeated_prefix_goes_to_the_worker_that_holds_it() -> None:
    async with routed_fleet(3) as fleet:
        first = await _complete(fleet, PROMPT)
        holder = first.headers["x-kvplane-worker"]
        assert first.headers["x-kvplane-cached-tokens"] == "0"
        for question in ("one", "two", "three"):
            repeat = await _complete(fleet, PROMPT + question)
            assert repeat.headers["x-kvplane-worker"] == holder
            predicted = int(repeat.headers["x-kvplane-cached-tokens"])
            assert predicted > 0
            assert abs(_reported(repeat) - predicted) <= 16  # within one block
        assert await _metric(fleet, "kvplane_prediction_verdicts_total", verdict="stale") == 0
        assert await _metric(fleet, "kvplane_prefill_tokens_saved_total") > 0


async def test_a_hot_prefix_spreads_once_its_holder_queues() -> None:
    # One request at a time per engine, each holding it for a while: a burst of the
    # same prefix must not all queue behind the holder.
    slow = {"time_scale": 1.0, "max_num_seqs": 1, "decode_step_ms": 20.0}
    async with routed_fleet(3, sim_options=slow) as fleet:
        await _complete(fleet, PROMPT)
        burst = await asyncio.gather(
            *(_complete(fleet, PROMPT + f" q{i}", max_tokens=8) for i in range(12))
        )
        used = {response.headers["x-kvplane-worker"] for response in burst}
        assert len(used) >= 2
        assert await _metric(fleet, "kvplane_routing_decisions_total", factor="load") > 0


async def test_tenants_never_match_each_others_blocks() -> None:
    async with routed_fleet(1) as fleet:
        await _complete(fleet, PROMPT, tenant="acme")
        again = await _complete(fleet, PROMPT, tenant="acme")
        assert _reported(again) > 0
        other = await _complete(fleet, PROMPT, tenant="globex")
        assert other.headers["x-kvplane-cached-tokens"] == "0"
        assert _reported(other) == 0  # the engine kept the scopes apart too
        async with httpx.AsyncClient() as client:
            blocks = (await client.get(fleet.workers[0].base_url + "/sim/blocks")).json()
        scopes = {block["scope"] for block in blocks["blocks"]}
        assert len(scopes) == 2
        assert all(scope and "acme" not in scope for scope in scopes)  # derived salts


async def test_tenants_that_share_a_scope_share_hits() -> None:
    tenants = tenant_settings()
    shared = [spec.model_copy(update={"cache_scope": "team"}) for spec in tenants.tenants]
    settings = router_settings(tenants=tenants.model_copy(update={"tenants": shared}))
    async with routed_fleet(1, settings) as fleet:
        await _complete(fleet, PROMPT, tenant="acme")
        other = await _complete(fleet, PROMPT, tenant="globex")
        assert int(other.headers["x-kvplane-cached-tokens"]) > 0
        assert _reported(other) > 0


@pytest.mark.parametrize("stream", [False, True])
async def test_the_official_client_completions(stream: bool) -> None:
    async with routed_fleet(2) as fleet:
        client = fleet.openai()
        if stream:
            chunks = await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=5, stream=True
            )
            text = "".join([chunk.choices[0].text async for chunk in chunks if chunk.choices])
        else:
            completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
            text = completion.choices[0].text
            assert completion.usage is not None
            assert completion.usage.completion_tokens == 5
        assert text


@pytest.mark.parametrize("stream", [False, True])
async def test_the_official_client_chat(stream: bool) -> None:
    messages: Any = [
        {"role": "system", "content": PROMPT},
        {"role": "user", "content": "What does the cache remember?"},
    ]
    async with routed_fleet(2) as fleet:
        client = fleet.openai()
        if stream:
            chunks = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts = [chunk async for chunk in chunks]
            text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            assert parts[-1].usage is not None
        else:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=5
            )
            text = raw.parse().choices[0].message.content or ""
            assert raw.headers["x-kvplane-worker"].startswith("worker-")
        assert text
        # The chat template is applied as the engine applies it: a repeat is predicted
        # exactly as the engine then reports it.
        again = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=1
        )
        usage = again.parse().usage
        assert usage is not None
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == int(
            again.headers["x-kvplane-cached-tokens"]
        )


async def test_models_lists_what_live_workers_serve() -> None:
    async with routed_fleet(2) as fleet:
        models = await fleet.openai().models.list()
        assert [model.id for model in models.data] == [MODEL]


async def test_requests_without_a_valid_key_are_refused() -> None:
    async with routed_fleet(1) as fleet:
        client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)


async def test_anonymous_access_when_configured() -> None:
    tenants = TenantSettings(allow_anonymous=True)
    async with routed_fleet(1, router_settings(tenants=tenants)) as fleet:
        async with fleet.http() as client:
            response = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
            )
        assert response.status_code == 200


async def test_bad_requests_get_a_clear_error_without_their_text() -> None:
    async with routed_fleet(1) as fleet, fleet.http() as client:
        headers = {"authorization": "Bearer sk-acme"}
        broken = await client.post(
            "/v1/completions", content=b'{"prompt": "' + SECRET_PHRASE.encode(), headers=headers
        )
        no_model = await client.post("/v1/completions", json={"prompt": PROMPT}, headers=headers)
    for response in (broken, no_model):
        assert response.status_code == 400
        assert response.json()["error"]["message"]
        assert SECRET_PHRASE not in response.text


# Short-lived predictions: the tests below wait them out to see what events alone say.
SHORT_PREDICTIONS = {"predicted_ttl_s": 0.3}


async def test_fleet_api_shows_workers_and_locality_without_sending() -> None:
    settings = router_settings(proxy=SHORT_PREDICTIONS)
    async with routed_fleet(2, settings) as fleet, fleet.http() as client:
        holder = (await _complete(fleet, PROMPT)).headers["x-kvplane-worker"]

        async def predicted_on_holder() -> bool:
            response = await client.post(
                "/fleet/locality",
                json={"model": MODEL, "prompt": PROMPT, "tenant": "acme"},
                headers=ADMIN,
            )
            body = response.json()
            return bool(body["chosen"] == holder and body["factor"] == "cache")

        await asyncio.sleep(fleet.router.planner.predicted.ttl_s)  # events, not predictions
        await wait_until("the holder's events reach the index", predicted_on_holder, 10)
        workers = (await client.get("/fleet/workers", headers=ADMIN)).json()["workers"]
        assert {w["worker_id"] for w in workers} == {"worker-1", "worker-2"}
        row = next(w for w in workers if w["worker_id"] == holder)
        assert row["state"] == "live"
        assert row["index_entries"] > 0
        assert row["load"] is not None
        assert row["last_heartbeat_age_s"] is not None
        stats = (await client.get("/fleet/index", headers=ADMIN)).json()
        assert stats["entries"] > 0

        refused = await client.get("/fleet/workers", headers={"authorization": "Bearer sk-acme"})
        assert refused.status_code == 401


async def test_drain_stops_routing_to_a_worker_until_undrained() -> None:
    async with routed_fleet(2) as fleet, fleet.http() as client:
        holder = (await _complete(fleet, PROMPT)).headers["x-kvplane-worker"]
        drained = await client.post(f"/fleet/workers/{holder}/drain", headers=ADMIN)
        assert drained.status_code == 200
        moved = await _complete(fleet, PROMPT)
        assert moved.headers["x-kvplane-worker"] != holder
        await client.post(f"/fleet/workers/{holder}/undrain", headers=ADMIN)
        back = await _complete(fleet, PROMPT + " again")
        assert back.headers["x-kvplane-worker"] in {holder, moved.headers["x-kvplane-worker"]}
        unknown = await client.post("/fleet/workers/nobody/drain", headers=ADMIN)
        assert unknown.status_code == 404


async def test_a_tenant_queries_its_own_scope_only() -> None:
    settings = router_settings(proxy=SHORT_PREDICTIONS)
    async with routed_fleet(1, settings) as fleet, fleet.http() as client:
        await _complete(fleet, PROMPT, tenant="acme")
        await asyncio.sleep(fleet.router.planner.predicted.ttl_s)  # events, not predictions

        async def own_prefix_cached() -> bool:
            own = await client.post(
                "/fleet/tenant/locality",
                json={"model": MODEL, "prompt": PROMPT},
                headers={"authorization": "Bearer sk-acme"},
            )
            assert own.status_code == 200
            return bool(own.json()["workers"][0]["cached_tokens"] > 0)

        await wait_until("the tenant's events reach the index", own_prefix_cached, 10)
        theirs = await client.post(
            "/fleet/tenant/locality",
            json={"model": MODEL, "prompt": PROMPT},
            headers={"authorization": "Bearer sk-globex"},
        )
        assert theirs.json()["workers"][0]["cached_tokens"] == 0
        sneaky = await client.post(
            "/fleet/tenant/locality",
            json={"model": MODEL, "prompt": PROMPT, "tenant": "acme"},
            headers={"authorization": "Bearer sk-globex"},
        )
        assert sneaky.status_code == 403


async def test_spans_cover_the_decision_and_hold_no_text() -> None:
    exporter = InMemorySpanExporter()
    async with routed_fleet(1, span_exporter=exporter) as fleet:
        await _complete(fleet, PROMPT)
    spans = exporter.get_finished_spans()
    names = {span.name for span in spans}
    assert {
        "kvplane.route",
        "kvplane.tokenize",
        "kvplane.key",
        "kvplane.lookup",
        "kvplane.score",
        "kvplane.upstream",
    } <= names
    upstream = next(span for span in spans if span.name == "kvplane.upstream")
    assert upstream.attributes is not None
    assert upstream.attributes["kvplane.first_byte_ms"] > 0
    dumped = json.dumps([dict(span.attributes or {}) for span in spans])
    assert SECRET_PHRASE not in dumped


async def test_purging_a_tenant_makes_its_cached_prefixes_unmatchable() -> None:
    async with routed_fleet(1) as fleet, fleet.http() as client:
        await _complete(fleet, PROMPT, tenant="acme")
        assert _reported(await _complete(fleet, PROMPT, tenant="acme")) > 0
        purged = await client.post("/fleet/tenants/acme/purge", headers=ADMIN)
        assert purged.status_code == 200
        assert purged.json()["generation"] == 1
        fresh = await _complete(fleet, PROMPT, tenant="acme")
        assert fresh.headers["x-kvplane-cached-tokens"] == "0"
        assert _reported(fresh) == 0  # a new salt: the engine's old blocks are out of reach
        assert _reported(await _complete(fleet, PROMPT, tenant="acme")) > 0  # caching again
        missing = await client.post("/fleet/tenants/nobody/purge", headers=ADMIN)
        assert missing.status_code == 404


async def test_a_body_over_the_limit_is_refused_with_413() -> None:
    settings = router_settings(proxy={"max_body_bytes": 2048})
    async with routed_fleet(1, settings) as fleet, fleet.http() as client:
        response = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT * 4, "max_tokens": 1},
            headers={"authorization": "Bearer sk-acme"},
        )
    assert response.status_code == 413
    assert SECRET_PHRASE not in response.text


async def test_a_dedicated_tenant_only_uses_its_pool_and_private_pays_for_company() -> None:
    tenants = tenant_settings()
    specs = [
        tenants.tenants[0].model_copy(update={"isolation": "dedicated", "pool": "acme"}),
        tenants.tenants[1].model_copy(update={"isolation": "private"}),
    ]
    settings = router_settings(tenants=tenants.model_copy(update={"tenants": specs}))
    labels = {"worker-2": {"kvplane.io/pool": "acme"}}
    async with routed_fleet(3, settings, labels=labels) as fleet, fleet.http() as client:
        for number in range(6):
            response = await _complete(fleet, PROMPT + str(number), tenant="acme")
            assert response.headers["x-kvplane-worker"] == "worker-2"
        locality = await client.post(
            "/fleet/locality",
            json={"model": MODEL, "prompt": PROMPT, "tenant": "acme"},
            headers=ADMIN,
        )
        eligible = {w["worker_id"] for w in locality.json()["workers"] if w["eligible"]}
        assert eligible == {"worker-2"}
        private = await client.post(
            "/fleet/locality",
            json={"model": MODEL, "prompt": PROMPT, "tenant": "globex"},
            headers=ADMIN,
        )
        rows = private.json()["workers"]
        assert all("tenant_penalty" in row for row in rows)  # every term is shown


async def test_logs_hold_no_prompt_or_completion_text(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with routed_fleet(2) as fleet, fleet.http() as client:
        completed = await _complete(fleet, PROMPT, max_tokens=16)
        await _complete(fleet, PROMPT)
        await client.post(
            "/v1/completions",
            content=b'{"model": "' + SECRET_PHRASE.encode() + b'", "prompt": 3',
            headers={"authorization": "Bearer sk-acme"},
        )
    completion_text = completed.json()["choices"][0]["text"]
    assert completion_text
    assert caplog.records  # the router, agents and engines did log
    assert SECRET_PHRASE not in caplog.text
    assert completion_text not in caplog.text


async def test_an_admin_port_keeps_the_fleet_api_and_metrics_off_the_public_one() -> None:
    settings = router_settings()
    settings = settings.model_copy(
        update={"http": settings.http.model_copy(update={"admin_port": 0})}
    )
    async with routed_fleet(1, settings) as fleet, fleet.http() as client:
        assert fleet.router.admin_port is not None
        admin = f"http://127.0.0.1:{fleet.router.admin_port}"
        assert (await client.get("/fleet/workers", headers=ADMIN)).status_code == 404
        assert (await client.get("/metrics", headers=ADMIN)).status_code == 404
        assert (await client.get("/readyz")).status_code == 200
        await _complete(fleet, PROMPT)  # the OpenAI API stays on the public port
        assert (await client.get(admin + "/fleet/workers", headers=ADMIN)).status_code == 200
        assert (await client.get(admin + "/metrics")).status_code == 200
        # A tenant's own locality query stays where the tenant can reach it.
        query = {"model": MODEL, "prompt": PROMPT}
        tenant = {"authorization": "Bearer sk-acme"}
        own = await client.post("/fleet/tenant/locality", json=query, headers=tenant)
        assert own.status_code == 200, own.text
        assert own.json()["workers"]
        assert (await client.post(admin + "/fleet/tenant/locality", json=query)).status_code == 404


async def test_metrics_on_the_client_port_need_the_admin_token_when_one_is_set() -> None:
    async with routed_fleet(1) as fleet, fleet.http() as client:
        assert (await client.get("/metrics")).status_code == 401
        assert (
            await client.get("/metrics", headers={"authorization": "Bearer sk-acme"})
        ).status_code == 401
        assert (await client.get("/metrics", headers=ADMIN)).status_code == 200


async def test_an_identical_prompt_is_tokenised_once() -> None:
    async with routed_fleet(1) as fleet:
        await _complete(fleet, PROMPT + " identical")
        await _complete(fleet, PROMPT + " identical", max_tokens=3)  # not read by tokenising
        assert await _metric(fleet, "kvplane_token_cache_lookups", result="hit") == 1
        assert await _metric(fleet, "kvplane_token_cache_tokens") > 0


async def _chat(fleet: RoutedFleet, messages: list[dict[str, str]]) -> httpx.Response:
    async with fleet.http() as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 2},
            headers={"authorization": "Bearer sk-acme"},
        )
    assert response.status_code == 200, response.text
    return response


async def test_a_short_new_end_is_tokenised_after_the_answer_and_counted_whole() -> None:
    system = {"role": "system", "content": PROMPT * 2}
    asked = [system, {"role": "user", "content": "What does the cache remember? " * 3}]
    async with routed_fleet(3) as fleet:
        first = await _chat(fleet, asked)
        holder = first.headers["x-kvplane-worker"]
        for use in range(CHECKED_FIRST_USES):  # compared with whole tokenisation first
            await _chat(fleet, [{"role": "user", "content": f"warm-up {use}"}])
        follow_up = [
            *asked,
            {"role": "assistant", "content": "What it has already read, block by block. " * 3},
            {"role": "user", "content": "And which blocks does it forget first? " * 3},
        ]
        routed_on_start = await _chat(fleet, follow_up)

        assert routed_on_start.headers["x-kvplane-worker"] == holder
        assert await _metric(fleet, "kvplane_prompt_rests_total", tokenised="after_answer") == 1
        # Counted whole once the answer was in: as the engine counted it.
        assert await _metric(fleet, "kvplane_prompt_token_checks_total", result="match") >= 10
        assert await _metric(fleet, "kvplane_prompt_token_checks_total", result="mismatch") == 0
        # And predicted whole where it went: the same prompt again expects all of it.
        again = await _chat(fleet, follow_up)
        assert again.headers["x-kvplane-worker"] == holder
        predicted = int(again.headers["x-kvplane-cached-tokens"])
        assert predicted > int(routed_on_start.headers["x-kvplane-cached-tokens"])
        assert abs(_reported(again) - predicted) <= 16
