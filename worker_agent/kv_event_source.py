"""The engine's KV event stream, in order and without gaps, or a clear "state lost".

Subscribes to the engine's ZMQ PUB socket (`[topic, sequence, payload]`) and tracks the
sequence. On a gap it asks the replay socket (ROUTER; we use a DEALER) for the missed
batches; if the engine's buffer no longer holds them, or no replay socket is configured,
the picture is incomplete and the source says so. A sequence that goes back means the
engine restarted. At start it replays from 0 to learn what the engine already holds.

Replay replies come in two forms: up to vLLM 0.25 `[b"", seq, payload]` ending with
`[b"", END, b""]`, from 0.26 (and SGLang) `[b"", topic, seq, payload]` ending with
`[b"", b"", END, b""]`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from worker_agent.engines.base import EngineAdapter
from worker_agent.events import EngineEventBatch, WireDecodeError

log = logging.getLogger(__name__)

END_OF_REPLAY = b"\xff" * 8
_IDLE_POLL_MS = 250


@dataclass(frozen=True, slots=True)
class StateLost:
    """The agent can no longer know the engine's cache: start over, empty."""

    reason: str


SourceItem = EngineEventBatch | StateLost


class KvEventSource:
    def __init__(
        self,
        adapter: EngineAdapter,
        endpoint: str,
        *,
        replay_endpoint: str | None,
        topic: str = "",
        replay_timeout_s: float = 2.0,
    ) -> None:
        self._adapter = adapter
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._replay_timeout_s = replay_timeout_s
        self._context = zmq.asyncio.Context()
        self._last: int | None = None  # last sequence delivered
        self._catch_up = False

    def engine_went_down(self) -> None:
        """The engine is gone (its cache with it). Its next life counts from 0 again, and
        its first batches may be published before our subscription reconnects: once the
        engine answers again, fetch them by replay rather than wait for a later batch to
        reveal the gap."""
        self._last = None
        self._catch_up = True

    def close(self) -> None:
        self._context.destroy(linger=0)

    async def items(self) -> AsyncIterator[SourceItem]:
        """Batches in sequence order, with StateLost where continuity broke."""
        subscriber = self._context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, self._topic)
        subscriber.connect(self._endpoint)
        try:
            if self._replay_endpoint is not None:
                # Learn what the engine already holds: its buffer may reach back to 0.
                async for item in self._replay_from(0, startup=True):
                    yield item
            while True:
                if not await subscriber.poll(_IDLE_POLL_MS):
                    if self._catch_up:
                        async for item in self._catch_up_after_outage():
                            yield item
                    continue
                frames = await subscriber.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    yield StateLost(f"a malformed message ({len(frames)} frames)")
                    continue
                sequence = int.from_bytes(frames[1], "big")
                async for item in self._deliver(sequence, frames[2]):
                    yield item
        finally:
            subscriber.close(linger=0)

    async def _deliver(self, sequence: int, payload: bytes) -> AsyncIterator[SourceItem]:
        if self._last is not None and sequence <= self._last:
            # The counter went back: a new engine process with an empty cache.
            last, self._last = self._last, None
            yield StateLost(f"the engine restarted (sequence {sequence} after {last})")
        expected = 0 if self._last is None else self._last + 1
        if sequence > expected:
            async for item in self._replay_from(expected):
                yield item
            if self._last is not None and sequence <= self._last:
                return  # the replay delivered it already
        yield self._decode(sequence, payload)

    async def _replay_from(self, start: int, *, startup: bool = False) -> AsyncIterator[SourceItem]:
        """Deliver the buffered batches from `start`; StateLost first if `start` itself
        cannot be had. At startup a buffer that begins later is expected: the engine ran
        before the agent, and what it cached then stays unknown (not announced: safe)."""
        if self._replay_endpoint is None:
            self._last = None
            yield StateLost(f"batch {start} was missed and there is no replay socket")
            return
        replies = await self._fetch_replay(start)
        if replies is None:
            self._last = None
            yield StateLost("the replay socket did not answer")
            return
        if replies and replies[0][0] > start and not startup:
            self._last = None
            yield StateLost(f"the engine's replay buffer no longer holds batch {start}")
        for sequence, payload in replies:
            if self._last is None or sequence > self._last:
                yield self._decode(sequence, payload)

    async def _catch_up_after_outage(self) -> AsyncIterator[SourceItem]:
        if self._replay_endpoint is None:
            self._catch_up = False
            return
        start = 0 if self._last is None else self._last + 1
        replies = await self._fetch_replay(start)
        if replies is None:
            return  # not back yet: try again when idle
        self._catch_up = False
        for sequence, payload in replies:
            if self._last is None or sequence > self._last:
                yield self._decode(sequence, payload)

    async def _fetch_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        assert self._replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        replies: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self._replay_timeout_s):
                while True:
                    frames = await dealer.recv_multipart()
                    if END_OF_REPLAY in frames[1:3]:
                        return replies
                    # [b"", seq, payload] or [b"", topic, seq, payload]
                    if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                        log.warning("ignoring a malformed replay reply (%d frames)", len(frames))
                        continue
                    replies.append((int.from_bytes(frames[-2], "big"), frames[-1]))
        except TimeoutError:
            return None
        finally:
            dealer.close(linger=0)

    def _decode(self, sequence: int, payload: bytes) -> SourceItem:
        self._last = sequence
        try:
            timestamp, events = self._adapter.decode_batch(payload)
        except WireDecodeError as error:
            # Applying the rest would give a picture with a hole in it.
            return StateLost(f"batch {sequence} did not decode: {error}")
        return EngineEventBatch(sequence, timestamp, events)
