"""Flow control against real engine simulators that take their time (one request running
at a time, each some tens of milliseconds a token), over loopback HTTP and gRPC: the
order requests are let through in, what a full queue sheds and says, how tenants share
by what they cost, and that a waiting request's worker is chosen when it goes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx
import numpy as np
import pytest

from kvplane.core.config import (
    FlowControlSettings,
    IndexSettings,
    Settings,
    TenantSettings,
    TenantSpec,
)
from router.app import RunningRouter
from router.flow_control.saturation import EngineQueues
from router.lifecycle.flow import SCHEDULING_LABEL
from router.tenants import api_key_digest
from tests.abuse.conftest import wait_indexed
from tests.metrics_text import sample_sum
from tests.router.proxy.conftest import ADMIN, MODEL, RoutedFleet, routed_fleet, router_settings
from tests.waiting import wait_until

# Tokens of 25 ms each, one request running at a time: an engine that saturates at once.
SLOW = {
    "time_scale": 1.0,
    "max_num_seqs": 1,
    "decode_step_ms": 25.0,
    "decode_ms_per_request": 0.0,
    "decode_ms_per_context_token": 0.0,
    "prefill_ms_per_token": 0.02,
    "prefill_overhead_ms": 1.0,
    "num_gpu_blocks_override": 256,
}
TENANTS = {
    "acme": {},
    "globex": {"max_priority": 5},
    "initech": {"share": 2.0},
    "noisy": {},
    "warm": {},
}


def key(tenant: str) -> str:
    return f"sk-{tenant}"


def flow_settings(index: IndexSettings | None = None, **flow: Any) -> Settings:
    specs = [
        TenantSpec(name=name, api_key_sha256=[api_key_digest(key(name))], **spec)
        for name, spec in TENANTS.items()
    ]
    tenants = TenantSettings(tenants=specs, cache_salt_secret="test-secret")
    settings = router_settings(index, tenants=tenants)
    return settings.model_copy(update={"flow_control": FlowControlSettings(enabled=True, **flow)})


@contextlib.asynccontextmanager
async def slow_fleet(
    count: int = 1, *, sim: Mapping[str, Any] | None = None, **flow: Any
) -> AsyncIterator[RoutedFleet]:
    options = {**SLOW, **(sim or {})}
    async with routed_fleet(count, flow_settings(**flow), sim_options=options) as fleet:
        await learn_batch_limits(fleet, batch=options["max_num_seqs"])
        yield fleet


async def complete(
    fleet: RoutedFleet | str,
    tenant: str,
    prompt: str,
    max_tokens: int = 4,
    headers: Mapping[str, str] | None = None,
    *,
    stream: bool = False,
    model: str = MODEL,
) -> httpx.Response:
    """`prompt` completed through the fleet's router (or the router at this URL)."""
    url = fleet if isinstance(fleet, str) else fleet.url
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await http.post(
            "/v1/completions",
            json=body,
            headers={"authorization": f"Bearer {key(tenant)}", **(headers or {})},
        )


