"""Physical KV blocks, the prefix cache over them, and the events they produce.

Mechanism only (vLLM v1's `BlockPool`): which request owns which block is the
`KVCacheManager`'s business, what runs when is the scheduler's.

- A block with reference count 0 sits in the free queue. If it holds a full, hashed
  block it stays in the prefix cache and can be reused (touched) until it is evicted.
- Allocation takes blocks from the front of the free queue, evicting their cached
  contents (one `BlockRemoved` each); freeing appends to the back. So the least recently
  freed block is evicted first, and because requests free their blocks tail first, a
  sequence's tail goes before its head.
- The same hash can be cached in two physical blocks (two requests computed it at the
  same time); each is stored and removed separately, as in vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, eq=False)
class BlockLineage:
    """A cached block's tokens and its parent's lineage, back to token 0: what tests need
    to recompute the router's key for each block the engine holds. Parents are shared,
    so a chain costs one node per block."""

    parent: BlockLineage | None
    token_ids: tuple[int, ...]

    def prefix_token_ids(self) -> list[int]:
        """Every token from the start of the prompt to the end of this block."""
        chain: list[tuple[int, ...]] = []
        node: BlockLineage | None = self
        while node is not None:
            chain.append(node.token_ids)
            node = node.parent
        return [token for tokens in reversed(chain) for token in tokens]


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    digest: bytes | None = None  # set while the block is in the prefix cache
    scope: str = ""  # "<LoRA>/<cache salt>" of the request that filled it (for tests)
    lineage: BlockLineage | None = None  # set with the digest (for tests)

    def leave_cache(self) -> None:
        self.digest, self.scope, self.lineage = None, "", None


@dataclass(frozen=True, slots=True)
class BlocksStored:
    digests: tuple[bytes, ...]
    parent_digest: bytes | None  # None for a chain that starts at token 0
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    extra_keys: tuple[tuple[str, ...] | None, ...]  # one entry per block


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    digest: bytes


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


CacheEvent = BlocksStored | BlockRemoved | AllBlocksCleared


class OutOfBlocks(Exception):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # Eviction order: the first entry is evicted first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        self._cached: dict[bytes, dict[int, KVBlock]] = {}
        self._events: list[CacheEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's `kv_cache_usage_perc`)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_block(self, digest: bytes) -> KVBlock | None:
        holders = self._cached.get(digest)
        return next(iter(holders.values())) if holders else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take references on cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise OutOfBlocks(f"{count} blocks wanted, {len(self._free)} free")
        taken = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop references, in the order given: the first block freed is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        digests: Sequence[bytes],
        parent_digest: bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None,
        extra_keys: Sequence[tuple[str, ...] | None],
        scope: str,
    ) -> None:
        """Enter newly filled blocks into the prefix cache; one `BlocksStored` for all."""
        if not self.enable_caching or not blocks:
            return
        parent = None if parent_digest is None else self.cached_block(parent_digest)
        lineage = None if parent is None else parent.lineage
        for index, (block, digest) in enumerate(zip(blocks, digests, strict=True)):
            lineage = BlockLineage(
                lineage, tuple(token_ids[index * block_size : (index + 1) * block_size])
            )
            block.digest = digest
            block.scope = scope
            block.lineage = lineage
            self._cached.setdefault(digest, {})[block.block_id] = block
        self._events.append(
            BlocksStored(
                digests=tuple(digests),
                parent_digest=parent_digest,
                token_ids=tuple(token_ids),
                block_size=block_size,
                lora_name=lora_name,
                extra_keys=tuple(extra_keys),
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use, as vLLM."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.leave_cache()
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def forget_everything(self) -> None:
        """A restart: every block free and uncached, no events (a new process sends none)."""
        self._cached.clear()
        self._events.clear()
        self._free.clear()
        for block in self.blocks:
            block.ref_cnt = 0
            block.leave_cache()
            self._free[block.block_id] = block

    def cached_blocks(self) -> list[KVBlock]:
        """Every block in the prefix cache (the engine's true block set, for tests)."""
        return [block for holders in self._cached.values() for block in holders.values()]

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVBlock) -> None:
        if block.digest is None:
            return
        holders = self._cached[block.digest]
        del holders[block.block_id]
        if not holders:
            del self._cached[block.digest]
        self._events.append(BlockRemoved(block.digest))
        block.leave_cache()
