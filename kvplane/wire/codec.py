"""The one codec between kvplane's domain objects and the wire contract
(proto/kvplane/wire/v1/control_plane.proto).

- Encode, for agents: a registration, an event batch, a load report, a drain.
- Decode and validate, for the control plane: a wire message becomes domain objects
  from kvplane/core/types.py, or a Rejection that says why not. Nothing here does I/O,
  so every rule is testable without a server, and a batch is refused whole or not at
  all.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError

from kvplane.core.config import ControlPlaneSettings
from kvplane.core.keys import SCHEME_VERSION, BlockKey
from kvplane.core.types import (
    EVENT_TYPE_PATTERN,
    MAX_CHAIN_END,
    MAX_SKIPPED_KINDS,
    MAX_WIRING_DETAIL_CHARS,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    EventsState,
    KvEvent,
    LoadReport,
    ReplayState,
    SkippedEvents,
    SkipReason,
    Tier,
    WiringReport,
    WorkerInfo,
    WorkerRole,
)
from kvplane.wire.v1 import control_plane_pb2 as pb

WORKER_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_ENGINE_FIELD_CHARS = (
    64  # engine_kind, engine_version, kv_connector, as the fleet API shows them
)
UNREADABLE_DETAIL = (
    f"(the agent's detail was not one printable line of at most {MAX_WIRING_DETAIL_CHARS} "
    "characters)"
)

_TIER_TO_WIRE: dict[Tier, pb.Tier] = {
    Tier.DEVICE: pb.TIER_DEVICE,
    Tier.HOST: pb.TIER_HOST,
    Tier.DISK: pb.TIER_DISK,
    Tier.REMOTE: pb.TIER_REMOTE,
}
_TIER_FROM_WIRE: dict[int, Tier] = {wire: tier for tier, wire in _TIER_TO_WIRE.items()}

_ROLE_TO_WIRE: dict[WorkerRole, pb.WorkerRole] = {
    WorkerRole.BOTH: pb.WORKER_ROLE_BOTH,
    WorkerRole.PREFILL: pb.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: pb.WORKER_ROLE_DECODE,
}
# An older agent leaves the role unset: it serves whole requests, as before roles.
_ROLE_FROM_WIRE: dict[int, WorkerRole] = {
    pb.WORKER_ROLE_UNSPECIFIED: WorkerRole.BOTH,
    **{int(wire): role for role, wire in _ROLE_TO_WIRE.items()},
}

_EVENTS_TO_WIRE: dict[EventsState, pb.EventsState] = {
    EventsState.UNKNOWN: pb.EVENTS_STATE_UNSPECIFIED,
    EventsState.NOT_CONNECTED: pb.EVENTS_STATE_NOT_CONNECTED,
    EventsState.NEVER_SEEN: pb.EVENTS_STATE_NEVER_SEEN,
    EventsState.FLOWING: pb.EVENTS_STATE_FLOWING,
    EventsState.SILENT: pb.EVENTS_STATE_SILENT,
}
_EVENTS_FROM_WIRE: dict[int, EventsState] = {w: state for state, w in _EVENTS_TO_WIRE.items()}
_REPLAY_TO_WIRE: dict[ReplayState, pb.ReplayState] = {
    ReplayState.UNKNOWN: pb.REPLAY_STATE_UNSPECIFIED,
    ReplayState.NOT_CONFIGURED: pb.REPLAY_STATE_NOT_CONFIGURED,
    ReplayState.OK: pb.REPLAY_STATE_OK,
    ReplayState.FAILING: pb.REPLAY_STATE_FAILING,
}
_REPLAY_FROM_WIRE: dict[int, ReplayState] = {w: state for state, w in _REPLAY_TO_WIRE.items()}


@dataclass(frozen=True, slots=True)
class Limits:
    """What this router accepts; agents must hash with the same block size and scheme."""

    block_size: int
    key_scheme_version: int
    max_batch_events: int
    max_batch_blocks: int

    @classmethod
    def from_settings(cls, settings: ControlPlaneSettings) -> Limits:
        return cls(
            block_size=settings.block_size,
            key_scheme_version=settings.key_scheme_version,
            max_batch_events=settings.max_batch_events,
            max_batch_blocks=settings.max_batch_blocks,
        )


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a message was refused; the service sends it as a Reject and closes the stream."""

    code: pb.RejectCode
    reason: str

    @property
    def label(self) -> str:
        """The code as a short metric label, e.g. "batch_too_large"."""
        return pb.RejectCode.Name(self.code).removeprefix("REJECT_CODE_").lower()


