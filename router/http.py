"""The router's HTTP app (FastAPI): liveness, readiness, Prometheus metrics and the
OpenAPI document, plus the routes the caller adds (the OpenAI proxy, the fleet API).

Readiness does not depend on the index: when it is unreachable the router still
serves (routing on load alone) and /readyz says so in its body. Nor does it depend on
the workers' wiring: a model whose every worker is blind (router/routing/wiring.py) is
still served, on the router's own predictions, and /readyz names it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Security
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute

from router.auth import ADMIN_ERRORS, AdminToken
from router.control_plane.workers import WorkerView
from router.errors import EXCEPTION_HANDLERS
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


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    ready: bool
    draining: bool = Field(description="the router got its stop signal and is finishing")
    grpc: str
    index: str
    routing: Literal["cache-aware", "predictions-only", "load-only"] = Field(
        description="load-only: the index is unreachable; predictions-only: every served "
        "model's workers are blind (see predictions_only_models)"
    )
    predictions_only_models: list[str] = Field(
        description="models routed on the router's own predicted entries alone, their "
        "workers' wiring failing (GET /fleet/workers says which check)"
    )


def create_http_app(
    *,
    index: LocationIndex,
    view: WorkerView,
    metrics: RouterMetrics,
    grpc_serving: Callable[[], bool],
    draining: Callable[[], bool] = lambda: False,
    routes: Sequence[BaseRoute] = (),
    before_scrape: Callable[[], None] = lambda: None,
    model_routing: Callable[[], Mapping[str, str]] = dict,
    serve_metrics: bool = True,
    metrics_guard: AdminToken | None = None,
) -> FastAPI:
    """`model_routing()`: each served model's routing, "cache_aware" or "predictions_only";
    `metrics_guard`: the credential /metrics needs (none: open)."""

    async def healthz() -> Health:
        return Health()

    async def readyz(response: Response) -> Readiness:
        index_problem = await _index_problem(index)
        serving = grpc_serving()
        stopping = draining()
        response.status_code = 200 if serving and not stopping else 503
        routing = model_routing()
        blind = sorted(model for model, mode in routing.items() if mode == "predictions_only")
        return Readiness(
            ready=serving and not stopping,
            draining=stopping,
            grpc="serving" if serving else "not serving",
            index=index_problem or "ok",
            routing="load-only"
            if index_problem is not None
            else "predictions-only"
            if blind and len(blind) == len(routing)
            else "cache-aware",
            predictions_only_models=blind,
        )

    document: dict[str, Any] = {}  # of every route, this one's included: filled below

    async def openapi() -> dict[str, Any]:
        return document

    async def metrics_endpoint() -> Response:
        metrics.set_index_stats(await _index_stats(index))
        metrics.set_worker_counts(view.counts_by_state())
        before_scrape()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    own_routes = [
        APIRoute("/healthz", healthz, methods=["GET"], summary="the process is up"),
        APIRoute(
            "/readyz",
            readyz,
            methods=["GET"],
            summary="200 while gRPC serves and the router is not draining; the body says "
            "whether routing is cache-aware or load-only (the index unreachable)",
            response_description="ready",
            responses={503: {"model": Readiness, "description": "not serving, or draining"}},
        ),
        APIRoute("/openapi.json", openapi, methods=["GET"], summary="this document"),
    ]
    if serve_metrics:
        own_routes.append(
            APIRoute(
                "/metrics",
                metrics_endpoint,
                methods=["GET"],
                summary="Prometheus metrics (on the admin port when one is set; else here, "
                "behind the admin token when one is set)",
                response_class=PlainTextResponse,
                dependencies=[] if metrics_guard is None else [Security(metrics_guard)],
                responses={} if metrics_guard is None else _json_errors(ADMIN_ERRORS),
            )
        )
    app = FastAPI(
        routes=[*own_routes, *routes],
        openapi_url=None,  # served by the route above, which the document describes too
        docs_url=None,
        redoc_url=None,
        exception_handlers=EXCEPTION_HANDLERS,
        # The router traces requests itself (router/tracing.py), with its own provider.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    # Unknown paths and methods get Starlette's plain-text 404 and 405, not FastAPI's JSON.
    del app.exception_handlers[HTTPException]
    # Starlette's routes answer HEAD where they answer GET (without the body); FastAPI's
    # do not. The document leaves HEAD out (openapi.py).
    for route in app.routes:
        if isinstance(route, APIRoute) and route.methods and "GET" in route.methods:
            route.methods.add("HEAD")
    document.update(openapi_document(app.routes))
    return app


def _json_errors(responses: Mapping[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """Error answers documented as JSON on a route whose own answer is not (FastAPI would
    give them the route's media type)."""
    return {
        status: {
            **{key: value for key, value in response.items() if key != "model"},
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
        }
        for status, response in responses.items()
    }


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
