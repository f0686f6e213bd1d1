"""KV cache events in vLLM's wire forms: msgspec structs and the msgpack payload.

Three forms, named after the vLLM release whose bytes they reproduce (see
`../shared/reference/engine-protocols.md`):
- `vllm-0.32` (the default): events are maps tagged `"type"`, batches `[ts, events, rank]`,
  replay replies carry the topic frame;
- `vllm-0.23`: events are positional arrays led by their tag, the same batches, replay
  replies without the topic frame;
- `vllm-0.9`: arrays with only the fields of that time, batches `[ts, events]`.

The CPU tier's events (offload.py) are vLLM's offloading connector's: hash-only stores
(no tokens, no parent, block size 0) and removals on medium CPU. vLLM 0.32's
`OffloadingEventsTracker` sends a store per block, and a removal per eviction, in group
0, with hashes as the device's; 0.23's connector sent one store or removal for all the
blocks, with the raw digests whatever `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` says
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py: `take_events`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import msgspec

from simulations.engine_sim.block_hash import wire_hash
from simulations.engine_sim.block_pool import (
    AllBlocksCleared,
    BlockRemoved,
    BlocksStored,
    CacheEvent,
)
from simulations.engine_sim.offload import BlocksOffloaded, OffloadedBlocksRemoved, OffloadEvent

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
KV_CACHE_SPEC_KIND = "full_attention"


class WireFormat(StrEnum):
    VLLM_0_32 = "vllm-0.32"
    VLLM_0_23 = "vllm-0.23"
    VLLM_0_9 = "vllm-0.9"

    @property
    def replay_has_topic(self) -> bool:
        return self is WireFormat.VLLM_0_32


WireHash = int | bytes
KVEvent = CacheEvent | OffloadEvent


# vLLM 0.24 and later: maps tagged with the class name; fields left at a None default
# are left out, required fields are always sent (None as nil).
class _Tagged(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStored(_Tagged):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    extra_keys: list[list[str] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemovedEvent(_Tagged, tag="BlockRemoved"):
    block_hashes: list[WireHash]
    medium: str
    group_idx: int | None = None


class AllBlocksClearedEvent(_Tagged, tag="AllBlocksCleared"):
    pass


# Before 0.24: positional arrays whose first element is the tag; up to 0.23 with the
# same fields as above.
class LegacyBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class LegacyBlockRemoved(BlockRemovedEvent, array_like=True, tag="BlockRemoved"):
    pass


class LegacyAllBlocksCleared(AllBlocksClearedEvent, array_like=True, tag="AllBlocksCleared"):
    pass


# vLLM 0.9: the fields of that time only.
class EarlyBlockStored(msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class EarlyBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True):
    block_hashes: list[WireHash]


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None


class EarlyEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]


def use_int_hashes() -> bool:
    """vLLM's switch: hashes as 64-bit integers (default) or raw 32-byte digests."""
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"


class EventEncoder:
    """Turns the block pool's and the CPU tier's events into one msgpack payload per
    batch."""

    def __init__(
        self, wire_format: WireFormat, *, int_hashes: bool = True, data_parallel_rank: int = 0
    ) -> None:
        self.wire_format = wire_format
        self._int_hashes = int_hashes
        self._rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()

    def encode_batch(self, ts: float, events: Sequence[KVEvent], *, odd: bool = False) -> bytes:
        """The batch as the engine sends it; `odd`: with events no agent can use among
        them (a fault the chaos suite injects: see odd_events())."""
        wire_events: list[Any] = []
        for event in events:
            if isinstance(event, BlocksOffloaded | OffloadedBlocksRemoved):
                wire_events += self._offload_events(event)
            else:
                wire_events.append(self._wire_event(event))
        if odd:
            wire_events = [*odd_events(events), *wire_events]
        batch: EventBatch | EarlyEventBatch
        if self.wire_format is WireFormat.VLLM_0_9:
            batch = EarlyEventBatch(ts, wire_events)
        else:
            batch = EventBatch(ts, wire_events, self._rank)
        return self._encoder.encode(batch)

    def _hash(self, digest: bytes) -> WireHash:
        return wire_hash(digest) if self._int_hashes else digest

    def _wire_event(self, event: CacheEvent) -> msgspec.Struct:
        form = self.wire_format
        if isinstance(event, BlocksStored):
            hashes = [self._hash(digest) for digest in event.digests]
            parent = None if event.parent_digest is None else self._hash(event.parent_digest)
            tokens = list(event.token_ids)
            if form is WireFormat.VLLM_0_9:
                return EarlyBlockStored(hashes, parent, tokens, event.block_size, None)
            stored_type = BlockStored if form is WireFormat.VLLM_0_32 else LegacyBlockStored
            return stored_type(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=event.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=event.lora_name,
                extra_keys=[None if keys is None else list(keys) for keys in event.extra_keys],
                group_idx=0,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        if isinstance(event, BlockRemoved):
            removed = [self._hash(event.digest)]
            if form is WireFormat.VLLM_0_9:
                return EarlyBlockRemoved(removed)
            removed_type = BlockRemovedEvent if form is WireFormat.VLLM_0_32 else LegacyBlockRemoved
            return removed_type(block_hashes=removed, medium=MEDIUM_GPU, group_idx=0)
        assert isinstance(event, AllBlocksCleared)
        if form is WireFormat.VLLM_0_32:
            return AllBlocksClearedEvent()
        return LegacyAllBlocksCleared()

    def _offload_events(self, event: OffloadEvent) -> list[msgspec.Struct]:
        removed = isinstance(event, OffloadedBlocksRemoved)
        if self.wire_format is WireFormat.VLLM_0_32:
            hashes = [self._hash(digest) for digest in event.digests]
            if removed:
                return [BlockRemovedEvent(block_hashes=hashes, medium=MEDIUM_CPU, group_idx=0)]
            return [_hash_only(BlockStored, [block_hash], group_idx=0) for block_hash in hashes]
        digests: list[WireHash] = list(event.digests)
        if removed:
            return [LegacyBlockRemoved(block_hashes=digests, medium=MEDIUM_CPU)]
        return [_hash_only(LegacyBlockStored, digests)]


def _hash_only(
    stored_type: type[BlockStored], hashes: list[WireHash], group_idx: int | None = None
) -> BlockStored:
    """A store of blocks on the CPU tier as vLLM's offloading connector sends it."""
    return stored_type(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=MEDIUM_CPU,
        lora_name=None,
        group_idx=group_idx,
    )


def odd_events(events: Sequence[KVEvent]) -> list[dict[str, Any]]:
    """Events a newer or stranger engine might send that an agent must skip, never
    credit: an unknown event type, a store on an unknown medium, a store of blocks
    another node holds (fresh hashes and tokens, so that crediting them would show as
    entries no engine holds), and a removal that does not decode."""
    block_size = next((e.block_size for e in events if isinstance(e, BlocksStored)), 16)
    fresh = random.Random(len(events))

    def store(**fields: Any) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": [fresh.getrandbits(63)],
            "parent_block_hash": None,
            "token_ids": [fresh.randrange(1, 30_000) for _ in range(block_size)],
            "block_size": block_size,
            **fields,
        }

    return [
        {"type": "BlockPinned", "block_hashes": [fresh.getrandbits(63)]},
        store(medium="TAPE"),
        store(medium=MEDIUM_GPU, locality="REMOTE"),
        {"type": "BlockRemoved", "block_hashes": "not hashes", "medium": MEDIUM_GPU},
    ]
