"""/healthz, /readyz and /metrics over real HTTP."""

from __future__ import annotations

import grpc.aio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvplane.wire.codec import drain_message, events_message, load_message, register_message
from kvplane.wire.stream import AgentStream
from router.app import RunningRouter, running_router
from router.control_plane.workers import WorkerView
from router.http import create_http_app
from router.index.memory import MemoryLocationIndex
from router.metrics import RouterMetrics
from tests.control_plane.conftest import body, make_settings, prompt_keys, stored, worker


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
        "grpc": "serving",
        "index": "ok",
        "routing": "cache-aware",
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
        "grpc": "not serving",
        "index": "ok",
        "routing": "cache-aware",
    }


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
