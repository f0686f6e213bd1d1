"""Route classes for the operations whose request body FastAPI must not parse.

The router reads its JSON bodies itself (router/proxy/bodies.py): a size limit (413)
checked while reading, JSON that is not UTF-8 or nests too deeply refused as a 400;
FastAPI's body parsing has neither. Such a route still names the model its body is
described with, which router/openapi.py puts in the document.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, cast

from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response


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
