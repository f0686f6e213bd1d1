"""Bad input on the control plane's gRPC ingest of a running fleet: a router on a real
Redis index with an agent token, two simulated engines whose agents stream to it, and
other streams that send it garbage, oversized or unauthenticated calls, messages out
of order, forged worker ids, values out of range and batches too large.

Each bad stream gets a clear Reject (its code and a reason) and the matching gRPC
status, or gRPC's own status where the bytes never reach the service (a message over
the size limit). Then the legitimate workers' registrations and the lookups of their
cached prompts are what they were, nothing the bad stream sent is in the index, and
the legitimate agents' streams still apply batches (a new prompt's blocks reach the
index) while the proxy still serves.

The same refusals against a bare router (no agents, the in-memory index) one message
at a time are in tests/router/control_plane/test_stream.py and test_auth.py; pure validation
in tests/wire/test_codec.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from pydantic import SecretStr

from kvplane.core.config import ControlPlaneSettings, IndexSettings, Settings
from kvplane.core.keys import SCHEME_VERSION
from kvplane.core.types import MAX_CHAIN_END, BlocksStored, Tier, WorkerInfo
from kvplane.wire.codec import drain_message, events_message, load_message, register_message
from kvplane.wire.stream import CONNECT_METHOD, AgentStream
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.app import running_router
from router.index.base import PrefixMatch, WorkerState
from simulations.local_workers import local_workers
from tests.abuse.conftest import PROBE_PROMPTS, SIM_OPTIONS, block_keys, prime, still_serves
from tests.router.proxy.conftest import MODEL, RoutedFleet, router_settings
from tests.waiting import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

AGENT_TOKEN = "agent-secret"
LEASE_S = 2.0
FORGED_MODEL = "forged-model"  # streams the tests open never serve the fleet's model
BOGUS_KEYS = [0xDEAD0000 + n for n in range(1, 9)]
LEGIT = ("worker-1", "worker-2")


@dataclass(frozen=True)
class Legit:
    """What bad streams must not touch: the agents' registrations, and where the index
    finds each tenant's cached prompt."""

    workers: list[tuple[str, int, WorkerState, int]]  # id, incarnation, state, entries
    lookups: dict[str, dict[str, PrefixMatch]]


async def legit(fleet: RoutedFleet) -> Legit:
    index = fleet.router.index
    return Legit(
        workers=sorted(
            (w.info.worker_id, w.info.incarnation, w.state, w.entries)
            for w in await index.workers()
            if w.info.worker_id in LEGIT
        ),
        lookups={
            tenant: await index.lookup(block_keys(fleet.router, prompt, tenant))
            for tenant, prompt in PROBE_PROMPTS.items()
        },
    )


@dataclass
class Ingest:
    fleet: RoutedFleet
    settings: Settings
    channel: grpc.aio.Channel


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ingest(redis_url: str) -> AsyncIterator[Ingest]:
    index = IndexSettings(
        backend="redis", redis_url=redis_url, redis_prefix=f"abuse-{uuid.uuid4().hex[:8]}"
    )
    control_plane = ControlPlaneSettings(
        grpc_port=0, lease_s=LEASE_S, agent_token=SecretStr(AGENT_TOKEN)
    )
    settings = router_settings(index).model_copy(update={"control_plane": control_plane})
    async with (
        running_router(settings) as router,
        local_workers(
            2,
            grpc_port=router.grpc_port,
            agent_token=SecretStr(AGENT_TOKEN),
            sim_options={"time_scale": 0.0, **SIM_OPTIONS},
        ) as workers,
        grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel,
    ):
        await wait_until(
            "both workers are routable", lambda: len(router.pool.candidates(MODEL)) == 2
        )
        fleet = RoutedFleet(router, workers)
        await prime(fleet)
        yield Ingest(fleet, settings, channel)


