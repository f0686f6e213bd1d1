"""Engine events become exactly the kvplane keys the router computes for the prompt."""

from __future__ import annotations

import pytest

from kvplane.keys import KeyNamespace, block_keys
from router.index.base import AllBlocksCleared, BlocksRemoved, BlocksStored, Tier
from worker_agent.events import EngineBlocksRemoved, EngineBlocksStored, EngineCacheCleared
from worker_agent.translate import BlockTranslator, TrackingLimitExceeded

MODEL = "tiny"
TOKENS = list(range(100, 164))  # 64 tokens


def stored(
    hashes: list[int],
    tokens: list[int],
    *,
    parent: int | None = None,
    size: int = 16,
    salt: str | None = None,
    lora: str | None = None,
    tier: Tier = Tier.DEVICE,
) -> EngineBlocksStored:
    return EngineBlocksStored(tuple(hashes), parent, tuple(tokens), size, tier, lora, salt)


def removed(hashes: list[int], tier: Tier = Tier.DEVICE) -> EngineBlocksRemoved:
    return EngineBlocksRemoved(tuple(hashes), tier)


def translator(router_block_size: int = 16, limit: int = 1000) -> BlockTranslator:
    return BlockTranslator(MODEL, router_block_size, max_tracked_blocks=limit)


def all_keys(events: list[object]) -> list[int]:
    return [key for event in events if isinstance(event, BlocksStored) for key in event.keys]


def test_keys_equal_the_routers_for_the_same_prompt_and_chains_continue() -> None:
    agent = translator()
    first = agent.translate([stored([1, 2], TOKENS[:32])])
    second = agent.translate([stored([3, 4], TOKENS[32:], parent=2)])
    expected = block_keys(TOKENS, KeyNamespace(MODEL, 16))
    assert all_keys(first) + all_keys(second) == expected
    (run,) = second
    assert isinstance(run, BlocksStored)
    assert run.first_position == 2
    assert run.parent_key == expected[1]
    assert first[0].parent_key is None  # type: ignore[union-attr]


def test_salt_and_lora_root_the_chain_in_their_own_scope() -> None:
    agent = translator()
    events = agent.translate([stored([1, 2], TOKENS[:32], salt="tenant-a", lora="sql")])
    namespace = KeyNamespace(MODEL, 16, lora="sql", cache_scope="tenant-a")
    assert all_keys(events) == block_keys(TOKENS[:32], namespace)
    assert all_keys(events) != block_keys(TOKENS[:32], KeyNamespace(MODEL, 16))


def test_removals_need_every_reference_gone_per_tier() -> None:
    agent = translator()
    keys = all_keys(agent.translate([stored([1], TOKENS[:16])]))
    assert agent.translate([stored([1], TOKENS[:16])]) == []  # a second copy: no news
    assert agent.translate([stored([1], TOKENS[:16], tier=Tier.HOST)]) != []
    assert agent.translate([removed([1])]) == []  # one device copy left
    assert agent.translate([removed([1])]) == [BlocksRemoved(keys=keys, tier=Tier.DEVICE)]
    assert agent.translate([removed([1])]) == []
    assert agent.counters.unknown_removals == 1
    assert agent.translate([removed([1], Tier.HOST)]) == [BlocksRemoved(keys=keys, tier=Tier.HOST)]
    assert agent.tracked_blocks == 0


def test_an_unknown_parent_is_skipped_not_guessed() -> None:
    agent = translator()
    assert agent.translate([stored([5, 6], TOKENS[:32], parent=99)]) == []
    assert agent.counters.orphan_blocks == 2
    assert agent.translate([removed([5, 77])]) == []
    assert agent.counters.unknown_removals == 2


def test_a_router_block_of_two_engine_blocks_needs_both() -> None:
    agent = translator(router_block_size=32)
    events = agent.translate([stored([1, 2, 3], TOKENS[:48])])  # 1.5 router blocks
    expected = block_keys(TOKENS, KeyNamespace(MODEL, 32))
    assert all_keys(events) == expected[:1]
    events = agent.translate([stored([4], TOKENS[48:], parent=3)])
    assert all_keys(events) == expected[1:2]
    assert events[0].parent_key == expected[0]  # type: ignore[union-attr]
    # Removing an earlier member of a group withdraws the group's key.
    assert agent.translate([removed([3])]) == [BlocksRemoved(keys=expected[1:2], tier=Tier.DEVICE)]
    assert agent.translate([removed([1])]) == [BlocksRemoved(keys=expected[:1], tier=Tier.DEVICE)]


def test_engine_blocks_that_do_not_divide_the_router_block_are_counted() -> None:
    agent = translator(router_block_size=24)
    assert agent.translate([stored([1], TOKENS[:16])]) == []
    assert agent.counters.mismatched_blocks == 1


def test_clear_and_snapshot() -> None:
    agent = translator()
    agent.translate([stored([1, 2], TOKENS[:32]), stored([3], TOKENS[32:48], parent=2)])
    agent.translate([stored([1], TOKENS[:16], tier=Tier.HOST)])
    snapshot = agent.snapshot()
    expected = block_keys(TOKENS[:48], KeyNamespace(MODEL, 16))
    assert [event.keys[0] for event in snapshot] == [expected[0], expected[0], *expected[1:]]  # type: ignore[union-attr]
    assert [event.first_position for event in snapshot] == [0, 0, 1, 2]  # type: ignore[union-attr]
    assert agent.translate([EngineCacheCleared()]) == [AllBlocksCleared()]
    assert agent.snapshot() == []
    assert agent.tracked_blocks == 0


def test_the_map_is_bounded() -> None:
    agent = translator(limit=2)
    with pytest.raises(TrackingLimitExceeded):
        agent.translate([stored([1, 2, 3], TOKENS[:48])])
