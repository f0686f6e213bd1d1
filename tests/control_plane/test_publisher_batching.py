"""The agent lets an engine's consecutive steps join one batch (agent.batch_linger_s)
and sends what piles up together: the control plane pays per batch, not per step."""

from __future__ import annotations

import asyncio
import time

from kvplane.core.config import AgentSettings, ControlPlaneSettings
from kvplane.core.keys import block_keys
from kvplane.core.serving import cancel_task
from kvplane.core.types import Tier
from router.app import RunningRouter, running_router
from tests.control_plane.conftest import BLOCK_SIZE, MODEL, NAMESPACE, make_settings
from worker_agent.events import EngineBlockHash, EngineBlocksStored
from worker_agent.publisher import ControlPlanePublisher, WorkerIdentity
from worker_agent.translate import BlockTranslator

STEPS = 5
STEP_GAP_S = 0.05


async def _publish_steps(
    router: RunningRouter, linger_s: float, *, steps: int = STEPS, max_batch_blocks: int = 4096
) -> float:
    """Five engine steps, each storing the next block of one chain, STEP_GAP_S apart;
    the batches the control plane applied for them."""
    translator = BlockTranslator(MODEL, BLOCK_SIZE, max_tracked_blocks=1000)
    publisher = ControlPlanePublisher(
        WorkerIdentity("w1", "http://127.0.0.1:1", MODEL, BLOCK_SIZE, 0, "vllm", "", {}),
        AgentSettings(
            control_plane_address=f"127.0.0.1:{router.grpc_port}", batch_linger_s=linger_s
        ),
        ControlPlaneSettings(block_size=BLOCK_SIZE, max_batch_blocks=max_batch_blocks),
        snapshot=translator.snapshot,
    )
    tokens = list(range(steps * BLOCK_SIZE))
    before = _batches_applied(router)
    task = asyncio.create_task(publisher.run())
    try:
        await publisher.wait_connected()
        for step in range(steps):
            block = tokens[step * BLOCK_SIZE : (step + 1) * BLOCK_SIZE]
            parent = None if step == 0 else EngineBlockHash(step)
            stored = EngineBlocksStored(
                (EngineBlockHash(step + 1),),
                parent,
                tuple(block),
                BLOCK_SIZE,
                Tier.DEVICE,
                None,
                None,
            )
            publisher.submit(translator.translate([stored]))
            await asyncio.sleep(STEP_GAP_S)
        await publisher.wait_flushed()
        match = (await router.index.lookup(block_keys(tokens, NAMESPACE)))["w1"]
        assert match.blocks == steps  # every step arrived, whatever the batching
    finally:
        await cancel_task(task)
    return _batches_applied(router) - before


def _batches_applied(router: RunningRouter) -> float:
    value = router.metrics.registry.get_sample_value("kvplane_batches_applied_total")
    return value or 0.0


async def test_steps_within_the_linger_go_in_one_batch() -> None:
    async with running_router(make_settings()) as router:
        assert await _publish_steps(router, linger_s=1.0) == 1


async def test_without_a_linger_each_step_goes_as_soon_as_nothing_is_in_flight() -> None:
    async with running_router(make_settings()) as router:
        assert await _publish_steps(router, linger_s=0.0) > 1


async def test_a_whole_batch_goes_without_waiting_out_the_linger() -> None:
    async with running_router(make_settings()) as router:
        started = time.monotonic()
        # One block a batch: each step fills one, so none waits out the second of linger
        # (the first alone would have taken a second).
        batches = await _publish_steps(router, linger_s=1.0, steps=3, max_batch_blocks=1)
        assert batches == 3
        assert time.monotonic() - started < 1.0