async def direct(
    worker_url: str, prompt: str, max_tokens: int, cache_salt: str | None = None
) -> None:
    """A request straight to an engine, around the router (as another client's would)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(worker_url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text


async def learn_batch_limits(
    fleet: RoutedFleet, routers: Sequence[RunningRouter] | None = None, batch: int = 1
) -> None:
    """Queue requests in every engine (of `batch` running at most) until the routers
    (the fleet's, by default) have seen each one's batch full (flow control knows no
    engine's limit before that)."""
    count = len(fleet.workers)
    routers = routers or [fleet.router]
    warmers = [
        asyncio.ensure_future(direct(worker.base_url, f"warm {worker.worker_id} {n}", 8))
        for worker in fleet.workers
        for n in range(3 * batch)
    ]

    def learnt() -> bool:
        for router in routers:
            limits = engine_queues(router).batch_limit
            if len(limits) != count or not np.isfinite(limits).all():
                return False
        return True

    await wait_until("the routers learnt every engine's batch", learnt)
    await asyncio.gather(*warmers)
    for router in routers:
        await wait_until("the engines are idle again", lambda r=router: engines_idle(r))


def engine_queues(router: RoutedFleet | RunningRouter) -> EngineQueues:
    pool = router.router.pool if isinstance(router, RoutedFleet) else router.pool
    return pool.engine_queues(pool.serving_rows(MODEL))


def engines_idle(router: RoutedFleet | RunningRouter) -> bool:
    queues = engine_queues(router)
    return bool((queues.running + queues.waiting == 0).all())


async def metric(fleet: RoutedFleet, name: str, **labels: str) -> float:
    async with fleet.http() as http:
        return sample_sum((await http.get("/metrics", headers=ADMIN)).text, name, **labels)


async def queued(fleet: RoutedFleet, count: int) -> None:
    async def enough() -> bool:
        return await metric(fleet, "kvplane_flow_queued_requests", model=MODEL) >= count

    await wait_until(f"{count} requests wait in the router", enough)


def finishing(fleet: RoutedFleet, finished: list[str]) -> Callable[..., Awaitable[None]]:
    """A sender of named requests that must be answered, each name appended to
    `finished` as its answer ends."""

    async def send(name: str, tenant: str, **kw: Any) -> None:
        response = await complete(fleet, tenant, f"request {name}", **kw)
        assert response.status_code == 200, response.text
        finished.append(name)

    return send


async def test_a_higher_band_goes_before_requests_that_waited_longer() -> None:
    async with slow_fleet(max_engine_waiting=0) as fleet:
        finished: list[str] = []
        send = finishing(fleet, finished)

        occupying = asyncio.ensure_future(send("occupying", "acme", max_tokens=12))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        low = [asyncio.ensure_future(send(f"low {n}", "acme")) for n in range(3)]
        await queued(fleet, 3)
        # globex may ask for band 5; acme's header is ignored (it may not set one).
        high = asyncio.ensure_future(send("high", "globex", headers={"x-kvplane-priority": "9"}))
        ignored = asyncio.ensure_future(
            send("ignored", "acme", headers={"x-kvplane-priority": "9"})
        )
        await asyncio.gather(occupying, *low, high, ignored)

    assert finished == ["occupying", "high", "low 0", "low 1", "low 2", "ignored"]


async def test_a_malformed_priority_header_is_refused_before_anything_is_done() -> None:
    async with routed_fleet(1, flow_settings(), sim_options={"time_scale": 0.0}) as fleet:
        response = await complete(fleet, "globex", "hello", headers={"x-kvplane-priority": "high"})
        deadline = await complete(
            fleet, "acme", "hello", headers={"x-kvplane-ttft-deadline-ms": "0"}
        )
        ok = await complete(fleet, "acme", "hello", headers={"x-kvplane-priority": "high"})
    assert response.status_code == 400
    assert "x-kvplane-priority" in response.json()["error"]["message"]
    assert deadline.status_code == 400
    assert ok.status_code == 200  # acme may not set a priority: its header is not read


async def test_tenants_share_a_band_by_the_tokens_they_cost() -> None:
    async with slow_fleet(max_engine_waiting=0) as fleet:
        order: list[str] = []

        async def send(tenant: str, words: int, n: int, max_tokens: int = 1) -> None:
            prompt = f"{tenant} {n} " + " ".join(f"w{n}x{i}" for i in range(words))
            response = await complete(fleet, tenant, prompt, max_tokens=max_tokens)
            assert response.status_code == 200, response.text
            order.append(tenant)

        occupying = asyncio.ensure_future(send("warm", 4, 0, max_tokens=12))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        tasks = []
        for n in range(6):  # alternating: acme's prompts cost ten times globex's
            tasks.append(asyncio.ensure_future(send("acme", 200, n)))
            tasks.append(asyncio.ensure_future(send("globex", 20, n)))
            await asyncio.sleep(0.01)
        await queued(fleet, 12)
        await asyncio.gather(occupying, *tasks)

    served = order[1:]  # the occupying request's first
    # acme's first request goes first (the counters tie, it came first); then globex's
    # six cost less than acme's one, and all go before acme's second.
    assert served[:7] == ["acme"] + ["globex"] * 6, served


async def test_configured_shares_split_a_backlogged_band() -> None:
    async with slow_fleet(max_engine_waiting=0) as fleet:
        order: list[str] = []

        async def send(tenant: str, n: int, max_tokens: int = 1) -> None:
            prompt = f"{tenant} asks question {n}"
            response = await complete(fleet, tenant, prompt, max_tokens=max_tokens)
            assert response.status_code == 200, response.text
            order.append(tenant)

        occupying = asyncio.ensure_future(send("warm", 0, max_tokens=12))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        tasks = [
            asyncio.ensure_future(send(tenant, n))
            for n in range(9)
            for tenant in ("initech", "acme")
        ]
        await queued(fleet, 18)
        await asyncio.gather(occupying, *tasks)

    first = order[1:10]
    assert 5 <= first.count("initech") <= 7, order  # its share is twice acme's


async def test_a_full_queue_sheds_the_flood_and_says_why() -> None:
    async with slow_fleet(max_engine_waiting=0, max_queued_requests=2) as fleet:
        occupying = asyncio.ensure_future(complete(fleet, "acme", "occupying", max_tokens=16))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        flood = [asyncio.ensure_future(complete(fleet, "noisy", f"flood {n}")) for n in range(2)]
        await queued(fleet, 2)
        own = await complete(fleet, "noisy", "flood 2")  # the flood's newest: itself
        displacing = asyncio.ensure_future(complete(fleet, "acme", "a fair request"))
        results = await asyncio.gather(occupying, displacing, *flood)
        shed_full = await metric(
            fleet, "kvplane_flow_shed_total", tenant="noisy", reason="queue_full"
        )
        shed_displaced = await metric(
            fleet, "kvplane_flow_shed_total", tenant="noisy", reason="displaced"
        )
        acme_shed = await metric(fleet, "kvplane_flow_shed_total", tenant="acme")
        async with fleet.http() as http:
            flow = (await http.get("/fleet/flow", headers=ADMIN)).json()

    assert own.status_code == 429
    assert own.headers["x-kvplane-shed-reason"] == "queue_full"
    assert int(own.headers["retry-after"]) >= 1
    error = own.json()["error"]
    assert (error["type"], error["code"]) == ("RateLimitError", 429)
    assert error["message"].startswith("queue_full:")
    occupied, fair, first, second = results
    assert (occupied.status_code, fair.status_code, first.status_code) == (200, 200, 200)
    # The fair request took the place of the flood's newest waiting one.
    assert second.status_code == 429
    assert second.headers["x-kvplane-shed-reason"] == "displaced"
    assert (shed_full, shed_displaced, acme_shed) == (1, 1, 0)
    assert flow["enabled"]
    assert flow["replicas"] == 1
    tenants = {row["tenant"]: row for row in flow["tenants"]}
    assert tenants["noisy"]["shed"] == {"queue_full": 1, "displaced": 1}
    assert tenants["acme"]["shed"] == {}
    assert sum(row["service_share"] for row in tenants.values()) == pytest.approx(1.0)
    (model,) = flow["models"]
    assert model["model"] == MODEL
    assert model["waiting"] == {}  # all served or shed by now


async def test_a_request_that_cannot_wait_long_enough_is_shed_with_its_reason() -> None:
    async with slow_fleet(max_engine_waiting=0, max_wait_s=0.3) as fleet:
        occupying = asyncio.ensure_future(complete(fleet, "acme", "occupying", max_tokens=40))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        timed_out = await complete(fleet, "acme", "a patient request")
        late = await complete(
            fleet, "globex", "an impatient request", headers={"x-kvplane-ttft-deadline-ms": "100"}
        )
        assert (await occupying).status_code == 200
    assert timed_out.status_code == 429
    assert timed_out.headers["x-kvplane-shed-reason"] == "queue_timeout"
    assert late.status_code == 429
    assert late.headers["x-kvplane-shed-reason"] == "deadline"


async def test_a_request_whose_client_leaves_while_it_waits_counts_its_wait() -> None:
    async with slow_fleet(max_engine_waiting=0) as fleet:
        running = asyncio.ensure_future(complete(fleet, "acme", "running", max_tokens=20))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        leaving = asyncio.ensure_future(complete(fleet, "globex", "leaving before its turn"))
        await queued(fleet, 1)
        leaving.cancel()

        async def gone() -> bool:
            return await metric(fleet, "kvplane_flow_queued_requests", model=MODEL) == 0

        await wait_until("the router lets it go", gone)
        waits = await metric(fleet, "kvplane_flow_wait_seconds_count", tenant="globex")
        assert (await running).status_code == 200
    assert waits == 1


async def test_a_request_no_worker_can_take_is_refused_at_once() -> None:
    # It must not wait max_wait_s (60 s: the client gives up after 30) for a room that
    # never comes, nor leave a queue behind.
    async with routed_fleet(0, flow_settings()) as fleet:
        response = await complete(fleet, "acme", "hello")
        async with fleet.http() as http:
            flow = (await http.get("/fleet/flow", headers=ADMIN)).json()
    assert response.status_code == 503, response.text
    assert flow["models"] == []


async def test_a_name_no_worker_registers_waits_among_the_served_models_requests() -> None:
    # A client's made-up model name (or an adapter the engines serve under their base
    # model) gets no queue, counters or metric series of its own.
    async with slow_fleet(max_engine_waiting=0) as fleet:
        occupying = asyncio.ensure_future(complete(fleet, "acme", "occupying", max_tokens=12))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        made_up = asyncio.ensure_future(complete(fleet, "acme", "hello", model="made-up"))
        await queued(fleet, 1)
        async with fleet.http() as http:
            flow = (await http.get("/fleet/flow", headers=ADMIN)).json()
        assert (await occupying).status_code == 200
        answer = await made_up
        async with fleet.http() as http:
            exposed = (await http.get("/metrics", headers=ADMIN)).text
    assert [model["model"] for model in flow["models"]] == [MODEL]
    assert answer.status_code == 404, answer.text  # the engine's own answer
    assert 'model="made-up"' not in exposed


async def test_a_waiting_request_is_routed_on_the_index_of_when_it_goes() -> None:
    """Its prefix leaves the worker that held it when the request arrived, and reaches
    another, while the request waits: it goes where the prefix is then."""
    small = {"num_gpu_blocks_override": 24}  # 384 tokens: one long prompt evicts the rest
    async with slow_fleet(2, sim=small, max_engine_waiting=0) as fleet:
        tenant = fleet.router.tenants.get("acme")
        assert tenant is not None
        prefix = "The handbook of the storage desk, chapter one. " * 6
        first = await complete(fleet, "acme", prefix + "first question", max_tokens=1)
        holder = first.headers["x-kvplane-worker"]
        await wait_indexed(fleet, prefix, "acme", holder)
        (other,) = [w for w in fleet.workers if w.worker_id != holder]
        held = fleet.worker(holder)
        # Both engines busy with requests the router never saw.
        busy = [
            asyncio.ensure_future(direct(held.base_url, "occupying the holder", 30)),
            asyncio.ensure_future(direct(other.base_url, "occupying the other", 20)),
        ]

        def both_busy() -> bool:
            queues = engine_queues(fleet)
            return bool((queues.running >= 1).all())

        await wait_until("the router sees both engines busy", both_busy)
        waiting = asyncio.ensure_future(complete(fleet, "acme", prefix + "second question"))
        await queued(fleet, 1)
        # Behind each occupant: a long prompt that evicts the prefix from its holder, and
        # the prefix itself (in acme's scope) on the other, decoding long enough for its
        # blocks' events to be indexed before that engine has room.
        busy.append(asyncio.ensure_future(direct(held.base_url, "evict " * 100, 30)))
        busy.append(
            asyncio.ensure_future(
                direct(other.base_url, prefix + "elsewhere", 10, tenant.cache_salt)
            )
        )
        response = await waiting
        await asyncio.gather(*busy)

    assert response.status_code == 200
    assert response.headers["x-kvplane-worker"] == other.worker_id
    assert int(response.headers["x-kvplane-cached-tokens"]) > 0  # the prefix, found there


async def send_in_order(fleet: RoutedFleet) -> list[str]:
    """While the engine is busy: three of acme's requests (the second asking the engine
    itself for the first place), then one of globex in band 5; the order they finish."""
    finished: list[str] = []
    send = finishing(fleet, finished)

    occupying = asyncio.ensure_future(send("occupying", "acme", max_tokens=12))
    await wait_until("the engine runs it", lambda: not engines_idle(fleet))
    tasks = [asyncio.ensure_future(send("low 0", "acme"))]
    await asyncio.sleep(0.02)
    async with fleet.http() as http:  # the engine's own priority field, in the body
        jumping = asyncio.ensure_future(
            http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "request low 1", "max_tokens": 4, "priority": -100},
                headers={"authorization": f"Bearer {key('acme')}"},
            )
        )
        await asyncio.sleep(0.02)
        tasks.append(asyncio.ensure_future(send("low 2", "acme")))
        await asyncio.sleep(0.02)
        tasks.append(
            asyncio.ensure_future(send("high", "globex", headers={"x-kvplane-priority": "5"}))
        )
        response = await jumping
        assert response.status_code == 200, response.text
        finished.append("low 1")
    await asyncio.gather(occupying, *tasks)
    return finished


