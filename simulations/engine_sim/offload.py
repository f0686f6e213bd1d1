"""A CPU tier behind the device cache, as vLLM's native CPU offloading keeps one.

Mechanism only, as vLLM 0.32 does it for one full-attention KV group and one block per
offloaded chunk (its defaults): `CPUTier` is its `CPUOffloadingManager` with the LRU
policy (vllm/v1/kv_offload/cpu/manager.py, cpu/policies/lru.py); `OffloadingConnector`
is the scheduler side of its `OffloadingConnector`, which decides what each request
writes and reads (vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py).
When copies start and how long they take is the engine loop's business (offload_copies.py).

- Writes go through as blocks are computed, not on eviction: each time a request is
  scheduled, its full blocks computed by the end of the step, from where its last
  offer ended, are offered (prompt blocks only, unless `offload_prompt_only` is off). A
  request that read blocks from the tier offers only blocks after them; one that read
  none offers its device hits too, so a block the tier lost is written again. The tier
  writes those it lacks, making room by evicting its least recently used blocks that no
  copy is using (one removal event for them all); if that cannot make room, it writes
  nothing and the request offers the same blocks next step (vLLM's allocation failure).
  A block is announced, and can be read, once its copy completes.
- Recency: a block written is the most recent, the request's earlier blocks older than
  its later ones; when the request ends, every block it read or offered that the tier
  holds becomes the most recent, its head last, so that its tail goes first.
- Reads: a new request's blocks after its device prefix hit are looked up one by one
  until one is missing. If any found is still being written, or being read for another
  request, the request waits and asks again (vLLM's deferred lookup); otherwise it reads
  them into blocks of its own while waiting for them, as for any connector's load.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from simulations.engine_sim.block_pool import BlockLineage, KVBlock
from simulations.engine_sim.kv_cache_manager import CacheRequest


class OffloadRequest(CacheRequest, Protocol):
    """What the connector reads of a request: the engine simulator's SimRequest, or the
    fleet simulator's requests, which carry block ids instead of tokens."""

    @property
    def num_prompt_tokens(self) -> int: ...


