"""A TCP relay between an agent and a router that a scenario can partition.

Modes, switchable at any time:
- `PASS`: bytes flow both ways.
- `DELAY`: every chunk waits `delay_s` before it is forwarded (order kept).
- `BLACKHOLE`: bytes stop flowing, connections stay open and new ones are accepted but
  not forwarded; TCP holds what was sent, so when the partition heals the bytes arrive
  late, as on a real network whose packets were dropped and retransmitted.
- `DROP`: every connection is reset, and new ones are reset as soon as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging

log = logging.getLogger(__name__)

_CHUNK = 64 * 1024


class Mode(enum.Enum):
    PASS = "pass"
    DELAY = "delay"
    BLACKHOLE = "blackhole"
    DROP = "drop"


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.mode = Mode.PASS
        self.delay_s = 0.0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_mode(self, mode: Mode, delay_s: float = 0.0) -> None:
        self.mode, self.delay_s = mode, delay_s
        if mode is Mode.BLACKHOLE:
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode is Mode.DROP:
            for writer in list(self._writers):
                writer.transport.abort()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.set_mode(Mode.DROP)  # resets every connection: each relay ends on its own
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            if self.mode is Mode.DROP:
                return
            await self._flowing.wait()  # a blackholed connection reaches nobody until healed
            if self._dropping():  # the mode may have changed while it waited
                return
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
            self._writers.add(upstream_writer)
            await asyncio.gather(
                self._pump(reader, upstream_writer), self._pump(upstream_reader, writer)
            )
        except (OSError, asyncio.IncompleteReadError):
            pass  # either side went away: both are closed below
        finally:
            for side in (writer, upstream_writer):
                if side is not None:
                    self._writers.discard(side)
                    side.transport.abort()
            self._tasks.discard(task)

    def _dropping(self) -> bool:
        return self.mode is Mode.DROP

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await self._flowing.wait()
            data = await reader.read(_CHUNK)
            if not data:
                break
            if self.mode is Mode.DELAY and self.delay_s > 0:
                await asyncio.sleep(self.delay_s)
            await self._flowing.wait()
            if self._dropping():
                break
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()
