"""What engine adapters produce: the engine's KV cache events and load, engine-neutral.

Hashes are the engine's own, normalised to unsigned 64-bit integers; they are opaque
here and only used to match removals and hash-only stores with earlier stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

from kvplane.core.types import SkipReason, Tier

EngineBlockHash = NewType("EngineBlockHash", int)
"""An engine's own hash of one block (vLLM's, SGLang's), as an unsigned 64-bit integer.
It names a block only within that engine; kvplane.core.keys.BlockKey is what the
router knows, and the translator is the one place that maps one to the other."""


class WireDecodeError(ValueError):
    """What does not decode as the engine's events: a whole message (nothing of it is
    used), or one event of a batch (that event is skipped, for `reason`)."""

    def __init__(self, message: str, reason: SkipReason = SkipReason.MALFORMED) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EngineBlocksStored:
    block_hashes: tuple[EngineBlockHash, ...]
    parent_hash: EngineBlockHash | None  # None: the chain starts at token 0
    token_ids: tuple[int, ...]  # len == len(block_hashes) * block_size
    block_size: int
    tier: Tier
    lora_name: str | None
    cache_salt: str | None  # only for a chain that starts at token 0
    group_idx: int = 0  # vLLM's KV cache group (hybrid models have several)


@dataclass(frozen=True, slots=True)
class EngineBlocksRemoved:
    block_hashes: tuple[EngineBlockHash, ...]
    tier: Tier
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class EngineBlocksOffloaded:
    """A store that names its blocks by hash only (vLLM's offloading connector copying
    blocks the engine computed to a slower tier): no tokens, no block size, no parent.
    Only blocks the agent already knows from their own store can be credited."""

    block_hashes: tuple[EngineBlockHash, ...]
    tier: Tier
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class EngineCacheCleared:
    pass


EngineEvent = EngineBlocksStored | EngineBlocksOffloaded | EngineBlocksRemoved | EngineCacheCleared


@dataclass(frozen=True, slots=True)
class SkippedEvent:
    """An event of a batch that could not be used, and why."""

    event_type: str  # its tag as sent, at most MAX_EVENT_TYPE_CHARS; "?" without one
    reason: SkipReason


@dataclass(frozen=True, slots=True)
class EngineEventBatch:
    sequence: int  # the engine publisher's, counting from 0 per engine process
    timestamp: float  # engine's wall clock, seconds
    events: tuple[EngineEvent, ...]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    kv_usage: float  # 0.0 to 1.0
    # Failed KV transfers since the engine started (disaggregated fleets; 0 elsewhere).
    kv_load_failures: int = 0
    kv_leases_expired: int = 0


@dataclass(frozen=True, slots=True)
class EngineCacheConfig:
    block_size: int | None
    num_blocks: int | None


@dataclass(frozen=True, slots=True)
class PrefixCacheCounters:
    """The engine's cumulative prefix-cache counters: prompt tokens looked up, and found
    cached (their difference is prompt tokens it computed, which it caches, and
    announces, whole block by whole block); and requests past their prefill (first
    token out)."""

    queried_tokens: float
    hit_tokens: float
    prefilled_requests: float

    @property
    def computed_tokens(self) -> float:
        return self.queried_tokens - self.hit_tokens
