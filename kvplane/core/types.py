"""The domain types the router and the agents share: where a block lives, the KV
events of a worker in kvplane block keys, and what a worker says about itself.

The wire codec (kvplane/wire/codec.py) turns these into protobuf and back; nothing
here knows about the wire or any backend.
"""

from __future__ import annotations

import enum
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


@dataclass(frozen=True, slots=True)
class LoadReport:
    running: int
    waiting: int
    kv_usage: float
    timestamp_ms: int  # the agent's wall clock; 0 when it sent none
    engine_down: bool = False
