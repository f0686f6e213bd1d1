"""A Reject the control plane writes before it ends a stream reaches the agent with its
reason, also where nothing was reading replies when it came: with deferred Acks the
agent's next write is what fails, and the Reject is still there to be read."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvplane.core.config import AgentSettings, ControlPlaneSettings
from kvplane.core.serving import cancel_task
from kvplane.core.types import Tier
from kvplane.wire.codec import register_message
from kvplane.wire.stream import AgentStream
from tests.router.conftest import (
    BLOCK_SIZE,
    MODEL,
    make_settings,
    router_with_channel,
    worker,
)
from tests.waiting import wait_until
from worker_agent.events import EngineBlockHash, EngineBlocksStored
from worker_agent.publisher import ControlPlanePublisher, WorkerIdentity
from worker_agent.translate import BlockTranslator

ENGINE_URL = "http://127.0.0.1:8000"


def _stored(step: int) -> EngineBlocksStored:
    return EngineBlocksStored(
        (EngineBlockHash(step + 1),),
        None if step == 0 else EngineBlockHash(step),
        tuple(range(step * BLOCK_SIZE, (step + 1) * BLOCK_SIZE)),
        BLOCK_SIZE,
        Tier.DEVICE,
        None,
        None,
    )


async def test_a_reject_behind_a_failed_write_is_read_for_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="worker_agent")
    async with router_with_channel(make_settings()) as (router, channel):
        translator = BlockTranslator(MODEL, BLOCK_SIZE, max_tracked_blocks=1000)
        publisher = ControlPlanePublisher(
            WorkerIdentity("w1", ENGINE_URL, MODEL, BLOCK_SIZE, 0, "vllm", "", {}),
            AgentSettings(control_plane_address=f"127.0.0.1:{router.grpc_port}"),
            ControlPlaneSettings(block_size=BLOCK_SIZE),
            snapshot=translator.snapshot,
        )
        task = asyncio.create_task(publisher.run())
        try:
            await publisher.wait_connected()
            first = publisher.incarnation
            # Another stream speaks for w1 under a later incarnation (an agent restarted
            # beside the engine): this one's next batch is refused and its stream ended.
            later = worker("w1", incarnation=first + 1, base_url=ENGINE_URL)
            other = AgentStream(channel)
            assert (await other.request(register_message(later))).WhichOneof("body") == "ack"
            caplog.clear()
            for step in range(3):  # the first batch defers its Ack: nothing reads the Reject
                publisher.submit(translator.translate([_stored(step)]))
                await asyncio.sleep(0.2)
            await wait_until("a new incarnation", lambda: publisher.incarnation != first)
        finally:
            await cancel_task(task)
    # One end of the stream, named for the refusal; without the Reject read, gRPC's bare
    # INTERNAL, then a second end when Register under the same incarnation was refused.
    ends = [message for message in caplog.messages if "control plane stream" in message]
    assert len(ends) == 1, ends
    assert "REJECT_CODE_STALE_INCARNATION" in ends[0]
