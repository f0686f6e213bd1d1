"""KV events on ZMQ, as vLLM's `ZmqEventPublisher` sends them.

PUB socket: `[topic, sequence as 8 bytes big-endian, msgpack payload]` per non-empty
batch, the sequence counting from 0. ROUTER replay socket: a DEALER sends
`[b"", start_seq]` and gets every buffered batch with sequence >= start_seq, then an end
marker. The buffer keeps the last `buffer_steps` batches. A batch that a fault drops is
still buffered, as a batch lost on the network would be: the subscriber sees a gap and
can fetch it by replay.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from simulations.engine_sim.config import KVEventsConfig
from simulations.engine_sim.kv_events import EventEncoder, KVEvent

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def _is_bind(endpoint: str) -> bool:
    # vLLM binds where the endpoint names a wildcard or a local transport, else connects.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    def __init__(
        self,
        config: KVEventsConfig,
        encoder: EventEncoder,
        *,
        drop_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        self._config = config
        self._encoder = encoder
        self._topic = config.topic.encode()
        self.drop_fraction = drop_fraction
        self.odd_events = False  # a fault: events no agent can use in every batch
        self._drop_random = random.Random(seed)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_sequence = 0
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        """The PUB endpoint actually bound (a `*` port resolved)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        if self._replay is None:
            return None
        return self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        _open(self._pub, self._config.endpoint)
        if self._config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            _open(self._replay, self._config.replay_endpoint)
            self._replay_task = asyncio.create_task(self._serve_replay(self._replay))

    async def publish(self, events: Sequence[KVEvent]) -> None:
        if not events:
            return  # only non-empty batches are sent, as vLLM
        sequence = self._next_sequence
        self._next_sequence += 1
        payload = self._encoder.encode_batch(time.time(), events, odd=self.odd_events)
        self._buffer.append((sequence, payload))
        if self.drop_fraction and self._drop_random.random() < self.drop_fraction:
            return
        # PUB never blocks: past the high-water mark ZMQ drops, as it does for vLLM.
        await self._pub.send_multipart([self._topic, sequence.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        """What a restarted engine does: count from 0 again with an empty buffer."""
        self._next_sequence = 0
        self._buffer.clear()

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    async def _serve_replay(self, socket: zmq.asyncio.Socket) -> None:
        with_topic = self._encoder.wire_format.replay_has_topic
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for sequence, payload in list(self._buffer):
                if sequence < start:
                    continue
                head = [client, b"", self._topic] if with_topic else [client, b""]
                await socket.send_multipart([*head, sequence.to_bytes(8, "big"), payload])
            head = [client, b"", b""] if with_topic else [client, b""]
            await socket.send_multipart([*head, END_OF_REPLAY, b""])


def _open(socket: zmq.asyncio.Socket, endpoint: str) -> None:
    if _is_bind(endpoint):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)
