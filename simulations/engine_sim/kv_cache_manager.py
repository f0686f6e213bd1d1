"""Which blocks each request holds: prefix-cache hits, allocation, caching, freeing.

vLLM v1's `KVCacheManager` for one full-attention group. The block pool is the
mechanism; this is the per-request bookkeeping on top of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from simulations.engine_sim.block_pool import BlockPool, KVBlock


class CacheRequest(Protocol):
    """What the cache manager reads of a request: the engine simulator's SimRequest,
    or the fleet simulator's requests, which carry block ids instead of tokens."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def block_digests(self) -> Sequence[bytes]: ...
    @property
    def lora_name(self) -> str | None: ...
    @property
    def scope(self) -> str: ...
    def token_ids_between(self, start: int, stop: int) -> Sequence[int]: ...
    def block_extra_keys(self, index: int) -> tuple[str, ...] | None: ...


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached
    # Hits on a block another cache scope filled: tenant isolation broken (must stay 0).
    cross_scope_hits: int = 0


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # of a request's blocks, how many hashed

    def cached_prefix(self, request: CacheRequest) -> list[KVBlock]:
        """The longest run of the request's blocks already in the prefix cache.

        At least one token is always left to compute (the engine needs its logits), so a
        fully cached prompt gives up its last block, as in vLLM.
        """
        hits: list[KVBlock] = []
        if self.pool.enable_caching:
            max_blocks = (request.num_tokens - 1) // self.block_size
            for digest in request.block_digests[:max_blocks]:
                block = self.pool.cached_block(digest)
                if block is None:
                    break
                hits.append(block)
        return hits

    def record_lookup(self, request: CacheRequest, hits: Sequence[KVBlock]) -> None:
        """Count a lookup's hits (vLLM's PrefixCacheStats); not one of a request that a
        connector had the scheduler pass over, which is looked up again later."""
        self.stats.cross_scope_hits += sum(block.scope != request.scope for block in hits)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size

    def blocks_of(self, request: CacheRequest) -> list[KVBlock]:
        """The blocks the request holds, in order."""
        return list(self._blocks.get(request.request_id, ()))

    def held_tokens(self, request: CacheRequest) -> int:
        """Tokens the request's blocks have room for (computed or not)."""
        return len(self._blocks.get(request.request_id, ())) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        cached_blocks: Sequence[KVBlock] = (),
        *,
        num_external_tokens: int = 0,
        delay_caching: bool = False,
        reserved_blocks: int = 0,
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens, after its computed
        tokens, any newly found cached blocks and `num_external_tokens` that a KV
        connector will write into blocks allocated here (vLLM's `allocate_slots`). False,
        changing nothing, when there are not enough free blocks beyond `reserved_blocks`.
        `delay_caching` (a P/D load still to arrive) leaves the new blocks out of the
        prefix cache until `cache_blocks`."""
        held = self._blocks.get(request.request_id, [])
        num_cached_tokens = len(cached_blocks) * self.block_size
        total_tokens = (
            request.num_computed_tokens + num_cached_tokens + num_external_tokens + num_new_tokens
        )
        new_count = self.blocks_needed(total_tokens) - len(held) - len(cached_blocks)
        # Cached hits that sit in the free queue stop being free once touched.
        hits_now_free = sum(1 for block in cached_blocks if block.ref_cnt == 0)
        if new_count > self.pool.num_free_blocks - hits_now_free - reserved_blocks:
            return False
        self.pool.touch(cached_blocks)
        held = self._blocks.setdefault(request.request_id, held)
        held.extend(cached_blocks)
        if cached_blocks:
            self._num_cached_blocks[request.request_id] = len(held)
        held.extend(self.pool.allocate(max(new_count, 0)))
        if not delay_caching:
            self._cache_full_blocks(request, min(total_tokens, request.num_tokens))
        return True

    def cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        """Enter the request's full blocks up to `num_tokens` into the prefix cache, with
        their `BlocksStored` (vLLM's `cache_blocks`: for a P/D load, once it arrived)."""
        self._cache_full_blocks(request, num_tokens)

    def free(self, request: CacheRequest) -> None:
        """Release the request's blocks, tail first (so its tail is evicted first)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def _cache_full_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        already = self._num_cached_blocks.get(request.request_id, 0)
        full = min(num_tokens // self.block_size, len(request.block_digests))
        if full <= already:
            return
        blocks = self._blocks[request.request_id][already:full]
        size = self.block_size
        self.pool.cache_full_blocks(
            blocks=blocks,
            digests=request.block_digests[already:full],
            parent_digest=request.block_digests[already - 1] if already else None,
            token_ids=request.token_ids_between(already * size, full * size),
            block_size=size,
            lora_name=request.lora_name,
            extra_keys=[request.block_extra_keys(index) for index in range(already, full)],
            scope=request.scope,
        )
        self._num_cached_blocks[request.request_id] = full
