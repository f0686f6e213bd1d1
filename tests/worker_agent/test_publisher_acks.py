"""The publisher asks for an Ack once every agent.ack_every_batches batches, or a load
interval after its last batch; what a broken stream lost goes again on the next; a
control plane that does not say it defers Acks is asked for every one. A real router,
real gRPC, and a real TCP proxy to break the stream; the agent's stream is recorded,
not replaced."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

import router.control_plane.service as control_plane_service
import worker_agent.publisher as publisher_module
from chaos.tcp_proxy import Mode, TcpProxy
from kvplane.core.config import AgentSettings, ControlPlaneSettings
from kvplane.core.keys import block_keys
from kvplane.core.serving import cancel_task
from kvplane.core.types import KvEvent, Tier
from kvplane.wire.stream import AgentStream
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.app import RunningRouter, running_router
from tests.router.conftest import BLOCK_SIZE, MODEL, NAMESPACE, make_settings
from tests.waiting import wait_until
from worker_agent.events import EngineBlockHash, EngineBlocksStored, EngineLoad
from worker_agent.publisher import ControlPlanePublisher, WorkerIdentity
from worker_agent.translate import BlockTranslator


@dataclass
class Wire:
    """What the agent's streams carried: its batches as sent, the replies it read."""

    batches: list[pb.KvEvents] = field(default_factory=list)
    replies: list[pb.ControlMessage] = field(default_factory=list)


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    seen = Wire()

    class RecordedStream(AgentStream):
        async def send(self, message: pb.AgentMessage) -> None:
            if message.HasField("kv_events"):
                seen.batches.append(message.kv_events)
            await super().send(message)

        async def reply(self) -> pb.ControlMessage:
            message = await super().reply()
            seen.replies.append(message)
            return message

    monkeypatch.setattr(publisher_module, "AgentStream", RecordedStream)
    return seen


class Chain:
    """One chain of engine blocks, stored a block a step."""

    def __init__(self) -> None:
        self.translator = BlockTranslator(MODEL, BLOCK_SIZE, max_tracked_blocks=1000)
        self.steps = 0

    def step(self) -> list[KvEvent]:
        self.steps += 1
        parent = None if self.steps == 1 else EngineBlockHash(self.steps - 1)
        tokens = tuple(self._tokens()[-BLOCK_SIZE:])
        stored = EngineBlocksStored(
            (EngineBlockHash(self.steps),), parent, tokens, BLOCK_SIZE, Tier.DEVICE, None, None
        )
        return self.translator.translate([stored])

    def _tokens(self) -> list[int]:
        return list(range(self.steps * BLOCK_SIZE))

    async def blocks_cached(self, router: RunningRouter) -> int:
        matches = await router.index.lookup(block_keys(self._tokens(), NAMESPACE))
        return matches["w1"].blocks if "w1" in matches else 0


def _publisher(address: str, chain: Chain, **agent: float) -> ControlPlanePublisher:
    return ControlPlanePublisher(
        WorkerIdentity("w1", "http://127.0.0.1:1", MODEL, BLOCK_SIZE, 0, "vllm", "", {}),
        AgentSettings(control_plane_address=address, **agent),  # type: ignore[arg-type]
        ControlPlaneSettings(block_size=BLOCK_SIZE),
        snapshot=chain.translator.snapshot,
    )


@contextlib.asynccontextmanager
async def _running(publisher: ControlPlanePublisher) -> AsyncIterator[None]:
    task = asyncio.create_task(publisher.run())
    try:
        await publisher.wait_connected()
        yield
    finally:
        await cancel_task(task)


async def _steps(publisher: ControlPlanePublisher, chain: Chain, wire: Wire, count: int) -> None:
    """`count` steps, each sent alone as a batch before the next is submitted."""
    for _ in range(count):
        publisher.submit(chain.step())
        await wait_until("the step's batch sent", functools.partial(_sent, wire, chain.steps))


def _sent(wire: Wire, batches: int) -> bool:
    return len(wire.batches) >= batches


def _applied(router: RunningRouter) -> int:
    record = router.workers.get("w1")
    return 0 if record is None else record.applied


def _batches_applied(router: RunningRouter) -> float:
    return router.metrics.registry.get_sample_value("kvplane_batches_applied_total") or 0.0