@contextlib.asynccontextmanager
async def unchanged(ingest: Ingest, bogus_keys: Sequence[int] = BOGUS_KEYS) -> AsyncIterator[None]:
    """The block's bad streams leave the legitimate workers and lookups as they were and
    put nothing in the index; afterwards the agents' streams still apply batches."""
    fleet = ingest.fleet
    before = await legit(fleet)
    applied = {worker: _applied(fleet, worker) for worker in LEGIT}
    yield
    assert await legit(fleet) == before
    assert await fleet.router.index.lookup(list(bogus_keys)) == {}
    holders = [w.info.worker_id for w in await fleet.router.index.workers() if w.entries]
    assert set(holders) <= set(LEGIT)
    await still_serves(fleet, ("acme", "globex"))
    assert any(_applied(fleet, worker) > applied[worker] for worker in LEGIT)


def _applied(fleet: RoutedFleet, worker_id: str) -> int:
    record = fleet.router.workers.get(worker_id)
    assert record is not None
    return record.applied


def forged(worker_id: str, incarnation: int = 1, **fields: Any) -> WorkerInfo:
    info = WorkerInfo(
        worker_id=worker_id,
        incarnation=incarnation,
        base_url="http://127.0.0.1:9",
        model=FORGED_MODEL,
        block_size=16,
    )
    return dataclasses.replace(info, **fields)


def stream(ingest: Ingest, token: str | None = AGENT_TOKEN) -> AgentStream:
    return AgentStream(ingest.channel, token=token)


async def registered(ingest: Ingest, worker_id: str) -> AgentStream:
    agent = stream(ingest)
    reply = await agent.request(register_message(forged(worker_id)))
    assert reply.ack.sequence == 0, reply
    return agent


async def rejected(agent: AgentStream, code: int, status: grpc.StatusCode) -> str:
    """The next reply is a Reject with `code` and a reason; the call ends with `status`."""
    reply = await agent.reply()
    assert reply.WhichOneof("body") == "reject", reply
    assert reply.reject.code == code, reply
    assert reply.reject.reason
    assert await agent.call.code() == status
    return reply.reject.reason


async def leave(agent: AgentStream) -> None:
    """A bad stream that is still open drains and ends: the worker goes at once."""
    await agent.send(drain_message())
    await agent.close()


def raw_connect(ingest: Ingest) -> grpc.aio.StreamStreamCall[bytes, pb.ControlMessage]:
    connect: grpc.aio.StreamStreamMultiCallable[bytes, pb.ControlMessage]
    connect = ingest.channel.stream_stream(
        CONNECT_METHOD,
        request_serializer=lambda raw: raw,
        response_deserializer=pb.ControlMessage.FromString,
    )
    return connect(metadata=(("authorization", f"Bearer {AGENT_TOKEN}"),))


def stored(keys: Sequence[int], first_position: int = 0, parent: int | None = None) -> BlocksStored:
    return BlocksStored(
        keys=list(keys), tier=Tier.DEVICE, first_position=first_position, parent_key=parent
    )


# -- bytes that are no message, and messages too big -------------------------------------

_REGISTER = register_message(forged("garbage")).SerializeToString()


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff" * 64,
        bytes(range(256)) * 4,
        _REGISTER[: len(_REGISTER) // 2],
        b"\x4a\x03abc",  # field 9, a body no contract version has: no known body
        pb.ControlMessage(ack=pb.Ack(sequence=7)).SerializeToString(),  # the other direction
    ],
    ids=["ff", "noise", "truncated", "unknown-field", "a-reply"],
)
async def test_bytes_that_are_no_agent_message_are_rejected(ingest: Ingest, payload: bytes) -> None:
    async with unchanged(ingest):
        call = raw_connect(ingest)
        await call.write(payload)
        reply = await call.read()
        assert isinstance(reply, pb.ControlMessage)
        assert reply.reject.code == pb.REJECT_CODE_INVALID_MESSAGE
        assert reply.reject.reason
        assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_message_over_the_size_limit_ends_the_call(ingest: Ingest) -> None:
    """gRPC refuses it before the service sees it: no Reject, RESOURCE_EXHAUSTED."""
    limit = ingest.settings.control_plane.max_message_bytes
    async with unchanged(ingest):
        agent = stream(ingest)
        await agent.send(register_message(forged("huge", engine_version="x" * limit)))
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await agent.reply()
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ingest.fleet.router.workers.get("huge") is None


