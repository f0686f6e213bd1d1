"""The HTTP servers' own loop: it wakes once a second (not uvicorn's ten times), and
the Date header it stamps must still move on each second."""

from __future__ import annotations

import asyncio
from email.utils import parsedate_to_datetime

import httpx
from starlette.types import Receive, Scope, Send

from kvplane.core.serving import bind_http, serving_http


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_the_date_header_moves_on_while_the_server_waits_a_second_at_a_time() -> None:
    async with (
        serving_http((_ok, bind_http("127.0.0.1", 0))) as (port,),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        first = parsedate_to_datetime((await client.get("/")).headers["date"])
        await asyncio.sleep(2.2)  # at least two of the loop's seconds
        second = parsedate_to_datetime((await client.get("/")).headers["date"])
    assert (second - first).total_seconds() >= 1
