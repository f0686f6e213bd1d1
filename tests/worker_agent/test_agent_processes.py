"""The three commands as real processes, as an operator runs them: `kvplane engine-sim`,
`kvplane router --index redis` and `kvplane agent`; the test reads the shared Redis index."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator

import httpx
import pytest

from kvplane.core.config import AgentSettings, ControlPlaneSettings, HttpSettings, Settings
from kvplane.core.keys import KeyNamespace, block_keys
from kvplane.core.serving import cancel_task, free_port
from kvplane.core.tokenizer import load_tokenizer
from router.app import running_router
from router.index.redis import RedisLocationIndex
from simulations.processes import spawn_kvplane
from tests.one_worker_stack import one_worker_stack
from tests.waiting import wait_until
from worker_agent.agent import WorkerAgent

PROMPT = "Write a Python function that returns the longest common prefix of two lists. " * 3


def test_agent_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from kvplane.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["agent", "--help"])
    text = capsys.readouterr().out
    # Option entries start at two spaces; their help follows on the same or next lines.
    entries = re.split(r"\n(?=  -)", text.split("options:", 1)[1])
    documented = {}
    for entry in entries:
        words = entry.split()
        if not words:
            continue
        flag = words[0].rstrip(",")
        documented[flag] = len(words) > 2  # the flag, its metavar, then the help
    for name in AgentSettings.model_fields:
        flag = "--" + name.replace("_", "-")
        assert documented.get(flag), f"{flag} is missing or has no help text"
    assert all(documented.values())


@pytest.fixture
def processes(redis_url: str) -> Iterator[tuple[str, str]]:
    """(engine URL, Redis key prefix) of a running simulator, router and agent."""
    prefix = f"proc{uuid.uuid4().hex[:8]}"
    with one_worker_stack(
        "proc-worker",
        router_args=["--index", "redis", "--redis-url", redis_url, "--lease-s", "2"],
        router_env={"KVPLANE_INDEX__REDIS_PREFIX": prefix},
    ) as fleet:
        yield fleet.engine_url, prefix


@pytest.mark.slow
async def test_a_prompt_served_by_the_engine_is_in_the_shared_index(
    processes: tuple[str, str], redis_url: str
) -> None:
    engine_url, prefix = processes
    index = RedisLocationIndex.from_url(redis_url, prefix=prefix)
    keys = block_keys(load_tokenizer().completion_tokens(PROMPT), KeyNamespace("kvplane-tiny", 16))

    async def indexed_blocks() -> int:
        match = (await index.lookup(keys)).get("proc-worker")
        return 0 if match is None else match.blocks

    async def indexed() -> bool:
        return await indexed_blocks() > 0

    try:
        async with httpx.AsyncClient() as client:
            response = await client.post(
                engine_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}
            )
            assert response.status_code == 200
        await wait_until("the agent's blocks reach Redis", indexed, 20)
        # Every full block of the prompt but the one with its last token is cached.
        assert await indexed_blocks() == len(keys)
    finally:
        await index.close()


@pytest.mark.slow
async def test_an_engine_restarted_between_two_probes_starts_a_new_incarnation() -> None:
    """The engine restarts faster than the health probes notice (they are told to be
    patient here): its new process start time tells the agent its picture is gone."""
    sim_port, events, replay = free_port(), free_port(), free_port()
    engine_url = f"http://127.0.0.1:{sim_port}"
    sim_args = [
        "engine-sim", "--port", str(sim_port), "--time-scale", "0", "--kv-events-config",
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{events}", '
        f'"replay_endpoint": "tcp://*:{replay}"}}',
    ]  # fmt: skip
    settings = Settings(
        control_plane=ControlPlaneSettings(grpc_port=free_port(), block_size=16, lease_s=30),
        http=HttpSettings(port=0),
        agent=AgentSettings(
            worker_id="restarting",
            engine_url=engine_url,
            kv_events_endpoint=f"tcp://127.0.0.1:{events}",
            kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}",
            control_plane_address="127.0.0.1:0",  # set below
            load_interval_s=0.2,
            engine_down_after_failures=1000,
        ),
    )
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        agent_settings = settings.agent.model_copy(
            update={"control_plane_address": f"127.0.0.1:{router.grpc_port}"}
        )
        agent = WorkerAgent(settings.model_copy(update={"agent": agent_settings}))
        task = asyncio.create_task(agent.run())

        async def entries() -> int:
            statuses = await router.index.workers()
            return sum(s.entries for s in statuses if s.info.worker_id == "restarting")

        async def blocks_held() -> int:
            cached = (await client.get(engine_url + "/sim/blocks")).json()["blocks"]
            return len({block["hash"] for block in cached})

        async def index_matches_engine() -> bool:
            return await entries() == await blocks_held() > 0

        try:
            with spawn_kvplane(sim_args, engine_url + "/health"):
                await client.post(engine_url + "/v1/completions", json={"prompt": PROMPT})
                await wait_until("the first engine's blocks", index_matches_engine, 20)
            assert agent.publisher is not None
            first = agent.publisher.incarnation
            with spawn_kvplane(sim_args, engine_url + "/health"):
                other = "A different prompt, so that the new engine holds other blocks. " * 3
                await client.post(engine_url + "/v1/completions", json={"prompt": other})
                await wait_until(
                    "a new incarnation", lambda: agent.publisher.incarnation > first, 20
                )
                await wait_until("only the new engine's blocks", index_matches_engine, 20)
        finally:
            await cancel_task(task)
