"""The publisher sends what is pending as one batch as soon as nothing is in flight,
up to the control plane's limits: the control plane pays per batch, not per step. (The
event source gathers an engine's consecutive steps: tests/worker_agent/
test_kv_event_source.py.) The limits are the smaller of the agent's own and those the
control plane states when the agent registers; an event larger than a whole batch goes
in pieces."""

from __future__ import annotations

import asyncio

import grpc.aio
import pytest

from kvplane.core.config import AgentSettings, ControlPlaneSettings
from kvplane.core.keys import block_keys
from kvplane.core.serving import cancel_task
from kvplane.core.types import Tier
from kvplane.wire.codec import register_message
from kvplane.wire.stream import AgentStream
from router.app import RunningRouter, running_router
from tests.router.conftest import (
    BLOCK_SIZE,
    MODEL,
    NAMESPACE,
    make_settings,
    router_with_channel,
    worker,
)
from worker_agent.events import EngineBlockHash, EngineBlocksStored
from worker_agent.publisher import ControlPlanePublisher, WorkerIdentity
from worker_agent.translate import BlockTranslator

STEPS = 5
STEP_GAP_S = 0.05


async def _publish_steps(
    router: RunningRouter,
    gap_s: float,
    *,
    steps: int = STEPS,
    blocks_per_step: int = 1,
    max_batch_blocks: int = 4096,
) -> float:
    """`steps` engine steps, each storing the next `blocks_per_step` blocks of one chain,
    submitted `gap_s` apart (0: with no await between them); the batches the control
    plane applied for them. Fails unless every block arrives under the incarnation the
    agent began with."""
    translator = BlockTranslator(MODEL, BLOCK_SIZE, max_tracked_blocks=1000)
    publisher = ControlPlanePublisher(
        WorkerIdentity("w1", "http://127.0.0.1:1", MODEL, BLOCK_SIZE, 0, "vllm", "", {}),
        # A long linger: the event source applies it, never the publisher.
        AgentSettings(control_plane_address=f"127.0.0.1:{router.grpc_port}", batch_linger_s=1.0),
        ControlPlaneSettings(block_size=BLOCK_SIZE, max_batch_blocks=max_batch_blocks),
        snapshot=translator.snapshot,
    )
    step_tokens = blocks_per_step * BLOCK_SIZE
    tokens = list(range(steps * step_tokens))
    before = _batches_applied(router)
    task = asyncio.create_task(publisher.run())
    try:
        await publisher.wait_connected()
        for step in range(steps):
            first = step * blocks_per_step + 1  # engine block hashes count from 1
            stored = EngineBlocksStored(
                tuple(EngineBlockHash(first + block) for block in range(blocks_per_step)),
                None if step == 0 else EngineBlockHash(first - 1),
                tuple(tokens[step * step_tokens : (step + 1) * step_tokens]),
                BLOCK_SIZE,
                Tier.DEVICE,
                None,
                None,
            )
            publisher.submit(translator.translate([stored]))
            if gap_s:
                await asyncio.sleep(gap_s)
        async with asyncio.timeout(10):  # batches refused for ever would never flush
            await publisher.wait_flushed()
        match = (await router.index.lookup(block_keys(tokens, NAMESPACE)))["w1"]
        assert match.blocks == steps * blocks_per_step  # all arrived, whatever the batching
        assert publisher.incarnations_started == 1  # none refused: nothing started over
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


async def test_the_register_ack_states_the_control_planes_limits() -> None:
    settings = make_settings(max_batch_events=7, max_batch_blocks=11)
    async with router_with_channel(settings) as (_, channel):
        reply = await AgentStream(channel).request(register_message(worker()))
        assert (reply.ack.max_batch_events, reply.ack.max_batch_blocks) == (7, 11)


async def test_batches_keep_to_a_control_plane_that_takes_smaller_ones() -> None:
    """The agent's own limit is 4,096 blocks, the control plane's 1: every batch of the
    agent's size was refused, and the agent started over under a new incarnation, for
    ever."""
    async with running_router(make_settings(max_batch_blocks=1)) as router:
        assert await _publish_steps(router, gap_s=0, steps=3) == 3


async def test_an_event_larger_than_a_batch_goes_in_pieces() -> None:
    async with running_router(make_settings(max_batch_blocks=2)) as router:
        assert await _publish_steps(router, gap_s=0, steps=1, blocks_per_step=5) == 3


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
