"""The agent's one gRPC stream to the control plane: incarnations, batches, heartbeats.

- Every life of the worker's picture is an incarnation (a fresh id, larger than any
  before): at agent start, after the engine restarted or was down, and whenever the
  agent's state was lost or its outbox overflowed. A new incarnation starts with the
  translator's whole current picture (its snapshot), so the control plane never holds a
  partial or stale one: a higher incarnation replaces everything of the lower.
- A batch goes as soon as there is something to send (each takes everything pending;
  the engine's consecutive steps arrive together already: the event source gathers
  them, agent.batch_linger_s). Only every agent.ack_every_batches-th waits for its Ack,
  which covers those before it: an Ack costs both sides a wake-up, more than a batch's
  own work. A control plane that does not say it defers Acks is asked for every one.
  Unacknowledged batches are kept, sent again after a reconnect, and acknowledged a load
  interval after the last one at the latest (an empty batch asks).
- Reconnects back off exponentially with jitter. Re-registering the same incarnation
  resumes when the control plane's Ack matches what the agent sent (routers on a shared
  index answer what the index recorded, so another replica, or a restarted one,
  resumes it); anything else (a router with an index of its own restarted, or the index
  lost batches) means a new incarnation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from kvplane.core.config import AgentSettings, ControlPlaneSettings
from kvplane.core.keys import BlockKey
from kvplane.core.types import (
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    WiringReport,
    WorkerInfo,
    WorkerRole,
)
from kvplane.wire.codec import events_message, load_message, register_message
from kvplane.wire.stream import AgentStream, StreamClosed
from kvplane.wire.v1 import control_plane_pb2 as pb
from worker_agent.events import EngineLoad

log = logging.getLogger(__name__)

REJECT_WAIT_S = 0.5
"""After a failed write, how long the stream may take to end for its Reject to be read
(an ended call ends at once; this bounds one still open)."""


class PublisherRejected(Exception):
    """The control plane refuses this agent's configuration; retrying cannot help."""


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What the agent registers, less the incarnation."""

    worker_id: str
    base_url: str
    model: str
    block_size: int
    kv_capacity_blocks: int
    engine_kind: str
    engine_version: str  # "" when the engine does not say
    labels: dict[str, str]
    max_model_len: int = 0  # 0 when the engine does not say
    role: WorkerRole = WorkerRole.BOTH
    kv_connector: str = ""


@dataclass(slots=True)
class _Batch:
    sequence: int
    message: pb.AgentMessage
    asks_ack: bool


def new_incarnation_id(previous: int = 0) -> int:
    return max(time.time_ns(), previous + 1)


class ControlPlanePublisher:
    def __init__(
        self,
        identity: WorkerIdentity,
        agent: AgentSettings,
        control_plane: ControlPlaneSettings,
        snapshot: Callable[[], list[KvEvent]],
    ) -> None:
        self._identity = identity
        self._agent = agent
        self._limits = control_plane
        # The largest batch, in events and blocks: this agent's own settings, or the
        # smaller ones the control plane it registered with says it takes.
        self._batch_limits = (control_plane.max_batch_events, control_plane.max_batch_blocks)
        token = control_plane.agent_token
        self._token = None if token is None else token.get_secret_value()
        self._snapshot = snapshot
        self._addresses = agent.control_plane_address.split(",")
        self._next_address = 0
        self.incarnation = new_incarnation_id()
        self._outbox: deque[KvEvent] = deque()
        self._outbox_blocks = 0
        self._outbox_limit = agent.max_pending_blocks
        # Sent, or to send again after a reconnect, and not yet acknowledged: sequences
        # _acked + 1 onwards, those up to _sent written on the current stream.
        self._unacked: deque[_Batch] = deque()
        self._acked = 0
        self._sent = 0
        self._defers_acks = False  # what the control plane said when it registered us
        self._ack_due = 0.0  # when deferred Acks are asked for if nothing else asks first
        self._flush_wanted = False
        self._load: EngineLoad | None = None
        self._wiring: WiringReport | None = None
        # What the last load report said and when it went: the same again goes only
        # once a third of the lease the control plane grants has passed (0: always).
        self._last_report: tuple[EngineLoad, WiringReport | None] | None = None
        self._last_report_at = 0.0
        self._repeat_after_s = 0.0
        # The engine's last load and when the lease was last renewed (a Register or a
        # load report): the lease's own heartbeat, where probes come too seldom for it.
        self._last_load: EngineLoad | None = None
        self._renewed_at = 0.0
        self._engine_down = False
        self._down_report_pending = False
        self._wakeup = asyncio.Event()
        self._registered = False
        self._connected = asyncio.Event()
        self._flushed = asyncio.Event()
        self.incarnations_started = 1

    # -- called by the agent core ---------------------------------------------------

    def submit(self, events: Sequence[KvEvent]) -> None:
        if self._engine_down or not events:
            return
        self._outbox.extend(events)
        self._outbox_blocks += sum(_blocks(event) for event in events)
        # Bounded: past the limit the pending events are replaced by the snapshot (which
        # the engine's capacity bounds) under a new incarnation.
        if self._outbox_blocks > self._outbox_limit:
            self.start_new_incarnation("the outbox overflowed while disconnected")
        self._wakeup.set()

    def report_load(self, load: EngineLoad) -> None:
        self._load = self._last_load = load
        self._wakeup.set()

    def report_wiring(self, report: WiringReport) -> None:
        """Sent with every load report from now on (the router shows the latest)."""
        self._wiring = report

    def report_engine_down(self) -> None:
        """The engine is not answering: publish nothing and say so in a Load (called once
        per health probe while it lasts). The control plane stops routing here and lets
        the lease, and with it the worker's entries, run out."""
        self._engine_down = True
        self._outbox.clear()
        self._outbox_blocks, self._load, self._last_load = 0, None, None
        self._down_report_pending = True
        self._wakeup.set()

    def engine_up(self) -> None:
        self._engine_down = False
        self.start_new_incarnation("the engine is back")

    def start_new_incarnation(self, reason: str) -> None:
        self.incarnation = new_incarnation_id(self.incarnation)
        self.incarnations_started += 1
        self._acked = self._sent = 0
        self._unacked.clear()
        self._outbox = deque(self._snapshot())
        self._outbox_blocks = sum(_blocks(event) for event in self._outbox)
        self._outbox_limit = self._outbox_blocks + self._agent.max_pending_blocks
        self._registered = False
        log.info("new incarnation %d: %s", self.incarnation, reason)
        self._wakeup.set()

    async def wait_connected(self) -> None:
        """Until a stream is registered."""
        await self._connected.wait()

    async def wait_flushed(self) -> None:
        """Until everything submitted so far is acknowledged."""
        while self._outbox or self._unacked:
            self._flush_wanted = True  # ask for the deferred Acks now
            self._wakeup.set()
            self._flushed.clear()
            await self._flushed.wait()

    # -- the stream -----------------------------------------------------------------

    async def run(self) -> None:
        """Keep a stream open until cancelled; PublisherRejected if it cannot work."""
        delay = self._agent.reconnect_min_s
        while True:
            address = self._addresses[self._next_address]
            try:
                async with self._channel(address) as channel:
                    stream = AgentStream(channel, token=self._token)
                    try:
                        await self._serve(stream)
                    except (PublisherRejected, StreamClosed):
                        raise
                    except Exception:
                        # A write after the control plane ended the stream fails with no
                        # word of why; the Reject it wrote first says it, if it came.
                        reject = await stream.unread_reject(REJECT_WAIT_S)
                        if reject is not None:
                            self._rejected(reject)  # raises
                        raise
            except PublisherRejected:
                raise
            except Exception as error:  # grpc raises several kinds; the agent must go on
                if _cancelling():
                    # The stream's teardown turned a cancellation into an error: going on
                    # would reconnect for ever, and whoever cancelled would wait for ever.
                    raise asyncio.CancelledError from error
                log.warning(
                    "control plane stream to %s ended (%s); reconnecting",
                    address,
                    _describe(error),
                )
            finally:
                if self._connected.is_set():  # it worked: the next failure starts afresh
                    delay = self._agent.reconnect_min_s
                self._connected.clear()
            # The next control plane at once; back off only once every one has been tried.
            self._next_address = (self._next_address + 1) % len(self._addresses)
            if self._next_address == 0:
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self._agent.reconnect_max_s)

    async def _serve(self, stream: AgentStream) -> None:
        self._registered = False
        while True:
            if self._down_report_pending and self._registered:
                await stream.send(load_message(0, 0, 0.0, engine_down=True, wiring=self._wiring))
            self._down_report_pending = False
            if self._engine_down:  # nothing else until it is back, under a new incarnation
                await self._wait()
                continue
            if not self._registered:
                await self._register(stream)
                self._connected.set()
            if self._load is not None:  # first, so that heartbeats go on under traffic
                load, self._load = self._load, None
                if not self._repeats_last_report(load):
                    await stream.send(
                        load_message(
                            load.running,
                            load.waiting,
                            load.kv_usage,
                            wiring=self._wiring,
                            kv_load_failures=load.kv_load_failures,
                            kv_leases_expired=load.kv_leases_expired,
                        )
                    )
                    self._last_report = (load, self._wiring)
                    self._last_report_at = self._renewed_at = time.monotonic()
                continue  # an incarnation may have begun meanwhile: register it first
            batch = self._next_to_send()
            if batch is not None:
                await self._send_batch(stream, batch)
                continue
            renewal_s = self._until_lease_needs_renewal_s()
            if renewal_s is not None and renewal_s <= 0:
                self._load = self._last_load  # the heartbeat: what the engine said last
                continue
            if self._unacked:  # all sent, their Acks deferred
                ack_s = self._ack_due - time.monotonic()
                heartbeat_first = renewal_s is not None and renewal_s < ack_s
                if heartbeat_first and not self._flush_wanted:
                    await self._wait(renewal_s)
                    continue
                if self._flush_wanted or not await self._wait(ack_s):
                    self._flush_wanted = False
                    self._unacked.append(self._batch([], asks_ack=True))
                continue
            await self._wait(renewal_s)

    async def _wait(self, timeout_s: float | None = None) -> bool:
        """Until woken (True) or `timeout_s` has passed (False)."""
        if timeout_s is None:  # the usual wait: no timer
            await self._wakeup.wait()
        else:
            try:
                async with asyncio.timeout(max(0.0, timeout_s)):
                    await self._wakeup.wait()
            except TimeoutError:
                return False
        self._wakeup.clear()
        return True

    def _until_lease_needs_renewal_s(self) -> float | None:
        """Seconds until the last load goes again as a heartbeat, whether or not a probe
        brought it: two thirds of the lease after its last renewal. A probe brings it
        every load interval, which may be longer than the lease (the control plane sets
        that, not this agent): the lease would run out between probes, and the worker
        drop out of routing and the index until it registered again. None: no lease was
        told (an older control plane), or no load is known yet."""
        if self._repeat_after_s <= 0 or self._last_load is None:
            return None
        return self._renewed_at + 2 * self._repeat_after_s - time.monotonic()

    def _repeats_last_report(self, load: EngineLoad) -> bool:
        """Whether `load` (with the current wiring) says what the last report said, and
        the lease does not need renewing yet: an idle engine's agent then heartbeats
        every third of the lease, not every probe (each message costs the control plane
        a wake-up, 1.5-3 ms of CPU at rest on the 2-core machine)."""
        return (
            self._last_report == (load, self._wiring)
            and time.monotonic() - self._last_report_at < self._repeat_after_s
        )

    async def _register(self, stream: AgentStream) -> None:
        while True:
            info = WorkerInfo(
                worker_id=self._identity.worker_id,
                incarnation=self.incarnation,
                base_url=self._identity.base_url,
                model=self._identity.model,
                block_size=self._identity.block_size,
                kv_capacity_blocks=self._identity.kv_capacity_blocks,
                engine_kind=self._identity.engine_kind,
                engine_version=self._identity.engine_version,
                labels=self._identity.labels,
                max_model_len=self._identity.max_model_len,
                role=self._identity.role,
                kv_connector=self._identity.kv_connector,
            )
            reply = await stream.request(register_message(info))
            if self.incarnation != info.incarnation:
                continue  # a new incarnation began meanwhile: register that one instead
            kind = reply.WhichOneof("body")
            if kind == "reject":
                self._rejected(reply.reject)
                continue
            if kind == "resync":
                self.start_new_incarnation(f"the control plane asked: {reply.resync.reason}")
                continue
            applied = reply.ack.sequence
            self._repeat_after_s = reply.ack.lease_ms / 1000 / 3
            self._renewed_at = time.monotonic()
            self._last_report = None  # the new stream hears the load at once
            self._defers_acks = reply.ack.defers_acks
            self._batch_limits = _batch_limits(self._limits, reply.ack)
            if self._acked <= applied <= self._acked + len(self._unacked):
                self._acknowledged(applied)  # those landed before the stream broke
                self._sent = applied  # the rest go again, each asking for its Ack where
                if not self._defers_acks:  # this control plane would send it anyway
                    for batch in self._unacked:
                        batch.asks_ack = True
                        batch.message.kv_events.ack_deferred = False
                break
            # The control plane does not hold what we sent (it restarted, or another
            # replica answers now): only a whole new picture is safe.
            self.start_new_incarnation(
                f"the control plane had applied {applied}, the agent sent {self._acked}"
            )
        self._registered = True
        log.info(
            "registered worker %s incarnation %d after sequence %d",
            self._identity.worker_id,
            self.incarnation,
            self._acked,
        )

    async def _send_batch(self, stream: AgentStream, batch: _Batch) -> None:
        incarnation = self.incarnation
        await stream.send(batch.message)
        self._sent = batch.sequence
        if not batch.asks_ack:
            self._ack_due = time.monotonic() + self._agent.load_interval_s
            return
        while True:  # replies come in order; older Acks may come first
            reply = await stream.reply()
            current = self.incarnation == incarnation  # else about one that is over
            kind = reply.WhichOneof("body")
            if kind == "ack":
                if current:
                    self._acknowledged(reply.ack.sequence)
                if reply.ack.sequence >= batch.sequence:
                    return
                continue
            if not current:
                return
            if kind == "resync":
                self.start_new_incarnation(f"the control plane asked: {reply.resync.reason}")
            elif kind == "reject":
                self._rejected(reply.reject)
            else:
                self.start_new_incarnation(f"unexpected reply to batch {batch.sequence}")
            return

    def _acknowledged(self, sequence: int) -> None:
        while self._unacked and self._unacked[0].sequence <= sequence:
            self._unacked.popleft()
        self._acked = max(self._acked, sequence)
        if not self._unacked and not self._outbox:
            self._flushed.set()

    def _next_to_send(self) -> _Batch | None:
        """What a reconnect left to send again, else everything pending as a new batch."""
        if self._unacked and self._unacked[-1].sequence > self._sent:
            return self._unacked[self._sent - self._acked]
        if not self._outbox:
            return None
        batch = self._batch(self._take_pending())
        self._unacked.append(batch)
        return batch

    def _batch(self, events: list[KvEvent], *, asks_ack: bool = False) -> _Batch:
        """The next sequence; it asks for its Ack when the control plane acknowledges every
        batch, or when agent.ack_every_batches are unacknowledged with it."""
        asks_ack = (
            asks_ack
            or not self._defers_acks
            or len(self._unacked) + 1 >= self._agent.ack_every_batches
        )
        sequence = self._acked + len(self._unacked) + 1
        message = events_message(sequence, coalesced(events), ack_deferred=not asks_ack)
        return _Batch(sequence, message, asks_ack)

    def _take_pending(self) -> list[KvEvent]:
        """Everything pending, up to the control plane's batch limits; an event with more
        blocks than a whole batch may hold goes in pieces, its first one now."""
        max_events, max_blocks = self._batch_limits
        events: list[KvEvent] = []
        blocks = 0
        while self._outbox and len(events) < max_events:
            event = self._outbox[0]
            size = _blocks(event)
            if blocks + size <= max_blocks:
                self._outbox.popleft()
            elif events:
                break
            else:
                assert isinstance(event, BlocksStored | BlocksRemoved)  # it has blocks
                event, self._outbox[0] = _split(event, max_blocks)
                size = max_blocks
            events.append(event)
            blocks += size
        self._outbox_blocks -= blocks
        return events

    def _rejected(self, reject: pb.Reject) -> None:
        code = pb.RejectCode.Name(reject.code)
        if reject.code in (pb.REJECT_CODE_INCOMPATIBLE, pb.REJECT_CODE_UNAUTHENTICATED):
            raise PublisherRejected(f"{code}: {reject.reason}")
        # Anything else ends this stream; a new incarnation on the next is always safe.
        self.start_new_incarnation(f"rejected ({code}: {reject.reason})")
        raise StreamClosed(f"rejected: {code}")

    def _channel(self, address: str) -> grpc.aio.Channel:
        options = [
            ("grpc.max_send_message_length", self._limits.max_message_bytes),
            ("grpc.max_receive_message_length", self._limits.max_message_bytes),
            # Notice a vanished control plane within seconds, not TCP's minutes.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
        ]
        agent = self._agent
        if agent.tls_ca_file is None:
            return grpc.aio.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=agent.tls_ca_file.read_bytes(),
            private_key=None if agent.tls_key_file is None else agent.tls_key_file.read_bytes(),
            certificate_chain=(
                None if agent.tls_cert_file is None else agent.tls_cert_file.read_bytes()
            ),
        )
        return grpc.aio.secure_channel(address, credentials, options=options)


