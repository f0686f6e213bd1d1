"""`POST /fleet/check` against workers that lie: an agent that reports its events
flowing when nothing reaches the index, an engine that answers with far too much, one
that fails. Real gRPC streams for the agents, real HTTP for the engines."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc.aio
import httpx
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvplane.core.serving import bind_http, serving_http
from kvplane.core.tokenizer import load_tokenizer
from kvplane.core.types import EventsState, ReplayState, WiringReport
from kvplane.wire.codec import load_message, register_message
from kvplane.wire.stream import AgentStream
from router.app import running_router
from router.probe import MAX_ANSWER_BYTES
from tests.router.conftest import BLOCK_SIZE, make_settings, worker

ADMIN = {"authorization": "Bearer check-admin"}
FLOWING = WiringReport(EventsState.FLOWING, ReplayState.OK, engine_block_size=BLOCK_SIZE)


async def _completion(request: Request) -> Response:
    """Counts the prompt as the router does, caches nothing anyone hears of."""
    prompt = json.loads(await request.body())["prompt"]
    tokens = len(load_tokenizer().completion_tokens(prompt))
    return JSONResponse({"choices": [{"text": "x"}], "usage": {"prompt_tokens": tokens}})


async def _flood(request: Request) -> Response:
    return Response(b"x" * (MAX_ANSWER_BYTES + 1), media_type="application/json")


async def _fail(request: Request) -> Response:
    return Response(status_code=500)


ENGINES = Starlette(
    routes=[
        Route("/quiet/v1/completions", _completion, methods=["POST"]),
        Route("/flood/v1/completions", _flood, methods=["POST"]),
        Route("/failing/v1/completions", _fail, methods=["POST"]),
    ]
)


@contextlib.asynccontextmanager
async def fleet_check() -> AsyncIterator[dict[str, dict[str, Any]]]:
    """A router with three workers, each on one of the engines above, whose agents all
    say their events flow; yields the fleet check's rows by worker."""
    settings = make_settings()
    settings = settings.model_copy(
        update={"http": settings.http.model_copy(update={"admin_token": SecretStr("check-admin")})}
    )
    async with (
        serving_http((ENGINES, bind_http("127.0.0.1", 0))) as (engine_port,),
        running_router(settings) as router,
        grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel,
    ):
        streams = []
        for name in ("quiet", "flood", "failing"):
            stream = AgentStream(channel)
            base_url = f"http://127.0.0.1:{engine_port}/{name}"
            await stream.request(
                register_message(dataclasses.replace(worker(name), base_url=base_url))
            )
            await stream.send(load_message(0, 0, 0.0, wiring=FLOWING))
            streams.append(stream)
        await router.pool.refresh()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as http:
            answer = await http.post(
                "/fleet/check", params={"wait_s": 0.5}, headers=ADMIN, timeout=30
            )
        assert answer.status_code == 200
        verdict = answer.json()
        assert not verdict["ok"]
        yield {row["worker_id"]: row for row in verdict["workers"]}


def _checks(row: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {check["name"]: check for check in row["checks"]}


async def test_an_agent_that_says_its_events_flow_is_caught_by_the_probe() -> None:
    async with fleet_check() as rows:
        quiet = _checks(rows["quiet"])
    assert quiet["events"]["status"] == "pass"  # the agent's word
    assert quiet["block_size"]["status"] == "pass"
    assert quiet["probe_tokenizer"]["status"] == "pass"
    assert quiet["probe_index"]["status"] == "fail"  # what the router sees
    assert rows["quiet"]["blind"]


async def test_an_engine_that_floods_or_fails_the_probe_fails_it_without_blinding() -> None:
    async with fleet_check() as rows:
        flood, failing = _checks(rows["flood"]), _checks(rows["failing"])
    assert flood["probe_send"]["status"] == "fail"
    assert f"ran past {MAX_ANSWER_BYTES} bytes" in flood["probe_send"]["detail"]
    assert failing["probe_send"]["status"] == "fail"
    assert "500" in failing["probe_send"]["detail"]
    # Nothing was learnt about their caches: not blind on that account.
    assert not rows["flood"]["blind"]
    assert not rows["failing"]["blind"]
