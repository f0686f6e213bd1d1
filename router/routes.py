"""Route classes for the operations whose request body FastAPI must not parse.

The router reads its JSON bodies itself (router/lifecycle/bodies.py): a size limit (413)
checked while reading, JSON that is not UTF-8 or nests too deeply refused as a 400;
FastAPI's body parsing has neither. Such a route still names the model its body is
described with, which router/openapi.py puts in the document.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable
from typing import Any, cast

from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send


class RawBodyRoute(APIRoute):
    """An operation whose handler reads the body; `body` describes it."""

    def __init__(
        self, path: str, endpoint: Callable[..., Any], *, body: type[BaseModel], **options: Any
    ) -> None:
        self.body = body
        super().__init__(path, endpoint, **options)


class HotRoute(RawBodyRoute):
    """...called as a Starlette route is: the handler takes the bare Request and returns
    a Response. No dependency solving nor validation, which the proxy would pay for on
    every request: it authenticates and reads the body itself."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return cast(Callable[[Request], Coroutine[Any, Any, Response]], self.endpoint)


class HotPaths:
    """An ASGI app in front of the FastAPI one: a request for a HotRoute's exact path
    and method goes straight to its handler, everything else to the app.

    Those requests are the proxy's, and the app's middleware and routing cost each of
    them (and each chunk of a streamed answer) more Python than the handler's own
    work around the engine's call. The handler answers every error itself, as the
    app's middleware would have; anything it raises reaches the server, which answers
    500 and logs it, as after the app's error middleware."""

    def __init__(self, app: ASGIApp, routes: Iterable[BaseRoute]) -> None:
        self.app = app
        self._handlers = {
            (route.path, method): cast(
                Callable[[Request], Coroutine[Any, Any, Response]], route.endpoint
            )
            for route in routes
            if isinstance(route, HotRoute)
            for method in route.methods or ()
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self._handlers.get((scope["path"], scope["method"]))
            if handler is not None:
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