@pytest.mark.parametrize(
    "limit", ["max_batch_events", "max_batch_blocks"], ids=["events", "blocks"]
)
async def test_a_batch_over_the_configured_limits_is_rejected(ingest: Ingest, limit: str) -> None:
    limits = ingest.settings.control_plane
    if limit == "max_batch_events":
        events = [stored([key]) for key in range(1, limits.max_batch_events + 2)]
    else:
        half = limits.max_batch_blocks // 2 + 1
        events = [stored(range(1, half + 1)), stored(range(half + 1, 2 * half + 1))]
    async with unchanged(ingest, bogus_keys=[1, 2, limits.max_batch_blocks]):
        agent = await registered(ingest, f"too-big-{limit}")
        await agent.send(events_message(1, events))
        reason = await rejected(
            agent, pb.REJECT_CODE_BATCH_TOO_LARGE, grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert "at most" in reason


# -- who may speak ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        (("authorization", "Bearer wrong-token"),),
        (("authorization", f"Basic {AGENT_TOKEN}"),),
        (("authorization", f"Bearer {AGENT_TOKEN}x"),),
    ],
    ids=["none", "wrong", "basic-scheme", "longer"],
)
async def test_a_stream_without_the_agent_token_is_refused(
    ingest: Ingest, metadata: tuple[tuple[str, str], ...] | None
) -> None:
    async with unchanged(ingest):
        connect = ingest.channel.stream_stream(
            CONNECT_METHOD,
            request_serializer=pb.AgentMessage.SerializeToString,
            response_deserializer=pb.ControlMessage.FromString,
        )
        call = connect(metadata=metadata)
        # Claiming a live worker's id with a newer incarnation: refused all the same.
        await call.write(register_message(forged("worker-1", incarnation=2**63)))
        reply = await call.read()
        assert isinstance(reply, pb.ControlMessage)
        assert reply.reject.code == pb.REJECT_CODE_UNAUTHENTICATED
        assert "token" in reply.reject.reason
        assert await call.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "message",
    [
        events_message(1, [stored(BOGUS_KEYS)]),
        load_message(running=0, waiting=0, kv_usage=0.0),
        drain_message(),
    ],
    ids=["kv_events", "load", "drain"],
)
async def test_nothing_before_register_is_applied(ingest: Ingest, message: pb.AgentMessage) -> None:
    async with unchanged(ingest):
        agent = stream(ingest)
        await agent.send(message)
        await rejected(agent, pb.REJECT_CODE_NOT_REGISTERED, grpc.StatusCode.FAILED_PRECONDITION)


async def test_a_forged_worker_id_with_an_older_incarnation_is_refused(ingest: Ingest) -> None:
    """The contract (docs/wire-contract.md): anything carrying an incarnation lower than
    the worker's current one is refused; the live worker keeps its entries and stream."""
    live = ingest.fleet.router.workers.get("worker-1")
    assert live is not None
    async with unchanged(ingest):
        agent = stream(ingest)
        await agent.send(register_message(forged("worker-1", incarnation=live.incarnation - 1)))
        await agent.send(events_message(1, [stored(BOGUS_KEYS)]))  # never read
        reason = await rejected(
            agent, pb.REJECT_CODE_STALE_INCARNATION, grpc.StatusCode.FAILED_PRECONDITION
        )
        assert "older" in reason