def coalesced(events: Sequence[KvEvent]) -> list[KvEvent]:
    """The same changes in fewer events: removals next to each other on one tier become
    one, and so does a stored run that continues the run just before it. Engines
    announce each evicted block alone, and the control plane pays for every event it
    parses; the order of changes that do not merge is kept, so the result is the same."""
    merged: list[KvEvent] = []
    run: list[BlockKey] = []  # the keys of merged[-1] while it may still grow
    for event in events:
        previous = merged[-1] if merged else None
        if (
            isinstance(event, BlocksRemoved)
            and isinstance(previous, BlocksRemoved)
            and previous.tier is event.tier
        ) or (
            isinstance(event, BlocksStored)
            and isinstance(previous, BlocksStored)
            and previous.tier is event.tier
            and run
            and event.parent_key == run[-1]
            and event.first_position == previous.first_position + len(run)
        ):
            run.extend(event.keys)
        else:
            _close_run(merged, run)
            merged.append(event)
            run = list(event.keys) if isinstance(event, BlocksStored | BlocksRemoved) else []
    _close_run(merged, run)
    return merged


def _close_run(merged: list[KvEvent], run: list[BlockKey]) -> None:
    """merged[-1] with the keys its run gathered (built once, not at every merge)."""
    last = merged[-1] if merged else None
    if isinstance(last, BlocksRemoved) and len(run) > len(last.keys):
        merged[-1] = BlocksRemoved(run, last.tier)
    elif isinstance(last, BlocksStored) and len(run) > len(last.keys):
        merged[-1] = BlocksStored(run, last.tier, last.first_position, last.parent_key)


