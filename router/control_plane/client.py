"""The agent's side of a Connect stream, kept minimal: build the wire messages from
domain objects and exchange them over a typed stream. The tests speak to the control
plane through it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import grpc.aio

from kvplane.keys import SCHEME_VERSION
from kvplane.v1 import control_plane_pb2 as pb
from router.control_plane.service import CONNECT_METHOD
from router.index.base import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    Tier,
    WorkerInfo,
)

Call = grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControlMessage]

_WIRE_TIERS: dict[Tier, pb.Tier] = {
    Tier.DEVICE: pb.TIER_DEVICE,
    Tier.HOST: pb.TIER_HOST,
    Tier.DISK: pb.TIER_DISK,
    Tier.REMOTE: pb.TIER_REMOTE,
}


class StreamClosed(Exception):
    """The control plane ended the stream where a reply was expected."""


class AgentStream:
    """One open Connect call. Replies come in the order of the messages they answer."""

    def __init__(self, channel: grpc.aio.Channel, *, token: str | None = None) -> None:
        # The same method as the generated ControlPlaneStub, but typed (the generated
        # _grpc module has no type hints).
        connect: grpc.aio.StreamStreamMultiCallable[pb.AgentMessage, pb.ControlMessage]
        connect = channel.stream_stream(
            CONNECT_METHOD,
            request_serializer=pb.AgentMessage.SerializeToString,
            response_deserializer=pb.ControlMessage.FromString,
        )
        metadata = None if token is None else (("authorization", f"Bearer {token}"),)
        self.call: Call = connect(metadata=metadata)

    async def send(self, message: pb.AgentMessage) -> None:
        await self.call.write(message)

    async def reply(self) -> pb.ControlMessage:
        message = await self.call.read()
        if not isinstance(message, pb.ControlMessage):
            raise StreamClosed(f"stream ended: {await self.call.code()}")
        return message

    async def request(self, message: pb.AgentMessage) -> pb.ControlMessage:
        await self.send(message)
        return await self.reply()

    async def close(self) -> None:
        """Half-close (the agent is done) and wait for the control plane to end the call."""
        await self.call.done_writing()
        await self.call.code()


def register_message(info: WorkerInfo, key_scheme_version: int = SCHEME_VERSION) -> pb.AgentMessage:
    return pb.AgentMessage(
        register=pb.Register(
            worker_id=info.worker_id,
            incarnation=info.incarnation,
            base_url=info.base_url,
            model=info.model,
            block_size=info.block_size,
            key_scheme_version=key_scheme_version,
            kv_capacity_blocks=info.kv_capacity_blocks,
            engine_kind=info.engine_kind,
            engine_version=info.engine_version,
            labels=dict(info.labels),
        )
    )


def event_to_wire(event: KvEvent) -> pb.KvEvent:
    if isinstance(event, BlocksStored):
        return pb.KvEvent(
            stored=pb.BlocksStored(
                parent_key=event.parent_key,
                keys=event.keys,
                first_position=event.first_position,
                tier=_WIRE_TIERS[event.tier],
            )
        )
    if isinstance(event, BlocksRemoved):
        return pb.KvEvent(removed=pb.BlocksRemoved(keys=event.keys, tier=_WIRE_TIERS[event.tier]))
    assert isinstance(event, AllBlocksCleared)
    return pb.KvEvent(cleared=pb.AllBlocksCleared())


def events_message(sequence: int, events: Iterable[KvEvent]) -> pb.AgentMessage:
    return pb.AgentMessage(
        kv_events=pb.KvEvents(
            sequence=sequence,
            events=[event_to_wire(e) for e in events],
            timestamp_ms=time.time_ns() // 1_000_000,
        )
    )


def load_message(
    running: int, waiting: int, kv_usage: float, *, engine_down: bool = False
) -> pb.AgentMessage:
    return pb.AgentMessage(
        load=pb.Load(
            running=running,
            waiting=waiting,
            kv_usage=kv_usage,
            timestamp_ms=time.time_ns() // 1_000_000,
            engine_down=engine_down,
        )
    )


def drain_message() -> pb.AgentMessage:
    return pb.AgentMessage(drain=pb.Drain())
