"""The event source over real ZMQ sockets, against a scripted engine: what it delivers
when batches arrive twice, a replay has a hole, or a reply is malformed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from kvplane.core.serving import cancel_task
from kvplane.core.types import MAX_SKIPPED_KINDS, OTHER_EVENT_TYPES, SkipReason
from worker_agent.engines.vllm import VllmAdapter
from worker_agent.events import SkippedEvent
from worker_agent.kv_event_source import END_OF_REPLAY, KvEventSource, SourceItem, StateLost

TOPIC = b"kv"


def payload(sequence: int) -> bytes:
    event = {
        "type": "BlockStored",
        "block_hashes": [1000 + sequence],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "medium": "GPU",
    }
    return msgspec.msgpack.encode([0.0, [event], 0])


class ScriptedEngine:
    """A PUB socket the test publishes on, and a replay ROUTER that answers every
    request with the frames `replies(start)` gives."""

    def __init__(self, replies: Callable[[int], list[list[bytes]]]) -> None:
        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.context.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.replies = replies
        self.requests: list[int] = []
        self._task = asyncio.create_task(self._answer())

    def endpoint(self, socket: zmq.asyncio.Socket) -> str:
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    async def publish(self, sequence: int) -> None:
        await self.pub.send_multipart([TOPIC, sequence.to_bytes(8, "big"), payload(sequence)])

    async def _answer(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            for frames in self.replies(int.from_bytes(start, "big")):
                await self.router.send_multipart([client, b"", *frames])
            await self.router.send_multipart([client, b"", TOPIC, END_OF_REPLAY, b""])

    async def close(self) -> None:
        await cancel_task(self._task)
        self.context.destroy(linger=0)


def batches(*sequences: int) -> list[list[bytes]]:
    return [[TOPIC, s.to_bytes(8, "big"), payload(s)] for s in sequences]


class Items(asyncio.Queue[SourceItem]):
    """What a source delivered, in order, and the source itself."""

    def __init__(self, source: KvEventSource) -> None:
        super().__init__()
        self.source = source


@contextlib.asynccontextmanager
async def source_of(engine: ScriptedEngine, *, gather_s: float = 0.0) -> AsyncIterator[Items]:
    source = KvEventSource(
        VllmAdapter(),
        engine.endpoint(engine.pub),
        replay_endpoint=engine.endpoint(engine.router),
        topic="",
        replay_timeout_s=1.0,
        gather_s=gather_s,
    )
    items = Items(source)

    async def pump() -> None:
        async for item in source.items():
            items.put_nowait(item)

    task = asyncio.create_task(pump())
    await asyncio.sleep(0.3)  # the startup replay, and the subscription reaching the PUB
    try:
        yield items
    finally:
        await cancel_task(task)
        source.close()
        await engine.close()


async def take(items: asyncio.Queue[SourceItem], count: int) -> list[int | str]:
    taken: list[int | str] = []
    async with asyncio.timeout(5):
        while len(taken) < count:
            item = await items.get()
            taken.append("lost" if isinstance(item, StateLost) else item.sequence)
    return taken


async def test_batches_seen_again_after_a_replay_are_not_a_restart() -> None:
    engine = ScriptedEngine(lambda start: batches(0, 1, 2, 3) if start == 0 else [])
    async with source_of(engine) as items:
        assert await take(items, 4) == [0, 1, 2, 3]  # the startup replay
        for sequence in (2, 3, 4):  # published while it ran: they arrive over SUB too
            await engine.publish(sequence)
        assert await take(items, 1) == [4]
        await asyncio.sleep(0.2)
        assert items.empty()


async def _waiting_behind_the_first(engine: ScriptedEngine, items: Items, gap_s: float) -> int:
    """Five batches published `gap_s` apart: how many the source had delivered behind
    the first when its reader woke up for it."""

    async def first() -> int:
        await items.get()
        return items.qsize()

    reader = asyncio.create_task(first())
    for sequence in range(5):
        await engine.publish(sequence)
        await asyncio.sleep(gap_s)
    async with asyncio.timeout(5):
        return await reader


async def test_an_engines_steps_within_the_gather_window_are_read_in_one_wake_up() -> None:
    engine = ScriptedEngine(lambda start: [])
    async with source_of(engine, gather_s=1.0) as items:
        assert await _waiting_behind_the_first(engine, items, gap_s=0.05) == 4


async def test_without_a_gather_window_each_batch_is_delivered_as_it_comes() -> None:
    engine = ScriptedEngine(lambda start: [])
    async with source_of(engine) as items:
        assert await _waiting_behind_the_first(engine, items, gap_s=0.05) == 0


async def test_a_replay_with_a_hole_loses_the_state() -> None:
    engine = ScriptedEngine(lambda start: batches(1, 3) if start == 1 else [])
    async with source_of(engine) as items:
        await engine.publish(0)
        await engine.publish(4)  # 1 to 3 missed; the replay of them lacks 2
        assert await take(items, 3) == [0, "lost", 4]
        assert engine.requests == [0, 1]


async def test_a_malformed_replay_reply_loses_the_state() -> None:
    def replies(start: int) -> list[list[bytes]]:
        return [[b"not a sequence", payload(1)]] if start == 1 else []

    engine = ScriptedEngine(replies)
    async with source_of(engine) as items:
        await engine.publish(0)
        await engine.publish(2)
        assert await take(items, 3) == [0, "lost", 2]


async def test_a_replay_that_starts_after_the_gap_loses_the_state() -> None:
    engine = ScriptedEngine(lambda start: batches(3, 4) if start == 1 else [])
    async with source_of(engine) as items:
        await engine.publish(0)
        await engine.publish(5)
        assert await take(items, 4) == [0, "lost", 3, 4]
        assert await take(items, 1) == [5]


async def test_a_restarted_engine_is_not_mistaken_for_replayed_batches() -> None:
    engine = ScriptedEngine(lambda start: batches(0, 1, 2) if start == 0 else [])
    async with source_of(engine) as items:
        assert await take(items, 3) == [0, 1, 2]  # the startup replay
        # A new engine process: sequence 1 again, with a different payload.
        await engine.pub.send_multipart([TOPIC, (1).to_bytes(8, "big"), payload(99)])
        assert await take(items, 1) == ["lost"]


async def test_an_odd_event_is_skipped_and_counted_and_its_batch_goes_through() -> None:
    engine = ScriptedEngine(lambda start: [])
    async with source_of(engine) as items:
        good = msgspec.msgpack.decode(payload(0))[1][0]
        odd = {**good, "medium": "TAPE"}
        newer = {"type": "BlockPinned", "block_hashes": [7]}
        batch = msgspec.msgpack.encode([0.0, [odd, good, newer, good], 0])
        await engine.pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), batch])
        async with asyncio.timeout(5):
            item = await items.get()
        assert not isinstance(item, StateLost)
        assert len(item.events) == 2
        assert items.source.skipped_events == {
            SkippedEvent("BlockStored", SkipReason.UNKNOWN_MEDIUM): 1,
            SkippedEvent("BlockPinned", SkipReason.UNKNOWN_TYPE): 1,
        }


async def test_the_tally_of_skipped_kinds_is_bounded() -> None:
    engine = ScriptedEngine(lambda start: [])
    async with source_of(engine) as items:
        newer = [{"type": f"Future{n}"} for n in range(MAX_SKIPPED_KINDS + 4)]
        batch = msgspec.msgpack.encode([0.0, newer, 0])
        await engine.pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), batch])
        async with asyncio.timeout(5):
            await items.get()
        tally = items.source.skipped_events
        assert len(tally) == MAX_SKIPPED_KINDS + 1
        assert tally[SkippedEvent(OTHER_EVENT_TYPES, SkipReason.UNKNOWN_TYPE)] == 4
