"""The publisher sends what is pending as one batch as soon as nothing is in flight,
up to the control plane's limits: the control plane pays per batch, not per step. (The
event source gathers an engine's consecutive steps: tests/worker_agent/
test_kv_event_source.py.)"""

from __future__ import annotations

import asyncio

import grpc.aio
import pytest

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
    router: RunningRouter, gap_s: float, *, steps: int = STEPS, max_batch_blocks: int = 4096
) -> float:
    """`steps` engine steps, each storing the next block of one chain, submitted
    `gap_s` apart (0: with no await between them); the batches the control plane
    applied for them."""
    translator = BlockTranslator(MODEL, BLOCK_SIZE, max_tracked_blocks=1000)
    publisher = ControlPlanePublisher(
        WorkerIdentity("w1", "http://127.0.0.1:1", MODEL, BLOCK_SIZE, 0, "vllm", "", {}),
        # A long linger: the event source applies it, never the publisher.
        AgentSettings(control_plane_address=f"127.0.0.1:{router.grpc_port}", batch_linger_s=1.0),
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
            if gap_s:
                await asyncio.sleep(gap_s)
        await publisher.wait_flushed()
        match = (await router.index.lookup(block_keys(tokens, NAMESPACE)))["w1"]
        assert match.blocks == steps  # every step arrived, whatever the batching
    finally:
        await cancel_task(task)
    return _batches_applied(router) - before


def _batches_applied(router: RunningRouter) -> float:
    value = router.metrics.registry.get_sample_value("kvplane_batches_applied_total")
    return value or 0.0


async def test_steps_submitted_together_go_in_one_batch() -> None:
    async with running_router(make_settings()) as router:
        assert await _publish_steps(router, gap_s=0) == 1


async def test_a_step_goes_as_soon_as_nothing_is_in_flight() -> None:
    async with running_router(make_settings()) as router:
        assert await _publish_steps(router, gap_s=STEP_GAP_S) == STEPS


async def test_steps_past_the_control_planes_limit_go_in_several_batches() -> None:
    async with running_router(make_settings()) as router:
        assert await _publish_steps(router, gap_s=0, steps=3, max_batch_blocks=1) == 3


class _ChannelFailingOnClose:
    """A real channel whose teardown fails when a cancellation interrupts the stream,
    as a gRPC channel's may: the error then stands where the cancellation was."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    async def __aenter__(self) -> grpc.aio.Channel:
        return await self.channel.__aenter__()

    async def __aexit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        await self.channel.__aexit__(kind, *rest)  # type: ignore[arg-type]
        if kind is asyncio.CancelledError:
            raise RuntimeError("the channel did not close cleanly")


async def test_a_cancelled_publisher_stops_even_when_its_stream_fails_to_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whoever stops an agent waits for its publisher: one that took the error for a
    broken stream and reconnected would keep it waiting for ever (a test fleet's
    shutdown hung so)."""
    async with running_router(make_settings()) as router:
        publisher = ControlPlanePublisher(
            WorkerIdentity("w1", "http://127.0.0.1:1", MODEL, BLOCK_SIZE, 0, "vllm", "", {}),
            AgentSettings(control_plane_address=f"127.0.0.1:{router.grpc_port}"),
            ControlPlaneSettings(block_size=BLOCK_SIZE),
            snapshot=list,
        )
        real_channel = publisher._channel
        monkeypatch.setattr(
            publisher, "_channel", lambda address: _ChannelFailingOnClose(real_channel(address))
        )
        task = asyncio.create_task(publisher.run())
        try:
            await publisher.wait_connected()
            task.cancel()
            # (Not wait_for: on its timeout it would wait for the cancelled task too.)
            finished, _ = await asyncio.wait({task}, timeout=5)
            assert finished, "the cancelled publisher went on reconnecting"
            assert task.cancelled()
        finally:
            if not task.done():  # the bug: stop it with a channel that closes cleanly
                monkeypatch.undo()
                task.cancel()
                await asyncio.wait({task}, timeout=5)