def register_message(info: WorkerInfo, key_scheme_version: int = SCHEME_VERSION) -> pb.AgentMessage:
    return pb.AgentMessage(
        register=pb.Register(
            worker_id=info.worker_id,
            incarnation=info.incarnation,
            base_url=info.base_url,
            model=info.model,
            block_size=info.block_size,
            key_scheme_version=key_scheme_version,
            kv_capacity_blocks=info.kv_capacity_blocks,
            engine_kind=info.engine_kind,
            engine_version=info.engine_version,
            labels=dict(info.labels),
            max_model_len=info.max_model_len,
            role=_ROLE_TO_WIRE[info.role],
            kv_connector=info.kv_connector,
        )
    )


def event_to_wire(event: KvEvent) -> pb.KvEvent:
    if isinstance(event, BlocksStored):
        return pb.KvEvent(
            stored=pb.BlocksStored(
                parent_key=event.parent_key,
                keys=event.keys,
                first_position=event.first_position,
                tier=_TIER_TO_WIRE[event.tier],
            )
        )
    if isinstance(event, BlocksRemoved):
        return pb.KvEvent(removed=pb.BlocksRemoved(keys=event.keys, tier=_TIER_TO_WIRE[event.tier]))
    assert isinstance(event, AllBlocksCleared)
    return pb.KvEvent(cleared=pb.AllBlocksCleared())


def events_message(
    sequence: int, events: Iterable[KvEvent], *, ack_deferred: bool = False
) -> pb.AgentMessage:
    return pb.AgentMessage(
        kv_events=pb.KvEvents(
            sequence=sequence,
            events=[event_to_wire(e) for e in events],
            timestamp_ms=time.time_ns() // 1_000_000,
            ack_deferred=ack_deferred,
        )
    )


def load_message(
    running: int,
    waiting: int,
    kv_usage: float,
    *,
    engine_down: bool = False,
    wiring: WiringReport | None = None,
    kv_load_failures: int = 0,
    kv_leases_expired: int = 0,
) -> pb.AgentMessage:
    return pb.AgentMessage(
        load=pb.Load(
            running=running,
            waiting=waiting,
            kv_usage=kv_usage,
            timestamp_ms=time.time_ns() // 1_000_000,
            engine_down=engine_down,
            wiring=None if wiring is None else wiring_to_wire(wiring),
            kv_load_failures=kv_load_failures,
            kv_leases_expired=kv_leases_expired,
        )
    )


def wiring_to_wire(report: WiringReport) -> pb.Wiring:
    return pb.Wiring(
        events=_EVENTS_TO_WIRE[report.events],
        replay=_REPLAY_TO_WIRE[report.replay],
        engine_block_size=report.engine_block_size or 0,
        events_detail=_one_line(report.events_detail),
        replay_detail=_one_line(report.replay_detail),
        skipped_events=[
            pb.SkippedEvents(event_type=s.event_type, reason=s.reason.value, count=s.count)
            for s in sorted(report.skipped_events, key=lambda s: -s.count)[:MAX_SKIPPED_KINDS]
        ],
    )


def _one_line(detail: str) -> str:
    """What the router accepts as a wiring detail: printable, one line, not too long."""
    printable = "".join(char if char.isprintable() else " " for char in detail)
    return printable[:MAX_WIRING_DETAIL_CHARS]


