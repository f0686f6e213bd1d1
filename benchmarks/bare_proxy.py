"""A pass-through proxy on the router's own server and client stack, and nothing else:
the floor under `kvplane bench router`'s proxy figures.

It serves HTTP as the router does (uvicorn on uvloop, through kvplane.core.serving)
and sends each request on to one engine as the router does (one aiohttp session, its
keep-alive pool, no cookie jar), with no routing, tokenising, accounting or metrics.
What it adds to a request, against calling the engine directly, is what that stack
costs; what the router adds beyond it is kvplane's own work. Answers are relayed as the
router relays them, each chunk sent on as it arrives (a streamed answer is a chunk a
token); GET /healthz answers 200 once it serves.

    python -m benchmarks.bare_proxy --engine-url http://127.0.0.1:8000 --port 9000
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from starlette.types import Receive, Scope, Send

from kvplane.core.serving import bind_http, run_service, serving_http

_JSON = [(b"content-type", b"application/json")]


class BareProxy:
    """An ASGI app: POSTs go to the engine as they came, its answer back as it came."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            await _answer(send, 200, b"{}")
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.session is None:  # made in the serving loop, as the router's is
            self.session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False
            )
        async with self.session.post(
            self.engine_url + scope["path"],
            data=bytes(body),
            headers={"content-type": "application/json"},
        ) as answer:
            kind = answer.headers.get("content-type", "application/json").encode()
            headers = [(b"content-type", kind)]
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON})
    await send({"type": "http.response.body", "body": body})


async def _serve(engine_url: str, host: str, port: int) -> None:
    app = BareProxy(engine_url)
    try:
        async with serving_http((app, bind_http(host, port))):
            await asyncio.Event().wait()  # until the process is killed
    finally:
        if app.session is not None:
            await app.session.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bare_proxy", description=__doc__)
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    run_service(_serve(args.engine_url, args.host, args.port))


if __name__ == "__main__":
    main()
