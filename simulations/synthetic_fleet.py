"""Many worker agents without their engines: each speaks the real wire contract to a
router's control plane (registration with its own credentials, KV event batches with
sequence numbers, load reports with a wiring report that says its events flow), so a
control plane and its index can be driven at a fleet's scale from one process.

What each worker caches, in kvplane's block keys (the keys the router computes for a
prompt of token ids in the shared scope):
- one of `system_prompts` shared system prompts (worker w holds prompt w % count), as
  real chained keys of its token ids (`system_prompt_tokens`), so that a request that
  opens with it matches every worker holding it;
- requests after it: `request_blocks` blocks each, chained under the system prompt's
  last block. Their keys are drawn at random (no request repeats one), so no hashing
  is spent on text nobody asks for again.

A worker fills its cache to `capacity_blocks`, then at `batches_per_s` (Poisson) sends
one batch as an engine step would announce a finished request: the request's blocks
stored and, at capacity, its oldest request's blocks removed. Each batch waits for its
acknowledgement (the control plane acknowledges once the index applied it): the time
from sending to the acknowledgement is the batch's apply lag as the agent sees it.

Through faults it behaves as worker_agent/publisher.py does: a stream that ends is
opened again (through the next router at once, backing off once every router has been
tried, with the agent's delays), under the same incarnation, resuming after the sequence
the control plane says it applied; a Resync, a Reject (but for bad credentials or an
incompatible worker, which fail it), or an Ack of a sequence the worker never sent or
one behind what was acknowledged, starts a new incarnation that sends the whole cache
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import cast

import grpc.aio
from redis.asyncio.cluster import RedisCluster

from kvplane.core.config import AgentSettings
from kvplane.core.keys import BlockKey, KeyNamespace, block_keys
from kvplane.core.types import (
    BlocksRemoved,
    BlocksStored,
    EventsState,
    ReplayState,
    Tier,
    WiringReport,
    WorkerInfo,
)
from kvplane.core.worker_credentials import worker_token
from kvplane.wire.codec import events_message, load_message, register_message
from kvplane.wire.stream import AgentStream
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.index.redis import KeyLayout, member_incarnation

BLOCK_SIZE = 16
TOKEN_IDS = 500  # token ids drawn below this: within the engine simulator's vocabulary
STREAMS_PER_CHANNEL = 100  # gRPC multiplexes streams; a few connections spread the load
# The agent's own reconnect delays (it doubles them, with jitter, up to the longest).
RECONNECT_MIN_S = AgentSettings.model_fields["reconnect_min_s"].default
RECONNECT_MAX_S = AgentSettings.model_fields["reconnect_max_s"].default
FATAL_REJECTS = (pb.REJECT_CODE_INCOMPATIBLE, pb.REJECT_CODE_UNAUTHENTICATED)  # as the agent's
SNAPSHOT_REQUESTS_PER_BATCH = 16  # a new incarnation's whole cache, in batches of these
FLOWING = WiringReport(EventsState.FLOWING, ReplayState.OK, BLOCK_SIZE)


@dataclass(frozen=True, slots=True)
class FleetShape:
    workers: int
    model: str
    base_url: str  # where each worker says its engine answers
    system_prompts: int = 8
    system_prompt_tokens: int = 1024
    request_blocks: int = 64
    capacity_blocks: int = 2048
    batches_per_s: float = 1.0  # per worker, once its cache is full
    load_interval_s: float = 1.0
    worker_secret: str | None = None  # the router's worker credential secret
    seed: int = 0

    def system_prompt(self, index: int) -> list[int]:
        """The token ids of shared system prompt `index` (the requests' start too)."""
        rng = random.Random(f"system-{self.seed}-{index}")
        return [rng.randrange(1, TOKEN_IDS) for _ in range(self.system_prompt_tokens)]


@dataclass(slots=True)
class WorkerFigures:
    """What one synthetic worker did and saw."""

    registered: bool = False
    batches: int = 0  # acknowledged
    blocks_stored: int = 0
    blocks_removed: int = 0
    held_blocks: int = 0
    ack_seconds: list[float] = field(default_factory=list)  # in the steady phase
    reconnects: int = 0  # streams opened again after one ended
    resumed: int = 0  # of those, the ones that went on under the same incarnation
    incarnations: int = 0  # new ones after the first (a Resync, or a resume refused)
    incarnation_causes: Counter[str] = field(default_factory=Counter)
    failure: str = ""


class NewIncarnation(Exception):
    """The control plane does not hold what this incarnation sent: start another (the
    message says why)."""


class SyntheticWorker:
    def __init__(self, shape: FleetShape, number: int, system_keys: Sequence[BlockKey]) -> None:
        self.shape = shape
        self.worker_id = f"synthetic-{number:05d}"
        self.system_keys = system_keys
        self.rng = random.Random(f"worker-{shape.seed}-{number}")
        self.requests: deque[list[BlockKey]] = deque()
        self.figures = WorkerFigures()
        self.sequence = 0  # of the last batch sent
        self._pending: list[BlocksStored | BlocksRemoved] | None = None  # not acknowledged
        # Batches to send before any new one: a new incarnation's whole cache, which a
        # stream that ends halfway through must not lose (the agent's outbox).
        self._outbox: deque[list[BlocksStored | BlocksRemoved]] = deque()
        self._queue_snapshot()
        self.incarnation = time.time_ns()
        self.writing = asyncio.Lock()  # a gRPC call takes one write at a time
        self.acked = 0  # the last sequence acknowledged
        self.streaming = False  # registered on a stream that is open now

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            base_url=self.shape.base_url,
            model=self.shape.model,
            block_size=BLOCK_SIZE,
            kv_capacity_blocks=self.shape.capacity_blocks,
            engine_kind="synthetic",
        )

    def token(self) -> str | None:
        secret = self.shape.worker_secret
        return None if secret is None else worker_token(secret, self.worker_id)

    async def run(
        self,
        channels: Sequence[grpc.aio.Channel],
        steady: asyncio.Event,
        paused: asyncio.Event,
        stop: asyncio.Event,
    ) -> None:
        """Register, fill the cache (as fast as batches are acknowledged), then send at
        the shape's rate (none while `paused`: load reports only), timing
        acknowledgements once `steady` is set, until `stop`. Streams go to `channels[0]`
        first, then to the next one each time a stream ends (see the module's doc)."""
        figures = self.figures
        delay, turn = RECONNECT_MIN_S, 0
        while True:
            stream = AgentStream(channels[turn % len(channels)], token=self.token())
            self.streaming = False
            try:
                await self._session(stream, steady, paused, stop)
                return
            except NewIncarnation as cause:
                self._start_new_incarnation(str(cause))  # registered at once, same router
            except Exception:  # the stream ended: opened again, as the agent does
                reject = await stream.unread_reject(0.5)
                if reject is not None and reject.code in FATAL_REJECTS:
                    figures.failure = f"after {figures.batches} batches: {str(reject).strip()}"
                    return
                if stop.is_set():
                    return
                if reject is not None:  # any other: a new incarnation is always safe
                    self._start_new_incarnation(pb.RejectCode.Name(reject.code))
                figures.reconnects += 1
                if self.streaming:  # it worked: the next failure starts afresh
                    delay = RECONNECT_MIN_S
                # The next router at once; back off once every one has been tried.
                turn += 1
                if turn % len(channels) == 0:
                    await asyncio.sleep(delay * self.rng.uniform(0.5, 1))
                    delay = min(delay * 2, RECONNECT_MAX_S)
            finally:
                stream.call.cancel()

    def _start_new_incarnation(self, cause: str) -> None:
        self.incarnation = max(self.incarnation + 1, time.time_ns())
        self.sequence = self.acked = 0
        self._pending = None
        self._queue_snapshot()
        self.figures.incarnations += 1
        self.figures.incarnation_causes[cause] += 1

    def _queue_snapshot(self) -> None:
        """A new incarnation starts with everything cached: the system prompt, then each
        request held, under it."""
        self._outbox.clear()
        self._outbox.append([self._stored(self.system_keys, None)])
        held = list(self.requests)
        for start in range(0, len(held), SNAPSHOT_REQUESTS_PER_BATCH):
            chunk = held[start : start + SNAPSHOT_REQUESTS_PER_BATCH]
            self._outbox.append([self._stored(keys, self.system_keys[-1]) for keys in chunk])

    async def _session(
        self, stream: AgentStream, steady: asyncio.Event, paused: asyncio.Event, stop: asyncio.Event
    ) -> None:
        figures, shape = self.figures, self.shape
        reply = await stream.request(register_message(self.info))
        if reply.WhichOneof("body") == "resync":
            raise NewIncarnation(f"resync at registration: {reply.resync.reason.split(':')[0]}")
        if reply.WhichOneof("body") != "ack":
            raise RuntimeError(f"registration answered {reply.WhichOneof('body')}")
        figures.registered = True
        self.streaming = True
        applied = reply.ack.sequence
        if not self.acked <= applied <= self.sequence:
            # It lost batches it acknowledged, or names some never sent.
            raise NewIncarnation(f"resume refused (acknowledged {self.acked}, index {applied})")
        if self.sequence:
            figures.resumed += 1
        if self._pending is not None:
            if applied < self.sequence:
                await self._deliver(stream, timed=False)
            else:  # applied; only its acknowledgement was lost
                self._acknowledged()
        while self._outbox:
            await self._send(stream, self._outbox.popleft(), timed=False)
        reporter = asyncio.ensure_future(self._report_load(stream, stop))
        try:
            while self._held() + shape.request_blocks <= shape.capacity_blocks:
                await self._send(stream, self._next_request(), timed=False)
                if stop.is_set():
                    return
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    gap = self.rng.expovariate(shape.batches_per_s)
                    await asyncio.wait_for(stop.wait(), gap)
                    return
                if stream.call.done():  # ended by the control plane (a Reject, or its end)
                    raise RuntimeError("the control plane ended the stream")
                if not paused.is_set():
                    await self._send(stream, self._next_request(), timed=steady.is_set())
        finally:
            reporter.cancel()

    def _held(self) -> int:
        return len(self.system_keys) + sum(len(keys) for keys in self.requests)

    def held_keys(self) -> set[BlockKey]:
        return set(self.system_keys).union(*self.requests)

    def settled(self) -> bool:
        """Streaming, full, and with nothing unacknowledged (or failed for good)."""
        if self.figures.failure:
            return True
        full = self._held() + self.shape.request_blocks > self.shape.capacity_blocks
        return self.streaming and full and self._pending is None and not self._outbox

    def _stored(self, keys: Sequence[BlockKey], parent: BlockKey | None) -> BlocksStored:
        first = 0 if parent is None else len(self.system_keys)
        return BlocksStored(keys=list(keys), tier=Tier.DEVICE, first_position=first,
                            parent_key=parent)  # fmt: skip

    def _next_request(self) -> list[BlocksStored | BlocksRemoved]:
        keys = [BlockKey(self.rng.getrandbits(64)) for _ in range(self.shape.request_blocks)]
        events: list[BlocksStored | BlocksRemoved] = [self._stored(keys, self.system_keys[-1])]
        self.requests.append(keys)
        self.figures.blocks_stored += len(keys)
        if self._held() > self.shape.capacity_blocks:
            oldest = self.requests.popleft()
            events.append(BlocksRemoved(keys=oldest, tier=Tier.DEVICE))
            self.figures.blocks_removed += len(oldest)
        return events

    async def _send(
        self, stream: AgentStream, events: list[BlocksStored | BlocksRemoved], *, timed: bool
    ) -> None:
        self.sequence += 1
        self._pending = events
        await self._deliver(stream, timed=timed)

    async def _deliver(self, stream: AgentStream, *, timed: bool) -> None:
        """Send the pending batch under the current sequence, and wait for its Ack."""
        assert self._pending is not None
        started = time.perf_counter()
        async with self.writing:
            await stream.send(events_message(self.sequence, self._pending))
        reply = await stream.reply()
        if reply.WhichOneof("body") == "resync":
            raise NewIncarnation(f"resync: {reply.resync.reason.split(':')[0]}")
        if reply.WhichOneof("body") != "ack" or reply.ack.sequence != self.sequence:
            raise RuntimeError(f"batch {self.sequence} answered {reply.WhichOneof('body')}")
        if timed:
            self.figures.ack_seconds.append(time.perf_counter() - started)
        self._acknowledged()

    def _acknowledged(self) -> None:
        self._pending = None
        self.acked = self.sequence
        self.figures.batches += 1
        self.figures.held_blocks = self._held()

    async def _report_load(self, stream: AgentStream, stop: asyncio.Event) -> None:
        while not stop.is_set():
            usage = self._held() / self.shape.capacity_blocks
            running = self.rng.randrange(0, 16)
            async with self.writing:
                await stream.send(load_message(running, 0, usage, wiring=FLOWING))
            await asyncio.sleep(self.shape.load_interval_s)


