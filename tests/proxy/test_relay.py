"""A streamed answer's `finish` runs however the response ends, the case a generator's
own `finally` cannot cover included: a client gone before the stream started."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from router.proxy.service import RelayResponse

HTTP_24: dict[str, Any] = {"type": "http", "asgi": {"spec_version": "2.4"}}


class Stream:
    def __init__(self) -> None:
        self.started = False
        self.finished = 0
        self.sent: list[dict[str, Any]] = []

    async def body(self) -> AsyncIterator[bytes]:
        self.started = True
        yield b"data: 1\n\n"

    async def finish(self) -> None:
        self.finished += 1

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


async def test_finish_runs_when_the_client_left_before_the_stream_started() -> None:
    stream = Stream()

    async def gone(message: dict[str, Any]) -> None:
        raise OSError("the client disconnected")  # what an ASGI 2.4 server's send does

    with pytest.raises(ClientDisconnect):
        await RelayResponse(stream.body(), finish=stream.finish)(HTTP_24, _never, gone)
    assert not stream.started  # so the generator's own finally never ran
    assert stream.finished == 1


async def test_finish_runs_once_after_a_whole_stream() -> None:
    stream = Stream()
    await RelayResponse(stream.body(), finish=stream.finish)(HTTP_24, _never, stream.send)
    assert stream.started
    assert [m.get("body") for m in stream.sent[1:]] == [b"data: 1\n\n", b""]
    assert stream.finished == 1


async def _never() -> dict[str, Any]:
    raise AssertionError("a 2.4 server does not need receive to stream")
