"""Engine simulators with their agents, in this process, on loopback: a small fleet for
`kvplane demo`, `kvplane bench router` and the router's end-to-end tests.

Each worker is a real simulator (HTTP, ZMQ events and replay on free ports) and a real
agent streaming to the router's control plane over gRPC; only the process is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from kvplane.core.config import AgentSettings, ControlPlaneSettings, Settings
from kvplane.core.serving import cancel_task
from kvplane.core.worker_credentials import worker_token
from simulations.engine_sim.app import RunningEngineSim, running_engine_sim
from simulations.engine_sim.config import EngineSimConfig, KVEventsConfig
from worker_agent.agent import WorkerAgent

_EVENTS = KVEventsConfig(
    enable_kv_cache_events=True,
    endpoint="tcp://127.0.0.1:*",
    replay_endpoint="tcp://127.0.0.1:*",
)


@dataclass(slots=True)
class LocalWorker:
    worker_id: str
    sim: RunningEngineSim
    agent: WorkerAgent
    agent_task: asyncio.Task[None]

    @property
    def base_url(self) -> str:
        return self.sim.base_url

    async def stop_agent(self) -> None:
        await cancel_task(self.agent_task)


@contextlib.asynccontextmanager
async def local_worker(
    worker_id: str,
    *,
    control_plane: ControlPlaneSettings,
    control_plane_address: str,
    sim_options: Mapping[str, Any] | None = None,
    labels: Mapping[str, str] | None = None,
    load_interval_s: float = 0.1,
    idle_metrics_interval_s: float | None = None,
) -> AsyncIterator[LocalWorker]:
    """One simulator and its agent; both stop when the block exits. The agent reads an
    idle engine's metrics as often as a busy one's unless `idle_metrics_interval_s` is
    given: tests watch restarts and loads at the load interval."""
    options: dict[str, Any] = {"port": 0, "kv_events_config": _EVENTS}
    options.update(sim_options or {})
    async with running_engine_sim(EngineSimConfig(**options)) as sim:
        assert sim.events_endpoint is not None
        settings = Settings(
            control_plane=control_plane,
            agent=AgentSettings(
                worker_id=worker_id,
                engine_url=sim.base_url,
                kv_events_endpoint=sim.events_endpoint,
                kv_events_replay_endpoint=sim.replay_endpoint,
                control_plane_address=control_plane_address,
                load_interval_s=load_interval_s,
                idle_metrics_interval_s=idle_metrics_interval_s or load_interval_s,
                reconnect_max_s=0.5,
                labels=dict(labels or {}),
            ),
        )
        agent = WorkerAgent(settings)
        task = asyncio.create_task(agent.run())
        try:
            yield LocalWorker(worker_id, sim, agent, task)
        finally:
            await cancel_task(task)


@contextlib.asynccontextmanager
async def local_workers(
    count: int,
    *,
    grpc_port: int,
    block_size: int = 16,
    agent_token: SecretStr | None = None,
    worker_credential_secret: str | None = None,
    sim_options: Mapping[str, Any] | None = None,
    worker_sim_options: Mapping[str, Mapping[str, Any]] | None = None,
    labels: Mapping[str, Mapping[str, str]] | None = None,
) -> AsyncIterator[list[LocalWorker]]:
    """`count` workers named worker-1.. reporting to the router on `grpc_port`, their
    engines run with `sim_options` and, by worker id, `worker_sim_options` over them;
    with `worker_credential_secret` each agent presents its own worker's token."""
    async with contextlib.AsyncExitStack() as stack:
        workers = []
        for number in range(1, count + 1):
            worker_id = f"worker-{number}"
            token = (
                agent_token
                if worker_credential_secret is None
                else SecretStr(worker_token(worker_credential_secret, worker_id))
            )
            workers.append(
                await stack.enter_async_context(
                    local_worker(
                        worker_id,
                        control_plane=ControlPlaneSettings(
                            block_size=block_size, agent_token=token
                        ),
                        control_plane_address=f"127.0.0.1:{grpc_port}",
                        sim_options={
                            **(sim_options or {}),
                            **(worker_sim_options or {}).get(worker_id, {}),
                        },
                        labels=(labels or {}).get(worker_id),
                    )
                )
            )
        yield workers