class Lookup(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"  # vLLM's HIT_PENDING: held, its write not complete


@dataclass(slots=True, eq=False)
class CPUBlock:
    digest: bytes
    scope: str  # as the device block's (for tests)
    lineage: BlockLineage | None  # the device block's, where it was cached (for tests)
    ref_cnt: int = -1  # -1 while its write is in flight; then the reads using it


@dataclass(frozen=True, slots=True)
class BlocksOffloaded:
    """Blocks whose writes completed together (vLLM's OffloadingEvent, removed=False)."""

    digests: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class OffloadedBlocksRemoved:
    """Blocks evicted to make room for one write (vLLM's OffloadingEvent, removed=True)."""

    digests: tuple[bytes, ...]


OffloadEvent = BlocksOffloaded | OffloadedBlocksRemoved


class CPUTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[bytes, CPUBlock] = OrderedDict()  # least recent first
        self._events: list[OffloadEvent] = []
        self.num_writing = 0  # blocks whose write is in flight
        self.num_reading = 0  # written blocks that reads are using

    def lookup(self, digest: bytes) -> Lookup:
        block = self._blocks.get(digest)
        if block is None:
            return Lookup.MISS
        return Lookup.HIT if block.ref_cnt >= 0 else Lookup.PENDING

    def prepare_load(self, digests: Sequence[bytes]) -> None:
        """Pin written blocks for a read: nothing evicts them until `complete_load`."""
        for digest in digests:
            block = self._blocks[digest]
            self.num_reading += block.ref_cnt == 0
            block.ref_cnt += 1

    def complete_load(self, digests: Sequence[bytes]) -> None:
        for digest in digests:
            block = self._blocks[digest]
            block.ref_cnt -= 1
            self.num_reading -= block.ref_cnt == 0

    def prepare_store(self, offered: Sequence[CPUBlock]) -> list[bytes] | None:
        """Start writing those of the offered blocks the tier lacks, evicting for room;
        their digests (none: it holds them all), or None if it cannot make room, in
        which case nothing changes. An offered block is never evicted for another."""
        new = [block for block in offered if block.digest not in self._blocks]
        if not new:
            return []
        shortfall = len(new) - (self.num_blocks - len(self._blocks))
        if shortfall > 0:
            kept = {block.digest for block in offered}
            idle = (
                digest
                for digest, block in self._blocks.items()
                if block.ref_cnt == 0 and digest not in kept
            )
            evicted = list(itertools.islice(idle, shortfall))
            if len(evicted) < shortfall:
                return None
            for digest in evicted:
                del self._blocks[digest]
            self._events.append(OffloadedBlocksRemoved(tuple(evicted)))
        for block in new:
            self._blocks[block.digest] = block
        self.num_writing += len(new)
        return [block.digest for block in new]

    def complete_store(self, digests: Sequence[bytes]) -> None:
        """The blocks' writes completed: readable and evictable now, and announced."""
        for digest in digests:
            self._blocks[digest].ref_cnt = 0
        self.num_writing -= len(digests)
        self._events.append(BlocksOffloaded(tuple(digests)))

    def touch(self, digests: Sequence[bytes]) -> None:
        """Make the blocks held the most recently used, the first one the most."""
        for digest in reversed(digests):
            if digest in self._blocks:
                self._blocks.move_to_end(digest)

    def stored_blocks(self) -> list[CPUBlock]:
        """The blocks written and announced (the tier's true block set, for tests)."""
        return [block for block in self._blocks.values() if block.ref_cnt >= 0]

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def forget_everything(self) -> None:
        """A restart: the tier is empty, and sends no events (a new process sends none)."""
        self._blocks.clear()
        self._events.clear()
        self.num_writing = self.num_reading = 0


@dataclass(slots=True)
class _Offloading:
    """One request's part in the tier."""

    next_block: int = 0  # the first block it has not offered (vLLM's next_stored_chunk_idx)
    # The blocks it read, and those it offered that were not being written for another:
    # their recency when it ends. Block index -> digest.
    accessed: dict[int, bytes] = field(default_factory=dict)
    loading: list[bytes] = field(default_factory=list)  # the blocks it reads (pinned)
    writes_in_flight: int = 0


class OffloadingConnector:
    """What each request writes to and reads from the CPU tier, in blocks.

    `blocks_to_load` and `load_started` are what the scheduler asks of a connector
    (scheduler.py's `KVLoader`); the engine asks for each scheduled request's writes
    (`store`) and reports the copies that completed and the requests that ended."""

    def __init__(
        self, tier: CPUTier, block_size: int, *, prompt_only: bool, prefix_caching: bool
    ) -> None:
        self.tier = tier
        self.block_size = block_size
        self.prompt_only = prompt_only
        # Blocks being read: another request wanting one of them waits. vLLM tracks them
        # only with the prefix cache on, where the waiting request then finds them on
        # the device instead of reading them again.
        self._being_loaded: set[bytes] | None = set() if prefix_caching else None
        self._requests: dict[str, _Offloading] = {}

    def blocks_to_load(self, request: OffloadRequest, num_local_blocks: int) -> int | None:
        """How many blocks after the device hit the tier holds, consecutively; None while
        one of them is still being written or read for another request, or the request
        still writes (vLLM's `get_num_new_matched_tokens` answering None)."""
        state = self._requests.setdefault(request.request_id, _Offloading())
        if state.writes_in_flight:
            return None
        found: list[bytes] = []
        for digest in request.block_digests[num_local_blocks:]:
            lookup = self.tier.lookup(digest)
            if lookup is Lookup.MISS:
                break
            if lookup is Lookup.PENDING:
                return None
            found.append(digest)
        if self._being_loaded and not self._being_loaded.isdisjoint(found):
            return None
        return len(found)

    def load_started(self, request: OffloadRequest, num_local_blocks: int, num_blocks: int) -> None:
        """The scheduler gave the request blocks to read `num_blocks` into: pin them
        (vLLM's `update_state_after_alloc`). Under vLLM's chunk-level policy the request
        offers no block before the end of what it reads."""
        state = self._requests[request.request_id]
        end = num_local_blocks + num_blocks
        state.loading = list(request.block_digests[num_local_blocks:end])
        state.accessed.update(zip(range(num_local_blocks, end), state.loading, strict=True))
        state.next_block = end
        self.tier.prepare_load(state.loading)
        if self._being_loaded is not None:
            self._being_loaded.update(state.loading)

    def loading(self, request: OffloadRequest) -> list[bytes]:
        """The blocks the request's started read brings."""
        return self._requests[request.request_id].loading

    def load_finished(self, digests: Sequence[bytes]) -> None:
        self.tier.complete_load(digests)
        if self._being_loaded is not None:
            self._being_loaded.difference_update(digests)

    def store(
        self, request: OffloadRequest, num_tokens: int, device_blocks: Sequence[KVBlock]
    ) -> list[bytes] | None:
        """Offer the request's full blocks up to `num_tokens` (what it will have computed
        after the step) that it has not offered; the digests to write (vLLM's
        `_build_store_jobs`), or None if the tier could not make room."""
        state = self._requests.setdefault(request.request_id, _Offloading())
        limit = min(num_tokens, request.num_tokens)
        if self.prompt_only:
            limit = min(limit, request.num_prompt_tokens)
        digests = request.block_digests
        end = min(limit // self.block_size, len(digests), len(device_blocks))
        if end <= state.next_block:
            return []
        offered = range(state.next_block, end)
        state.accessed.update(
            (index, digests[index])
            for index in offered
            if self.tier.lookup(digests[index]) is not Lookup.PENDING
        )
        written = self.tier.prepare_store(
            [
                CPUBlock(digests[index], request.scope, device_blocks[index].lineage)
                for index in offered
            ]
        )
        if written is None:
            return None
        state.next_block = end
        state.writes_in_flight += bool(written)
        return written

    def store_finished(self, request_id: str, digests: Sequence[bytes]) -> None:
        self.tier.complete_store(digests)
        state = self._requests.get(request_id)
        if state is not None:
            state.writes_in_flight -= 1

    def request_finished(self, request: OffloadRequest) -> None:
        """The request ended (finished or aborted): what it used becomes most recent."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self.tier.touch([state.accessed[index] for index in sorted(state.accessed)])

    def forget_everything(self) -> None:
        self.tier.forget_everything()
        self._requests.clear()
        if self._being_loaded is not None:
            self._being_loaded.clear()