async def test_a_forged_worker_id_with_a_newer_incarnation_is_taken_back_at_once(
    ingest: Ingest,
) -> None:
    """The contract trusts whoever holds the agent token to speak for any worker: a
    higher incarnation is that worker restarted, and replaces everything of the lower
    one. What it promises against a forger is that the real agent, refused as stale on
    its next message, starts a newer incarnation (its clock, in ns) with its whole
    picture: the forger's entries go with the forged incarnation, the worker's come
    back, and the forger is refused from then on."""
    fleet = ingest.fleet
    live = fleet.router.workers.get("worker-1")
    assert live is not None
    before = await legit(fleet)
    forger = stream(ingest)
    claim = forged(
        "worker-1",
        incarnation=live.incarnation + 1,
        model=MODEL,
        base_url=fleet.worker("worker-1").base_url,
    )
    assert (await forger.request(register_message(claim))).ack.sequence == 0
    assert (await forger.request(events_message(1, [stored(BOGUS_KEYS)]))).ack.sequence == 1
    assert set(await fleet.router.index.lookup(BOGUS_KEYS)) == {"worker-1"}

    async def taken_back() -> bool:
        record = fleet.router.workers.get("worker-1")
        return record is not None and record.incarnation > claim.incarnation

    await wait_until("the real agent registers a newer incarnation", taken_back)

    async def its_blocks_are_back() -> bool:
        now = await legit(fleet)
        return found(now.lookups) == found(before.lookups) and [
            (worker_id, state, entries) for worker_id, _, state, entries in now.workers
        ] == [(worker_id, state, entries) for worker_id, _, state, entries in before.workers]

    await wait_until("all worker-1's blocks are back in the index", its_blocks_are_back)
    assert await fleet.router.index.lookup(BOGUS_KEYS) == {}
    await forger.send(load_message(running=0, waiting=0, kv_usage=0.0))
    await rejected(forger, pb.REJECT_CODE_STALE_INCARNATION, grpc.StatusCode.FAILED_PRECONDITION)
    await still_serves(fleet, ("acme", "globex"))


def found(lookups: dict[str, dict[str, PrefixMatch]]) -> dict[str, dict[str, object]]:
    """Who holds how much of each prompt, whatever the incarnation."""
    return {
        tenant: {worker: (match.blocks, dict(match.by_tier)) for worker, match in matches.items()}
        for tenant, matches in lookups.items()
    }


# -- sequences and values out of range ---------------------------------------------------


async def test_sequences_going_back_or_jumping_are_ignored_or_drop_the_stream(
    ingest: Ingest,
) -> None:
    """A resend (going back) is acked and not applied again; a jump drops everything of
    the incarnation and asks for a resync; sequence 0 is invalid. Other workers never
    notice."""
    index = ingest.fleet.router.index
    async with unchanged(ingest):
        agent = await registered(ingest, "jumper")
        assert (await agent.request(events_message(1, [stored(BOGUS_KEYS[:4])]))).ack.sequence == 1
        assert set(await index.lookup(BOGUS_KEYS[:4])) == {"jumper"}
        # Back to 1, with other blocks: a duplicate by its number, so not applied.
        again = await agent.request(events_message(1, [stored(BOGUS_KEYS[4:])]))
        assert again.ack.sequence == 1
        assert await index.lookup(BOGUS_KEYS[4:]) == {}
        # A jump: the control plane no longer knows the worker's state.
        jump = await agent.request(events_message(5, [stored(BOGUS_KEYS[4:])]))
        assert jump.WhichOneof("body") == "resync"
        assert jump.resync.reason.startswith("sequence_gap:")
        assert await index.lookup(BOGUS_KEYS) == {}
        # The same stream, registered anew, then sequence 0.
        assert (await agent.request(register_message(forged("jumper", 2)))).ack.sequence == 0
        await agent.send(events_message(0, [stored(BOGUS_KEYS)]))
        reason = await rejected(
            agent, pb.REJECT_CODE_INVALID_MESSAGE, grpc.StatusCode.INVALID_ARGUMENT
        )
        assert "sequence" in reason