def drain_message() -> pb.AgentMessage:
    return pb.AgentMessage(drain=pb.Drain())


def _invalid(reason: str) -> Rejection:
    return Rejection(pb.REJECT_CODE_INVALID_MESSAGE, reason)


def decode_agent_message(data: bytes) -> pb.AgentMessage | Rejection:
    """Parse one message off the wire; the service reads raw bytes so that bytes which
    are no AgentMessage get a Reject like any other bad message."""
    try:
        message = pb.AgentMessage.FromString(data)
    except DecodeError:
        return _invalid("the bytes received are not an AgentMessage")
    if message.WhichOneof("body") is None:
        return _invalid("the message carries no body (register, kv_events, load or drain)")
    return message


def parse_register(message: pb.Register, limits: Limits) -> WorkerInfo | Rejection:
    if not WORKER_ID_PATTERN.fullmatch(message.worker_id):
        return _invalid("worker_id must match [A-Za-z0-9._:-]{1,128}")
    if message.incarnation == 0:
        return _invalid("incarnation must be positive")
    if not _is_http_url(message.base_url):
        return _invalid("base_url must be an http:// or https:// URL with a host")
    if not message.model:
        return _invalid("model must not be empty")
    role = _ROLE_FROM_WIRE.get(message.role)
    if role is None:
        return _invalid(f"role {message.role} is none of WorkerRole's values")
    for name in ("engine_kind", "engine_version", "kv_connector"):
        if not _is_short_line(getattr(message, name), MAX_ENGINE_FIELD_CHARS):
            return _invalid(
                f"{name} must be printable, at most {MAX_ENGINE_FIELD_CHARS} characters"
            )
    if message.block_size != limits.block_size:
        return Rejection(
            pb.REJECT_CODE_INCOMPATIBLE,
            f"block_size {message.block_size} differs from this router's {limits.block_size}",
        )
    if message.key_scheme_version != limits.key_scheme_version:
        return Rejection(
            pb.REJECT_CODE_INCOMPATIBLE,
            f"key_scheme_version {message.key_scheme_version} differs from this router's "
            f"{limits.key_scheme_version}",
        )
    return WorkerInfo(
        worker_id=message.worker_id,
        incarnation=message.incarnation,
        base_url=message.base_url,
        model=message.model,
        block_size=message.block_size,
        kv_capacity_blocks=message.kv_capacity_blocks,
        engine_kind=message.engine_kind,
        engine_version=message.engine_version,
        labels=dict(message.labels),
        max_model_len=message.max_model_len,
        role=role,
        kv_connector=message.kv_connector,
    )


def _is_short_line(text: str, limit: int) -> bool:
    return len(text) <= limit and text.isprintable()


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a port that is not a number in range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def parse_kv_events(message: pb.KvEvents, limits: Limits) -> list[KvEvent] | Rejection:
    """The whole batch, or the first reason to refuse it."""
    if message.sequence == 0:
        return _invalid("sequence starts at 1")
    if len(message.events) > limits.max_batch_events:
        return Rejection(
            pb.REJECT_CODE_BATCH_TOO_LARGE,
            f"{len(message.events)} events in one batch; at most {limits.max_batch_events}",
        )
    events: list[KvEvent] = []
    for position, wire_event in enumerate(message.events):
        event = _parse_event(wire_event)
        if isinstance(event, Rejection):
            return _invalid(f"event {position}: {event.reason}")
        events.append(event)
    blocks = batch_blocks(events)
    if blocks > limits.max_batch_blocks:
        return Rejection(
            pb.REJECT_CODE_BATCH_TOO_LARGE,
            f"{blocks} blocks in one batch; at most {limits.max_batch_blocks}",
        )
    return events


