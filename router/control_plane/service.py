"""The ControlPlane.Connect stream: what the router does with each agent message.

gRPC runs every stream in its own task and this module handles one message at a time
per stream, so a stream's messages are applied in the order they were sent. Decisions
come from pure functions (the wire codec, admission.py, workers.py); this module only does
the I/O they call for (index calls, replies) and keeps the view and metrics current.

Outcomes, as proto/kvplane/wire/v1/control_plane.proto defines them:
- Ack: after a Register (the sequence to resume after, and that batches may defer
  their Acks) and after every KvEvents batch that was applied or was a duplicate,
  unless the agent marked it `ack_deferred`: a later Ack covers it. Load and Drain get
  no reply.
- Resync: the worker's entries are gone (sequence gap, or its lease ran out). The
  stream stays open for a Register of a higher incarnation; messages still in flight
  from the old one are ignored until then.
- Reject: the message was not applied. The Reject is written, then the stream ends
  with the gRPC status that matches the code (UNAUTHENTICATED, INVALID_ARGUMENT, ...),
  and nothing more is read from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from urllib.parse import urlsplit

import grpc
import grpc.aio

from kvplane.core.clock import Clock, WallClock
from kvplane.core.config import ControlPlaneSettings
from kvplane.core.types import AllBlocksCleared, BlocksRemoved, KvEvent
from kvplane.wire.codec import (
    Limits,
    Rejection,
    batch_blocks,
    decode_agent_message,
    parse_kv_events,
    parse_load,
    parse_register,
)
from kvplane.wire.v1 import control_plane_pb2 as pb
from router.control_plane.admission import (
    IPAddress,
    SequenceVerdict,
    authenticate,
    authenticate_worker,
    certificate_names,
    certificate_speaks_for,
    classify_sequence,
    engine_host_allowed,
    incarnation_too_far_ahead,
    peer_address,
    presented_token,
)
from router.control_plane.workers import (
    RegisterVerdict,
    WorkerRecord,
    WorkerView,
    classify_register,
    needs_renewal,
)
from router.index.base import (
    LocationIndex,
    LocationIndexError,
    SequenceMismatch,
    StaleIncarnation,
    UnknownWorker,
    WorkerState,
)
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["ControlPlane"].full_name
CONNECT_METHOD = f"/{SERVICE_NAME}/Connect"

_STATUS_FOR_REJECT: dict[int, grpc.StatusCode] = {
    pb.REJECT_CODE_UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    pb.REJECT_CODE_INVALID_MESSAGE: grpc.StatusCode.INVALID_ARGUMENT,
    pb.REJECT_CODE_NOT_REGISTERED: grpc.StatusCode.FAILED_PRECONDITION,
    pb.REJECT_CODE_STALE_INCARNATION: grpc.StatusCode.FAILED_PRECONDITION,
    pb.REJECT_CODE_INCOMPATIBLE: grpc.StatusCode.FAILED_PRECONDITION,
    pb.REJECT_CODE_BATCH_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

_REFUSED_FIRST_MESSAGE_WAIT_S = 2.0  # how long a refused call may hold a handler

Reply = pb.ControlMessage | Rejection | None
Context = grpc.aio.ServicerContext[bytes, pb.ControlMessage]


class ResyncCause(enum.Enum):
    SEQUENCE_GAP = "sequence_gap"
    LEASE_EXPIRED = "lease_expired"
    INDEX_LOST_WRITES = "index_lost_writes"  # e.g. a Redis failover to a lagging replica


def _ending(reply: pb.ControlMessage | Rejection) -> Rejection:
    """What a Load or Drain that cannot be applied gets. They have no replies, so an
    agent waiting for the reply to its next request would take a Resync here for that
    one: the stream ends instead, and the agent's Register on the next stream is told."""
    if isinstance(reply, Rejection):
        return reply
    return Rejection(pb.REJECT_CODE_NOT_REGISTERED, reply.resync.reason)


_MAX_LEASE_MS = 2**32 - 1  # Ack.lease_ms is a uint32
_UINT32_MAX = 2**32 - 1  # as are the Ack's batch limits


def _ack(sequence: int) -> pb.ControlMessage:
    return pb.ControlMessage(ack=pb.Ack(sequence=sequence))


