"""What the router does when things fail, end to end over loopback with real sockets.

A worker that dies before its first byte costs the client nothing (the router tries
the next worker, and says so in kvplane_failovers_total); when no worker answers (a
stalled one with a single attempt allowed, or none live at all) the client gets a 503
with Retry-After, and a model no live worker serves is a 404. A worker whose
simulator and agent are SIGKILLed (real child processes) stops getting traffic at
once and leaves the fleet and the index within its lease. Redis stopping mid-test
degrades routing to load only, without a failed request, even past a lease; a bug in
the index is no outage: the request fails with a 500 instead. A client
that goes away, mid-stream or before the first byte, cancels the engine's request and
the router's accounting of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import httpx
import openai
import pytest

from kvplane.core.clock import Clock
from kvplane.core.config import IndexSettings
from kvplane.core.keys import BlockKey
from kvplane.core.serving import free_port
from kvplane.core.tokenizer import load_tokenizer
from router.app import RunningRouter, running_router
from router.index.base import PrefixMatch, WorkerState
from router.index.memory import MemoryLocationIndex
from simulations.engine_sim.process import spawn_engine_sim
from simulations.processes import spawn_kvplane
from tests.metrics_text import sample_sum
from tests.redis_servers import stoppable_redis
from tests.router.proxy.conftest import (
    ADMIN,
    MODEL,
    TENANT_KEYS,
    RoutedFleet,
    routed_fleet,
    router_settings,
)
from tests.waiting import wait_until

AUTH = {"authorization": f"Bearer {TENANT_KEYS['acme']}"}
SURVIVOR = "worker-1"
DOOMED = "doomed"
# Long enough for a few blocks, so that a worker holding it is clearly preferred.
PROMPT = "Summarise the incident report of the storage cluster, paragraph by paragraph. " * 4
SLOW = {"time_scale": 1.0}  # default timing: about 8 ms per decoded token


# -- helpers -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerProcesses:
    """A simulator and its agent, each a `kvplane` child process."""

    worker_id: str
    base_url: str
    sim: Popen[bytes]
    agent: Popen[bytes]

    def kill(self) -> None:
        for process in (self.sim, self.agent):
            process.kill()  # SIGKILL: no goodbye to the control plane
            process.wait()


@contextlib.asynccontextmanager
async def worker_processes(
    worker_id: str, router: RunningRouter, *sim_flags: str
) -> AsyncIterator[WorkerProcesses]:
    events, replay = free_port(), free_port()
    kv_events = json.dumps(
        {
            "enable_kv_cache_events": True,
            # A wildcard: vLLM's PUB binds only then (a named host is connected to).
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
    )
    with contextlib.ExitStack() as stack:
        # The start waits on /health with blocking calls: off the loop the router runs in.
        sim = await asyncio.to_thread(
            stack.enter_context,
            spawn_engine_sim(
                "--time-scale", "0", "--num-gpu-blocks-override", "256",
                "--kv-events-config", kv_events, *sim_flags,
            ),
        )  # fmt: skip
        agent = stack.enter_context(
            spawn_kvplane(
                ["agent", "--worker-id", worker_id, "--engine-url", sim.base_url,
                 "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                 "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
                 "--control-plane-address", f"127.0.0.1:{router.grpc_port}",
                 "--load-interval-s", "0.2", "--reconnect-max-s", "0.5"],
                None,
            )
        )  # fmt: skip
        await wait_until(
            f"{worker_id} is routable",
            lambda: worker_id in candidate_ids(router),
            timeout_s=20,
        )
        yield WorkerProcesses(worker_id, sim.base_url, sim.process, agent)


def candidate_ids(router: RunningRouter) -> set[str]:
    return {candidate.worker_id for candidate in router.pool.candidates(MODEL)}


def acme_salt(router: RunningRouter) -> str:
    tenant = router.tenants.authenticate(AUTH["authorization"])
    assert tenant is not None
    assert tenant.cache_salt is not None
    return tenant.cache_salt


async def indexed_workers(router: RunningRouter, prompt: str) -> set[str]:
    """Workers the index says hold a prefix of `prompt` in acme's cache scope."""
    tokens = load_tokenizer().completion_tokens(prompt)
    keys = router.planner.keys(MODEL, acme_salt(router), tokens)
    return {worker for worker, match in (await router.index.lookup(keys)).items() if match.blocks}


async def prime(router: RunningRouter, worker: WorkerProcesses, prompt: str) -> None:
    """Cache `prompt` (in acme's scope) on `worker` only, and wait for the index to
    know: from then on the router prefers `worker` for it."""
    body = {"prompt": prompt, "max_tokens": 1, "cache_salt": acme_salt(router)}
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(worker.base_url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text

    async def indexed() -> bool:
        return worker.worker_id in await indexed_workers(router, prompt)

    await wait_until(f"{worker.worker_id}'s prefix is in the index", indexed, 10)


async def completion(client: openai.AsyncOpenAI, prompt: str = PROMPT) -> str:
    """Send one completion; returns the worker that answered it (it must succeed)."""
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=4
    )
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].text
    return raw.headers["x-kvplane-worker"]


