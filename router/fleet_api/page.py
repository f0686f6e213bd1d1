"""The fleet page (`GET /fleet/page`): the fleet API's answers in an operator's browser:
workers with their load, KV usage and hit rates, flow control (each model's room and
waiting requests by band, each tenant's counter, service and shedding), the cache funnel,
the hottest shared prefixes, and the locality query with each worker's score terms.

The page, its script and its style hold no data, so they are served without the admin
token. The script asks the fleet API for everything, with the token it takes from the
address's fragment (`/fleet/page#token=...`, which no server sees) or from a form, and
keeps in the tab's session storage. It renders text nodes only: worker ids and labels
come from agents and are never parsed as HTML. The Content-Security-Policy lets the
page load its own script and style and talk to its own origin, nothing else.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi.routing import APIRoute
from starlette.responses import Response

PATH = "/fleet/page"

_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
# Each path, the file it serves (in router/static), its media type and its summary.
_FILES = {
    PATH: (
        "page.html",
        "text/html",
        "the fleet page (it holds no data: its script asks the fleet API, with the admin token)",
    ),
    f"{PATH}.js": ("page.js", "text/javascript", "the fleet page's script"),
    f"{PATH}.css": ("page.css", "text/css", "the fleet page's style"),
}


def fleet_page_routes() -> list[APIRoute]:
    """The page's routes, its files read once."""
    static = resources.files("router") / "static"
    return [
        _file_route(path, static.joinpath(name).read_bytes(), media_type, summary)
        for path, (name, media_type, summary) in _FILES.items()
    ]


def _file_route(path: str, content: bytes, media_type: str, summary: str) -> APIRoute:
    async def serve() -> Response:
        return Response(content, media_type=f"{media_type}; charset=utf-8", headers=_HEADERS)

    ok: dict[str, Any] = {
        "description": summary,
        "content": {media_type: {"schema": {"type": "string"}}},
    }
    return APIRoute(
        path, serve, methods=["GET"], summary=summary, response_class=Response, responses={200: ok}
    )
