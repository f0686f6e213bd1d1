"""/healthz, /readyz, /metrics and /openapi.json over real HTTP."""

from __future__ import annotations

import grpc.aio
import httpx
import pytest
from fastapi.routing import APIRoute
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Route

from kvplane.wire.codec import drain_message, events_message, load_message, register_message
from kvplane.wire.stream import AgentStream
from router.app import RunningRouter, running_router
from router.control_plane.workers import WorkerView
from router.http import create_http_app
from router.index.memory import MemoryLocationIndex
from router.metrics import RouterMetrics
from tests.router.conftest import body, make_settings, prompt_keys, stored, worker


def _url(router: RunningRouter, path: str) -> str:
    return f"http://127.0.0.1:{router.http_port}{path}"


async def _samples(router: RunningRouter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient() as client:
        response = await client.get(_url(router, "/metrics"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


async def test_healthz_and_readyz(router: RunningRouter) -> None:
    async with httpx.AsyncClient() as client:
        health = await client.get(_url(router, "/healthz"))
        ready = await client.get(_url(router, "/readyz"))
    assert health.status_code == 200
    assert ready.status_code == 200
    assert ready.json() == {
        "ready": True,
        "draining": False,
        "grpc": "serving",
        "index": "ok",
        "routing": "cache-aware",
        "predictions_only_models": [],
    }


async def test_readyz_fails_while_grpc_is_not_serving() -> None:
    app = create_http_app(
        index=MemoryLocationIndex(),
        view=WorkerView(),
        metrics=RouterMetrics(),
        grpc_serving=lambda: False,
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://router"
    ) as client:
        response = await client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {
        "ready": False,
        "draining": False,
        "grpc": "not serving",
        "index": "ok",
        "routing": "cache-aware",
        "predictions_only_models": [],
    }


async def count_to(count: int) -> dict[str, int]:
    return {"count": count}


async def test_a_parameter_fastapi_refuses_is_a_400_in_the_openai_shape() -> None:
    """The router's own routes read no parameter FastAPI could refuse; one that does
    answers as the router's checks do, and is documented so."""
    app = create_http_app(
        index=MemoryLocationIndex(),
        view=WorkerView(),
        metrics=RouterMetrics(),
        grpc_serving=lambda: True,
        routes=[APIRoute("/count", count_to, methods=["GET"])],
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://router"
    ) as client:
        refused = await client.get("/count", params={"count": "many-secret"})
        document = (await client.get("/openapi.json")).json()
    assert refused.status_code == 400
    assert refused.json() == {
        "error": {
            "message": "invalid query.count",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    responses = document["paths"]["/count"]["get"]["responses"]
    assert "400" in responses
    assert "422" not in responses


async def test_metrics_count_what_the_control_plane_did(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    stream = AgentStream(channel)
    await stream.request(register_message(worker("w1")))
    await stream.request(events_message(1, [stored(prompt_keys(1, blocks=3))]))
    await stream.request(events_message(1, [stored(prompt_keys(1, blocks=3))]))  # duplicate
    await stream.send(load_message(running=1, waiting=0, kv_usage=0.1))
    await stream.send(drain_message())
    assert body(await stream.request(events_message(3, []))) == "resync"  # a gap
    rejected = AgentStream(channel)
    await rejected.send(events_message(1, []))  # before Register
    await rejected.reply()

    samples = await _samples(router)

    assert samples[("kvplane_events_applied_total", (("kind", "stored"),))] == 1
    assert samples[("kvplane_blocks_applied_total", (("kind", "stored"),))] == 3
    assert samples[("kvplane_batches_applied_total", ())] == 1
    assert samples[("kvplane_duplicate_batches_total", ())] == 1
    assert samples[("kvplane_apply_seconds_count", ())] == 1
    assert samples[("kvplane_load_lag_seconds_count", ())] == 1
    assert samples[("kvplane_event_lag_seconds_count", ())] == 1  # the applied batch
    assert samples[("kvplane_resyncs_total", (("reason", "sequence_gap"),))] == 1
    assert samples[("kvplane_rejects_total", (("reason", "not_registered"),))] == 1
    assert samples[("kvplane_workers", (("state", "dead"),))] == 1  # dropped by the gap
    assert samples[("kvplane_index_up", ())] == 1
    assert samples[("kvplane_index_entries", ())] == 0
    assert samples[("kvplane_index_workers", ())] == 0


async def test_two_routers_in_one_process_keep_their_own_metrics(
    router: RunningRouter, channel: grpc.aio.Channel
) -> None:
    stream = AgentStream(channel)
    await stream.request(register_message(worker("w1")))
    await stream.request(events_message(1, [stored(prompt_keys(1))]))

    async with running_router(make_settings()) as other:
        samples = await _samples(other)
        assert samples[("kvplane_batches_applied_total", ())] == 0
        assert samples[("kvplane_index_entries", ())] == 0
    assert (await _samples(router))[("kvplane_index_entries", ())] == 3


@pytest.mark.parametrize("admin_port", [None, 0], ids=["one-port", "admin-port"])
async def test_each_port_documents_every_route_it_serves(admin_port: int | None) -> None:
    """The document is generated from the routes: one added without a description (a
    Starlette route, a mount) or served on the wrong port would show here."""
    settings = make_settings()
    http = settings.http.model_copy(update={"admin_port": admin_port})
    async with running_router(settings.model_copy(update={"http": http})) as router:
        apps = [(router.http_port, router.http_app)]
        if router.admin_port is not None and router.admin_app is not None:
            apps.append((router.admin_port, router.admin_app))
        assert len(apps) == (1 if admin_port is None else 2)
        for port, app in apps:
            async with httpx.AsyncClient() as client:
                response = await client.get(f"http://127.0.0.1:{port}/openapi.json")
            assert response.status_code == 200
            paths = response.json()["paths"]
            documented = {
                (m.upper(), path) for path, operations in paths.items() for m in operations
            }
            assert all(isinstance(route, Route) for route in app.routes)
            served = {
                (method, route.path)
                for route in app.routes
                if isinstance(route, Route)
                for method in route.methods or ()
                if method != "HEAD"  # GET without the body, as Starlette answers it
            }
            assert served == documented
            assert ("GET", "/openapi.json") in served