def system_prompt_keys(shape: FleetShape) -> list[list[BlockKey]]:
    """Each shared system prompt's block keys, as the router keys a prompt of its token
    ids in the shared scope."""
    namespace = KeyNamespace(model=shape.model, block_size=BLOCK_SIZE)
    return [
        block_keys(shape.system_prompt(index), namespace) for index in range(shape.system_prompts)
    ]


class SyntheticFleet:
    """`shape.workers` synthetic workers, spread over the control planes at
    `grpc_addresses` in turn."""

    def __init__(self, shape: FleetShape, grpc_addresses: Sequence[str]) -> None:
        prompts = system_prompt_keys(shape)
        self.shape = shape
        self.workers = [
            SyntheticWorker(shape, number, prompts[number % len(prompts)])
            for number in range(shape.workers)
        ]
        self.addresses = list(grpc_addresses)
        self.steady = asyncio.Event()
        self.paused = asyncio.Event()
        self.stop = asyncio.Event()
        self._channels: list[grpc.aio.Channel] = []
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Each worker streams to the router after the last one's first (in turn), and
        to the next ones after a stream ends."""
        channels: dict[tuple[str, int], grpc.aio.Channel] = {}
        count = len(self.addresses)
        for number, worker in enumerate(self.workers):
            group = number // (STREAMS_PER_CHANNEL * count)
            mine = []
            for turn in range(count):
                address = self.addresses[(number + turn) % count]
                channel = channels.get((address, group))
                if channel is None:
                    channel = channels[address, group] = grpc.aio.insecure_channel(address)
                    self._channels.append(channel)
                mine.append(channel)
            run = worker.run(mine, self.steady, self.paused, self.stop)
            self._tasks.append(asyncio.ensure_future(run))

    def full(self) -> int:
        """Workers whose cache is full (or that failed: they will not fill)."""
        return sum(
            1
            for worker in self.workers
            if worker.figures.failure
            or worker.figures.held_blocks + self.shape.request_blocks > self.shape.capacity_blocks
        )

    def held_blocks(self) -> int:
        return sum(worker.figures.held_blocks for worker in self.workers)

    def report(self) -> FleetReport:
        figures = [worker.figures for worker in self.workers]
        failed = [
            f"{worker.worker_id}: {worker.figures.failure}"
            for worker in self.workers
            if worker.figures.failure
        ]
        return FleetReport(
            registered=sum(f.registered for f in figures),
            failed=failed[:5],
            failures=len(failed),
            reconnects=sum(f.reconnects for f in figures),
            resumed=sum(f.resumed for f in figures),
            incarnations=sum(f.incarnations for f in figures),
            incarnation_causes=dict(sum((f.incarnation_causes for f in figures), Counter())),
            batches=sum(f.batches for f in figures),
            blocks_stored=sum(f.blocks_stored for f in figures),
            blocks_removed=sum(f.blocks_removed for f in figures),
            held_blocks=self.held_blocks(),
            ack_seconds=[s for f in figures for s in f.ack_seconds],
        )

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels:
            await channel.close()


# -- in a process of its own ----------------------------------------------------------

FILLED = "filled"  # child -> parent: every worker's cache is full (or it failed)
STEADY = "steady"  # parent -> child: time acknowledgements from now on
PAUSE = "pause"  # parent -> child: no more batches (load reports go on)
RESUME = "resume"  # parent -> child: batches again
STOP = "stop"  # parent -> child: stop, and send the figures
REPORT = "report"  # parent -> child: send the figures so far
AUDIT = "audit"  # parent -> child, with the index's Redis: compare it with the caches
SETTLE_TIMEOUT_S = 120.0  # an audit waits this long for every worker to settle


@dataclass(frozen=True, slots=True)
class Audit:
    """The index against what the workers cache, block by block, once every worker is
    settled (the fleet paused first): what an index that lost nothing must match."""

    settled: bool  # every worker settled before the audit (else it compares a moving fleet)
    workers: int
    missing: int  # blocks a worker holds that its hash does not
    extra: int  # blocks its hash holds that it does not
    wrong_incarnation: int  # workers whose hash records another incarnation than theirs
    mismatched_workers: int


@dataclass(frozen=True, slots=True)
class FleetReport:
    registered: int
    failed: list[str]  # each failed worker's id and why (the first few)
    failures: int
    reconnects: int
    resumed: int
    incarnations: int
    incarnation_causes: dict[str, int]  # why, for how many
    batches: int
    blocks_stored: int
    blocks_removed: int
    held_blocks: int  # the entries the index should hold: what every worker holds now
    ack_seconds: list[float]  # every batch acknowledged in the steady phase


def run_fleet_process(shape: FleetShape, grpc_addresses: Sequence[str], conn: Connection) -> None:
    """A child process's body: runs the fleet, says FILLED once every cache is full,
    starts timing at STEADY, stops sending batches at PAUSE (until RESUME), answers
    REPORT with a FleetReport and (AUDIT, Redis URL, KeyLayout) with an Audit, and at STOP
    sends a FleetReport and returns."""
    asyncio.run(_serve_parent(shape, grpc_addresses, conn))


async def _serve_parent(shape: FleetShape, grpc_addresses: Sequence[str], conn: Connection) -> None:
    fleet = SyntheticFleet(shape, grpc_addresses)
    fleet.start()
    loop = asyncio.get_running_loop()
    said_filled = False
    while True:
        if not said_filled and fleet.full() == shape.workers:
            conn.send(FILLED)
            said_filled = True
        readable = await loop.run_in_executor(None, conn.poll, 0.2)
        if not readable:
            continue
        command = conn.recv()
        if isinstance(command, tuple) and command[0] == AUDIT:
            conn.send(await audit(fleet, *command[1:]))
        elif command == REPORT:
            conn.send(fleet.report())
        elif command == STEADY:
            fleet.steady.set()
        elif command == PAUSE:
            fleet.paused.set()
        elif command == RESUME:
            fleet.paused.clear()
        elif command == STOP:
            break
    await fleet.close()
    conn.send(fleet.report())


async def audit(fleet: SyntheticFleet, redis_url: str, layout: KeyLayout) -> Audit:
    """Every worker's hash in the index (named by `layout`, a Redis Cluster at `redis_url`) against
    the blocks the worker holds (docs/redis-layout.md: a held block is an 8-byte field,
    its key little-endian, whose tier mask, the value's first byte, is not 0; its
    incarnation is in its group's roster)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not all(worker.settled() for worker in fleet.workers):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    settled = all(worker.settled() for worker in fleet.workers)
    client = RedisCluster.from_url(redis_url)
    missing = extra = wrong = mismatched = 0
    try:
        for worker in fleet.workers:
            name = layout.worker(worker.worker_id)
            stored = cast(dict[bytes, bytes], await client.hgetall(name))
            indexed = {
                BlockKey(int.from_bytes(field, "little"))
                for field, value in stored.items()
                if len(field) == 8 and value[0] != 0
            }
            member = cast(bytes | None, await client.hget(layout.roster_of(worker.worker_id), name))
            held = worker.held_keys()
            lost, surplus = len(held - indexed), len(indexed - held)
            other = member is None or member_incarnation(member) != worker.incarnation
            missing, extra, wrong = missing + lost, extra + surplus, wrong + other
            mismatched += bool(lost or surplus or other)
    finally:
        await client.aclose()
    return Audit(settled, len(fleet.workers), missing, extra, wrong, mismatched)