def _blocks(event: KvEvent) -> int:
    if isinstance(event, BlocksStored | BlocksRemoved):
        return len(event.keys)
    return 0


def _split(event: BlocksStored | BlocksRemoved, blocks: int) -> tuple[KvEvent, KvEvent]:
    """The event's first `blocks` blocks and the rest, as two events. A stored run splits
    into two chained runs: the second's parent is the first's last block."""
    if isinstance(event, BlocksRemoved):
        return (
            BlocksRemoved(event.keys[:blocks], event.tier),
            BlocksRemoved(event.keys[blocks:], event.tier),
        )
    return (
        BlocksStored(event.keys[:blocks], event.tier, event.first_position, event.parent_key),
        BlocksStored(
            event.keys[blocks:], event.tier, event.first_position + blocks, event.keys[blocks - 1]
        ),
    )


def _batch_limits(own: ControlPlaneSettings, ack: pb.Ack) -> tuple[int, int]:
    """(events, blocks) a batch may hold: this agent's limits, or the control plane's where
    its Ack to the Register says smaller ones (0: it does not say)."""
    events, blocks = own.max_batch_events, own.max_batch_blocks
    if ack.max_batch_events:
        events = min(events, ack.max_batch_events)
    if ack.max_batch_blocks:
        blocks = min(blocks, ack.max_batch_blocks)
    return events, blocks


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