def _register_ack(applied: int, lease_s: float, limits: Limits) -> pb.ControlMessage:
    lease_ms = min(round(lease_s * 1000), _MAX_LEASE_MS)
    return pb.ControlMessage(
        ack=pb.Ack(
            sequence=applied,
            lease_ms=lease_ms,
            defers_acks=True,
            # An agent configured for larger batches than these would have every one
            # refused, and start over for ever: it sizes its batches by them instead.
            max_batch_events=min(limits.max_batch_events, _UINT32_MAX),
            max_batch_blocks=min(limits.max_batch_blocks, _UINT32_MAX),
        )
    )


class ControlPlaneService:
    def __init__(
        self,
        index: LocationIndex,
        view: WorkerView,
        metrics: RouterMetrics,
        settings: ControlPlaneSettings,
        on_removed: Callable[[str, BlocksRemoved | None], None] | None = None,
        clock: Clock = time.monotonic,
        wall_clock: WallClock = time.time,
    ) -> None:
        """`on_removed(worker_id, removal)` hears of every removal this router applies
        (None: all the worker's blocks), so that predictions never outlive one and
        evictions are counted.
        `clock` times the view's leases and reports (the index's and the fleet's clock);
        `wall_clock` is what agents' timestamps are compared with."""
        self.on_removed = on_removed or (lambda worker_id, removal: None)
        self.clock = clock
        self.wall_clock = wall_clock
        self.index = index
        self.view = view
        self.metrics = metrics
        self.limits = Limits.from_settings(settings)
        self.lease_s = settings.lease_s
        token, secret = settings.agent_token, settings.worker_credential_secret
        # Worker credentials replace the shared token: each agent presents its own.
        self.worker_secret = None if secret is None else secret.get_secret_value()
        self._token = None if token is None or secret is not None else token.get_secret_value()
        self.bind_engines = settings.bind_engines_to_agents
        self.max_incarnation_ahead_s = settings.max_incarnation_ahead_s
        self.allowed_engine_hosts = list(settings.allowed_engine_hosts)
        self.bind_certificates = settings.bind_worker_ids_to_certificates
        self._stream_ids = itertools.count(1)

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        # Requests arrive as raw bytes (no request_deserializer) and are parsed in
        # connect(), so bytes that are no AgentMessage get a Reject like any other bad
        # message instead of gRPC's bare INTERNAL status.
        handler: grpc.RpcMethodHandler[bytes, pb.ControlMessage]
        handler = grpc.stream_stream_rpc_method_handler(
            self.connect, response_serializer=pb.ControlMessage.SerializeToString
        )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {"Connect": handler})

    async def connect(self, requests: AsyncIterator[bytes], context: Context) -> None:
        presented = presented_token(context.invocation_metadata())
        rejection = authenticate(presented, self._token)
        if rejection is not None:
            # Take the agent's first message (unread) before refusing: an agent writes
            # Register and then reads, and a call that ended before its write reaches
            # the agent as a bare INTERNAL error instead of this Reject and its reason.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_REFUSED_FIRST_MESSAGE_WAIT_S):
                    async for _ in requests:
                        break
            await self._reject(context, rejection, worker_id=None)
            return
        stream = _Stream(
            self,
            next(self._stream_ids),
            presented,
            peer_address(context.peer()),
            certificate_names(context.auth_context()) if self.bind_certificates else None,
        )
        self.metrics.streams.inc()
        try:
            async for data in requests:
                reply = await stream.handle(data)
                if isinstance(reply, Rejection):
                    await self._reject(context, reply, worker_id=stream.worker_id)
                    return
                if reply is not None:
                    await context.write(reply)
        except LocationIndexError as error:
            # Nothing of the failed message was applied (apply is all or nothing), so
            # the agent reconnects later and resumes from the Ack it gets then.
            log.warning(
                "worker %s: location index failed (%s: %s); closing the stream",
                stream.worker_id,
                type(error).__name__,
                error,
            )
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details("the location index is unavailable; reconnect later")
        except Exception:  # the stream's edge: a bug ends this stream alone, logged
            log.exception("worker %s: unexpected error; closing the stream", stream.worker_id)
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details("internal error in the control plane")
        finally:
            self.metrics.streams.dec()
            await stream.end()

    async def _reject(self, context: Context, rejection: Rejection, worker_id: str | None) -> None:
        self.metrics.rejects.labels(reason=rejection.label).inc()
        log.info("worker %s rejected: %s (%s)", worker_id, rejection.label, rejection.reason)
        await context.write(
            pb.ControlMessage(reject=pb.Reject(code=rejection.code, reason=rejection.reason))
        )
        context.set_code(_STATUS_FOR_REJECT[rejection.code])
        context.set_details(rejection.reason)


