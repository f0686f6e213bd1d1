"""A request's life (router/lifecycle): what it takes is given back once, however it ends."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
from pydantic import SecretStr

from kvplane.core.config import (
    ControlPlaneSettings,
    RequestLimits,
    Settings,
    TenantSettings,
    TenantSpec,
)
from kvplane.core.types import WorkerInfo
from router.assembly import RouterParts, assemble_router
from router.errors import RequestRefused
from router.index.memory import MemoryLocationIndex
from router.lifecycle import RequestLifecycle, RoutedRequest
from router.lifecycle.bodies import Endpoint, Usage
from router.tenants import api_key_digest

MODEL = "m"
WORKERS = ("w1", "w2")
PROMPT = "the cat sat on the mat " * 8
ACME_KEY = "sk-acme"


@pytest.fixture
async def parts() -> AsyncIterator[RouterParts]:
    tenants = TenantSettings(
        tenants=[
            TenantSpec(
                name="acme",
                api_key_sha256=[api_key_digest(ACME_KEY)],
                limits=RequestLimits(concurrent_requests=1),
            )
        ],
        cache_salt_secret=SecretStr("salt"),
    )
    backend = MemoryLocationIndex()
    router = assemble_router(
        Settings(control_plane=ControlPlaneSettings(block_size=4), tenants=tenants), backend
    )
    for worker_id in WORKERS:
        info = WorkerInfo(worker_id, 1, f"http://{worker_id}.invalid:8000", MODEL, 4)
        await backend.register(info, 60.0)
        router.workers.registered(info, stream=1, now=0.0, lease_s=60.0, applied=0)
    await router.pool.refresh()
    try:
        yield router
    finally:
        await router.aclose()
        await backend.close()


def body(prompt: str = PROMPT) -> bytes:
    return msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 1})


async def routed(parts: RouterParts) -> tuple[RequestLifecycle, RoutedRequest]:
    lifecycle = parts.flow.admit(f"Bearer {ACME_KEY}")
    return lifecycle, await lifecycle.route(body(), Endpoint.COMPLETIONS)


def in_flight(parts: RouterParts, worker_id: str) -> int:
    return parts.pool.traffic(worker_id).in_flight


def predicted(parts: RouterParts, routed: RoutedRequest, worker_id: str) -> int:
    matched = parts.planner.predicted.match(routed.decision.keys, parts.flow.clock())
    return matched.get(worker_id, 0)


def outcomes(parts: RouterParts, outcome: str, worker: str) -> float:
    value = parts.metrics.registry.get_sample_value(
        "kvplane_requests_total", {"outcome": outcome, "worker": worker}
    )
    return value or 0.0


async def test_a_settled_dispatch_gives_its_ticket_back_once_and_keeps_its_prediction(
    parts: RouterParts,
) -> None:
    lifecycle, request = await routed(parts)
    (first, _) = request.worker_ids(2)
    dispatch = lifecycle.dispatch(request, first)
    assert in_flight(parts, first) == 1
    assert predicted(parts, request, first) == len(request.decision.keys)
    dispatch.first_byte()
    dispatch.settle("ok", Usage(prompt_tokens=None, cached_tokens=None), 200)
    dispatch.settle("ok", None, 200)  # a second settlement changes nothing
    dispatch.abandon("client_disconnected")  # nor an abandonment after it
    lifecycle.close()
    lifecycle.close()
    assert in_flight(parts, first) == 0
    assert predicted(parts, request, first) == len(request.decision.keys)
    assert outcomes(parts, "ok", first) == 1
    assert outcomes(parts, "client_disconnected", first) == 0
    assert parts.flow.limiter.in_progress(lifecycle.tenant) == 0


async def test_an_abandoned_dispatch_takes_its_prediction_back(parts: RouterParts) -> None:
    # The client left before the first byte: the engine dropped the request with its
    # connection, so its prefix is not predicted there.
    lifecycle, request = await routed(parts)
    (first, _) = request.worker_ids(2)
    lifecycle.dispatch(request, first).abandon("client_disconnected")
    assert in_flight(parts, first) == 0
    assert predicted(parts, request, first) == 0
    assert outcomes(parts, "client_disconnected", first) == 1
    lifecycle.close()


async def test_a_failed_worker_is_abandoned_and_the_next_one_may_be_tried(
    parts: RouterParts,
) -> None:
    lifecycle, request = await routed(parts)
    first, second = request.worker_ids(2)
    lifecycle.dispatch(request, first).failed("connection refused", refused=True)
    assert in_flight(parts, first) == 0
    assert predicted(parts, request, first) == 0
    assert first not in {c.worker_id for c in parts.pool.candidates()}  # sits out a while
    dispatch = lifecycle.dispatch(request, second)
    assert dispatch.attempt == 2
    dispatch.settle("ok_after_failover", None, 200)
    lifecycle.close()
    assert outcomes(parts, "ok_after_failover", second) == 1


async def test_closing_a_request_abandons_a_dispatch_left_open(parts: RouterParts) -> None:
    # The front door was cancelled (the router stopping) between dispatch and answer.
    lifecycle, request = await routed(parts)
    (first, _) = request.worker_ids(2)
    dispatch = lifecycle.dispatch(request, first)
    lifecycle.close()
    assert dispatch.ended
    assert in_flight(parts, first) == 0
    assert predicted(parts, request, first) == 0
    assert parts.flow.limiter.in_progress(lifecycle.tenant) == 0


async def test_one_dispatch_at_a_time(parts: RouterParts) -> None:
    lifecycle, request = await routed(parts)
    first, second = request.worker_ids(2)
    lifecycle.dispatch(request, first)
    with pytest.raises(RuntimeError, match="the previous dispatch has not ended"):
        lifecycle.dispatch(request, second)
    lifecycle.close()


async def test_the_tenant_slot_is_held_until_close(parts: RouterParts) -> None:
    lifecycle = parts.flow.admit(f"Bearer {ACME_KEY}")
    with pytest.raises(RequestRefused) as refused:
        parts.flow.admit(f"Bearer {ACME_KEY}")  # acme may have one request in progress
    assert (refused.value.status, refused.value.outcome) == (429, "concurrency_limited")
    assert refused.value.headers == {"retry-after": "1"}
    lifecycle.close()
    parts.flow.admit(f"Bearer {ACME_KEY}").close()


@pytest.mark.parametrize(
    ("authorization", "raw", "status", "outcome"),
    [
        (None, body(), 401, "unauthorized"),
        ("Bearer sk-nobody", body(), 401, "unauthorized"),
        (f"Bearer {ACME_KEY}", b"{not json", 400, "bad_request"),
        (f"Bearer {ACME_KEY}", b'{"model": "m"}', 400, "bad_request"),
    ],
)
async def test_refusals_are_one_hierarchy_and_counted(
    parts: RouterParts, authorization: str | None, raw: bytes, status: int, outcome: str
) -> None:
    async def admitted_and_routed() -> None:
        lifecycle = parts.flow.admit(authorization)
        try:
            await lifecycle.route(raw, Endpoint.COMPLETIONS)
        finally:
            lifecycle.close()

    with pytest.raises(RequestRefused) as refused:
        await admitted_and_routed()
    assert refused.value.status == status
    assert refused.value.outcome == outcome
    assert outcomes(parts, outcome, "none") == 1
    assert PROMPT not in str(refused.value)


async def test_no_live_worker_is_a_503_with_retry_after(parts: RouterParts) -> None:
    for worker_id in WORKERS:
        parts.pool.unreachable(worker_id)
    lifecycle = parts.flow.admit(f"Bearer {ACME_KEY}")
    with pytest.raises(RequestRefused) as refused:
        await lifecycle.route(body(), Endpoint.COMPLETIONS)
    lifecycle.close()
    assert (refused.value.status, refused.value.outcome) == (503, "no_worker")
    assert refused.value.headers == {"retry-after": "1"}


async def test_an_engine_error_is_counted_as_such_and_judges_nothing(parts: RouterParts) -> None:
    lifecycle, request = await routed(parts)
    (first, _) = request.worker_ids(2)
    lifecycle.dispatch(request, first).settle("ok", None, 503)
    lifecycle.close()
    assert outcomes(parts, "engine_error", first) == 1
    assert in_flight(parts, first) == 0