def _parse_event(event: pb.KvEvent) -> KvEvent | Rejection:
    kind = event.WhichOneof("event")
    if kind == "stored":
        stored = event.stored
        tier = _parse_tier(stored.tier)
        if tier is None:
            return _invalid(f"unknown tier {stored.tier}")
        if not stored.keys:
            return _invalid("stored event without keys")
        has_parent = stored.HasField("parent_key")
        if has_parent != (stored.first_position > 0):
            return _invalid("first_position must be 0 exactly when parent_key is absent")
        if stored.first_position + len(stored.keys) > MAX_CHAIN_END:
            return _invalid(f"chain positions past {MAX_CHAIN_END}")
        return BlocksStored(
            keys=cast(list[BlockKey], list(stored.keys)),
            tier=tier,
            first_position=stored.first_position,
            parent_key=BlockKey(stored.parent_key) if has_parent else None,
        )
    if kind == "removed":
        removed = event.removed
        tier = _parse_tier(removed.tier)
        if tier is None:
            return _invalid(f"unknown tier {removed.tier}")
        if not removed.keys:
            return _invalid("removed event without keys")
        return BlocksRemoved(keys=cast(list[BlockKey], list(removed.keys)), tier=tier)
    if kind == "cleared":
        return AllBlocksCleared()
    return _invalid("event carries no stored, removed or cleared")


def _parse_tier(value: int) -> Tier | None:
    # TIER_UNSPECIFIED (0) and values from a newer contract are both refused: the router
    # cannot rank a tier it does not know.
    return _TIER_FROM_WIRE.get(value)


def parse_load(message: pb.Load) -> LoadReport | Rejection:
    if not (math.isfinite(message.kv_usage) and 0.0 <= message.kv_usage <= 1.0):
        return _invalid("kv_usage must be a number from 0.0 to 1.0")
    wiring = _parse_wiring(message.wiring) if message.HasField("wiring") else None
    return LoadReport(
        running=message.running,
        waiting=message.waiting,
        kv_usage=message.kv_usage,
        timestamp_ms=message.timestamp_ms,
        engine_down=message.engine_down,
        wiring=wiring,
        kv_load_failures=message.kv_load_failures,
        kv_leases_expired=message.kv_leases_expired,
    )


def _parse_wiring(message: pb.Wiring) -> WiringReport:
    """A diagnosis, never a reason to refuse the heartbeat it comes with: a state from a
    newer contract is read as unknown, a detail that is no short printable line is
    replaced by a note saying so."""
    return WiringReport(
        events=_EVENTS_FROM_WIRE.get(message.events, EventsState.UNKNOWN),
        replay=_REPLAY_FROM_WIRE.get(message.replay, ReplayState.UNKNOWN),
        engine_block_size=message.engine_block_size or None,
        events_detail=_checked_detail(message.events_detail),
        replay_detail=_checked_detail(message.replay_detail),
        skipped_events=_checked_skips(message.skipped_events),
    )


_SKIP_REASONS = {reason.value: reason for reason in SkipReason}


def _checked_skips(entries: Iterable[pb.SkippedEvents]) -> tuple[SkippedEvents, ...]:
    """The agent's skipped-event counts that become metric labels: a bounded number of
    kinds, each a known reason and a short printable type; others are left out."""
    kept = []
    for entry in entries:
        reason = _SKIP_REASONS.get(entry.reason)
        if reason is None or not EVENT_TYPE_PATTERN.fullmatch(entry.event_type):
            continue
        kept.append(SkippedEvents(entry.event_type, reason, entry.count))
        if len(kept) == MAX_SKIPPED_KINDS:
            break
    return tuple(kept)


def _checked_detail(detail: str) -> str:
    if len(detail) <= MAX_WIRING_DETAIL_CHARS and detail.isprintable():
        return detail
    return UNREADABLE_DETAIL


def batch_blocks(events: Iterable[KvEvent]) -> int:
    """Blocks a validated batch names (stored plus removed), for logs and metrics."""
    return sum(len(e.keys) for e in events if not isinstance(e, AllBlocksCleared))
