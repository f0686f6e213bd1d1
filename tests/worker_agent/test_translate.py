"""Engine events become exactly the kvplane keys the router computes for the prompt."""

from __future__ import annotations

import pytest

from kvplane.core.keys import KeyNamespace, block_keys
from kvplane.core.types import AllBlocksCleared, BlocksRemoved, BlocksStored, Tier
from worker_agent.events import (
    EngineBlocksOffloaded,
    EngineBlocksRemoved,
    EngineBlocksStored,
    EngineCacheCleared,
)
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
    expected = block_keys(TOKENS[:48], KeyNamespace(MODEL, 16))
    # Whole chains, per tier, parents first.
    assert agent.snapshot() == [
        BlocksStored(keys=expected, tier=Tier.DEVICE, first_position=0, parent_key=None),
        BlocksStored(keys=expected[:1], tier=Tier.HOST, first_position=0, parent_key=None),
    ]
    assert agent.translate([EngineCacheCleared()]) == [AllBlocksCleared()]
    assert agent.snapshot() == []
    assert agent.tracked_blocks == 0


def test_the_map_is_bounded() -> None:
    agent = translator(limit=2)
    with pytest.raises(TrackingLimitExceeded):
        agent.translate([stored([1, 2, 3], TOKENS[:48])])


def test_a_router_block_missing_an_earlier_engine_block_stops_the_chain() -> None:
    agent = translator(router_block_size=48)  # three engine blocks per router block
    tokens = list(range(1000, 1000 + 16 * 6))
    first = agent.translate([stored([1, 2, 3], tokens[:48])])
    assert len(all_keys(first)) == 1
    agent.translate([stored([4, 5], tokens[48:80], parent=3)])  # the next group, part way
    agent.translate([removed([4])])  # an earlier block of that group is evicted
    # Its last block arrives: the group cannot be keyed, nor anything after it.
    assert agent.translate([stored([6, 7], [*tokens[80:96], 1, 2, 3] + [0] * 13, parent=5)]) == []
    assert agent.counters.orphan_blocks == 2
    assert agent.announced_keys == 1


def test_a_key_is_withdrawn_when_a_restored_member_leaves_again() -> None:
    agent = translator(router_block_size=32)
    keys = all_keys(agent.translate([stored([1, 2], TOKENS[:32])]))
    # Block 1 leaves the device; its record is dropped, and block 2 is moved to the host.
    assert agent.translate([removed([1])]) == [BlocksRemoved(keys=keys, tier=Tier.DEVICE)]
    agent.translate([stored([1], TOKENS[:16], tier=Tier.HOST)])
    agent.translate([stored([2], TOKENS[16:32], parent=1, tier=Tier.HOST)])
    assert agent.snapshot() == [
        BlocksStored(keys=keys, tier=Tier.HOST, first_position=0, parent_key=None)
    ]
    # Block 1 (stored again since the key was made) leaves the host: the key goes too.
    assert agent.translate([removed([1], Tier.HOST)]) == [BlocksRemoved(keys=keys, tier=Tier.HOST)]
    assert agent.snapshot() == []


def test_events_of_other_kv_cache_groups_are_ignored() -> None:
    agent = translator()
    sliding = EngineBlocksStored((1,), None, tuple(TOKENS[:16]), 16, Tier.DEVICE, None, None, 1)
    assert agent.translate([sliding]) == []
    keys = all_keys(agent.translate([stored([1], TOKENS[:16])]))
    # The sliding-window group evicting its copy does not withdraw the full group's.
    assert agent.translate([EngineBlocksRemoved((1,), Tier.DEVICE, group_idx=1)]) == []
    assert agent.snapshot()[0].keys == keys  # type: ignore[union-attr]
    assert agent.counters.other_group_blocks == 2


def offloaded(hashes: list[int], tier: Tier = Tier.HOST) -> EngineBlocksOffloaded:
    return EngineBlocksOffloaded(tuple(hashes), tier)


def test_blocks_stored_by_hash_alone_are_credited_to_their_tier_under_their_keys() -> None:
    agent = translator()
    device = agent.translate([stored([1, 2, 3], TOKENS[:48])])
    keys = all_keys(device)
    # The offloading connector copies blocks 2 and 3, and one the agent never saw.
    (copied,) = agent.translate([offloaded([2, 3, 99])])
    assert copied == BlocksStored(
        keys=keys[1:], tier=Tier.HOST, first_position=1, parent_key=keys[0]
    )
    assert (agent.counters.offloaded_blocks, agent.counters.unresolved_blocks) == (2, 1)
    # The device copies go; the host copies stay, and go with their own removal.
    assert agent.translate([removed([1, 2, 3])]) == [BlocksRemoved(keys=keys, tier=Tier.DEVICE)]
    assert agent.tracked_blocks == 2
    assert agent.translate([offloaded([2])]) == []  # held there already: no news
    # Block 2 has two host copies now: only block 3's key goes.
    assert agent.translate([removed([2, 3], Tier.HOST)]) == [
        BlocksRemoved(keys=keys[2:], tier=Tier.HOST)
    ]
    assert agent.translate([removed([2], Tier.HOST)]) == [
        BlocksRemoved(keys=keys[1:2], tier=Tier.HOST)
    ]


def test_a_router_block_of_several_engine_blocks_offloads_once_all_are_there() -> None:
    agent = translator(router_block_size=32)
    keys = all_keys(agent.translate([stored([1, 2, 3, 4], TOKENS, size=16)]))
    assert len(keys) == 2
    assert agent.translate([offloaded([1, 2, 3])]) == [
        BlocksStored(keys=keys[:1], tier=Tier.HOST, first_position=0, parent_key=None)
    ]
    assert agent.translate([offloaded([4])]) == [
        BlocksStored(keys=keys[1:], tier=Tier.HOST, first_position=1, parent_key=keys[0])
    ]


def test_an_offload_before_any_store_is_counted_not_guessed() -> None:
    agent = translator()
    assert agent.translate([offloaded([1, 2])]) == []
    assert agent.counters.unresolved_blocks == 2


def test_offloads_are_not_guessed_once_stores_disagree_on_the_block_size() -> None:
    # A router block of 64 tokens is four 16-token blocks, or two of 32: after stores of
    # both sizes, which blocks make one is unknown, and an offload credits nothing.
    agent = translator(router_block_size=64)
    agent.translate([stored([1, 2, 3, 4], TOKENS, size=16)])
    agent.translate([stored([5, 6], [9] * 64, size=32)])
    assert agent.translate([offloaded([3, 4])]) == []
    assert agent.counters.unresolved_blocks == 2
    agent.clear()  # a new picture starts over
    keys = all_keys(agent.translate([stored([1, 2, 3, 4], TOKENS, size=16)]))
    assert agent.translate([offloaded([1, 2, 3, 4])]) == [
        BlocksStored(keys=keys, tier=Tier.HOST, first_position=0, parent_key=None)
    ]