def _wire_batch(*events: pb.KvEvent) -> pb.AgentMessage:
    return pb.AgentMessage(kv_events=pb.KvEvents(sequence=1, events=list(events)))


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (
            _wire_batch(
                pb.KvEvent(
                    stored=pb.BlocksStored(
                        keys=BOGUS_KEYS[:2],
                        parent_key=7,
                        first_position=MAX_CHAIN_END - 1,
                        tier=pb.TIER_DEVICE,
                    )
                )
            ),
            "chain positions",
        ),
        (
            _wire_batch(
                pb.KvEvent(
                    stored=pb.BlocksStored(keys=BOGUS_KEYS, parent_key=7, tier=pb.TIER_DEVICE)
                )
            ),
            "first_position",
        ),
        (
            _wire_batch(pb.KvEvent(stored=pb.BlocksStored(keys=BOGUS_KEYS, tier=99))),  # type: ignore[arg-type]
            "tier",
        ),
        (_wire_batch(pb.KvEvent(stored=pb.BlocksStored(tier=pb.TIER_DEVICE))), "without keys"),
        (
            _wire_batch(
                pb.KvEvent(stored=pb.BlocksStored(keys=BOGUS_KEYS, tier=pb.TIER_DEVICE)),
                pb.KvEvent(),  # an event with no body, after a good one: the batch goes
            ),
            "event 1",
        ),
        (load_message(running=2**32 - 1, waiting=0, kv_usage=float("nan")), "kv_usage"),
        (load_message(running=0, waiting=0, kv_usage=1.5), "kv_usage"),
        (register_message(forged("out-of-range", block_size=8)), "block_size"),
        (register_message(forged("out-of-range"), key_scheme_version=SCHEME_VERSION + 1), "key"),
        (register_message(forged("out-of-range", incarnation=0)), "incarnation"),
        (register_message(forged("bad id!")), "worker_id"),
        (register_message(forged("out-of-range", base_url="file:///etc/passwd")), "base_url"),
    ],
    ids=[
        "chain-past-2^32",
        "parent-at-position-0",
        "unknown-tier",
        "no-keys",
        "empty-event",
        "nan-usage",
        "usage-over-1",
        "block-size",
        "key-scheme",
        "incarnation-0",
        "worker-id",
        "base-url",
    ],
)
async def test_values_out_of_range_are_rejected(
    ingest: Ingest, message: pb.AgentMessage, says: str
) -> None:
    async with unchanged(ingest):
        if message.WhichOneof("body") == "register":
            agent = stream(ingest)
        else:  # a batch or a load report needs a registered worker to be read at all
            agent = await registered(ingest, f"out-of-range-{uuid.uuid4().hex[:6]}")
        await agent.send(message)
        reply = await agent.reply()
        assert reply.WhichOneof("body") == "reject", reply
        assert reply.reject.code in (pb.REJECT_CODE_INVALID_MESSAGE, pb.REJECT_CODE_INCOMPATIBLE)
        assert says in reply.reject.reason
        assert await agent.call.code() in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
        )


async def test_extreme_but_valid_values_stay_with_their_worker(ingest: Ingest) -> None:
    """Keys 0 and 2^64-1, the last chain position, the largest capacity and an incarnation
    near the furthest ahead of the router's clock it accepts are valid: they are indexed
    for the worker that sent them, and for no other. (An incarnation further ahead is
    refused: test_auth.py.)"""
    extreme = [0, 2**64 - 1]
    index = ingest.fleet.router.index
    ahead = int((time.time() + ControlPlaneSettings().max_incarnation_ahead_s - 5) * 1e9)
    async with unchanged(ingest, bogus_keys=extreme):
        agent = stream(ingest)
        info = forged("extreme", incarnation=ahead, kv_capacity_blocks=2**64 - 1)
        assert (await agent.request(register_message(info))).ack.sequence == 0
        batch = [stored(extreme), stored([5], first_position=MAX_CHAIN_END - 1, parent=2**64 - 1)]
        assert (await agent.request(events_message(1, batch))).ack.sequence == 1
        assert set(await index.lookup(extreme)) == {"extreme"}
        assert (await index.lookup(extreme))["extreme"].blocks == 2
        status = next(w for w in await index.workers() if w.info.worker_id == "extreme")
        assert (status.info.incarnation, status.info.kv_capacity_blocks) == (ahead, 2**64 - 1)
        await leave(agent)

        async def dropped() -> bool:
            return all(w.info.worker_id != "extreme" for w in await index.workers())

        await wait_until("the drained worker is dropped", dropped)
