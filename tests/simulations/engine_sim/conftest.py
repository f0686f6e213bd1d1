"""Simulators started in the test's own event loop, on free ports, with real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import zmq
import zmq.asyncio

from simulations.engine_sim.app import RunningEngineSim, running_engine_sim
from simulations.engine_sim.config import EngineSimConfig, KVEventsConfig
from tests.metrics_text import sample_sum

EVENTS = KVEventsConfig(
    enable_kv_cache_events=True,
    endpoint="tcp://127.0.0.1:*",
    replay_endpoint="tcp://127.0.0.1:*",
    topic="kv-events",
)
END = b"\xff" * 8


@contextlib.asynccontextmanager
async def engine_sim(**settings: Any) -> AsyncIterator[RunningEngineSim]:
    options: dict[str, Any] = {"port": 0, "time_scale": 0.0, "kv_events_config": EVENTS}
    options.update(settings)
    async with running_engine_sim(EngineSimConfig(**options)) as running:
        yield running


class Subscriber:
    """A SUB socket on the simulator's PUB endpoint, collecting whole messages."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)

    async def ready(self) -> None:
        # ZMQ's slow joiner: the subscription needs a moment to reach the publisher.
        await asyncio.sleep(0.3)

    async def receive(self, timeout_s: float = 5.0) -> list[bytes]:
        async with asyncio.timeout(timeout_s):
            frames: list[bytes] = await self._socket.recv_multipart()
            return frames

    async def drain(self, quiet_s: float = 0.3) -> list[list[bytes]]:
        """Every message until none arrives for `quiet_s`."""
        messages = []
        while True:
            try:
                messages.append(await self.receive(quiet_s))
            except TimeoutError:
                return messages

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


@contextlib.asynccontextmanager
async def subscribed(sim: RunningEngineSim) -> AsyncIterator[Subscriber]:
    """A subscriber to the simulator's KV events, ready to receive."""
    assert sim.events_endpoint is not None
    subscriber = Subscriber(sim.events_endpoint)
    try:
        await subscriber.ready()
        yield subscriber
    finally:
        subscriber.close()


async def replay(endpoint: str, start: int, timeout_s: float = 5.0) -> list[list[bytes]]:
    """Ask the replay socket for everything from `start`; returns every reply message,
    the end marker included."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        async with asyncio.timeout(timeout_s):
            while True:
                frames = await dealer.recv_multipart()
                replies.append(frames)
                if END in frames:
                    return replies
    finally:
        dealer.close(linger=0)
        context.term()


def decode_payload(payload: bytes) -> Any:
    return msgspec.msgpack.decode(payload)


def refused_at_start_up(*flags: str) -> str:
    """`kvplane engine-sim` with `flags`, which must refuse them as a usage error (exit
    2) in a message, not a traceback: its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "engine-sim", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    return result.stderr


async def metric(client: httpx.AsyncClient, sample_name: str, **labels: str) -> float:
    """The engine's /metrics sample `sample_name` with these labels among its own,
    summed (0 where there is none)."""
    return sample_sum((await client.get("/metrics")).text, sample_name, **labels)
