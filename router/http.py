"""The router's HTTP app: liveness, readiness, Prometheus metrics and the OpenAPI
description, plus the routes the caller adds (the OpenAI proxy, the fleet API).

Readiness does not depend on the index: when it is unreachable the router still
serves (routing on load alone) and /readyz says so in its body.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from router.control_plane.workers import WorkerView
from router.index.base import (
    IndexStats,
    IndexTimeout,
    LocationIndex,
    LocationIndexError,
    index_deadline,
)
from router.metrics import RouterMetrics
from router.openapi import openapi_document

log = logging.getLogger(__name__)

INDEX_PROBE_TIMEOUT_S = 2.0
"""How long a probe or a scrape waits for the index before calling it unreachable."""


def create_http_app(
    *,
    index: LocationIndex,
    view: WorkerView,
    metrics: RouterMetrics,
    grpc_serving: Callable[[], bool],
    routes: Sequence[BaseRoute] = (),
    before_scrape: Callable[[], None] = lambda: None,
    serve_metrics: bool = True,
) -> Starlette:
    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        index_problem = await _index_problem(index)
        serving = grpc_serving()
        body = {
            "ready": serving,
            "grpc": "serving" if serving else "not serving",
            "index": index_problem or "ok",
            "routing": "cache-aware" if index_problem is None else "load-only",
        }
        return JSONResponse(body, status_code=200 if serving else 503)

    document = openapi_document()

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    async def metrics_endpoint(request: Request) -> Response:
        metrics.set_index_stats(await _index_stats(index))
        metrics.set_worker_counts(view.counts_by_state())
        before_scrape()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            *([Route("/metrics", metrics_endpoint, methods=["GET"])] if serve_metrics else []),
            *routes,
        ]
    )


async def _index_problem(index: LocationIndex) -> str | None:
    """None when the index answers; else what is wrong with it, for the probe's body.

    workers() is the probe because it is one cheap read on every backend, where stats()
    may count every key."""
    try:
        async with index_deadline(INDEX_PROBE_TIMEOUT_S):
            await index.workers()
    except IndexTimeout:
        return f"unreachable (no answer within {INDEX_PROBE_TIMEOUT_S:g} s)"
    except LocationIndexError as error:
        return f"unreachable ({type(error).__name__})"
    return None


async def _index_stats(index: LocationIndex) -> IndexStats | None:
    try:
        async with index_deadline(INDEX_PROBE_TIMEOUT_S):
            return await index.stats()
    except LocationIndexError as error:  # a scrape reports the index as down, it does not fail
        log.warning("index stats unavailable for /metrics (%s)", type(error).__name__)
        return None