class _Stream:
    """One agent stream. It speaks for at most one worker; `registered` is False before
    the first Register and again after a Resync, until the next Register."""

    def __init__(
        self,
        service: ControlPlaneService,
        stream_id: int,
        token: bytes,
        agent_address: IPAddress | None,
        certificate: frozenset[str] | None,
    ) -> None:
        self.service = service
        self.token = token  # what the call presented: a worker's own, with credentials on
        self.agent_address = agent_address  # where the agent connects from
        self.certificate = certificate  # the names of its client certificate, under mTLS
        self.index = service.index
        self.view = service.view
        self.metrics = service.metrics
        self.clock = service.clock
        self.id = stream_id
        self.worker_id: str | None = None
        self.incarnation = 0
        self.registered = False

    async def handle(self, data: bytes) -> Reply:
        message = decode_agent_message(data)
        if isinstance(message, Rejection):
            return message
        if message.WhichOneof("body") == "register":
            return await self._register(message.register)
        if self.worker_id is None:
            return Rejection(pb.REJECT_CODE_NOT_REGISTERED, "the first message must be Register")
        if not self.registered:
            # Sent before the agent read our Resync; that incarnation is gone.
            return None
        record = self._own_record()
        if not isinstance(record, WorkerRecord):
            return record
        if message.HasField("kv_events"):
            return await self._kv_events(message.kv_events, record)
        if message.HasField("load"):
            return await self._load(message.load, record)
        return await self._drain(record)

    def _own_record(self) -> WorkerRecord | pb.ControlMessage | Rejection:
        """The worker's record while this stream still speaks for the registered
        incarnation; otherwise the reply that says why it no longer does."""
        assert self.worker_id is not None
        record = self.view.get(self.worker_id)
        if record is None:  # dead so long that the view forgot it
            return self._resync(ResyncCause.LEASE_EXPIRED, "the worker's lease ran out")
        if record.incarnation != self.incarnation:
            return Rejection(
                pb.REJECT_CODE_STALE_INCARNATION,
                f"incarnation {self.incarnation} was replaced by {record.incarnation}",
            )
        if record.stream != self.id:
            return Rejection(
                pb.REJECT_CODE_STALE_INCARNATION,
                "a newer stream registered this incarnation; this one is closed",
            )
        return record

    async def _register(self, message: pb.Register) -> Reply:
        info = parse_register(message, self.service.limits)
        if isinstance(info, Rejection):
            return info
        refused = authenticate_worker(
            self.token, self.service.worker_secret, info.worker_id
        ) or certificate_speaks_for(self.certificate, info.worker_id)
        if refused is not None:
            return refused
        if incarnation_too_far_ahead(
            info.incarnation, self.service.wall_clock(), self.service.max_incarnation_ahead_s
        ):
            return Rejection(
                pb.REJECT_CODE_INCOMPATIBLE,
                f"incarnation {info.incarnation} is more than "
                f"{self.service.max_incarnation_ahead_s:g} s ahead of this router's clock "
                "(incarnations are the agent's wall clock in ns: check both clocks)",
            )
        host = urlsplit(info.base_url).hostname or ""
        if self.service.bind_engines and not engine_host_allowed(
            host, self.agent_address, self.service.allowed_engine_hosts
        ):
            return Rejection(
                pb.REJECT_CODE_INCOMPATIBLE,
                f"base_url names {host}, neither the address this agent connects from "
                f"({self.agent_address}) nor a host in control_plane.allowed_engine_hosts",
            )
        if self.worker_id is not None and info.worker_id != self.worker_id:
            return Rejection(
                pb.REJECT_CODE_INVALID_MESSAGE,
                f"this stream speaks for worker {self.worker_id}; open another for a second one",
            )
        now = self.clock()
        record = self.view.get(info.worker_id)
        verdict = classify_register(record, info.incarnation)
        if verdict is RegisterVerdict.STALE:
            assert record is not None
            return Rejection(
                pb.REJECT_CODE_STALE_INCARNATION,
                f"incarnation {info.incarnation} is older than {record.incarnation}",
            )
        try:
            # What the index recorded, not this view: another router may have applied
            # this incarnation's batches (the agent moved), or the index lost some.
            applied = await self.index.register(info, self.service.lease_s)
        except StaleIncarnation as error:  # a higher one registered through another router
            return Rejection(pb.REJECT_CODE_STALE_INCARNATION, str(error))
        # Only now does this stream speak for the new incarnation: if the index refused
        # it, end() must still see the incarnation the view records for this stream.
        self.worker_id, self.incarnation = info.worker_id, info.incarnation
        if verdict is RegisterVerdict.NEW:
            self.service.on_removed(info.worker_id, None)
        record = self.view.registered(
            info, stream=self.id, now=now, lease_s=self.service.lease_s, applied=applied
        )
        self.registered = True
        log.info(
            "worker %s incarnation %d registered (%s), resuming after sequence %d",
            info.worker_id,
            info.incarnation,
            verdict.value,
            record.applied,
        )
        # The lease, so that an agent whose load stands still heartbeats only as often
        # as it needs (each message costs both sides a wake-up).
        return _register_ack(record.applied, self.service.lease_s, self.service.limits)

    async def _kv_events(self, message: pb.KvEvents, record: WorkerRecord) -> Reply:
        events = parse_kv_events(message, self.service.limits)
        if isinstance(events, Rejection):
            return events
        verdict = classify_sequence(message.sequence, record.applied)
        if verdict is SequenceVerdict.DUPLICATE:
            self.metrics.duplicate_batches.inc()
            return _ack(record.applied)
        if verdict is SequenceVerdict.GAP:
            await self.index.drop_worker(record.info.worker_id, record.incarnation)
            return self._resync(
                ResyncCause.SEQUENCE_GAP,
                f"expected sequence {record.applied + 1}, got {message.sequence}",
            )
        if needs_renewal(record, self.clock(), self.service.lease_s):
            failed = await self._renew(record, draining=record.state is WorkerState.DRAINING)
            if failed is not None:
                return failed
        # An empty batch (it only asks for the Ack of those before it) goes too: the
        # index records every sequence, so that any router resumes the agent after it.
        try:
            await self.index.apply(
                record.info.worker_id, record.incarnation, events, sequence=message.sequence
            )
        except (StaleIncarnation, UnknownWorker, SequenceMismatch) as error:
            return await self._index_refused(record, error)
        if events:
            _tell_removals(self.service.on_removed, record.info.worker_id, events)
            if message.timestamp_ms:
                lag = self.service.wall_clock() - message.timestamp_ms / 1000
                self.metrics.event_lag_seconds.observe(max(0.0, lag))
        self.view.applied(
            record.info.worker_id,
            record.incarnation,
            message.sequence,
            self.clock() if events else None,
        )
        log.debug(
            "worker %s applied sequence %d: %d events, %d blocks",
            record.info.worker_id,
            message.sequence,
            len(events),
            batch_blocks(events),
        )
        # Each reply costs both sides a wake-up, more than a batch's own work here.
        return None if message.ack_deferred else _ack(message.sequence)

    async def _load(self, message: pb.Load, record: WorkerRecord) -> Reply:
        report = parse_load(message)
        if isinstance(report, Rejection):
            return report
        if report.engine_down:
            # Stop routing there at once, but let the lease (and the entries) run out.
            if record.state is WorkerState.LIVE:
                failed = await self._renew(record, draining=True)
                if failed is not None:
                    return _ending(failed)
                log.info("worker %s reports its engine down", record.info.worker_id)
        elif needs_renewal(record, self.clock(), self.service.lease_s):
            # Not every report: each renewal is an index write (a Redis round trip), and
            # a fleet's agents report every second.
            failed = await self._renew(record, draining=record.state is WorkerState.DRAINING)
            if failed is not None:
                return _ending(failed)
        self.view.load(record.info.worker_id, record.incarnation, report, self.clock())
        if report.timestamp_ms:
            lag = self.service.wall_clock() - report.timestamp_ms / 1000
            self.metrics.load_lag_seconds.observe(max(0.0, lag))
        return None

    async def _drain(self, record: WorkerRecord) -> Reply:
        failed = await self._renew(record, draining=True)
        if failed is None:
            log.info("worker %s incarnation %d draining", record.info.worker_id, record.incarnation)
            return None
        return _ending(failed)

    async def _renew(self, record: WorkerRecord, *, draining: bool) -> Reply:
        """Extend the lease; None on success, else the reply that ends the incarnation."""
        # Taken before the index renews: the view's lease must not outlast the index's.
        renewed_at = self.clock()
        try:
            await self.index.renew(
                record.info.worker_id,
                record.incarnation,
                self.service.lease_s,
                draining=draining,
                applied=record.applied,
            )
        except (StaleIncarnation, UnknownWorker, SequenceMismatch) as error:
            return await self._index_refused(record, error)
        self.view.renewed(
            record.info.worker_id,
            record.incarnation,
            now=renewed_at,
            lease_s=self.service.lease_s,
            draining=draining,
        )
        return None

    async def _index_refused(
        self, record: WorkerRecord, error: StaleIncarnation | UnknownWorker | SequenceMismatch
    ) -> pb.ControlMessage | Rejection:
        if isinstance(error, StaleIncarnation):
            return Rejection(pb.REJECT_CODE_STALE_INCARNATION, str(error))
        if isinstance(error, SequenceMismatch) and error.recorded > error.expected:
            # Another router applied this incarnation's later batches: the agent moved
            # there, and this is its old stream's message arriving late. The worker's
            # entries are whole; only this stream no longer speaks for it.
            return Rejection(pb.REJECT_CODE_STALE_INCARNATION, str(error))
        if isinstance(error, SequenceMismatch):
            # Entries no one can vouch for: none rather than a partial picture, until
            # the agent's whole state arrives under its next incarnation.
            await self.index.drop_worker(record.info.worker_id, record.incarnation)
            return self._resync(ResyncCause.INDEX_LOST_WRITES, str(error))
        # Unknown to the index: the lease ran out and the entries went with it.
        return self._resync(ResyncCause.LEASE_EXPIRED, "the worker's lease ran out")

    def _resync(self, cause: ResyncCause, detail: str) -> pb.ControlMessage:
        assert self.worker_id is not None
        self.view.dead(self.worker_id, self.clock())
        self.service.on_removed(self.worker_id, None)
        self.view.disconnected(self.worker_id, self.id)
        self.registered = False
        self.metrics.resyncs.labels(reason=cause.value).inc()
        log.info(
            "worker %s incarnation %d must resync: %s", self.worker_id, self.incarnation, detail
        )
        return pb.ControlMessage(resync=pb.Resync(reason=f"{cause.value}: {detail}"))

    async def end(self) -> None:
        """The stream closed. A draining worker is dropped at once (it said it would
        leave); any other keeps its entries until its lease runs out, so it can
        reconnect with the same incarnation and resume."""
        if self.worker_id is None or not self.registered:
            return
        record = self.view.get(self.worker_id)
        if record is None or record.stream != self.id or record.incarnation != self.incarnation:
            return  # another stream speaks for the worker now
        self.view.disconnected(self.worker_id, self.id)
        if record.state is not WorkerState.DRAINING:
            log.info("worker %s disconnected; entries kept until the lease ends", self.worker_id)
            return
        try:
            await self.index.drop_worker(self.worker_id, self.incarnation)
        except LocationIndexError as error:
            log.warning(
                "worker %s: could not drop the drained worker (%s); its lease will end it",
                self.worker_id,
                type(error).__name__,
            )
            return
        self.view.dead(self.worker_id, self.clock())
        log.info("worker %s drained and disconnected; dropped", self.worker_id)


def _tell_removals(
    on_removed: Callable[[str, BlocksRemoved | None], None],
    worker_id: str,
    events: Sequence[KvEvent],
) -> None:
    for event in events:
        if isinstance(event, BlocksRemoved):
            on_removed(worker_id, event)
        elif isinstance(event, AllBlocksCleared):
            on_removed(worker_id, None)
