"""Process plumbing shared by kvplane's servers (router, engine simulator).

Each runs uvicorn beside other servers (gRPC, ZMQ) in one event loop that it owns, stops
them all together on SIGINT or SIGTERM, and needs the port uvicorn bound when asked for 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import signal
import socket
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
import uvloop
from starlette.types import ASGIApp


class _EmbeddedServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stopping = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The caller owns SIGINT and SIGTERM and stops all its servers together; uvicorn's
        # own handlers would replace them and re-raise the signal on the way out.
        yield

    async def main_loop(self) -> None:
        # uvicorn's own wakes ten times a second to see whether it should stop, about
        # 2 ms of CPU a second at rest; this one wakes each second, to refresh the Date
        # header (tick 0 of uvicorn's ten), or when stop() is called.
        while not await self.on_tick(0):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._stopping.wait()

    def stop(self) -> None:
        self.should_exit = True
        self._stopping.set()


_T = TypeVar("_T")


def run_service(main: Coroutine[Any, Any, _T]) -> _T:
    """Run a server process's main coroutine on uvloop: its event loop spends about
    half of asyncio's CPU per request, which is most of a proxy's cost. (uvicorn then
    parses HTTP with httptools, also a dependency.)"""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def freeze_startup_heap() -> None:
    """Put every object alive once a server has started (its modules, app, tokenizers)
    out of the garbage collector's reach for good. Full collections walk every tracked
    object, and a router's start-up heap made them about 6% of its CPU under load; what
    start-up built lives as long as the process anyway."""
    gc.collect()
    gc.freeze()


def bind_http(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; a port in use, or an address this machine does
    not have, is an OSError that names them.

    Bound here rather than by uvicorn: uvicorn would call sys.exit(), and port 0 tells
    us the port it picked. A server binds before its slower start-up work, so that a
    port in use fails the start at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol must be named: asyncio sets TCP_NODELAY on accepted connections only
    # when the listening socket says IPPROTO_TCP (socket.create_server leaves it 0), and
    # without it Nagle's algorithm meets delayed ACKs and a keep-alive response whose
    # headers and body are written apart waits 40 ms.
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
    except OSError as error:
        listener.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return listener


@contextlib.asynccontextmanager
async def serving_http(
    *servers: tuple[ASGIApp, socket.socket], stop_grace_s: float = 2
) -> AsyncIterator[list[int]]:
    """Serve each app on its socket from bind_http() until the block exits; yields
    their ports.

    On the way out every server stops accepting at once, closes idle connections and
    lets the requests in progress (streams included) finish within `stop_grace_s`,
    then cuts what is left: the servers drain together, not one after the other."""
    with contextlib.ExitStack() as sockets:
        for _, listener in servers:
            sockets.enter_context(contextlib.closing(listener))
        running = [
            _EmbeddedServer(
                uvicorn.Config(
                    app,
                    lifespan="off",
                    log_config=None,
                    access_log=False,
                    # Nothing here reads a client's address: no middleware rewriting it
                    # from X-Forwarded-For on every request.
                    proxy_headers=False,
                    # uvicorn's annotation says int; it waits with asyncio.wait_for.
                    timeout_graceful_shutdown=stop_grace_s,  # type: ignore[arg-type]
                )
            )
            for app, _ in servers
        ]
        tasks = [
            asyncio.create_task(server.serve(sockets=[listener]))
            for server, (_, listener) in zip(running, servers, strict=True)
        ]
        try:
            while not all(server.started for server in running):
                for task in tasks:
                    if task.done():
                        task.result()  # raises what stopped it
                        raise RuntimeError("an HTTP server stopped while starting")
                await asyncio.sleep(0.01)
            yield [listener.getsockname()[1] for _, listener in servers]
        finally:
            for server in running:
                server.stop()
            await asyncio.gather(*tasks)


_EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for a server that must be told its port.

    Picked at random below the kernel's ephemeral range where it can be: a port from
    that range (what binding port 0 gives) may become the source port of any outgoing
    connection on the machine before the server binds it, and a fleet started for a
    test makes hundreds. Never the same port twice in one process."""
    try:
        first_ephemeral = int(_EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768  # Linux's default
    candidates = range(max(1024, first_ephemeral - 16384), first_ephemeral)
    for _ in range(64):
        port = random.choice(candidates)
        if port in _handed_out:
            continue
        try:
            with contextlib.closing(socket.create_server((host, port))):
                pass
        except OSError:  # in use
            continue
        _handed_out.add(port)
        return port
    with contextlib.closing(socket.create_server((host, 0))) as probe:
        port = int(probe.getsockname()[1])
        _handed_out.add(port)
        return port


async def cancel_task(task: asyncio.Task[None]) -> None:
    """Cancel a background task and wait until it has finished."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def wait_for_stop_signal() -> None:
    """Return on the first SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
