"""The router's client of the engines, against a real HTTP server over loopback: it
carries every tenant's requests on one session, so nothing one answer sets may ride on
the next request."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kvplane.core.config import ProxySettings
from router.proxy.upstream import Upstream


@pytest.fixture
async def cookie_setting_engine() -> AsyncIterator[tuple[str, list[str | None]]]:
    """An engine (or a proxy before one) whose answers set a cookie; yields its URL and
    the Cookie header of every request it got."""
    seen: list[str | None] = []

    async def complete(request: web.Request) -> web.Response:
        seen.append(request.headers.get("cookie"))
        answer = web.json_response({"choices": []})
        answer.set_cookie("session", "tenant-a-sticky", path="/")
        return answer

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        # By name, as engines usually are: aiohttp keeps no cookie from a bare IP address.
        yield f"http://localhost:{port}/v1/completions", seen
    finally:
        await runner.cleanup()


async def test_a_cookie_an_engine_sets_goes_to_its_client_and_never_back_upstream(
    cookie_setting_engine: tuple[str, list[str | None]],
) -> None:
    url, seen = cookie_setting_engine
    upstream = Upstream(ProxySettings())
    try:
        for _ in range(2):
            answer = await upstream.send(url, b"{}", {"content-type": "application/json"}, 5.0)
            try:
                assert ("Set-Cookie", "session=tenant-a-sticky; Path=/") in answer.headers
            finally:
                await answer.close()
    finally:
        await upstream.close()
    assert seen == [None, None]
