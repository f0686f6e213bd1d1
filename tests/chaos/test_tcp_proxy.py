"""The partitioning TCP proxy over real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from chaos.tcp_proxy import Mode, TcpProxy


@contextlib.asynccontextmanager
async def echo_behind_proxy() -> AsyncIterator[TcpProxy]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    proxy = TcpProxy("127.0.0.1", server.sockets[0].getsockname()[1])
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()


async def roundtrip(proxy: TcpProxy, payload: bytes, timeout_s: float = 2.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), timeout_s)
    finally:
        writer.close()


async def test_pass_and_delay_forward_every_byte_in_order() -> None:
    async with echo_behind_proxy() as proxy:
        assert await roundtrip(proxy, b"hello") == b"hello"
        proxy.set_mode(Mode.DELAY, delay_s=0.05)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await roundtrip(proxy, b"x" * 100_000) == b"x" * 100_000
        assert loop.time() - started >= 0.1  # at least one delay each way


async def test_a_blackhole_holds_bytes_until_it_heals() -> None:
    async with echo_behind_proxy() as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        proxy.set_mode(Mode.BLACKHOLE)
        writer.write(b"held")
        await writer.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), 0.3)
        proxy.set_mode(Mode.PASS)
        assert await asyncio.wait_for(reader.readexactly(4), 2) == b"held"
        writer.close()


async def test_drop_resets_open_connections_and_refuses_new_ones() -> None:
    async with echo_behind_proxy() as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"a")
        assert await reader.readexactly(1) == b"a"
        proxy.set_mode(Mode.DROP)
        assert await asyncio.wait_for(reader.read(10), 2) == b""  # reset: nothing more
        writer.close()
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await roundtrip(proxy, b"refused")
        proxy.set_mode(Mode.PASS)
        assert await roundtrip(proxy, b"healed") == b"healed"
