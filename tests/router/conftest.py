"""A real router on free loopback ports, real gRPC channels to it, and helpers to
build agents' messages and to compare the index before and after."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
import pytest

from kvplane.core.clock import Clock, WallClock
from kvplane.core.config import ControlPlaneSettings, HttpSettings, IndexSettings, Settings
from kvplane.core.keys import KeyNamespace, block_keys
from kvplane.core.types import BlocksStored, Tier, WorkerInfo
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.app import RunningRouter, running_router
from router.index.base import LocationIndex, PrefixMatch, WorkerState

BLOCK_SIZE = 4
MODEL = "test-model"
NAMESPACE = KeyNamespace(model=MODEL, block_size=BLOCK_SIZE)


def make_settings(index: IndexSettings | None = None, **control_plane: Any) -> Settings:
    return Settings(
        index=index or IndexSettings(),
        control_plane=ControlPlaneSettings(grpc_port=0, block_size=BLOCK_SIZE, **control_plane),
        http=HttpSettings(port=0),
    )


@contextlib.asynccontextmanager
async def router_with_channel(
    settings: Settings, *, clock: Clock = time.monotonic, wall_clock: WallClock = time.time
) -> AsyncIterator[tuple[RunningRouter, grpc.aio.Channel]]:
    async with (
        running_router(settings, clock=clock, wall_clock=wall_clock) as router,
        grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel,
    ):
        yield router, channel


@pytest.fixture
async def router_and_channel() -> AsyncIterator[tuple[RunningRouter, grpc.aio.Channel]]:
    async with router_with_channel(make_settings()) as pair:
        yield pair


@pytest.fixture
def router(router_and_channel: tuple[RunningRouter, grpc.aio.Channel]) -> RunningRouter:
    return router_and_channel[0]


@pytest.fixture
def channel(router_and_channel: tuple[RunningRouter, grpc.aio.Channel]) -> grpc.aio.Channel:
    return router_and_channel[1]


def worker(worker_id: str = "w1", incarnation: int = 1, **fields: Any) -> WorkerInfo:
    info = WorkerInfo(
        worker_id=worker_id,
        incarnation=incarnation,
        base_url="http://127.0.0.1:8000",
        model=MODEL,
        block_size=BLOCK_SIZE,
    )
    return dataclasses.replace(info, **fields)


def prompt_keys(seed: int, blocks: int = 3) -> list[int]:
    """Block keys of a prompt of `blocks` full blocks; different seeds share nothing."""
    return block_keys([seed * 1000 + i for i in range(blocks * BLOCK_SIZE)], NAMESPACE)


def stored(keys: Sequence[int], tier: Tier = Tier.DEVICE) -> BlocksStored:
    return BlocksStored(keys=list(keys), tier=tier)


def body(reply: pb.ControlMessage) -> object:
    """Which reply it is: "ack", "resync" or "reject"."""
    return reply.WhichOneof("body")


@dataclasses.dataclass(frozen=True)
class IndexSnapshot:
    """What a test compares to show that the index did not change."""

    keys: int
    entries: int
    workers: list[tuple[str, int, WorkerState, int]]  # id, incarnation, state, entries
    lookups: list[dict[str, PrefixMatch]]


async def snapshot(index: LocationIndex, probes: Sequence[Sequence[int]]) -> IndexSnapshot:
    stats = await index.stats()
    return IndexSnapshot(
        keys=stats.keys,
        entries=stats.entries,
        workers=sorted(
            (w.info.worker_id, w.info.incarnation, w.state, w.entries)
            for w in await index.workers()
        ),
        lookups=[await index.lookup(keys) for keys in probes],
    )
