"""A streamed answer's `finish` runs however the response ends, the case a generator's
own `finally` cannot cover included: a client gone before the stream started; and a
client gone mid-stream stops the engine's answer, whichever ASGI version the server
speaks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from router.proxy.service import RelayResponse

HTTP_24: dict[str, Any] = {"type": "http", "asgi": {"spec_version": "2.4"}}
HTTP_23: dict[str, Any] = {"type": "http", "asgi": {"spec_version": "2.3"}}


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

    def response(self) -> RelayResponse:
        return RelayResponse(self.body(), finish=self.finish, client_left=self.stop)

    async def stop(self) -> None:
        raise AssertionError("the client did not leave")

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


async def test_finish_runs_when_the_client_left_before_the_stream_started() -> None:
    stream = Stream()

    async def gone(message: dict[str, Any]) -> None:
        raise OSError("the client disconnected")  # what an ASGI 2.4 server's send does

    with pytest.raises(ClientDisconnect):
        await stream.response()(HTTP_24, _never, gone)
    assert not stream.started  # so the generator's own finally never ran
    assert stream.finished == 1


async def test_finish_runs_once_after_a_whole_stream() -> None:
    stream = Stream()
    await stream.response()(HTTP_24, _never, stream.send)
    assert stream.started
    assert [m.get("body") for m in stream.sent[1:]] == [b"data: 1\n\n", b""]
    assert stream.finished == 1


async def test_a_client_gone_mid_stream_stops_the_engines_answer_under_asgi_23() -> None:
    # A 2.3 server's send drops what it is given once the client is gone; only receive
    # says so. Here the engine's answer would go on for ever unless it is stopped.
    engine_stopped = asyncio.Event()
    finished: list[str] = []

    async def endless() -> AsyncIterator[bytes]:
        while not engine_stopped.is_set():
            yield b"data: token\n\n"
            await asyncio.sleep(0.01)

    async def stop_engine() -> None:
        engine_stopped.set()

    async def finish() -> None:
        finished.append("finish")

    messages = iter([{"type": "http.request", "body": b"", "more_body": False}])

    async def receive() -> dict[str, Any]:
        message = next(messages, None)
        if message is not None:
            return message
        await asyncio.sleep(0.05)  # the client leaves a few chunks into the answer
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    response = RelayResponse(endless(), finish=finish, client_left=stop_engine)
    await asyncio.wait_for(response(HTTP_23, receive, send), timeout=5)
    assert engine_stopped.is_set()
    assert finished == ["finish"]
    assert sent[0]["type"] == "http.response.start"
    assert len(sent) > 2  # chunks went out before the client left


async def _never() -> dict[str, Any]:
    raise AssertionError("a 2.4 server does not need receive to stream")
