"""`kvplane demo`: a smoke run of the control plane, until the full demo exists.

It starts a router in this process on free loopback ports, connects two simulated
agents over real gRPC, streams the KV events of a few prompts, queries the index the
way the router will, and shows /readyz and /metrics.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc.aio

from kvplane.config import Settings
from kvplane.keys import KeyNamespace, block_keys
from kvplane.v1 import control_plane_pb2 as pb
from router.app import RunningRouter, running_router
from router.control_plane.client import (
    AgentStream,
    drain_message,
    events_message,
    load_message,
    register_message,
)
from router.index.base import BlocksStored, Tier, WorkerInfo, WorkerState

MODEL = "demo-model"
_SYSTEM_BLOCKS = 4  # blocks of the shared system prompt every demo prompt starts with
_WAIT_S = 3.0
_UNSHOWN_SERIES = ("_created", "_bucket")  # creation times and histogram buckets: noise here


@dataclass(frozen=True, slots=True)
class _Agent:
    worker_id: str
    tier: Tier
    prompts: Sequence[Sequence[int]]


def _prompt(block_size: int, *parts: int) -> list[int]:
    """A synthetic prompt: the shared system prompt, then one question block per part."""
    tokens = list(range(1000, 1000 + _SYSTEM_BLOCKS * block_size))
    for part in parts:
        tokens += [part * 100_000 + i for i in range(block_size)]
    return tokens


def _newly_stored(keys: Sequence[int], held: set[int], tier: Tier) -> BlocksStored:
    """What an engine reports after caching a prompt: the blocks it did not hold yet,
    chained onto the prefix it held (prompts here share their start, never a middle)."""
    first = next((i for i, key in enumerate(keys) if key not in held), len(keys))
    held.update(keys)
    return BlocksStored(
        keys=keys[first:],
        tier=tier,
        first_position=first,
        parent_key=keys[first - 1] if first else None,
    )


async def run_demo(settings: Settings) -> int:
    try:
        await _demo(_demo_settings(settings))
    except Exception as error:  # the demo's one job is to say clearly what failed
        print(f"demo failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def _demo_settings(settings: Settings) -> Settings:
    """Free loopback ports and plaintext gRPC: the agents live in this process and have
    no client certificate. The index backend and the agent token are kept."""
    control_plane = settings.control_plane.model_copy(
        update={
            "grpc_host": "127.0.0.1",
            "grpc_port": 0,
            "tls_cert_file": None,
            "tls_key_file": None,
            "tls_client_ca_file": None,
        }
    )
    http = settings.http.model_copy(update={"host": "127.0.0.1", "port": 0})
    return settings.model_copy(update={"control_plane": control_plane, "http": http})


async def _demo(settings: Settings) -> None:
    cp = settings.control_plane
    namespace = KeyNamespace(model=MODEL, block_size=cp.block_size)
    token = None if cp.agent_token is None else cp.agent_token.get_secret_value()
    agents = [
        _Agent(
            "demo-worker-a", Tier.DEVICE, [_prompt(cp.block_size, 1, 2), _prompt(cp.block_size, 3)]
        ),
        _Agent("demo-worker-b", Tier.HOST, [_prompt(cp.block_size, 4)]),
    ]
    sample = _prompt(cp.block_size, 1, 2, 5)
    started = time.monotonic()
    async with running_router(settings) as router:
        print("kvplane control-plane demo")
        print(
            f"router: gRPC 127.0.0.1:{router.grpc_port}, HTTP 127.0.0.1:{router.http_port}, "
            f"index {settings.index.backend}, block size {cp.block_size}"
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
            streams = [AgentStream(channel, token=token) for _ in agents]
            for agent, stream in zip(agents, streams, strict=True):
                await _run_agent(agent, stream, namespace)
            await streams[1].send(drain_message())
            await _show_state(router, block_keys(sample, namespace))
            status, body = await _http_get(router, "/readyz")
            print(f"GET /readyz -> {status} {body}")
            status, metrics = await _http_get(router, "/metrics")
            print(f"GET /metrics -> {status}, its kvplane series:")
            for line in metrics.splitlines():
                name = line.partition("{")[0].partition(" ")[0]
                if name.startswith("kvplane_") and not name.endswith(_UNSHOWN_SERIES):
                    print(f"  {line}")
            await streams[1].close()
            await _wait_dropped(router, agents[1].worker_id)
            print(f"{agents[1].worker_id} closed its stream while draining: dropped from the index")
            await streams[0].close()
            await router.index.drop_worker(agents[0].worker_id)  # leave a shared index clean
    print(f"demo finished in {time.monotonic() - started:.1f} s")


async def _run_agent(agent: _Agent, stream: AgentStream, namespace: KeyNamespace) -> None:
    info = WorkerInfo(
        worker_id=agent.worker_id,
        incarnation=time.time_ns(),
        base_url=f"http://127.0.0.1:8000/{agent.worker_id}",
        model=MODEL,
        block_size=namespace.block_size,
        engine_kind="demo",
    )
    reply = await stream.request(register_message(info))  # the scheme block_keys hashes with
    if reply.WhichOneof("body") != "ack":
        raise RuntimeError(f"{agent.worker_id}: Register answered with {_describe(reply)}")
    held: set[int] = set()
    for sequence, prompt in enumerate(agent.prompts, start=1):
        stored = _newly_stored(block_keys(prompt, namespace), held, agent.tier)
        reply = await stream.request(events_message(sequence, [stored]))
        if reply.WhichOneof("body") != "ack" or reply.ack.sequence != sequence:
            raise RuntimeError(
                f"{agent.worker_id}: batch {sequence} answered with {_describe(reply)}"
            )
    await stream.send(load_message(running=len(agent.prompts), waiting=0, kv_usage=0.25))
    print(f"agent {agent.worker_id}: registered, {len(agent.prompts)} batches acked, load sent")


def _describe(reply: pb.ControlMessage) -> str:
    if reply.HasField("reject"):
        return f"Reject {pb.RejectCode.Name(reply.reject.code)}: {reply.reject.reason}"
    if reply.HasField("resync"):
        return f"Resync: {reply.resync.reason}"
    return f"Ack {reply.ack.sequence}"


async def _show_state(router: RunningRouter, sample_keys: Sequence[int]) -> None:
    async def load_and_drain_seen() -> bool:  # neither gets a reply
        records = router.workers.records()
        return all(r.last_load is not None for r in records) and any(
            r.state is WorkerState.DRAINING for r in records
        )

    await _wait_for("the router to take the load reports and the drain", load_and_drain_seen)
    states = {r.info.worker_id: r.state.value for r in router.workers.records()}
    print("workers in the index:")
    for status in sorted(await router.index.workers(), key=lambda s: s.info.worker_id):
        print(
            f"  {status.info.worker_id}  state {status.state.value:<8} "
            f"entries {status.entries:>3}  lease {status.lease_remaining_s:.1f} s  "
            f"(this router: {states.get(status.info.worker_id, '-')})"
        )
    matches = await router.index.lookup(sample_keys)
    print(f"lookup of a sample prompt ({len(sample_keys)} blocks), longest prefix per worker:")
    for worker_id, match in sorted(matches.items()):
        tiers = ", ".join(f"{tier.name.lower()} {n}" for tier, n in sorted(match.by_tier.items()))
        print(f"  {worker_id}  {match.blocks} blocks ({tiers})")


async def _wait_for(what: str, condition: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _wait_dropped(router: RunningRouter, worker_id: str) -> None:
    async def dropped() -> bool:
        return all(status.info.worker_id != worker_id for status in await router.index.workers())

    await _wait_for(f"{worker_id} to be dropped after its drained stream closed", dropped)


async def _http_get(router: RunningRouter, path: str) -> tuple[int, str]:
    """GET over real HTTP; the standard library suffices and keeps httpx a test-only
    dependency."""
    url = f"http://127.0.0.1:{router.http_port}{path}"

    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:  # a 503 from /readyz still has a body
            return error.code, error.read().decode()

    return await asyncio.to_thread(get)