async def test_engines_in_priority_mode_get_the_band_and_never_the_clients_own() -> None:
    # Room for every request in the engine's own queue: its order is the engine's.
    settings = flow_settings(max_engine_waiting=10)
    sim = {**SLOW, "scheduling_policy": "priority"}
    labelled = {"worker-1": {SCHEDULING_LABEL: "priority"}}
    async with routed_fleet(1, settings, sim_options=sim, labels=labelled) as fleet:
        await learn_batch_limits(fleet)
        order = await send_in_order(fleet)
    assert order.index("high") == 1, order  # band 5 went to the engine as priority -5
    assert order.index("low 1") > order.index("low 0"), order  # -100 never reached it


async def test_an_engine_not_labelled_for_priorities_is_sent_none() -> None:
    settings = flow_settings(max_engine_waiting=10)
    sim = {**SLOW, "scheduling_policy": "priority"}  # would order by one, were it sent
    async with routed_fleet(1, settings, sim_options=sim) as fleet:
        await learn_batch_limits(fleet)
        order = await send_in_order(fleet)
    assert order == ["occupying", "low 0", "low 1", "low 2", "high"], order


async def test_a_higher_band_preempts_a_lower_one_waiting_in_its_engine() -> None:
    # Two may wait in the engine: acme's first two streams do, the third in the router.
    # The running one is never preempted, nor one whose answer is not streamed.
    async with slow_fleet(max_engine_waiting=2) as fleet:
        finished: list[str] = []

        async def send(name: str, tenant: str, **kw: Any) -> httpx.Response:
            response = await complete(fleet, tenant, f"request {name}", stream=True, **kw)
            finished.append(name)
            return response

        occupying = asyncio.ensure_future(send("occupying", "acme", max_tokens=16))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        low = []
        for n in range(3):
            low.append(asyncio.ensure_future(send(f"low {n}", "acme")))
            await asyncio.sleep(0.02)
        await queued(fleet, 1)
        high = await send("high", "globex", headers={"x-kvplane-priority": "5"})
        responses = await asyncio.gather(occupying, *low)
        preempted = await metric(
            fleet, "kvplane_flow_shed_total", tenant="acme", reason="preempted"
        )

    assert high.status_code == 200
    # The newest of the two acme requests in the engine's queue gave the high band its place.
    shed = responses[2]
    assert shed.status_code == 429, shed.text
    assert shed.headers["x-kvplane-shed-reason"] == "preempted"
    assert [r.status_code for r in (responses[0], responses[1], responses[3])] == [200] * 3
    assert finished.index("high") < finished.index("low 2")
    assert preempted == 1


