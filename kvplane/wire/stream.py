"""The agent's side of a Connect stream: typed messages over one gRPC call. The
worker agent streams through it in production; the tests speak to the control plane
through it too."""

from __future__ import annotations

import asyncio
import contextlib

import grpc.aio

from kvplane.wire.v1 import control_plane_pb2 as pb

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["ControlPlane"].full_name
CONNECT_METHOD = f"/{SERVICE_NAME}/Connect"

Call = grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControlMessage]


class StreamClosed(Exception):
    """The control plane ended the stream where a reply was expected."""


class AgentStream:
    """One open Connect call. Replies come in the order of the messages they answer.

    Replies are read as they come, from the call's start, whether or not
    anything waits for one: the control plane ends a stream by writing a Reject and
    closing the call, and a write after that fails with gRPC's bare INTERNAL, the Reject
    and its reason lost with the call, unless it was already read (`unread_reject`)."""

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
        self._replies: asyncio.Queue[pb.ControlMessage | None] = asyncio.Queue()
        self._read_error: BaseException | None = None  # what ended the reading, if not EOF
        self._reader = asyncio.ensure_future(self._read_replies())

    async def send(self, message: pb.AgentMessage) -> None:
        await self.call.write(message)

    async def reply(self) -> pb.ControlMessage:
        message = await self._replies.get()
        if message is None:
            self._replies.put_nowait(None)  # the end, for whoever reads next
            if self._read_error is not None:
                raise self._read_error
            raise StreamClosed(f"stream ended: {await self.call.code()}")
        return message

    async def request(self, message: pb.AgentMessage) -> pb.ControlMessage:
        await self.send(message)
        return await self.reply()

    async def unread_reject(self, wait_s: float) -> pb.Reject | None:
        """The Reject among the replies nobody has read, waiting up to `wait_s` for the
        stream to end (an ended call ends its reading at once); None if there is none."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await asyncio.shield(self._reader)
        while not self._replies.empty():
            message = self._replies.get_nowait()
            if message is not None and message.WhichOneof("body") == "reject":
                return message.reject
        return None

    async def close(self) -> None:
        """Half-close (the agent is done) and wait for the control plane to end the call."""
        await self.call.done_writing()
        await self.call.code()
        await self._reader

    async def _read_replies(self) -> None:
        try:
            while isinstance(message := await self.call.read(), pb.ControlMessage):
                self._replies.put_nowait(message)
        except asyncio.CancelledError:  # the call's (this task is the stream's own)
            self._read_error = StreamClosed("the stream was cancelled")
        except Exception as error:  # grpc raises several kinds: each goes to the reader
            self._read_error = error
        finally:
            self._replies.put_nowait(None)
