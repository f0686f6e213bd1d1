"""The block pool and KV cache manager follow vLLM v1's prefix-caching semantics."""

from __future__ import annotations

import pytest

from simulations.engine_sim.block_hash import (
    BlockHasher,
    block_extra_keys,
    hash_block,
    none_hash,
    wire_hash,
)
from simulations.engine_sim.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlocksStored,
    OutOfBlocks,
)
from simulations.engine_sim.kv_cache_manager import KVCacheManager
from simulations.engine_sim.request import SimRequest

BLOCK = 4
ROOT = none_hash()


def request(request_id: str, tokens: list[int], *, salt: str | None = None) -> SimRequest:
    return SimRequest(request_id, tokens, 4, BLOCK, ROOT, cache_salt=salt)


def stored_digests(events: list[object]) -> list[bytes]:
    return [d for e in events if isinstance(e, BlocksStored) for d in e.digests]


def removed_digests(events: list[object]) -> list[bytes]:
    return [e.digest for e in events if isinstance(e, BlockRemoved)]


def test_wire_hash_is_the_low_64_bits_of_the_digest() -> None:
    digest = hash_block(ROOT, [1, 2, 3, 4], None)
    assert len(digest) == 32
    assert wire_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)


def test_hashes_chain_and_the_salt_reaches_only_the_first_block() -> None:
    plain = BlockHasher(BLOCK, ROOT, None, None)
    salted = BlockHasher(BLOCK, ROOT, None, "tenant-a")
    tokens = list(range(12))
    plain.update(tokens)
    salted.update(tokens)
    assert len(plain.digests) == 3
    # Every block differs (the chain carries the salt), but only block 0 hashes it.
    assert all(a != b for a, b in zip(plain.digests, salted.digests, strict=True))
    assert salted.extra_keys(0) == ("tenant-a",)
    assert salted.extra_keys(1) is None
    assert block_extra_keys(1, "adapter", "tenant-a") == ("adapter",)
    assert block_extra_keys(0, "adapter", "tenant-a") == ("adapter", "tenant-a")
    # A partial block is not hashed; the hash seed changes every hash.
    plain.update([*tokens, 99])
    assert len(plain.digests) == 3
    reseeded = BlockHasher(BLOCK, none_hash("other"), None, None)
    reseeded.update(tokens)
    assert reseeded.digests[0] != plain.digests[0]


def test_freed_blocks_stay_cached_and_the_least_recently_freed_is_evicted_first() -> None:
    pool = BlockPool(4)
    manager = KVCacheManager(pool, BLOCK)
    first = request("a", list(range(8)))  # two full blocks
    assert manager.allocate_slots(first, 8)
    stored = pool.take_events()
    assert stored_digests(stored) == first.block_digests
    assert stored[0].parent_digest is None  # type: ignore[union-attr]
    manager.free(first)
    assert pool.num_free_blocks == 4
    assert len(pool.cached_blocks()) == 2

    # A new request takes the two never-used blocks first, then must evict: the tail of
    # the freed sequence goes before its head.
    other = request("b", list(range(100, 112)))  # three blocks
    assert manager.allocate_slots(other, 12)
    events = pool.take_events()
    assert removed_digests(events) == [first.block_digests[1]]
    assert pool.cached_block(first.block_digests[0]) is not None
    assert pool.cached_block(first.block_digests[1]) is None


def test_a_cache_hit_takes_a_reference_and_leaves_the_free_queue() -> None:
    pool = BlockPool(4)
    manager = KVCacheManager(pool, BLOCK)
    first = request("a", list(range(9)))
    assert manager.allocate_slots(first, 9)
    manager.free(first)
    again = request("b", list(range(9)))
    hits = manager.cached_prefix(again)
    manager.record_lookup(again, hits)
    assert [block.digest for block in hits] == first.block_digests
    assert manager.allocate_slots(again, 1, hits)
    assert all(block.ref_cnt == 1 for block in hits)
    assert pool.num_free_blocks == 1  # 2 hits + 1 new block for the last token held
    assert manager.stats.hits == 8


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    pool = BlockPool(4)
    manager = KVCacheManager(pool, BLOCK)
    first = request("a", list(range(8)))
    assert manager.allocate_slots(first, 8)
    manager.free(first)
    hits = manager.cached_prefix(request("b", list(range(8))))
    assert len(hits) == 1  # block 2 is given up so that one token is computed


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    pool = BlockPool(2)
    manager = KVCacheManager(pool, BLOCK)
    big = request("a", list(range(12)))
    assert not manager.allocate_slots(big, 12)
    assert pool.num_free_blocks == 2
    assert pool.take_events() == []
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)


def test_the_same_hash_in_two_blocks_is_stored_and_removed_twice() -> None:
    pool = BlockPool(4)
    manager = KVCacheManager(pool, BLOCK)
    one, two = request("a", [1, 2, 3, 4, 5]), request("b", [1, 2, 3, 4, 5])
    assert manager.allocate_slots(one, 5)
    assert manager.allocate_slots(two, 5)  # no hit looked up: computed twice
    events = pool.take_events()
    assert stored_digests(events) == [one.block_digests[0], one.block_digests[0]]
    manager.free(one)
    manager.free(two)
    # Fill the cache with other blocks: both copies are evicted, one event each.
    assert manager.allocate_slots(request("c", list(range(50, 66))), 16)
    assert removed_digests(pool.take_events()) == [one.block_digests[0]] * 2


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    pool = BlockPool(4)
    manager = KVCacheManager(pool, BLOCK)
    active = request("a", list(range(8)))
    assert manager.allocate_slots(active, 8)
    pool.take_events()
    assert not pool.reset_prefix_cache()
    manager.free(active)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_blocks() == []


def test_each_cached_block_knows_its_prefix_back_to_token_0() -> None:
    pool = BlockPool(8)
    manager = KVCacheManager(pool, BLOCK)
    first = request("a", list(range(10)))  # two full blocks
    assert manager.allocate_slots(first, 10)
    manager.free(first)
    longer = request("b", list(range(13)))  # the same two, then a third of its own
    hits = manager.cached_prefix(longer)
    assert manager.allocate_slots(longer, 13 - len(hits) * BLOCK, hits)
    lineages = {block.digest: block.lineage for block in pool.cached_blocks()}
    prefixes = [
        lineage.prefix_token_ids()
        for digest in longer.block_digests
        if (lineage := lineages[digest]) is not None
    ]
    assert prefixes == [list(range(4)), list(range(8)), list(range(12))]
    manager.free(longer)
    assert pool.reset_prefix_cache()
    assert all(block.lineage is None and block.scope == "" for block in pool.blocks)


def test_hits_on_a_block_of_another_scope_are_counted() -> None:
    """Salts keep scopes apart in the hash; the counter is the tenant-isolation check of
    the chaos suite, so it must see a hit across scopes if one ever happened."""
    pool = BlockPool(4)
    manager = KVCacheManager(pool, BLOCK)
    owner = request("a", list(range(9)), salt="tenant-a")
    assert manager.allocate_slots(owner, 9)
    manager.free(owner)
    same_scope = request("b", list(range(9)), salt="tenant-a")
    hits = manager.cached_prefix(same_scope)
    manager.record_lookup(same_scope, hits)
    assert len(hits) == 2
    assert manager.stats.cross_scope_hits == 0
    for block in pool.cached_blocks():
        block.scope = "/tenant-b"  # as if another tenant's request had filled them
    manager.record_lookup(same_scope, manager.cached_prefix(same_scope))
    assert manager.stats.cross_scope_hits == 2
