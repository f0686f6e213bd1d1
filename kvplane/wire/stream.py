"""The agent's side of a Connect stream: typed messages over one gRPC call. The
worker agent streams through it in production; the tests speak to the control plane
through it too."""

from __future__ import annotations

import grpc.aio

from kvplane.wire.v1 import control_plane_pb2 as pb

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["ControlPlane"].full_name
CONNECT_METHOD = f"/{SERVICE_NAME}/Connect"

Call = grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControlMessage]


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
