"""Sending a request to one engine and waiting for the first byte of its answer.

An attempt fails, and the caller may try another worker, when the engine refuses the
connection, times out connecting or before its first byte, answers 5xx, or breaks the
connection before the first byte. Once an attempt succeeds its bytes belong to the
client: the rest of the stream is passed on as it arrives and never retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from kvplane.core.config import ProxySettings

# Headers that describe one hop, or that the router sets itself.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "date",
        "server",
    }
)


class AttemptFailed(Exception):
    """This worker did not answer; `refused` when it could not even be connected to;
    `status`: the error status it answered with instead, if it did."""

    def __init__(self, reason: str, *, refused: bool = False, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused
        self.status = status


class UpstreamBroken(Exception):
    """The engine broke its answer after the first byte, or went silent past the idle
    timeout: bytes may have reached the client already, so there is no retry."""


class NoFreeConnection(Exception):
    """The router's own connection pool is full: no worker is to blame, and no other
    worker would fare better."""


@dataclass(slots=True)
class UpstreamAnswer:
    status: int
    headers: list[tuple[str, str]]
    first_chunk: bytes
    idle_timeout_s: float
    _response: aiohttp.ClientResponse
    _slot: asyncio.Semaphore
    _closed: bool = False
    _watchdog: _IdleWatchdog | None = None  # set by the first read that must wait

    async def next_chunk(self) -> bytes:
        """The next chunk after the first as it arrives; b"" once the answer has ended.
        Raises UpstreamBroken when the connection breaks or the engine is silent for
        longer than the idle timeout. (A streamed answer is relayed a chunk per call:
        an async generator around this would cost every chunk another frame to resume.)"""
        content = self._response.content
        watchdog = self._watchdog
        if watchdog is None:
            if content.at_eof():  # all of it came at once: no timer to set
                return b""
            watchdog = self._watchdog = _IdleWatchdog(self.idle_timeout_s, self._response.close)
        watchdog.reading()
        try:
            chunk = await content.readany()
        except aiohttp.ClientError as error:
            if watchdog.fired:
                raise UpstreamBroken("silent past the idle timeout") from None
            raise UpstreamBroken(type(error).__name__) from None
        watchdog.read()
        if not chunk:
            watchdog.stop()
            if watchdog.fired:
                raise UpstreamBroken("silent past the idle timeout")
        return chunk

    async def rest(self) -> AsyncIterator[bytes]:
        """The chunks after the first, as next_chunk() reads them."""
        while chunk := await self.next_chunk():
            yield chunk

    async def close(self) -> None:
        """A connection whose answer was read to the end goes back to the pool; closing
        earlier drops it, which cancels the request in the engine."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()
        self._slot.release()


class _IdleWatchdog:
    """Closes the engine's connection once a read has waited `idle_s`. One timer a
    stream, moved on lazily, where a timeout around each read would set and cancel a
    timer a chunk; time the relay spends sending to the client is not counted."""

    def __init__(self, idle_s: float, close: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle_s = idle_s
        self._close = close
        self._reading_since: float | None = None
        self.fired = False
        self._timer = self._loop.call_later(idle_s, self._check)

    def reading(self) -> None:
        self._reading_since = self._loop.time()

    def read(self) -> None:
        self._reading_since = None

    def stop(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        since = self._reading_since
        now = self._loop.time()
        if since is not None and now - since >= self._idle_s:
            self.fired = True
            self._close()
            return
        due = self._idle_s if since is None else since + self._idle_s - now
        self._timer = self._loop.call_later(due, self._check)


class Upstream:
    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        # The pool's size is kept here, not by aiohttp, which would wait for a free
        # connection as it waits for a slow connect: a full pool is the router's own
        # limit (no other worker would fare better), a slow connect is the worker's.
        self._slots = asyncio.Semaphore(settings.max_connections)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=settings.max_connections, limit_per_host=0),
            # Reads are timed here, not by aiohttp: the first byte may take as long as
            # first_byte_timeout_s (queueing, prefill, a whole non-streamed answer),
            # each later chunk idle_timeout_s.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s),
            auto_decompress=False,  # the engine's bytes go to the client as they are
            # One session carries every tenant's requests: a cookie an engine (or a proxy
            # before it) sets must reach the client that got that answer, never go back
            # with other clients' requests.
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        await self.session.close()

    async def send(
        self, url: str, body: bytes, headers: dict[str, str], first_byte_timeout_s: float
    ) -> UpstreamAnswer:
        """POST `body` and return once the first byte of the answer is in."""
        if self._slots.locked():  # a free slot is taken at once: no timer to set up
            try:
                async with asyncio.timeout(self.settings.connect_timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise NoFreeConnection from None
        else:
            await self._slots.acquire()
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(first_byte_timeout_s):
                response = await self.session.post(
                    url, data=body, headers=headers, allow_redirects=False
                )
                if response.status >= 500:
                    raise AttemptFailed(
                        f"the engine answered {response.status}", status=response.status
                    )
                first = await response.content.readany()
        except AttemptFailed:
            _drop(response, self._slots)
            raise
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as error:
            _drop(response, self._slots)
            raise AttemptFailed(f"cannot connect ({type(error).__name__})", refused=True) from None
        except TimeoutError:
            _drop(response, self._slots)
            raise AttemptFailed("no first byte within the timeout") from None
        except aiohttp.ClientError as error:
            _drop(response, self._slots)
            raise AttemptFailed(f"broken before the first byte ({type(error).__name__})") from None
        except BaseException:  # the client went away: drop the engine's request too
            _drop(response, self._slots)
            raise
        return UpstreamAnswer(
            status=response.status,
            headers=[
                (name, value)
                for name, value in response.headers.items()
                if name.lower() not in _NOT_FORWARDED
            ],
            first_chunk=first,
            idle_timeout_s=self.settings.idle_timeout_s,
            _response=response,
            _slot=self._slots,
        )


def _drop(response: aiohttp.ClientResponse | None, slots: asyncio.Semaphore) -> None:
    if response is not None:
        response.close()
    slots.release()
