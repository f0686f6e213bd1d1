"""Sending a request to one engine and waiting for the first byte of its answer.

An attempt fails, and the caller may try another worker, when the engine refuses the
connection, times out connecting or before its first byte, answers 5xx, or breaks the
connection before the first byte. Once an attempt succeeds its bytes belong to the
client: the rest of the stream is passed on as it arrives and never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx2

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
    """This worker did not answer; `refused` when it could not even be connected to."""

    def __init__(self, reason: str, *, refused: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused


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
    _response: httpx2.Response
    _chunks: AsyncIterator[bytes]

    async def rest(self) -> AsyncIterator[bytes]:
        """The chunks after the first, as they arrive. Raises UpstreamBroken when the
        connection breaks or the engine is silent for longer than the idle timeout."""
        while True:
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    chunk = await anext(self._chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise UpstreamBroken("silent past the idle timeout") from None
            except httpx2.HTTPError as error:
                raise UpstreamBroken(type(error).__name__) from None
            yield chunk

    async def close(self) -> None:
        """Closing early drops the connection, which cancels the request in the engine."""
        await self._response.aclose()


class Upstream:
    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.client = httpx2.AsyncClient(
            # Reads are timed here, not by httpx: the first byte may take as long as
            # first_byte_timeout_s (queueing, prefill, a whole non-streamed answer),
            # each later chunk idle_timeout_s.
            timeout=httpx2.Timeout(
                connect=settings.connect_timeout_s,
                read=None,
                write=settings.idle_timeout_s,
                pool=settings.connect_timeout_s,
            ),
            limits=httpx2.Limits(
                max_connections=settings.max_connections,
                max_keepalive_connections=settings.max_connections,
            ),
            follow_redirects=False,
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def send(
        self, url: str, body: bytes, headers: dict[str, str], first_byte_timeout_s: float
    ) -> UpstreamAnswer:
        """POST `body` and return once the first byte of the answer is in."""
        request = self.client.build_request("POST", url, content=body, headers=headers)
        response: httpx2.Response | None = None
        try:
            async with asyncio.timeout(first_byte_timeout_s):
                response = await self.client.send(request, stream=True)
                if response.status_code >= 500:
                    raise AttemptFailed(f"the engine answered {response.status_code}")
                chunks = response.aiter_raw()
                first = b""
                with contextlib.suppress(StopAsyncIteration):
                    first = await anext(chunks)
        except AttemptFailed:
            await _close(response)
            raise
        except TimeoutError:
            await _close(response)
            raise AttemptFailed("no first byte within the timeout") from None
        except httpx2.PoolTimeout:
            await _close(response)
            raise NoFreeConnection from None
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as error:
            await _close(response)
            raise AttemptFailed(f"cannot connect ({type(error).__name__})", refused=True) from None
        except httpx2.HTTPError as error:
            await _close(response)
            raise AttemptFailed(f"broken before the first byte ({type(error).__name__})") from None
        except BaseException:  # the client went away: drop the engine's request too
            await _close(response)
            raise
        return UpstreamAnswer(
            status=response.status_code,
            headers=[
                (name, value)
                for name, value in response.headers.items()
                if name.lower() not in _NOT_FORWARDED
            ],
            first_chunk=first,
            idle_timeout_s=self.settings.idle_timeout_s,
            _response=response,
            _chunks=chunks,
        )


async def _close(response: httpx2.Response | None) -> None:
    if response is not None:
        await response.aclose()