async def flood_then_light(fleet: RoutedFleet) -> list[str]:
    """While the engine runs one of noisy's requests: four more of noisy's at once,
    then one of acme's; the order they finish. Noisy, the only tenant asking until
    then, has asked for more than its share once acme waits too."""
    finished: list[str] = []
    send = finishing(fleet, finished)

    occupying = asyncio.ensure_future(send("occupying", "noisy", max_tokens=12))
    await wait_until("the engine runs it", lambda: not engines_idle(fleet))
    # Answers long enough for the request let through next to reach the engine while the
    # one before it still runs.
    flood = [asyncio.ensure_future(send(f"noisy {n}", "noisy", max_tokens=12)) for n in range(4)]
    await queued(fleet, 2)
    light = asyncio.ensure_future(send("light", "acme"))
    await queued(fleet, 3)
    await asyncio.gather(occupying, *flood, light)
    return finished


async def test_a_flood_leaves_the_engines_last_waiting_places_to_a_lighter_tenant() -> None:
    # Two may wait in the engine, one of them a backlogged tenant's: noisy's first two
    # take both before it has a backlog, then acme's request takes the place the third
    # would have had (noisy's turn in the router: acme is lifted to its counter).
    async with slow_fleet(max_engine_waiting=2, max_engine_waiting_backlogged=1) as fleet:
        order = await flood_then_light(fleet)
    assert order.index("light") < order.index("noisy 2"), order


async def test_engines_in_priority_mode_run_a_backlogged_tenants_requests_last() -> None:
    # No place kept: noisy's third goes first from the router, backlogged (its fourth
    # still waits), and acme's after it; the engine runs acme's first.
    settings = flow_settings(max_engine_waiting=2, max_engine_waiting_backlogged=2)
    sim = {**SLOW, "scheduling_policy": "priority"}
    labelled = {"worker-1": {SCHEDULING_LABEL: "priority"}}
    async with routed_fleet(1, settings, sim_options=sim, labels=labelled) as fleet:
        await learn_batch_limits(fleet)
        order = await flood_then_light(fleet)
    assert order.index("light") < order.index("noisy 2"), order
