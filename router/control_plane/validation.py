"""Pure checks of what agents send: a wire message becomes domain objects from
router/index/base.py, or a Rejection that says why not. Nothing here does I/O, so every
rule is testable without a server, and the service applies a batch only after all of
it has passed (a batch is applied whole or not at all).
"""

from __future__ import annotations

import enum
import hmac
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError

from kvplane.config import ControlPlaneSettings
from kvplane.v1 import control_plane_pb2 as pb
from router.index.base import (
    MAX_CHAIN_END,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    Tier,
    WorkerInfo,
)

WORKER_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


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


@dataclass(frozen=True, slots=True)
class LoadReport:
    running: int
    waiting: int
    kv_usage: float
    timestamp_ms: int  # the agent's wall clock; 0 when it sent none
    engine_down: bool = False


class SequenceVerdict(enum.Enum):
    DUPLICATE = "duplicate"  # applied already: ignore it and Ack again
    NEXT = "next"  # the one expected: apply it
    GAP = "gap"  # batches were lost in between: the worker must resync


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


def authenticate(
    metadata: Iterable[tuple[str, str | bytes]] | None, expected_token: str | None
) -> Rejection | None:
    """None when the call may proceed: no token is configured, or the call carries
    `authorization: Bearer <token>` with the configured token."""
    if expected_token is None:
        return None
    presented = b""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            raw = value.encode() if isinstance(value, str) else value
            scheme, _, token = raw.partition(b" ")
            if scheme.lower() == b"bearer":
                presented = token.strip()
    # compare_digest on bytes: its time does not depend on where the tokens differ.
    if presented and hmac.compare_digest(presented, expected_token.encode()):
        return None
    return Rejection(
        pb.REJECT_CODE_UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)"
    )


def parse_register(message: pb.Register, limits: Limits) -> WorkerInfo | Rejection:
    if not WORKER_ID_PATTERN.fullmatch(message.worker_id):
        return _invalid("worker_id must match [A-Za-z0-9._:-]{1,128}")
    if message.incarnation == 0:
        return _invalid("incarnation must be positive")
    if not _is_http_url(message.base_url):
        return _invalid("base_url must be an http:// or https:// URL with a host")
    if not message.model:
        return _invalid("model must not be empty")
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
    )


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
            keys=list(stored.keys),
            tier=tier,
            first_position=stored.first_position,
            parent_key=stored.parent_key if has_parent else None,
        )
    if kind == "removed":
        removed = event.removed
        tier = _parse_tier(removed.tier)
        if tier is None:
            return _invalid(f"unknown tier {removed.tier}")
        if not removed.keys:
            return _invalid("removed event without keys")
        return BlocksRemoved(keys=list(removed.keys), tier=tier)
    if kind == "cleared":
        return AllBlocksCleared()
    return _invalid("event carries no stored, removed or cleared")


def _parse_tier(value: int) -> Tier | None:
    # TIER_UNSPECIFIED (0) and values from a newer contract are both refused: the router
    # cannot rank a tier it does not know.
    try:
        return Tier(value)
    except ValueError:
        return None


def parse_load(message: pb.Load) -> LoadReport | Rejection:
    if not (math.isfinite(message.kv_usage) and 0.0 <= message.kv_usage <= 1.0):
        return _invalid("kv_usage must be a number from 0.0 to 1.0")
    return LoadReport(
        running=message.running,
        waiting=message.waiting,
        kv_usage=message.kv_usage,
        timestamp_ms=message.timestamp_ms,
        engine_down=message.engine_down,
    )


def classify_sequence(sequence: int, last_applied: int) -> SequenceVerdict:
    if sequence <= last_applied:
        return SequenceVerdict.DUPLICATE
    if sequence == last_applied + 1:
        return SequenceVerdict.NEXT
    return SequenceVerdict.GAP


def batch_blocks(events: Iterable[KvEvent]) -> int:
    """Blocks a validated batch names (stored plus removed), for logs and metrics."""
    return sum(len(e.keys) for e in events if not isinstance(e, AllBlocksCleared))
