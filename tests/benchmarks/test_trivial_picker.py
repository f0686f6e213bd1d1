"""The bake-off's trivial picker answers as kvplane's does, in both body modes."""

from __future__ import annotations

import grpc.aio
import pytest

from benchmarks.trivial_picker import started
from tests.picker.ext_proc import (
    BUFFERED,
    FULL_DUPLEX,
    Exchange,
    body_messages,
    destination,
    headers_message,
    streamed_back,
)

ENDPOINTS = ["127.0.0.1:8001", "127.0.0.1:8002"]


@pytest.mark.parametrize("mode", [FULL_DUPLEX, BUFFERED])
async def test_it_names_the_endpoints_in_turn_and_sends_the_body_on(mode: int) -> None:
    server, port = await started(0, ENDPOINTS)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            named = []
            for _ in range(4):
                exchange = Exchange(channel)
                await exchange.send(headers_message(mode=mode), *body_messages(b'{"a": 1}'))
                if mode == BUFFERED:
                    await exchange.receive()  # the headers, unchanged
                    answer = await exchange.receive()
                    named += destination(answer, "request_body")
                    assert answer.request_body.response.body_mutation.body == b'{"a": 1}'
                else:
                    named += destination(await exchange.receive())
                    assert await streamed_back(exchange) == b'{"a": 1}'
            assert named == ENDPOINTS * 2
    finally:
        await server.stop(None)
