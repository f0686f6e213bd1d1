"""Attacks on worker identity against a running fleet whose agents each hold their own
worker's credential (control_plane.worker_credential_secret): another worker's
credential, an engine address where the agent is not, an incarnation far ahead, and a
worker announcing blocks its engine does not hold to draw a tenant's traffic. Each is
refused, or (the last, which no router can refuse) costs the attacker its cache credit,
visibly; the fleet serves throughout.

The same refusals against a bare router are in tests/router/control_plane/test_auth.py."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import httpx
import pytest
import pytest_asyncio
from pydantic import SecretStr

from kvplane.core.types import BlocksStored, Tier, WorkerInfo
from kvplane.core.worker_credentials import worker_token
from kvplane.wire.codec import events_message, load_message, register_message
from kvplane.wire.stream import AgentStream
from kvplane.wire.v1 import control_plane_pb2 as pb
from simulations.engine_sim.app import running_engine_sim
from simulations.engine_sim.config import EngineSimConfig
from tests.abuse.conftest import ADMIN, auth, block_keys, still_serves
from tests.metrics_text import sample_sum
from tests.router.proxy.conftest import MODEL, RoutedFleet, routed_fleet, router_settings
from tests.waiting import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

SECRET = "abuse-worker-credential-secret-0123456789"
_incarnations = itertools.count(10**18)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[RoutedFleet]:
    settings = router_settings()
    settings = settings.model_copy(
        update={
            "control_plane": settings.control_plane.model_copy(
                update={"worker_credential_secret": SecretStr(SECRET)}
            ),
            "proxy": settings.proxy.model_copy(
                update={"suspect_after_misses": 2, "withdraw_credit_after_suspicions": 2}
            ),
        }
    )
    async with routed_fleet(2, settings) as fleet:  # the agents present their own tokens
        yield fleet


def claim(fleet: RoutedFleet, worker_id: str, **fields: object) -> WorkerInfo:
    """`worker_id` registering as its real agent would, but for `fields`."""
    record = fleet.router.workers.get(worker_id)
    info = (
        record.info
        if record is not None
        else WorkerInfo(
            worker_id=worker_id, incarnation=1, base_url="http://127.0.0.1:9", model=MODEL,
            block_size=16,
        )
    )  # fmt: skip
    return dataclasses.replace(info, incarnation=next(_incarnations), **fields)


async def refused(fleet: RoutedFleet, token: str, info: WorkerInfo) -> pb.Reject:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fleet.router.grpc_port}") as channel:
        reply = await AgentStream(channel, token=token).request(register_message(info))
    assert reply.WhichOneof("body") == "reject", reply
    return reply.reject


async def registrations(fleet: RoutedFleet) -> list[tuple[str, int, str]]:
    return sorted(
        (s.info.worker_id, s.info.incarnation, s.info.base_url)
        for s in await fleet.router.index.workers()
    )


async def test_another_workers_credential_cannot_register_or_take_over(
    fleet: RoutedFleet,
) -> None:
    before = await registrations(fleet)
    mine = worker_token(SECRET, "worker-1")
    thief = "http://127.0.0.1:9"  # the attacker's own server
    for token, target in [(mine, "worker-2"), (mine, "someone-new"), ("", "worker-1")]:
        reject = await refused(fleet, token, claim(fleet, target, base_url=thief))
        assert reject.code == pb.REJECT_CODE_UNAUTHENTICATED
    assert await registrations(fleet) == before
    await still_serves(fleet, ("acme", "globex"))


async def test_a_valid_credential_cannot_point_its_worker_at_a_foreign_engine(
    fleet: RoutedFleet,
) -> None:
    before = await registrations(fleet)
    elsewhere = claim(fleet, "worker-1", base_url="http://203.0.113.9:8000")
    reject = await refused(fleet, worker_token(SECRET, "worker-1"), elsewhere)
    assert reject.code == pb.REJECT_CODE_INCOMPATIBLE
    assert "allowed_engine_hosts" in reject.reason
    assert await registrations(fleet) == before


async def test_a_maximal_incarnation_cannot_fence_the_real_agent_out(fleet: RoutedFleet) -> None:
    before = await registrations(fleet)
    fence = dataclasses.replace(claim(fleet, "worker-1"), incarnation=2**64 - 1)
    reject = await refused(fleet, worker_token(SECRET, "worker-1"), fence)
    assert reject.code == pb.REJECT_CODE_INCOMPATIBLE
    assert await registrations(fleet) == before
    await still_serves(fleet)


async def test_a_worker_claiming_blocks_it_does_not_hold_loses_its_cache_credit(
    fleet: RoutedFleet,
) -> None:
    """Mallory holds a valid credential and a real engine, caches one prompt of acme's
    honestly (so that its engine's reports are read), and announces the blocks of prompts
    acme is about to send (it has seen acme's salt) to draw them. Each time its claims
    fail and it turns suspect it starts a new incarnation, as a fresh start; the second
    time its cache credit is withdrawn, new incarnations included."""
    honest = "acme's standing instructions, cached where mallory says. " * 6
    prompts = [f"acme's report number {n}, paragraph after paragraph. " * 6 for n in range(6)]
    acme = fleet.router.tenants.get("acme")
    assert acme is not None
    config = EngineSimConfig(
        port=0, time_scale=0.0, num_gpu_blocks_override=256, enable_prompt_tokens_details=True
    )
    async with (
        running_engine_sim(config) as engine,
        grpc.aio.insecure_channel(f"127.0.0.1:{fleet.router.grpc_port}") as channel,
        httpx.AsyncClient(base_url=fleet.url, timeout=30) as http,
    ):
        warm = {"model": MODEL, "prompt": honest, "max_tokens": 1, "cache_salt": acme.cache_salt}
        assert (await http.post(engine.base_url + "/v1/completions", json=warm)).status_code == 200

        async def complete(prompt: str) -> tuple[str, int]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            answer = await http.post("/v1/completions", json=body, headers=auth("acme"))
            assert answer.status_code == 200
            return answer.headers["x-kvplane-worker"], int(
                answer.headers["x-kvplane-cached-tokens"]
            )

        async def incarnation(claims: list[str]) -> AgentStream:
            """Mallory registers anew and claims `honest` and `claims`."""
            stream = AgentStream(channel, token=worker_token(SECRET, "mallory"))
            info = claim(fleet, "mallory", base_url=engine.base_url)
            assert (await stream.request(register_message(info))).ack.sequence == 0
            stored = [
                BlocksStored(keys=block_keys(fleet.router, prompt, "acme"), tier=Tier.DEVICE)
                for prompt in [honest, *claims]
            ]
            assert (await stream.request(events_message(1, stored))).ack.sequence == 1
            await stream.send(load_message(running=0, waiting=0, kv_usage=0.0))

            def routable() -> bool:
                return any(
                    c.info.worker_id == "mallory" and c.info.incarnation == info.incarnation
                    for c in fleet.router.pool.candidates()
                )

            await wait_until("mallory's new incarnation is a candidate", routable)
            return stream

        streams = []
        for round_ in range(2):
            streams.append(await incarnation(prompts[2 * round_ : 2 * round_ + 2]))
            worker, cached = await complete(honest)
            assert worker == "mallory"
            assert cached > 0
            # Its claims draw acme's prompts; its engine finds nothing of them.
            for prompt in prompts[2 * round_ : 2 * round_ + 2]:
                worker, cached = await complete(prompt)
                assert worker == "mallory"
                assert cached > 0
        # Withdrawn: a third incarnation's claims are in the index, and count for nothing.
        streams.append(await incarnation(prompts[4:]))
        for prompt in prompts[4:]:
            query = {"model": MODEL, "prompt": prompt, "tenant": "acme"}
            locality = (await http.post("/fleet/locality", json=query, headers=ADMIN)).json()
            row = next(row for row in locality["workers"] if row["worker_id"] == "mallory")
            assert sum(row["matched_tokens"].values()) > 0
            assert row["saved_tokens"] == 0
            assert row["eligible"] is True  # still served on its load: only its claims are out
        workers = (await http.get("/fleet/workers", headers=ADMIN)).json()["workers"]
        row = next(row for row in workers if row["worker_id"] == "mallory")
        assert row["suspect"] is True
        assert row["credit_withdrawn_for_s"] > 0
        metrics = (await http.get("/metrics", headers=ADMIN)).text
        assert sample_sum(metrics, "kvplane_worker_credit_withdrawn", worker="mallory") == 1
        assert sample_sum(metrics, "kvplane_worker_suspicions_total", worker="mallory") == 2
        for stream in streams:
            await stream.close()
    await still_serves(fleet)
