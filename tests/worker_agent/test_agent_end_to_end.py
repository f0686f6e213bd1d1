"""An engine simulator, a control plane and an agent over loopback (real HTTP, ZMQ, gRPC):
the index holds exactly what the engine holds, through the faults that break continuity.

The comparison: for every prompt sent, the longest prefix the engine holds (its own
block table) equals the prefix the index returns for the router's keys of the prompt,
and the index holds as many entries for the worker as the engine holds distinct blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplane.core.config import (
    AgentSettings,
    ControlPlaneSettings,
    HttpSettings,
    IndexSettings,
    Settings,
)
from kvplane.core.keys import KeyNamespace, block_keys
from kvplane.core.serving import cancel_task, free_port
from kvplane.core.tokenizer import load_tokenizer
from router.app import RunningRouter, running_router
from simulations.engine_sim.app import RunningEngineSim
from simulations.engine_sim.block_hash import BlockHasher
from simulations.engine_sim.config import KVEventsConfig
from simulations.engine_sim.protocol import VLLM_VERSION
from tests.simulations.engine_sim.conftest import engine_sim
from tests.waiting import wait_until
from worker_agent.agent import WorkerAgent

WORKER = "worker-1"
MODEL = "kvplane-tiny"
BLOCK = 16
LEASE_S = 1.0


@dataclass
class Fleet:
    sim: RunningEngineSim
    router: RunningRouter
    settings: Settings
    agent: WorkerAgent
    agent_task: asyncio.Task[None]
    prompts: list[tuple[str, str | None]] = field(default_factory=list)
    engine_block: int = BLOCK  # the router's block is a multiple of it

    async def send(self, client: httpx.AsyncClient, prompt: str, salt: str | None = None) -> None:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 2}
        if salt is not None:
            body["cache_salt"] = salt
        response = await client.post(self.sim.base_url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        self.prompts.append((prompt, salt))

    def engine_prefix(self, prompt: str, salt: str | None) -> int:
        engine = self.sim.engine
        hasher = BlockHasher(self.engine_block, engine.hash_root, None, salt)
        hasher.update(load_tokenizer().completion_tokens(prompt))
        held = 0
        for digest in hasher.digests:
            if engine.pool.cached_block(digest) is None:
                break
            held += 1
        return held * self.engine_block // BLOCK  # in router blocks

    async def index_prefix(self, prompt: str, salt: str | None) -> int:
        tokens = load_tokenizer().completion_tokens(prompt)
        keys = block_keys(tokens, KeyNamespace(MODEL, BLOCK, cache_scope=salt or ""))
        match = (await self.router.index.lookup(keys)).get(WORKER)
        return 0 if match is None else match.blocks

    async def index_entries(self) -> int:
        for status in await self.router.index.workers():
            if status.info.worker_id == WORKER:
                return status.entries
        return 0

    def engine_blocks(self) -> int:
        return len({block.digest for block in self.sim.engine.pool.cached_blocks()})

    async def matches_engine(self) -> bool:
        for prompt, salt in self.prompts:
            if await self.index_prefix(prompt, salt) != self.engine_prefix(prompt, salt):
                return False
        if self.engine_block != BLOCK:
            return True  # entries of partly held router blocks are not counted here
        return await self.index_entries() == self.engine_blocks()

    async def never_ahead_of_engine(self) -> bool:
        for prompt, salt in self.prompts:
            if await self.index_prefix(prompt, salt) > self.engine_prefix(prompt, salt):
                return False
        return True

    async def registered(self) -> bool:
        return any(s.info.worker_id == WORKER for s in await self.router.index.workers())

    @property
    def incarnation(self) -> int:
        assert self.agent.publisher is not None
        return self.agent.publisher.incarnation


def agent_settings(sim: RunningEngineSim, grpc_port: int, index: IndexSettings) -> Settings:
    assert sim.events_endpoint is not None
    return Settings(
        index=index,
        control_plane=ControlPlaneSettings(grpc_port=grpc_port, block_size=BLOCK, lease_s=LEASE_S),
        http=HttpSettings(port=0),
        agent=AgentSettings(
            worker_id=WORKER,
            engine_url=sim.base_url,
            kv_events_endpoint=sim.events_endpoint,
            kv_events_replay_endpoint=sim.replay_endpoint,
            control_plane_address=f"127.0.0.1:{grpc_port}",
            load_interval_s=0.1,
            reconnect_max_s=0.5,
        ),
    )


def start_agent(settings: Settings) -> tuple[WorkerAgent, asyncio.Task[None]]:
    agent = WorkerAgent(settings)
    return agent, asyncio.create_task(agent.run())


def sim_options(**settings: Any) -> dict[str, Any]:
    """A simulator on fixed free ports, so that a restarted one is found again."""
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{free_port()}",  # a "*" makes the engine bind, as vLLM
        replay_endpoint=f"tcp://*:{free_port()}",
        buffer_steps=settings.pop("buffer_steps", 10_000),
    )
    return {
        "port": free_port(),
        "num_gpu_blocks_override": 48,
        "kv_events_config": events,
        **settings,
    }


@contextlib.asynccontextmanager
async def fleet(index: IndexSettings, **sim_settings: Any) -> AsyncIterator[Fleet]:
    async with engine_sim(**sim_options(**sim_settings)) as sim:
        settings = agent_settings(sim, free_port(), index)
        async with running_router(settings) as router:
            agent, task = start_agent(settings)
            running = Fleet(sim, router, settings, agent, task)
            try:
                await wait_until("the agent registers", running.registered)
                yield running
            finally:
                await cancel_task(running.agent_task)


PROMPTS = [
    f"{topic} The cache remembers what the model has already read, so a request that starts "
    "the same way as an earlier one can skip the work."
    for topic in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
]


@pytest.fixture(params=["memory", "redis"])
def index_settings(request: pytest.FixtureRequest) -> IndexSettings:
    if request.param == "memory":
        return IndexSettings()
    redis_url: str = request.getfixturevalue("redis_url")
    prefix = f"agent{request.node.name.__hash__() & 0xFFFF}"
    return IndexSettings(backend="redis", redis_url=redis_url, redis_prefix=prefix)


async def test_the_index_follows_stores_and_evictions(index_settings: IndexSettings) -> None:
    async with fleet(index_settings) as running, httpx.AsyncClient() as client:
        for prompt in PROMPTS * 2:  # 8 prompts of ~4 blocks in a 48-block cache: evictions
            await running.send(client, prompt)
        await running.send(client, PROMPTS[0], salt="tenant-a")
        await wait_until("the index matches the engine", running.matches_engine)
        assert running.sim.engine.scheduler.kv_cache.stats.hits > 0
        record = running.router.workers.get(WORKER)
        assert record is not None
        assert record.last_load is not None  # heartbeats with the engine's load arrive
        assert record.info.engine_version == VLLM_VERSION  # as the engine's /version says


async def test_router_blocks_of_two_engine_blocks(index_settings: IndexSettings) -> None:
    async with engine_sim(**sim_options(block_size=BLOCK // 2)) as sim:
        settings = agent_settings(sim, free_port(), index_settings)
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            agent, task = start_agent(settings)
            running = Fleet(sim, router, settings, agent, task, engine_block=BLOCK // 2)
            try:
                await wait_until("the agent registers", running.registered)
                for prompt in PROMPTS * 2:  # with evictions (48 blocks of 8 tokens)
                    await running.send(client, prompt)
                await wait_until("the index matches the engine", running.matches_engine)
                assert await running.index_entries() > 0
            finally:
                await cancel_task(task)


async def test_a_reset_and_a_restart_empty_the_index(index_settings: IndexSettings) -> None:
    async with fleet(index_settings) as running, httpx.AsyncClient() as client:
        for prompt in PROMPTS[:3]:
            await running.send(client, prompt)
        await wait_until("the index matches the engine", running.matches_engine)
        await client.post(running.sim.base_url + "/reset_prefix_cache")
        await wait_until("the reset reaches the index", _entries_are(running, 0))
        await running.send(client, PROMPTS[3])
        await wait_until("the index matches the engine", running.matches_engine)
        before = running.incarnation
        await client.post(running.sim.base_url + "/sim/faults", json={"restart": True})
        await running.send(client, PROMPTS[4])
        await wait_until("a new incarnation", lambda: running.incarnation > before)
        await wait_until("the index matches the restarted engine", running.matches_engine)


async def test_dropped_batches_are_replayed(index_settings: IndexSettings) -> None:
    async with (
        fleet(index_settings, drop_event_fraction=0.4, seed=7) as running,
        httpx.AsyncClient() as client,
    ):
        first = running.incarnation
        for prompt in PROMPTS:
            await running.send(client, prompt)
        await wait_until("the index matches the engine", running.matches_engine)
        assert running.incarnation == first  # replay filled every gap


async def test_a_replay_buffer_too_short_starts_a_new_incarnation(
    index_settings: IndexSettings,
) -> None:
    async with (
        fleet(index_settings, drop_event_fraction=0.5, seed=3, buffer_steps=1) as running,
        httpx.AsyncClient() as client,
    ):
        first = running.incarnation
        for prompt in PROMPTS:
            await running.send(client, prompt)
        await wait_until("a new incarnation", lambda: running.incarnation > first)
        # What the agent could not see stays unknown: the index may miss blocks, it
        # never claims one the engine does not hold.
        await wait_until("the index settles", running.never_ahead_of_engine)
        assert await running.never_ahead_of_engine()


async def test_a_restarted_agent_rebuilds_the_index_from_replay(
    index_settings: IndexSettings,
) -> None:
    async with fleet(index_settings) as running, httpx.AsyncClient() as client:
        for prompt in PROMPTS[:4]:
            await running.send(client, prompt)
        await wait_until("the index matches the engine", running.matches_engine)
        first = running.incarnation
        await cancel_task(running.agent_task)
        running.agent, running.agent_task = start_agent(running.settings)
        await wait_until("the new agent registers", _newer(running, first))
        await wait_until("the index matches the engine", running.matches_engine)
        assert await running.index_entries() > 0


@pytest.mark.slow
async def test_a_restarted_control_plane_is_refilled(index_settings: IndexSettings) -> None:
    async with engine_sim(**sim_options()) as sim, httpx.AsyncClient() as client:
        settings = agent_settings(sim, free_port(), index_settings)
        agent, task = start_agent(settings)
        try:
            async with running_router(settings) as router:
                running = Fleet(sim, router, settings, agent, task)
                await wait_until("the agent registers", running.registered)
                for prompt in PROMPTS[:4]:
                    await running.send(client, prompt)
                await wait_until("the index matches the engine", running.matches_engine)
            # The control plane is gone (with the memory index, all it knew); the engine
            # goes on caching meanwhile. It comes back on the same port, and the agent
            # reconnects and refills it, what happened in between included.
            await running.send(client, PROMPTS[6])
            async with running_router(settings) as router:
                running.router = router
                await wait_until("the index matches the engine", running.matches_engine, 15)
                await running.send(client, PROMPTS[5])
                await wait_until("new blocks arrive too", running.matches_engine)
        finally:
            await cancel_task(task)


@pytest.mark.slow
async def test_a_killed_engine_leaves_the_index_within_the_lease_and_comes_back(
    index_settings: IndexSettings,
) -> None:
    options = sim_options()
    async with contextlib.AsyncExitStack() as engine_life, httpx.AsyncClient() as client:
        sim = await engine_life.enter_async_context(engine_sim(**options))
        settings = agent_settings(sim, free_port(), index_settings)
        async with running_router(settings) as router:
            agent, task = start_agent(settings)
            running = Fleet(sim, router, settings, agent, task)
            try:
                await wait_until("the agent registers", running.registered)
                for prompt in PROMPTS[:3]:
                    await running.send(client, prompt)
                await wait_until("the index matches the engine", running.matches_engine)
                first = running.incarnation

                assert agent.publisher is not None
                started = agent.publisher.incarnations_started
                await engine_life.aclose()  # the engine dies: its HTTP and ZMQ sockets close
                await wait_until(
                    "the dead engine's entries are gone",
                    _entries_are(running, 0),
                    timeout_s=LEASE_S * 3 + 2,
                )
                running.sim = await engine_life.enter_async_context(engine_sim(**options))
                running.prompts.clear()
                await running.send(client, PROMPTS[4])
                await wait_until("a new incarnation", lambda: running.incarnation > first)
                await wait_until("the index matches the new engine", running.matches_engine)
                await asyncio.sleep(1.0)
                # One new incarnation for the new engine (two if the restart also shows in
                # its event sequence), not a storm of them.
                assert agent.publisher.incarnations_started - started <= 3
                assert await running.matches_engine()
            finally:
                await cancel_task(task)


def _entries_are(running: Fleet, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await running.index_entries() == count

    return check


def _newer(running: Fleet, incarnation: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        for status in await running.router.index.workers():
            if status.info.worker_id == WORKER and status.info.incarnation > incarnation:
                return True
        return False

    return check


@pytest.mark.slow
async def test_an_engine_whose_metrics_fail_stays_up(index_settings: IndexSettings) -> None:
    """/health alone decides that an engine is down: a /metrics that times out on every
    probe costs the load report, not the worker. (The heartbeat waits for the probe, up
    to its timeout a request: the lease here is the default's 5 s, which covers that.)"""
    async with engine_sim(**sim_options()) as sim, httpx.AsyncClient() as client:
        settings = agent_settings(sim, free_port(), index_settings)
        lease = settings.control_plane.model_copy(update={"lease_s": 5.0})
        settings = settings.model_copy(update={"control_plane": lease})
        agent, task = start_agent(settings)
        try:
            async with running_router(settings) as router:
                running = Fleet(sim, router, settings, agent, task)
                await wait_until("the agent registers", running.registered)
                await running.send(client, PROMPTS[0])
                await wait_until("the index matches the engine", running.matches_engine)
                stall = {"metrics_stall_s": 30}
                assert (await client.post(sim.base_url + "/sim/faults", json=stall)).is_success
                incarnation = running.incarnation
                # Three probes' metrics timeouts (2 s each): two failed probes call it down.
                await asyncio.sleep(3 * 2.0 + 1)
                assert not agent.engine_is_down
                record = router.workers.get(WORKER)
                assert record is not None
                assert record.state.value == "live"
                assert running.incarnation == incarnation
                await running.send(client, PROMPTS[1])
                await wait_until("the index follows the engine still", running.matches_engine)
        finally:
            await cancel_task(task)


async def test_odd_events_are_skipped_counted_and_reported_to_the_router(
    index_settings: IndexSettings,
) -> None:
    async with fleet(index_settings) as running, httpx.AsyncClient() as client:
        first = running.incarnation
        answer = await client.post(running.sim.base_url + "/sim/faults", json={"odd_events": True})
        assert answer.status_code == 200
        for prompt in PROMPTS:
            await running.send(client, prompt)
        await wait_until("the index matches the engine", running.matches_engine)
        assert running.incarnation == first  # the odd events cost nothing else

        async def reported() -> dict[tuple[str, str], float]:
            metrics = await client.get(f"http://127.0.0.1:{running.router.http_port}/metrics")
            return {
                (sample.labels["event_type"], sample.labels["reason"]): sample.value
                for family in text_string_to_metric_families(metrics.text)
                if family.name == "kvplane_worker_skipped_events"
                for sample in family.samples
                if sample.labels["worker"] == WORKER
            }

        async def every_batch_reported() -> bool:
            # The counts ride on the agent's load reports, once a load interval: one may
            # have left before the last prompts' batches were counted.
            counts = await reported()
            return len(counts) == 4 and min(counts.values()) >= len(PROMPTS)

        await wait_until("the router shows the agent's skipped events", every_batch_reported)
        counts = await reported()
        assert set(counts) == {
            ("BlockPinned", "unknown_type"),
            ("BlockStored", "unknown_medium"),
            ("BlockStored", "remote"),
            ("BlockRemoved", "malformed"),
        }
        assert len(set(counts.values())) == 1  # one of each in every batch


async def test_events_and_replay_over_ipc_sockets(tmp_path: Path) -> None:
    """An engine and its agent on one host (one pod) keep the event ports off the
    network with ipc:// endpoints, which an engine binds as it binds a wildcard."""
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/kv-events",
        replay_endpoint=f"ipc://{tmp_path}/kv-replay",
    )
    async with engine_sim(**{**sim_options(), "kv_events_config": events}) as sim:
        assert sim.events_endpoint == events.endpoint
        settings = agent_settings(sim, free_port(), IndexSettings())
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            agent, task = start_agent(settings)
            running = Fleet(sim, router, settings, agent, task)
            try:
                await wait_until("the agent registers", running.registered)
                for prompt in PROMPTS[:4]:
                    await running.send(client, prompt)
                await wait_until("the index matches the engine", running.matches_engine)
                assert await running.index_entries() > 0
            finally:
                await cancel_task(task)
