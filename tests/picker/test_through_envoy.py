"""kvplane's picker behind a real Envoy (`make envoy-env`), configured by `kvplane
envoy-config`, in front of simulated workers: llm-d's hermetic picker cases as a client
sees them, in both of Envoy's body modes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from kvplane.core.config import PickerSettings
from router.picker.envoy_config import BodyMode
from router.picker.protocol import endpoint_of
from tests.picker.envoy import RunningEnvoy, running_envoy
from tests.router.proxy.conftest import (
    MODEL,
    TENANT_KEYS,
    RoutedFleet,
    routed_fleet,
    router_settings,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.heavy("envoy")

ACME = {"authorization": f"Bearer {TENANT_KEYS['acme']}"}
PROMPT = "A gateway names the endpoint; kvplane picks it from the cache it holds. " * 10
BOTH_MODES = pytest.mark.parametrize("body_mode", [BodyMode.FULL_DUPLEX, BodyMode.BUFFERED])


@dataclass
class Gateway:
    fleet: RoutedFleet
    envoy: RunningEnvoy

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.envoy.url, timeout=30, headers=ACME)

    def requests(self, outcome: str) -> float:
        return sum(
            sample.value
            for metric in self.fleet.router.metrics.registry.collect()
            if metric.name == "kvplane_requests"
            for sample in metric.samples
            if sample.name == "kvplane_requests_total" and sample.labels["outcome"] == outcome
        )


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path, body_mode: BodyMode, *, workers: int = 2, **options: Any
) -> AsyncIterator[Gateway]:
    settings = router_settings().model_copy(update={"picker": PickerSettings(port=0)})
    async with (
        routed_fleet(workers, settings) as fleet,
        running_envoy(
            tmp_path,
            endpoints=[endpoint_of(worker.base_url) for worker in fleet.workers],
            pickers=[f"127.0.0.1:{fleet.router.picker_port}"],
            body_mode=body_mode,
            **options,
        ) as envoy,
    ):
        yield Gateway(fleet, envoy)


def completion(prompt: str = PROMPT, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **fields}


def events(raw: bytes) -> list[Any]:
    """A streamed answer's events, without what differs between two identical requests
    (their ids and creation times)."""
    parsed: list[Any] = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            parsed.append(data)
            continue
        event = json.loads(data)
        event.pop("id", None)
        event.pop("created", None)
        parsed.append(event)
    return parsed


@BOTH_MODES
async def test_a_completion_goes_where_the_proxy_would_send_it(
    body_mode: BodyMode, tmp_path: Path
) -> None:
    async with gateway(tmp_path, body_mode) as gw, gw.client() as client:
        async with gw.fleet.http() as proxy:
            routed = await proxy.post("/v1/completions", json=completion(), headers=ACME)
        assert routed.status_code == 200
        cached_on = routed.headers["x-kvplane-worker"]
        for _ in range(3):
            answer = await client.post("/v1/completions", json=completion())
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"]
        # The engine that holds the prefix served them: its cache reports the hits.
        await wait_until("handed off", lambda: gw.requests("handed_off") == 3)
        served = gw.fleet.router.metrics.registry.get_sample_value(
            "kvplane_requests_total", {"outcome": "handed_off", "worker": cached_on}
        )
        assert served == 3


@BOTH_MODES
async def test_a_streamed_answer_reaches_the_client_as_the_engine_sent_it(
    body_mode: BodyMode, tmp_path: Path
) -> None:
    body = completion(stream=True)
    async with gateway(tmp_path, body_mode) as gw, gw.client() as client:
        async with gw.fleet.http() as proxy:
            direct = await proxy.post("/v1/completions", json=body, headers=ACME)
        through_envoy = await client.post("/v1/completions", json=body)
        assert through_envoy.status_code == 200
        assert through_envoy.headers["content-type"].startswith("text/event-stream")
        assert events(through_envoy.content) == events(direct.content)
        assert events(through_envoy.content)[-1] == "[DONE]"


@BOTH_MODES
async def test_a_body_sent_in_pieces_is_routed_whole(body_mode: BodyMode, tmp_path: Path) -> None:
    raw = msgspec.json.encode(completion())

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(raw), 100):
            yield raw[start : start + 100]

    async with gateway(tmp_path, body_mode) as gw, gw.client() as client:
        answer = await client.post(
            "/v1/completions", content=pieces(), headers={"content-type": "application/json"}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] > 0


@BOTH_MODES
async def test_refusals_reach_the_client_in_the_openai_shape(
    body_mode: BodyMode, tmp_path: Path
) -> None:
    async with gateway(tmp_path, body_mode) as gw, gw.client() as client:
        invalid = await client.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert invalid.status_code == 400
        assert invalid.json()["error"]["message"] == "the request body is not valid JSON"
        nobody = await client.post(
            "/v1/completions", json=completion(), headers={"authorization": "Bearer sk-nobody"}
        )
        assert nobody.status_code == 401
        assert nobody.headers["www-authenticate"] == "Bearer"
        unknown = await client.post("/v1/completions", json=completion(model="no-such-model"))
        assert unknown.status_code == 404  # the engine's word, as through the proxy
        assert PROMPT not in invalid.text + nobody.text + unknown.text


async def test_no_live_worker_is_a_503_with_retry_after(tmp_path: Path) -> None:
    async with gateway(tmp_path, BodyMode.FULL_DUPLEX, workers=1) as gw, gw.client() as client:
        await gw.fleet.workers[0].stop_agent()
        await wait_until("no candidate", lambda: not gw.fleet.router.pool.candidates())
        answer = await client.post("/v1/completions", json=completion())
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["type"] == "ServiceUnavailableError"


@BOTH_MODES
async def test_a_header_only_request_reaches_an_engine(body_mode: BodyMode, tmp_path: Path) -> None:
    async with gateway(tmp_path, body_mode) as gw, gw.client() as client:
        models = await client.get("/v1/models")
        assert models.status_code == 200
        assert [card["id"] for card in models.json()["data"]] == [MODEL]


@BOTH_MODES
async def test_the_response_phase_option_settles_with_the_answers_usage(
    body_mode: BodyMode, tmp_path: Path
) -> None:
    async with gateway(tmp_path, body_mode, response_body=True) as gw, gw.client() as client:
        for stream in (False, True):
            answer = await client.post("/v1/completions", json=completion(stream=stream))
            assert answer.status_code == 200
        await wait_until("settled", lambda: gw.requests("ok") == 2)
        assert gw.requests("handed_off") == 0
        registry = gw.fleet.router.metrics.registry
        checks = sum(
            registry.get_sample_value(
                "kvplane_prompt_token_checks_total",
                {"worker": worker.worker_id, "model": MODEL, "result": "match"},
            )
            or 0
            for worker in gw.fleet.workers
        )
        assert checks >= 1  # the engine's usage was read and compared
