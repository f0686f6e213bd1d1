"""The agent sends a batch's changes in fewer events, and the index ends up the same."""

from __future__ import annotations

import random

from kvplane.core.keys import BlockKey
from kvplane.core.types import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    Tier,
    WorkerInfo,
)
from router.index.memory import MemoryLocationIndex
from worker_agent.publisher import coalesced

K = [BlockKey(key) for key in range(1000, 1100)]


def test_removals_next_to_each_other_on_one_tier_become_one() -> None:
    events: list[KvEvent] = [
        BlocksRemoved([K[0]], Tier.DEVICE),
        BlocksRemoved([K[1]], Tier.DEVICE),
        BlocksRemoved([K[2]], Tier.HOST),
        BlocksRemoved([K[3]], Tier.HOST),
        BlocksRemoved([K[4]], Tier.DEVICE),
    ]
    assert coalesced(events) == [
        BlocksRemoved([K[0], K[1]], Tier.DEVICE),
        BlocksRemoved([K[2], K[3]], Tier.HOST),
        BlocksRemoved([K[4]], Tier.DEVICE),
    ]


def test_a_stored_run_that_continues_the_one_before_joins_it() -> None:
    first = BlocksStored([K[0], K[1]], Tier.DEVICE)
    continued = BlocksStored([K[2]], Tier.DEVICE, first_position=2, parent_key=K[1])
    elsewhere = BlocksStored([K[3]], Tier.DEVICE, first_position=5, parent_key=K[2])
    other_tier = BlocksStored([K[4]], Tier.HOST, first_position=3, parent_key=K[2])
    assert coalesced([first, continued, elsewhere]) == [
        BlocksStored([K[0], K[1], K[2]], Tier.DEVICE),
        elsewhere,  # its position does not follow: another chain
    ]
    assert coalesced([first, continued, other_tier]) == [
        BlocksStored([K[0], K[1], K[2]], Tier.DEVICE),
        other_tier,
    ]


def test_nothing_merges_across_a_change_of_another_kind() -> None:
    events: list[KvEvent] = [
        BlocksRemoved([K[0]], Tier.DEVICE),
        BlocksStored([K[0]], Tier.DEVICE),
        BlocksRemoved([K[0]], Tier.DEVICE),
        AllBlocksCleared(),
        AllBlocksCleared(),
    ]
    assert coalesced(events) == events


async def test_the_index_holds_the_same_after_coalesced_batches_as_after_the_originals() -> None:
    rng = random.Random(7)
    original, merged = MemoryLocationIndex(), MemoryLocationIndex()
    info = WorkerInfo("w", 1, "http://127.0.0.1:1", "m", 16, kv_capacity_blocks=64)
    for index in (original, merged):
        await index.register(info, 60.0)
    chain_end: dict[Tier, tuple[BlockKey, int]] = {}
    sent = coalesced_sent = 0
    for _ in range(200):
        events: list[KvEvent] = []
        for _ in range(rng.randrange(1, 12)):
            tier, roll = rng.choice([Tier.DEVICE, Tier.HOST]), rng.random()
            if roll < 0.45:
                keys = rng.sample(K, rng.randrange(1, 4))
                end = chain_end.get(tier)
                if end is not None and rng.random() < 0.7:  # continue the last run
                    events.append(BlocksStored(keys, tier, end[1], end[0]))
                    chain_end[tier] = (keys[-1], end[1] + len(keys))
                else:
                    events.append(BlocksStored(keys, tier))
                    chain_end[tier] = (keys[-1], len(keys))
            elif roll < 0.97:
                events.append(BlocksRemoved(rng.sample(K, rng.randrange(1, 3)), tier))
            else:
                events.append(AllBlocksCleared())
        fewer = coalesced(events)
        sent, coalesced_sent = sent + len(events), coalesced_sent + len(fewer)
        await original.apply("w", 1, events)
        await merged.apply("w", 1, fewer)
        for key in K:
            assert await original.lookup([key]) == await merged.lookup([key])
    assert coalesced_sent < sent  # some batches did merge (982 events of 1,200 with this seed)
