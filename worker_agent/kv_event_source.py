"""The engine's KV event stream, in order and without gaps, or a clear "state lost".

Subscribes to the engine's ZMQ PUB socket (`[topic, sequence, payload]`) and tracks the
sequence. On a gap it asks the replay socket (ROUTER; we use a DEALER) for the missed
batches; if the engine's buffer no longer holds them, or no replay socket is configured,
the picture is incomplete and the source says so. A sequence that goes back means the
engine restarted. At start it replays from 0 to learn what the engine already holds.

Replay replies come in two forms: up to vLLM 0.25 `[b"", seq, payload]` ending with
`[b"", END, b""]`, from 0.26 (and SGLang) `[b"", topic, seq, payload]` ending with
`[b"", b"", END, b""]`.

The source also records what proves its wiring (worker_agent/wiring.py judges it): whether
a publisher completed the ZMQ handshake with the SUB socket (a socket monitor sees it;
ZMQ itself reports no error when nothing ever accepts the connection), when the last
batch arrived, and whether the last replay request was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvplane.core.clock import Clock
from kvplane.core.types import MAX_SKIPPED_KINDS, OTHER_EVENT_TYPES
from worker_agent.engines.base import EngineAdapter
from worker_agent.events import EngineEventBatch, SkippedEvent, WireDecodeError

log = logging.getLogger(__name__)

END_OF_REPLAY = b"\xff" * 8
_IDLE_POLL_MS = 250
_DRAIN_YIELD_EVERY = 64
_CATCH_UP_TRIES = 40  # idle polls (10 s) to fetch a restarted engine's first batches
_CONNECTION_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


class _Arrivals:
    """Waits for a ZMQ socket to hold a message, on the event loop's own watch of the
    socket's descriptor. zmq.asyncio's poll() builds a poller, futures and flag enums
    for every wait: an engine publishes a batch a step, each waited for alone, and that
    doubled what receiving one cost an agent (about 320-360 µs of CPU against 135-200
    this way, at 40 batches a second)."""

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self._socket = socket
        self._signalled = asyncio.Event()
        self._descriptor = socket.fileno()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._descriptor, self._signalled.set)

    async def wait(self) -> None:
        # The descriptor signals that the socket's state changed, not that a message
        # waits, and only once: ask the socket itself before each wait.
        while True:
            self._signalled.clear()
            if _holds_message(self._socket):
                return
            await self._signalled.wait()

    def close(self) -> None:
        self._loop.remove_reader(self._descriptor)


_POLLIN = int(zmq.POLLIN)  # a plain int: zmq.POLLIN is a flag enum, its `&` is Python code


def _holds_message(socket: zmq.Socket[bytes]) -> bool:
    return bool(cast(int, socket.getsockopt(zmq.EVENTS)) & _POLLIN)


@dataclass(frozen=True, slots=True)
class StateLost:
    """The agent can no longer know the engine's cache: start over, empty."""

    reason: str


SourceItem = EngineEventBatch | StateLost