async def router_metric(fleet: RoutedFleet, name: str, **labels: str) -> float:
    async with fleet.http() as http:
        return sample_sum((await http.get("/metrics", headers=ADMIN)).text, name, **labels)


async def engine_busy(base_url: str) -> float:
    """Requests the simulator is running or queueing, from its own /metrics."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(base_url + "/metrics")).text
    return sample_sum(text, "vllm:num_requests_running") + sample_sum(
        text, "vllm:num_requests_waiting"
    )


async def wait_cancelled_everywhere(fleet: RoutedFleet) -> None:
    worker = fleet.workers[0]

    async def engine_idle() -> bool:
        scheduler = worker.sim.engine.scheduler
        return (
            not scheduler.running
            and not scheduler.waiting
            and not await engine_busy(worker.base_url)
        )

    # Well before the request would have finished on its own (about 16 s).
    await wait_until("the engine dropped the request", engine_idle, 3)
    await wait_until(
        "the router's traffic to the worker is back to 0",
        lambda: fleet.router.pool.traffic(worker.worker_id).in_flight == 0,
        3,
    )
    traffic = fleet.router.pool.traffic(worker.worker_id)
    assert (traffic.prefilling, traffic.prefill_tokens, dict(traffic.by_tenant)) == (0, 0, {})


# -- failover before the first byte ----------------------------------------------------


async def test_a_worker_dying_before_its_first_byte_costs_no_request() -> None:
    """The preferred worker (it holds the prompt's prefix) dies on the next request,
    while its registration is live: every request of the batch is answered by the
    other worker."""
    async with (
        routed_fleet(1) as fleet,
        worker_processes(DOOMED, fleet.router, "--fail-after-requests", "1") as doomed,
        fleet.openai() as client,
    ):
        await prime(fleet.router, doomed, PROMPT)  # its one request: the next kills it
        before = await router_metric(fleet, "kvplane_failovers_total", worker=DOOMED)
        answered = await asyncio.gather(*(completion(client) for _ in range(6)))
        assert answered == [SURVIVOR] * 6
        assert doomed.sim.poll() is not None  # it did die
        after = await router_metric(fleet, "kvplane_failovers_total", worker=DOOMED)
        assert after >= before + 1
        status = fleet.router.pool.status(DOOMED)
        assert status is not None
        assert status.state is WorkerState.LIVE


async def test_with_one_attempt_a_failing_worker_gets_the_client_a_503() -> None:
    settings = router_settings(proxy={"max_attempts": 1, "first_byte_timeout_s": 0.3})
    async with routed_fleet(1, settings) as fleet, fleet.http() as http:
        fault = await http.post(fleet.workers[0].base_url + "/sim/faults", json={"stall_s": 5})
        assert fault.status_code == 200
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
        response = await http.post("/v1/completions", json=body, headers=AUTH)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "ServiceUnavailableError"
        assert "no worker answered (1 tried)" in error["message"]
        assert "worker-1: no first byte within the timeout" in error["message"]
        assert await router_metric(fleet, "kvplane_failovers_total", worker="worker-1") == 1


# -- nothing to route to ---------------------------------------------------------------


async def test_a_router_without_workers_answers_503_with_retry_after() -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    async with (
        running_router(router_settings()) as router,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as http,
    ):
        response = await http.post("/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert error["message"] == "no live worker can take the request now"


async def test_an_unknown_model_is_a_404_while_workers_are_live() -> None:
    async with routed_fleet(1) as fleet, fleet.openai() as client:
        with pytest.raises(openai.NotFoundError, match="no-such-model"):
            await client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
        assert await completion(client) == SURVIVOR  # the known model still is
        # The engine refused it: the client's mistake, counted apart from engine failures.
        worker = fleet.workers[0].worker_id
        refused = await router_metric(
            fleet, "kvplane_requests_total", outcome="engine_refused", worker=worker
        )
        failed = await router_metric(
            fleet, "kvplane_requests_total", outcome="engine_error", worker=worker
        )
        assert (refused, failed) == (1, 0)


# -- a worker killed ---------------------------------------------------------------------


@pytest.mark.slow
async def test_a_killed_worker_loses_its_traffic_at_once_and_its_place_within_its_lease() -> None:
    lease_s = 1.5
    settings = router_settings(lease_s=lease_s, proxy={"unreachable_backoff_s": 0.1})
    async with (
        routed_fleet(1, settings) as fleet,
        worker_processes(DOOMED, fleet.router) as doomed,
        fleet.openai() as client,
    ):
        router = fleet.router
        await prime(router, doomed, PROMPT)
        doomed.kill()
        killed_at = time.monotonic()
        assert DOOMED in await indexed_workers(router, PROMPT)  # its lease runs on

        async def gone() -> bool:
            return DOOMED not in candidate_ids(router) and DOOMED not in await indexed_workers(
                router, PROMPT
            )

        served = 0
        while not await gone():
            assert time.monotonic() - killed_at < lease_s + 1.0, "still routable past its lease"
            assert await completion(client) == SURVIVOR
            served += 1
        assert served > 0
        assert time.monotonic() - killed_at > lease_s / 2  # requests did meet the dead worker

        def not_live_in_registry() -> bool:
            status = router.pool.status(DOOMED)  # re-read from the index every 0.25 s
            return status is None or status.state is not WorkerState.LIVE

        await wait_until("the registry no longer has it live", not_live_in_registry, 1)
        await asyncio.sleep(0.2)  # past the unreachable backoff: the lease keeps it out
        assert candidate_ids(router) == {SURVIVOR}
        assert await completion(client) == SURVIVOR


# -- the index going away ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisLoss:
    fleet: RoutedFleet
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient
    stopped_at: float


@contextlib.asynccontextmanager
async def fleet_losing_redis(workdir: Path, lease_s: float) -> AsyncIterator[RedisLoss]:
    """Two workers on a Redis index, served a few requests; then Redis stops."""
    with stoppable_redis(workdir) as (url, redis_process):
        index = IndexSettings(backend="redis", redis_url=url, redis_prefix="failures")
        settings = router_settings(index, lease_s=lease_s)
        async with (
            routed_fleet(2, settings) as fleet,
            fleet.openai() as client,
            fleet.http() as http,
        ):
            for number in range(4):
                await completion(client, f"{number} {PROMPT}")
            ready = await http.get("/readyz")
            assert ready.json()["routing"] == "cache-aware"
            redis_process.stop()
            yield RedisLoss(fleet, client, http, time.monotonic())


async def test_redis_stopping_degrades_to_load_only_routing(tmp_path: Path) -> None:
    lease_s = 3.0  # the test ends well within it
    async with fleet_losing_redis(tmp_path, lease_s) as loss:
        answered = {await completion(loss.client, f"after {n} {PROMPT}") for n in range(6)}
        assert answered <= {"worker-1", "worker-2"}
        ready = await loss.http.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["routing"] == "load-only"
        assert (
            sample_sum(
                (await loss.http.get("/metrics", headers=ADMIN)).text, "kvplane_index_degraded"
            )
            == 1
        )
        assert time.monotonic() - loss.stopped_at < lease_s / 2  # all within the lease


@pytest.mark.slow
async def test_redis_down_for_longer_than_a_lease_fails_no_request(tmp_path: Path) -> None:
    """The workers cannot renew their registrations while the index is down; the
    router routes on its last picture of the registry (a dead worker costs a
    failover, not a failed request)."""
    lease_s = 1.5
    async with fleet_losing_redis(tmp_path, lease_s) as loss:
        number = 0
        while (elapsed := time.monotonic() - loss.stopped_at) < 2 * lease_s:
            try:
                await completion(loss.client, f"after {number} {PROMPT}")
            except openai.APIStatusError as error:
                view = {
                    record.info.worker_id: record.state.value
                    for record in loss.fleet.router.workers.records()
                }
                raise AssertionError(
                    f"request {number}, {elapsed:.2f} s after Redis stopped (lease "
                    f"{lease_s} s), failed: {error.status_code} {error.message}; "
                    f"the router's worker view: {view}"
                ) from None
            number += 1
        ready = await loss.http.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["routing"] == "load-only"


class LookupBug(MemoryLocationIndex):
    """A memory index whose lookups hit a programming error."""

    def __init__(self, bug: Exception, clock: Clock) -> None:
        super().__init__(clock=clock)
        self.bug = bug

    async def lookup(self, keys: Sequence[BlockKey]) -> dict[str, PrefixMatch]:
        raise self.bug


@pytest.mark.parametrize("bug", [TypeError("a bug"), KeyError("w1")], ids=["TypeError", "KeyError"])
async def test_a_bug_in_the_index_fails_the_request_rather_than_routing_on_load(
    monkeypatch: pytest.MonkeyPatch, bug: Exception
) -> None:
    monkeypatch.setattr("router.app.open_index", lambda settings, clock: LookupBug(bug, clock))
    async with routed_fleet(1) as fleet, fleet.http() as http:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        response = await http.post("/v1/completions", json=body, headers=AUTH)
        assert response.status_code == 500
        assert fleet.router.planner.index_answering
        text = (await http.get("/metrics", headers=ADMIN)).text
    error = type(bug).__name__
    assert sample_sum(text, "kvplane_index_errors_total", operation="lookup", error=error) == 1
    assert sample_sum(text, "kvplane_index_degraded") == 0


# -- clients that go away -------------------------------------------------------------


async def test_a_client_leaving_mid_stream_cancels_the_engine_request() -> None:
    async with routed_fleet(1, sim_options=SLOW) as fleet, fleet.http() as http:
        worker = fleet.workers[0]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
            assert await engine_busy(worker.base_url) == 1
            assert fleet.router.pool.traffic(worker.worker_id).in_flight == 1
        # Leaving the block closes the connection with the answer unread.
        await wait_cancelled_everywhere(fleet)
        gone = await router_metric(
            fleet, "kvplane_requests_total", outcome="client_disconnected", worker="worker-1"
        )
        assert gone == 1


async def test_a_client_leaving_before_the_first_byte_cancels_the_engine_request() -> None:
    async with routed_fleet(1, sim_options=SLOW) as fleet, fleet.http() as http:
        worker = fleet.workers[0]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000}  # not streamed
        request = asyncio.create_task(http.post("/v1/completions", json=body, headers=AUTH))
        await wait_until(
            "the engine is generating", lambda: len(worker.sim.engine.scheduler.running) == 1
        )
        assert await engine_busy(worker.base_url) == 1
        assert fleet.router.pool.traffic(worker.worker_id).in_flight == 1
        assert not request.done()  # nothing came back yet
        request.cancel()  # closes the client's connection
        await asyncio.gather(request, return_exceptions=True)
        await wait_cancelled_everywhere(fleet)
        gone = await router_metric(
            fleet, "kvplane_requests_total", outcome="client_disconnected", worker="worker-1"
        )
        assert gone == 1


async def test_a_full_connection_pool_is_a_503_that_blames_no_worker() -> None:
    """With every connection to the engines in use, a request waits connect_timeout_s
    for one (the only wait that sets a timer: a free slot is taken at once), then gets
    a 503 counted as router_busy: the other worker, idle, is not tried, and no worker
    is marked unreachable; once the slot is free the next request is served."""
    settings = router_settings(proxy={"max_connections": 1, "connect_timeout_s": 0.3})
    async with routed_fleet(2, settings, sim_options=SLOW) as fleet, fleet.http() as http:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000}
        holding = asyncio.create_task(http.post("/v1/completions", json=body, headers=AUTH))
        await wait_until(
            "an engine is generating",
            lambda: sum(len(w.sim.engine.scheduler.running) for w in fleet.workers) == 1,
        )
        started = time.monotonic()
        refused = await http.post("/v1/completions", json=body, headers=AUTH)
        waited = time.monotonic() - started
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert "no free connection" in refused.json()["error"]["message"]
        assert waited >= 0.3
        assert not holding.done()
        assert await router_metric(fleet, "kvplane_requests_total", outcome="router_busy") == 1
        assert await router_metric(fleet, "kvplane_failovers_total") == 0
        assert len(candidate_ids(fleet.router)) == 2  # nobody was marked unreachable
        holding.cancel()  # frees the slot (and the engine's request)
        await asyncio.gather(holding, return_exceptions=True)
        await wait_cancelled_everywhere(fleet)
        short = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        served = await http.post("/v1/completions", json=short, headers=AUTH)
        assert served.status_code == 200


async def test_an_engine_silent_mid_stream_ends_the_stream_with_an_error() -> None:
    settings = router_settings(proxy={"idle_timeout_s": 0.3})
    async with routed_fleet(1, settings, sim_options=SLOW) as fleet, fleet.http() as http:
        worker = fleet.workers[0]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "stream": True}
        lines = []
        async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue  # the blank line after each event
                lines.append(line)
                if len(lines) == 3:
                    stalled = await http.post(worker.base_url + "/sim/faults", json={"stall_s": 2})
                    assert stalled.status_code == 200
        assert lines[-1].startswith("data: ")
        assert json.loads(lines[-1][6:])["error"]["message"] == "the engine broke the stream"
        assert "data: [DONE]" not in lines
        broken = await router_metric(
            fleet, "kvplane_requests_total", outcome="broken_stream", worker="worker-1"
        )
        assert broken == 1


async def test_a_slow_answer_waits_for_the_first_byte_timeout_not_the_idle_one() -> None:
    # About a second of generating before a non-streamed answer's first (and only) byte.
    settings = router_settings(proxy={"idle_timeout_s": 0.3, "first_byte_timeout_s": 30})
    async with routed_fleet(1, settings, sim_options=SLOW) as fleet, fleet.http() as http:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120}
        response = await http.post("/v1/completions", json=body, headers=AUTH)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 120
