"""The endpoint picker over real gRPC, as Envoy's ext_proc filter speaks to it: the
messages of both body modes, built here as Envoy builds them, against a running router
with simulated workers. (tests/picker/test_through_envoy.py has a real Envoy.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import msgspec
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.core.config import IndexSettings, PickerSettings, RequestLimits, Settings
from router.app import running_router
from router.picker.protocol import endpoint_of
from simulations.local_workers import local_workers
from tests.certificates import self_signed
from tests.picker.ext_proc import (
    BUFFERED,
    Exchange,
    body_messages,
    destination,
    set_header,
    streamed_back,
)
from tests.picker.ext_proc import headers_message as bare_headers_message
from tests.router.flow_control.test_gate import (
    SLOW,
    direct,
    engines_idle,
    flow_settings,
    learn_batch_limits,
)
from tests.router.proxy.conftest import (
    MODEL,
    TENANT_KEYS,
    RoutedFleet,
    routed_fleet,
    router_settings,
    tenant_settings,
)
from tests.waiting import wait_until

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12
ACME = f"Bearer {TENANT_KEYS['acme']}"


def headers_message(*args: Any, **kwargs: Any) -> ProcessingRequest:
    """Envoy's first message, with acme's key unless told otherwise."""
    kwargs.setdefault("authorization", ACME)
    return bare_headers_message(*args, **kwargs)


def picker_settings(picker: PickerSettings | None = None, **overrides: Any) -> Settings:
    settings = router_settings(**overrides)
    return settings.model_copy(update={"picker": picker or PickerSettings(port=0)})


@contextlib.asynccontextmanager
async def picked_fleet(
    count: int = 2,
    *,
    sim_options: dict[str, Any] | None = None,
    picker: PickerSettings | None = None,
    **overrides: Any,
) -> AsyncIterator[RoutedFleet]:
    settings = picker_settings(picker, **overrides)
    async with routed_fleet(count, settings, sim_options=sim_options) as fleet:
        yield fleet


@contextlib.asynccontextmanager
async def channel(fleet: RoutedFleet) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fleet.router.picker_port}") as opened:
        yield opened


def completion(prompt: str = PROMPT, **fields: Any) -> bytes:
    return msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields})


def addresses(fleet: RoutedFleet) -> dict[str, str]:
    return {endpoint_of(worker.base_url): worker.worker_id for worker in fleet.workers}


def in_flight(fleet: RoutedFleet, worker_id: str) -> int:
    return fleet.router.pool.traffic(worker_id).in_flight


def requests_counted(fleet: RoutedFleet, outcome: str) -> float:
    registry = fleet.router.metrics.registry
    return sum(
        sample.value
        for metric in registry.collect()
        if metric.name == "kvplane_requests"
        for sample in metric.samples
        if sample.name == "kvplane_requests_total" and sample.labels["outcome"] == outcome
    )


async def test_full_duplex_names_the_best_endpoint_then_sends_the_salted_body_back() -> None:
    async with picked_fleet() as fleet, channel(fleet) as opened:
        exchange = Exchange(opened)
        await exchange.send(headers_message(), *body_messages(completion(), chunks=3))
        headers = await exchange.receive()
        endpoints = destination(headers)
        assert set(endpoints) == set(addresses(fleet))  # the choice, then the fallback
        assert headers.request_headers.response.clear_route_cache
        body = await streamed_back(exchange)
        sent = json.loads(body)
        assert sent["prompt"] == PROMPT
        assert sent["cache_salt"]  # the tenant's, so that the engine isolates it
        assert set_header(headers, "content-length") is None  # Envoy would drop it
        chosen = addresses(fleet)[endpoints[0]]
        assert in_flight(fleet, chosen) == 1  # until Envoy is done with the request
        await exchange.finish()
        await wait_until("handed off", lambda: requests_counted(fleet, "handed_off") == 1)


async def test_buffered_answers_the_headers_then_the_whole_body() -> None:
    async with picked_fleet() as fleet, channel(fleet) as opened:
        exchange = Exchange(opened)
        await exchange.send(headers_message(mode=BUFFERED))
        first = await exchange.receive()
        assert first.HasField("request_headers")
        assert not first.request_headers.response.header_mutation.set_headers
        await exchange.send(*body_messages(completion()))
        answer = await exchange.receive()
        assert destination(answer, "request_body")[0] in addresses(fleet)
        body = answer.request_body.response.body_mutation.body
        assert json.loads(body)["cache_salt"]
        assert set_header(answer, "content-length", "request_body") == str(len(body))
        await exchange.finish()


async def test_the_picker_sends_a_prompt_where_the_proxy_sent_it() -> None:
    async with picked_fleet() as fleet, channel(fleet) as opened, fleet.http() as client:
        proxied = await client.post(
            "/v1/completions",
            content=completion(),
            headers={"authorization": ACME, "content-type": "application/json"},
        )
        assert proxied.status_code == 200
        cached_on = proxied.headers["x-kvplane-worker"]
        for _ in range(3):
            exchange = Exchange(opened)
            await exchange.send(headers_message(), *body_messages(completion()))
            endpoints = destination(await exchange.receive())
            assert addresses(fleet)[endpoints[0]] == cached_on
            await streamed_back(exchange)
            await exchange.finish()


def immediate(answer: ProcessingResponse) -> tuple[int, dict[str, str], dict[str, Any]]:
    assert answer.HasField("immediate_response"), answer
    response = answer.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in response.headers.set_headers}
    return response.status.code, headers, json.loads(response.body)


async def refused(
    fleet: RoutedFleet, *messages: ProcessingRequest
) -> tuple[int, dict[str, str], dict[str, Any]]:
    async with channel(fleet) as opened:
        exchange = Exchange(opened)
        await exchange.send(*messages)
        answer = immediate(await exchange.receive())
        await exchange.finish()  # the picker has closed its side
        return answer


async def test_refusals_are_immediate_responses_in_the_openai_shape() -> None:
    async with picked_fleet() as fleet:
        status, headers, body = await refused(fleet, headers_message(authorization=None))
        assert status == 401
        assert headers["www-authenticate"] == "Bearer"
        assert body["error"]["type"] == "AuthenticationError"

        status, _, body = await refused(fleet, headers_message(), *body_messages(b"{not json"))
        assert (status, body["error"]["code"]) == (400, 400)
        assert body["error"]["message"] == "the request body is not valid JSON"

        status, _, body = await refused(
            fleet, headers_message(), *body_messages(msgspec.json.encode({"model": MODEL}))
        )
        assert status == 400
        assert "'prompt' is required" in body["error"]["message"]
        assert requests_counted(fleet, "bad_request") == 2
        assert requests_counted(fleet, "unauthorized") == 1


async def test_a_body_over_the_limit_is_refused_before_it_is_all_in() -> None:
    async with picked_fleet(proxy={"max_body_bytes": 4096}) as fleet:
        status, _, body = await refused(
            fleet, headers_message(), *body_messages(completion("x" * 10_000), chunks=4)
        )
        assert status == 413
        assert "4096" in body["error"]["message"]


async def test_a_tenant_over_its_rate_gets_429_with_retry_after() -> None:
    plain = tenant_settings()
    limited = RequestLimits(requests_per_s=0.01, burst=1)
    tenants = plain.model_copy(
        update={"tenants": [spec.model_copy(update={"limits": limited}) for spec in plain.tenants]}
    )
    async with picked_fleet(tenants=tenants) as fleet, channel(fleet) as opened:
        first = Exchange(opened)
        await first.send(headers_message(), *body_messages(completion()))
        destination(await first.receive())
        await streamed_back(first)
        status, headers, body = await refused(fleet, headers_message())
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert body["error"]["type"] == "RateLimitError"
        assert requests_counted(fleet, "rate_limited") == 1


async def test_no_live_worker_is_503() -> None:
    async with picked_fleet(1) as fleet:
        await fleet.workers[0].stop_agent()
        await wait_until("no candidate", lambda: not fleet.router.pool.candidates())
        status, headers, _ = await refused(fleet, headers_message(), *body_messages(completion()))
        assert status == 503
        assert headers["retry-after"] == "1"


async def test_the_subset_hint_is_honoured_strictly() -> None:
    async with picked_fleet() as fleet, channel(fleet) as opened:
        by_address = addresses(fleet)
        for allowed in by_address:  # the best inside the subset, whatever is best outside
            exchange = Exchange(opened)
            await exchange.send(headers_message(), *body_messages(completion(), subset=[allowed]))
            assert destination(await exchange.receive()) == [allowed]
            await streamed_back(exchange)
            await exchange.finish()
        partial = next(iter(by_address)) + ",10.255.0.1:8000"  # a comma list, one of them unknown
        exchange = Exchange(opened)
        await exchange.send(headers_message(), *body_messages(completion(), subset=partial))
        assert destination(await exchange.receive()) == [next(iter(by_address))]
        await streamed_back(exchange)
        await exchange.finish()
        exchange = Exchange(opened)  # llm-d's hints name endpoints by IP alone
        await exchange.send(headers_message(), *body_messages(completion(), subset=["127.0.0.1"]))
        assert set(destination(await exchange.receive())) == set(by_address)
        await streamed_back(exchange)
        await exchange.finish()
        status, _, body = await refused(
            fleet, headers_message(), *body_messages(completion(), subset=["10.255.0.1:8000"])
        )
        assert status == 503
        assert "subset" in body["error"]["message"]


async def test_a_header_only_request_goes_to_the_least_busy_worker() -> None:
    async with picked_fleet() as fleet, channel(fleet) as opened:
        busy = Exchange(opened)
        await busy.send(headers_message(), *body_messages(completion()))
        busy_address = destination(await busy.receive())[0]
        await streamed_back(busy)
        models = Exchange(opened)
        await models.send(headers_message("/v1/models", method="GET", end_of_stream=True))
        endpoints = destination(await models.receive())
        assert endpoints[0] != busy_address
        assert set(endpoints) == set(addresses(fleet))
        await models.finish()
        await busy.finish()


async def test_a_client_sent_destination_is_overwritten() -> None:
    async with picked_fleet() as fleet, channel(fleet) as opened:
        exchange = Exchange(opened)
        steering = {"x-gateway-destination-endpoint": "169.254.169.254:80"}
        await exchange.send(headers_message(extra=steering), *body_messages(completion()))
        assert "169.254.169.254:80" not in destination(await exchange.receive())
        await streamed_back(exchange)
        await exchange.finish()


async def test_a_handed_off_request_counts_until_the_workers_next_load_report() -> None:
    # Envoy ends the stream once the picker has answered (it skips the response phase):
    # the request still loads its worker until the worker's own figures hold it.
    # (A horizon far off: only the worker's report can end the ticket here.)
    picker = PickerSettings(port=0, hand_off_s=60.0)
    async with (
        picked_fleet(sim_options={"time_scale": 1.0}, picker=picker) as fleet,
        channel(fleet) as opened,
    ):
        exchange = Exchange(opened)
        await exchange.send(headers_message(), *body_messages(completion()))
        chosen = addresses(fleet)[destination(await exchange.receive())[0]]
        await streamed_back(exchange)
        exchange.call.cancel()  # as Envoy does: a half-close, then a reset
        await wait_until(
            "handed off",
            lambda: requests_counted(fleet, "handed_off") == 1,
        )
        assert in_flight(fleet, chosen) == 1
        await wait_until(
            "the next load report takes it over",
            lambda: len(fleet.router.pool.roster) > 0 and in_flight(fleet, chosen) == 0,
            timeout_s=5,
        )


async def test_health_says_live_and_ready_for_every_service_gateways_probe() -> None:
    async with picked_fleet(1) as fleet, channel(fleet) as opened:
        health = health_pb2_grpc.HealthStub(opened)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        fleet.router.draining.set()

        async def not_ready() -> bool:
            readiness = await health.Check(health_pb2.HealthCheckRequest(service="readiness"))
            return bool(readiness.status == health_pb2.HealthCheckResponse.NOT_SERVING)

        await wait_until("not ready once draining", not_ready)
        liveness = await health.Check(health_pb2.HealthCheckRequest(service="liveness"))
        assert liveness.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_picker_serves_tls_when_configured(tmp_path: Path) -> None:
    key_pem, pem = self_signed("picker")
    cert_file, key_file = tmp_path / "picker.pem", tmp_path / "picker-key.pem"
    cert_file.write_bytes(pem)
    key_file.write_bytes(key_pem)
    settings = router_settings().model_copy(
        update={"picker": PickerSettings(port=0, tls_cert_file=cert_file, tls_key_file=key_file)}
    )
    async with routed_fleet(1, settings) as fleet:
        address = f"127.0.0.1:{fleet.router.picker_port}"
        credentials = grpc.ssl_channel_credentials(root_certificates=pem)
        async with grpc.aio.secure_channel(address, credentials) as secure:
            exchange = Exchange(secure)
            await exchange.send(headers_message(), *body_messages(completion()))
            assert destination(await exchange.receive()) == list(addresses(fleet))
        async with grpc.aio.insecure_channel(address) as plain:
            health = health_pb2_grpc.HealthStub(plain)
            with pytest.raises(grpc.aio.AioRpcError):
                await health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)


async def test_two_pickers_on_one_redis_index_answer_alike(redis_url: str) -> None:
    index = IndexSettings(
        backend="redis", redis_url=redis_url, redis_prefix=f"pickers-{uuid.uuid4().hex[:8]}"
    )
    settings = picker_settings(index=index)
    async with (
        running_router(settings) as first,
        running_router(settings) as second,
        local_workers(2, grpc_port=first.grpc_port, sim_options={"time_scale": 0.0}) as workers,
        httpx.AsyncClient(timeout=30) as client,
    ):
        for router in (first, second):
            await wait_until(
                "both workers are routable", lambda r=router: len(r.pool.candidates(MODEL)) == 2
            )
        routed = await client.post(
            f"http://127.0.0.1:{first.http_port}/v1/completions",
            content=completion(),
            headers={"authorization": ACME, "content-type": "application/json"},
        )
        holder = endpoint_of(
            next(w.base_url for w in workers if w.worker_id == routed.headers["x-kvplane-worker"])
        )

        async def both_name(address: str) -> bool:
            for router in (first, second):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{router.picker_port}") as opened:
                    exchange = Exchange(opened)
                    await exchange.send(headers_message(), *body_messages(completion()))
                    if destination(await exchange.receive())[0] != address:
                        return False
                    await streamed_back(exchange)
            return True

        await wait_until(
            "both pickers name the worker holding the prefix", lambda: both_name(holder)
        )


async def test_a_stream_that_lies_is_refused_and_holds_nothing() -> None:
    async with picked_fleet() as fleet:
        status, _, body = await refused(fleet, headers_message(), headers_message())
        assert (status, body["error"]["message"]) == (400, "the request's headers came twice")
        status, _, body = await refused(fleet, *body_messages(completion()))
        assert (status, body["error"]["message"]) == (400, "a body came before the headers")
        # Nothing admitted is left holding a tenant's slot or a worker's ticket.
        assert all(in_flight(fleet, worker.worker_id) == 0 for worker in fleet.workers)
        async with channel(fleet) as opened:
            exchange = Exchange(opened)
            await exchange.send(headers_message(), *body_messages(completion()))
            assert destination(await exchange.receive())


async def test_flow_control_sheds_through_the_gateway_and_keeps_the_clients_priority_out() -> None:
    settings = flow_settings(max_engine_waiting=0, max_queued_requests=0).model_copy(
        update={"picker": PickerSettings(port=0)}
    )
    async with routed_fleet(1, settings, sim_options=SLOW) as fleet:
        await learn_batch_limits(fleet)
        async with channel(fleet) as opened:
            # Room: it goes, without the header vLLM would read its priority from.
            exchange = Exchange(opened)
            await exchange.send(
                headers_message(extra={"x-vllm-priority": "-100"}, mode=BUFFERED),
                *body_messages(completion(priority=-100)),
            )
            await exchange.receive()  # the headers go on (buffered)
            answer = await exchange.receive()
            mutation = answer.request_body.response.header_mutation
            assert list(mutation.remove_headers) == ["x-vllm-priority"]
            body = json.loads(answer.request_body.response.body_mutation.body)
            assert "priority" not in body
        # The engine busy with a request the router never saw: no room, and no queue.
        occupying = asyncio.ensure_future(direct(fleet.workers[0].base_url, "occupying", 30))
        await wait_until("the engine runs it", lambda: not engines_idle(fleet))
        status, headers, body = await refused(
            fleet, headers_message(), *body_messages(completion())
        )
        await occupying
    assert status == 429
    assert headers["x-kvplane-shed-reason"] == "queue_full"
    assert int(headers["retry-after"]) >= 1
    assert body["error"]["message"].startswith("queue_full:")
    assert requests_counted(fleet, "shed_queue_full") == 1