class KvEventSource:
    """The engine's batches over SUB (and replay); `gather_s`: how long the first batch
    after a quiet spell waits for the engine's next steps, which are then read with it
    in one wake-up (agent.batch_linger_s)."""

    def __init__(
        self,
        adapter: EngineAdapter,
        endpoint: str,
        *,
        replay_endpoint: str | None,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        gather_s: float = 0.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self._adapter = adapter
        self._gather_s = gather_s
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._clock = clock
        self._topic = topic.encode()
        self._replay_timeout_s = replay_timeout_s
        self._context = zmq.asyncio.Context()
        self._last: int | None = None  # last sequence delivered
        # What the last replay delivered, sequence -> payload hash: the same batches may
        # still come over SUB. A different payload under a replayed number is a restart.
        self._replayed: dict[int, int] = {}
        # Bumped when the engine goes down: answers to requests made before are the old
        # engine's and must not be delivered.
        self._epoch = 0
        self._catch_up_tries = 0
        self._endless_poll: asyncio.Future[Any] | None = None
        self._poll_ended = False  # engine_went_down() cancelled the endless poll
        # What proves the wiring, times on `clock`:
        self.subscribed_at: float | None = None  # when the SUB socket started connecting
        # Since when no publisher is on the other end (one that completed the handshake
        # and is still there); None while one is.
        self.unconnected_since: float | None = None
        self.last_batch_at: float | None = None  # when the last batch arrived (SUB or replay)
        # The last replay request's fate; None: none yet. Catching up while idle after an
        # engine outage fails as long as the engine is away, and says nothing then.
        self.replay_answered: bool | None = None
        # Events that batches carried but that could not be used, by (type, reason).
        self.skipped_events: Counter[SkippedEvent] = Counter()

    def engine_went_down(self) -> None:
        """The engine is gone (its cache with it). Its next life counts from 0 again, and
        its first batches may be published before our subscription reconnects: until a
        batch arrives over SUB, fetch them by replay when idle rather than wait for a
        later batch to reveal the gap."""
        self._epoch += 1
        self._last = None
        self._replayed = {}
        self._catch_up_tries = _CATCH_UP_TRIES
        if self._endless_poll is not None:
            self._poll_ended = True
            self._endless_poll.cancel()
        self.replay_answered = None  # the next life's endpoint is judged afresh

    def close(self) -> None:
        self._context.destroy(linger=0)

    async def items(self) -> AsyncGenerator[SourceItem]:
        """Batches in sequence order, with StateLost where continuity broke."""
        # A plain socket, read without waiting once it holds a message; its arrivals are
        # watched on the event loop (_Arrivals), never through zmq.asyncio, which would
        # watch the same descriptor with a handler of its own.
        subscriber: zmq.Socket[bytes] = zmq.Socket(self._context, zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, self._topic)
        # Before connect(), so that the first handshake is seen. pyzmq makes it of the
        # context's (asyncio) socket class, though it types it as the subscriber's.
        monitor = cast(zmq.asyncio.Socket, subscriber.get_monitor_socket(_CONNECTION_EVENTS))
        watch = asyncio.create_task(self._watch_connection(monitor))
        subscriber.connect(self.endpoint)
        self.subscribed_at = self.unconnected_since = self._clock()
        arrivals: _Arrivals | None = None
        try:
            if self.replay_endpoint is not None:
                # Learn what the engine already holds: its buffer may reach back to 0.
                async for item in self._replay_from(0, startup=True):
                    yield item
            arrivals = _Arrivals(subscriber)
            while True:
                if not await self._readable(arrivals):
                    if self._catch_up_tries:
                        self._catch_up_tries -= 1
                        async for item in self._replay_from(self._next_expected(), idle=True):
                            yield item
                    continue
                if self._gather_s:
                    # The first batch after a quiet spell: engines publish a batch a
                    # step, and every wake-up costs the agent more than a batch's own
                    # work. Its next steps are read with it, and forwarded as one.
                    await asyncio.sleep(self._gather_s)
                for drained in itertools.count(1):
                    if not _holds_message(subscriber):
                        break  # asked, not tried: a failed receive raises, a dear exception
                    frames = subscriber.recv_multipart(zmq.NOBLOCK)
                    self._catch_up_tries = 0  # the subscription works: gaps show as usual
                    async for item in self._frames(frames):
                        yield item
                    if drained % _DRAIN_YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # heartbeats and probes go on under a flood
        finally:
            if arrivals is not None:
                arrivals.close()
            watch.cancel()
            with contextlib.suppress(zmq.ZMQError):  # the context may be gone already
                subscriber.disable_monitor()
            monitor.close(linger=0)
            subscriber.close(linger=0)

    async def _readable(self, arrivals: _Arrivals) -> bool:
        """Whether a message waits; False after an idle poll while catching up. Outside
        catch-up the wait has no timeout, so that an idle engine costs the agent no
        wake-up at all: engine_went_down() ends that wait to start catching up."""
        if self._catch_up_tries:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_IDLE_POLL_MS / 1000):
                    await arrivals.wait()
                    return True
            return False
        poll = self._endless_poll = asyncio.ensure_future(arrivals.wait())
        try:
            await poll
            return True
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._poll_ended or (task is not None and task.cancelling()):
                raise  # the source itself is being stopped
            return False
        finally:
            self._endless_poll, self._poll_ended = None, False

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        """Keep `unconnected_since` None exactly while a publisher is on the other end."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.unconnected_since = None
                elif self.unconnected_since is None:
                    self.unconnected_since = self._clock()
        except zmq.ZMQError:
            return  # the socket closed under it: the source is closing
        except Exception:  # a task's edge: a bug would otherwise freeze the state unseen
            log.exception("watching the event socket's connection failed")

    async def _frames(self, frames: list[bytes]) -> AsyncIterator[SourceItem]:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._last = None
            yield StateLost(f"a malformed message ({len(frames)} frames)")
            return
        async for item in self._deliver(int.from_bytes(frames[1], "big"), frames[2]):
            yield item

    def _next_expected(self) -> int:
        return 0 if self._last is None else self._last + 1

    async def _deliver(self, sequence: int, payload: bytes) -> AsyncIterator[SourceItem]:
        if self._replayed:
            if self._replayed.get(sequence) == hash(payload):
                return  # the replay delivered it already
            self._replayed = {}
        if self._last is not None and sequence <= self._last:
            # The counter went back: a new engine process with an empty cache.
            last, self._last = self._last, None
            yield StateLost(f"the engine restarted (sequence {sequence} after {last})")
        if sequence > self._next_expected():
            epoch = self._epoch
            async for item in self._replay_from(self._next_expected()):
                yield item
            if self._epoch != epoch:
                return  # the engine went down meanwhile: this batch was the old one's
            if self._last is not None and sequence <= self._last:
                return  # the replay delivered it already
        yield self._decode(sequence, payload)

    async def _replay_from(
        self, start: int, *, startup: bool = False, idle: bool = False
    ) -> AsyncIterator[SourceItem]:
        """Deliver the buffered batches from `start`; StateLost first if `start` itself
        cannot be had. At startup (and when catching up while idle) a buffer that begins
        later, or no answer, is expected: what the engine cached before stays unknown
        (not announced), which is safe."""
        # Lenient only while nothing is known yet: a hole after a known batch is a hole.
        lenient = startup or (idle and self._last is None)
        if self.replay_endpoint is None:
            if not lenient:
                self._last = None
                yield StateLost(f"batch {start} was missed and there is no replay socket")
            return
        epoch = self._epoch
        replies = await self._fetch_replay(start)
        if self._epoch != epoch:
            return  # asked before the engine went down: the answer is the old engine's
        if replies is not None or not idle:
            self.replay_answered = replies is not None
        if replies is None:
            if not lenient:
                self._last = None
                yield StateLost("the replay socket did not answer whole")
            return
        sequences = [sequence for sequence, _ in replies]
        if any(after != before + 1 for before, after in itertools.pairwise(sequences)):
            self._last = None
            yield StateLost(f"the engine's replay from batch {start} has a hole")
            return
        if sequences and sequences[0] > start and not lenient:
            self._last = None
            yield StateLost(f"the engine's replay buffer no longer holds batch {start}")
        self._replayed = {sequence: hash(payload) for sequence, payload in replies}
        for sequence, payload in replies:
            if self._last is None or sequence > self._last:
                yield self._decode(sequence, payload)

    async def _fetch_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every reply up to the end marker; None if the socket stops answering or an
        answer is malformed (a partial replay would be a hole)."""
        assert self.replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        replies: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                # A time limit per reply, not for the whole replay: a full buffer is long.
                async with asyncio.timeout(self._replay_timeout_s):
                    frames = await dealer.recv_multipart()
                if END_OF_REPLAY in frames[1:3]:
                    return replies
                # [b"", seq, payload] (up to vLLM 0.25) or [b"", topic, seq, payload]
                if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                    log.warning("a malformed replay reply (%d frames)", len(frames))
                    return None
                replies.append((int.from_bytes(frames[-2], "big"), frames[-1]))
        except TimeoutError:
            return None
        finally:
            dealer.close(linger=0)

    def _decode(self, sequence: int, payload: bytes) -> SourceItem:
        self._last = sequence
        self.last_batch_at = self._clock()
        try:
            timestamp, events, skipped = self._adapter.decode_batch(payload)
        except WireDecodeError as error:
            # Its envelope is broken: what it held is unknown, a hole in the picture.
            return StateLost(f"batch {sequence} did not decode: {error}")
        for event in skipped:
            if event not in self.skipped_events and len(self.skipped_events) >= MAX_SKIPPED_KINDS:
                event = SkippedEvent(OTHER_EVENT_TYPES, event.reason)  # a bounded tally
            if event not in self.skipped_events:  # once per kind; the counts are logged
                log.warning(
                    "skipping %s events that cannot be used (%s), first in batch %d",
                    event.event_type,
                    event.reason.value,
                    sequence,
                )
            self.skipped_events[event] += 1
        return EngineEventBatch(sequence, timestamp, events)