async def test_only_every_nth_batch_waits_for_its_ack(wire: Wire) -> None:
    chain = Chain()
    async with running_router(make_settings()) as router:
        publisher = _publisher(f"127.0.0.1:{router.grpc_port}", chain, ack_every_batches=4)
        async with _running(publisher):
            await _steps(publisher, chain, wire, 8)
            await publisher.wait_flushed()
            assert await chain.blocks_cached(router) == 8

    assert [batch.ack_deferred for batch in wire.batches] == [True, True, True, False] * 2
    # The Register's Ack, then those of batches 4 and 8, each covering the three before.
    assert [reply.ack.sequence for reply in wire.replies] == [0, 4, 8]


async def test_a_quiet_agent_asks_for_the_acks_it_deferred(wire: Wire) -> None:
    chain = Chain()
    async with running_router(make_settings()) as router:
        publisher = _publisher(f"127.0.0.1:{router.grpc_port}", chain, load_interval_s=0.2)
        async with _running(publisher):
            await _steps(publisher, chain, wire, 3)
            # Nobody waits for the flush: the quiet load interval alone asks.
            await wait_until("the deferred Acks asked for", lambda: len(wire.replies) == 2)
            assert wire.replies[-1].ack.sequence == 4
            assert _applied(router) == 4
            assert _batches_applied(router) == 3  # the fourth carried nothing to apply

    assert [batch.ack_deferred for batch in wire.batches] == [True, True, True, False]
    assert not wire.batches[-1].events


async def test_a_flush_does_not_wait_for_a_heartbeat_due_first(wire: Wire) -> None:
    """A short lease and a long load interval: the lease's heartbeat comes due before
    the deferred Acks' own time, and a flush asked for meanwhile goes at once."""
    chain = Chain()
    async with running_router(make_settings(lease_s=0.9)) as router:
        publisher = _publisher(f"127.0.0.1:{router.grpc_port}", chain, load_interval_s=5.0)
        async with _running(publisher):
            publisher.report_load(EngineLoad(0, 0, 0.0))  # the heartbeat's load, 0.6 s on
            await _steps(publisher, chain, wire, 1)
            async with asyncio.timeout(2):  # well before the load interval's 5 s
                await publisher.wait_flushed()
            assert await chain.blocks_cached(router) == 1


async def test_a_control_plane_that_does_not_defer_acks_is_asked_for_each(
    wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A router older than Ack.defers_acks, which cannot run here: its Register Ack.
    monkeypatch.setattr(
        control_plane_service,
        "_register_ack",
        lambda applied, lease_s, limits: pb.ControlMessage(ack=pb.Ack(sequence=applied)),
    )
    chain = Chain()
    async with running_router(make_settings()) as router:
        publisher = _publisher(f"127.0.0.1:{router.grpc_port}", chain)
        async with _running(publisher):
            await _steps(publisher, chain, wire, 3)
            await publisher.wait_flushed()
            assert await chain.blocks_cached(router) == 3

    assert [batch.ack_deferred for batch in wire.batches] == [False, False, False]
    assert [reply.ack.sequence for reply in wire.replies] == [0, 1, 2, 3]


async def test_batches_a_broken_stream_lost_go_again_on_the_next(wire: Wire) -> None:
    chain = Chain()
    async with running_router(make_settings()) as router:
        proxy = TcpProxy("127.0.0.1", router.grpc_port)
        await proxy.start()
        try:
            publisher = _publisher(proxy.address, chain)
            async with _running(publisher):
                await _steps(publisher, chain, wire, 1)
                await wait_until("batch 1 applied", lambda: _applied(router) == 1)
                proxy.set_mode(Mode.BLACKHOLE)
                await _steps(publisher, chain, wire, 2)  # held by the proxy, then lost
                proxy.set_mode(Mode.DROP)
                proxy.set_mode(Mode.PASS)

                await publisher.wait_flushed()

                assert publisher.incarnations_started == 1  # resumed, not started over
                assert await chain.blocks_cached(router) == 3
                assert _batches_applied(router) == 3
        finally:
            await proxy.close()

    # Waiting for the flush found the stream broken (the empty batch 4 went nowhere);
    # the next stream resumed after batch 1 and sent 2 to 4 again.
    assert [batch.sequence for batch in wire.batches] == [1, 2, 3, 4, 2, 3, 4]
    assert [reply.ack.sequence for reply in wire.replies] == [0, 1, 4]
