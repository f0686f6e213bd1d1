"""The domain types the router and the agents share: where a block lives, the KV
events of a worker in kvplane block keys, and what a worker says about itself.

The wire codec (kvplane/wire/codec.py) turns these into protobuf and back; nothing
here knows about the wire or any backend.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvplane.core.keys import BlockKey


class Tier(enum.IntEnum):
    """Where a block lives; values equal the wire enum, lower is faster."""

    DEVICE = 1
    HOST = 2
    DISK = 3
    REMOTE = 4


MAX_CHAIN_END = 2**32 - 1
"""Largest first_position + len(keys) of a stored run (the next run of the same chain
starts there, and first_position is a uint32 on the wire); apply() refuses a batch
with a run outside 0..MAX_CHAIN_END."""


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """A chained run of newly cached blocks; see BlocksStored in the proto."""

    keys: Sequence[BlockKey]
    tier: Tier
    first_position: int = 0
    parent_key: BlockKey | None = None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    keys: Sequence[BlockKey]
    tier: Tier


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


class WorkerRole(enum.StrEnum):
    """Which legs of a request a worker takes under prefill/decode disaggregation
    (docs/pd-disaggregation.md). Values equal the wire enum's names, lower-cased."""

    BOTH = "both"  # whole requests; either leg too where it has a KV connector
    PREFILL = "prefill"  # prefill legs (whole requests only when no decode worker is live)
    DECODE = "decode"  # decode legs, and whole requests where disaggregating does not pay


Incarnation = tuple[str, int]
"""A worker id and one of its incarnations: a restarted agent or engine starts afresh,
and what was learnt of the one before does not carry over."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker says about itself when it registers."""

    worker_id: str
    incarnation: int
    base_url: str
    model: str
    block_size: int
    kv_capacity_blocks: int = 0
    engine_kind: str = ""
    engine_version: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    max_model_len: int = 0  # the engine's longest prompt plus output, in tokens; 0: unknown
    role: WorkerRole = WorkerRole.BOTH
    # The engine's KV transfer connector (vLLM's kv_transfer_config.kv_connector, e.g.
    # "NixlConnector"); "" for none. Legs are only split between workers with the same.
    kv_connector: str = ""

    @property
    def transfers_kv(self) -> bool:
        return bool(self.kv_connector)


class EventsState(enum.Enum):
    """Whether an engine's KV events reach its agent (the agent's own finding)."""

    UNKNOWN = "unknown"  # the agent does not say
    NOT_CONNECTED = "not_connected"  # no publisher accepted the event socket's connection
    NEVER_SEEN = "never_seen"  # connected; no event yet, nor any sign the engine cached
    FLOWING = "flowing"
    SILENT = "silent"  # the engine's counters prove it cached a block; no event came


class ReplayState(enum.Enum):
    """Whether the engine's replay endpoint answers its agent."""

    UNKNOWN = "unknown"  # the agent does not say, or has not asked yet
    NOT_CONFIGURED = "not_configured"
    OK = "ok"
    FAILING = "failing"


MAX_WIRING_DETAIL_CHARS = 512


class SkipReason(enum.Enum):
    """Why an agent skipped an engine event it could not use (the rest of its batch
    goes through)."""

    MALFORMED = "malformed"  # a field that does not decode, or no type tag
    UNKNOWN_TYPE = "unknown_type"  # an event type from a newer engine
    UNKNOWN_MEDIUM = "unknown_medium"  # a tier the agent cannot place: never the device
    REMOTE = "remote"  # held by another node, not by the publisher


EVENT_TYPE_PATTERN = re.compile(r"[A-Za-z0-9_.:?()-]{1,64}")
"""An engine event type as agents report it and routers accept it (a metric label): the
engine's tag if it is that, else "?"."""
OTHER_EVENT_TYPES = "(other)"
MAX_SKIPPED_KINDS = 16
"""Kinds (event type, reason) of skipped events an agent counts apart, and the router
keeps; an agent counts the types past them as OTHER_EVENT_TYPES."""


@dataclass(frozen=True, slots=True)
class SkippedEvents:
    """How many events of one type an agent skipped for one reason since it started."""

    event_type: str  # matches EVENT_TYPE_PATTERN
    reason: SkipReason
    count: int


@dataclass(frozen=True, slots=True)
class WiringReport:
    """What an agent found about its own wiring to its engine."""

    events: EventsState
    replay: ReplayState
    engine_block_size: int | None  # None: the engine does not say
    # The diagnosis of each and its fix: one line, ids and addresses only.
    events_detail: str = ""
    replay_detail: str = ""
    skipped_events: tuple[SkippedEvents, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadReport:
    running: int
    waiting: int
    kv_usage: float
    timestamp_ms: int  # the agent's wall clock; 0 when it sent none
    engine_down: bool = False
    wiring: WiringReport | None = None  # None: the agent sent none
    # The engine's failed KV transfers since it started (see Load in the proto).
    kv_load_failures: int = 0
    kv_leases_expired: int = 0
