"""LocationTable (the in-memory index's storage, _table.c) against a plain-Python model,
from a two-node table up, so growth, long probe runs and the closing-up of removed
nodes all happen; and lookups against a walk written the obvious way."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.core.types import WorkerInfo
from router.index._table import MAX_SLOT, RUN_CLEAR, RUN_REMOVE, RUN_STORE, LocationTable
from router.index.base import LocationIndexError
from router.index.memory import MemoryLocationIndex

TIERS = 3
SLOTS = 4
# Few distinct values, so runs repeat keys; 0 and 2**64-1 included on purpose.
key_values = st.one_of(st.integers(0, 40), st.sampled_from([0, 2**64 - 1, 2**63]))
runs = st.tuples(
    st.sampled_from([RUN_STORE, RUN_STORE, RUN_REMOVE, RUN_CLEAR]),
    st.integers(0, TIERS - 1),
    st.lists(key_values, max_size=30),
    st.integers(0, 70_000),
)
Model = dict[int, tuple[int, dict[int, set[int]]]]  # key -> (depth, slot -> tiers)


class _Row(NamedTuple):
    worker_id: str
    incarnation: int
    blocks: int
    by_tier: tuple[int, ...]


def _table(seed: int, capacity: int = 1024) -> LocationTable:
    return LocationTable(TIERS, seed, match=_Row, by_tier=lambda counts: counts, capacity=capacity)


def _lookup(
    table: LocationTable, keys: list[int], live: bytes
) -> set[tuple[int, int, tuple[int, ...]]]:
    """(slot, blocks, blocks per tier) of every match, each slot named after itself."""
    names = [(f"w{slot}", slot) if alive else None for slot, alive in enumerate(live)]
    matches = table.lookup(keys, names)
    assert all(key == match.worker_id for key, match in matches.items())
    return {(match.incarnation, match.blocks, match.by_tier) for match in matches.values()}


def _apply_to_model(model: Model, slot: int, run: tuple[int, int, list[int], int]) -> None:
    kind, tier, keys, first = run
    if kind == RUN_CLEAR:
        for key in list(model):
            model[key][1].pop(slot, None)
            if not model[key][1]:
                del model[key]
        return
    for position, key in enumerate(keys, start=first):
        if kind == RUN_STORE:
            _, holders = model.setdefault(key, (min(position, 65535), {}))
            holders.setdefault(slot, set()).add(tier)
        elif key in model and tier in model[key][1].get(slot, set()):
            model[key][1][slot].discard(tier)
            if not model[key][1][slot]:
                del model[key][1][slot]
            if not model[key][1]:
                del model[key]


def _walk(model: Model, keys: list[int], live: bytes) -> set[tuple[int, int, tuple[int, ...]]]:
    """Each live slot's longest consecutive prefix, blocks counted on their fastest tier."""
    results = set()
    for slot in range(len(live)):
        if not live[slot]:
            continue
        counts = [0] * TIERS
        for key in keys:
            tiers = model.get(key, (0, {}))[1].get(slot)
            if not tiers:
                break
            counts[min(tiers)] += 1
        if sum(counts):
            results.add((slot, sum(counts), tuple(counts)))
    return results


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, SLOTS - 1), st.lists(runs, max_size=4)), max_size=15),
    query=st.lists(key_values, max_size=12),
    live=st.lists(st.booleans(), min_size=SLOTS, max_size=SLOTS),
)
def test_table_agrees_with_a_model(
    steps: list[tuple[int, list[tuple[int, int, list[int], int]]]],
    query: list[int],
    live: list[bool],
) -> None:
    table = _table(7, capacity=2)
    model: Model = {}
    for slot, slot_runs in steps:
        table.apply(slot, slot_runs)
        for run in slot_runs:
            _apply_to_model(model, slot, run)
        assert table.keys == len(model)
        assert table.entries == sum(len(t) for _, h in model.values() for t in h.values())
        for key, (depth, _) in model.items():
            assert table.depth(key) == depth
        for slot_number in range(SLOTS):
            held = sum(len(h.get(slot_number, ())) for _, h in model.values())
            assert table.slot_entries(slot_number) == held
    mask = bytes(live)
    assert _lookup(table, query, mask) == _walk(model, query, mask)
    for key in model:
        assert _lookup(table, [key], mask) == _walk(model, [key], mask)


def test_a_bad_run_changes_nothing() -> None:
    table = _table(1)
    table.apply(0, [(RUN_STORE, 0, [1, 2, 3], 0)])
    for bad in ([4, -1], [4, 2**64], [4, "5"]):
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            table.apply(0, [(RUN_REMOVE, 0, [1], 0), (RUN_STORE, 0, bad, 3)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="out of range"):
        table.apply(0, [(RUN_REMOVE, 0, [1], 0), (RUN_STORE, TIERS, [4], 3)])
    assert (table.entries, table.keys) == (3, 3)
    assert _lookup(table, [1, 2, 3], b"\x01") == {(0, 3, (3, 0, 0))}


def test_eviction_takes_the_deepest_entries_first() -> None:
    table = _table(1, capacity=2)
    chain = list(range(100, 120))
    table.apply(0, [(RUN_STORE, 0, chain, 0)])
    table.apply(1, [(RUN_STORE, 1, chain[:10], 0)])
    # Depths 19..10 hold one entry each, depth 9 two: evicting 11 takes depths 19..10
    # and one entry's block at depth 9 (a block goes whole).
    removed = table.evict_deepest(11)
    assert removed == 12
    assert table.entries == 30 - 12
    assert [table.depth(key) for key in chain] == [*range(9), *[None] * 11]


def test_growth_keeps_every_holder() -> None:
    table = _table(3, capacity=2)
    keys = [key * 0x9E3779B97F4A7C15 % 2**64 for key in range(1, 20_001)]
    for slot in range(300):  # slots past 255 need more than the holder's low byte
        table.apply(slot, [(RUN_STORE, slot % TIERS, keys[:3], 0)])
    table.apply(0, [(RUN_STORE, 0, keys, 0)])
    assert table.keys == len(keys)
    assert table.capacity >= len(keys) / 0.8
    everyone = _lookup(table, keys[:3], b"\x01" * 300)
    assert sorted(everyone) == [
        (slot, 3, tuple(3 if t == slot % TIERS else 0 for t in range(TIERS))) for slot in range(300)
    ]


def test_eviction_stops_at_the_count_within_the_threshold_depth() -> None:
    table = _table(5)
    shallow, deep = list(range(1000, 1100)), list(range(2000, 2100))
    table.apply(0, [(RUN_STORE, 0, [key], 0) for key in shallow])
    table.apply(0, [(RUN_STORE, 0, [key], 1) for key in deep])
    # All 100 entries at depth 1 go, then 50 of the 100 at depth 0 (the threshold), however
    # the scan meets them: never entries past the count at the threshold depth.
    assert table.evict_deepest(150) == 150
    assert [table.depth(key) for key in deep] == [None] * 100
    assert sum(table.depth(key) is not None for key in shallow) == 50


@pytest.mark.parametrize(
    "run",
    [(RUN_STORE, 0.0, [1], 0), (RUN_STORE, 0, (1,), 0), (RUN_STORE, 0, [1], "0"), (RUN_STORE,)],
)
def test_runs_of_the_wrong_types_change_nothing(run: tuple[object, ...]) -> None:
    table = _table(1)
    table.apply(0, [(RUN_STORE, 0, [7], 0)])
    with pytest.raises(TypeError, match="a run is"):
        table.apply(0, [(RUN_REMOVE, 0, [7], 0), run])  # type: ignore[list-item]
    assert _lookup(table, [7], b"\x01") == {(0, 1, (1, 0, 0))}


def test_an_uninitialised_table_raises() -> None:
    table = LocationTable.__new__(LocationTable)
    with pytest.raises(RuntimeError, match="not initialised"):
        table.lookup([1], [("w", 1)])


async def test_the_memory_index_refuses_a_worker_past_the_last_slot() -> None:
    index = MemoryLocationIndex()
    for n in range(MAX_SLOT + 1):
        await index.register(WorkerInfo(f"w{n}", 1, "http://w:8000", "m", 16), 60.0)
    with pytest.raises(LocationIndexError, match="at most 65535 workers"):
        await index.register(WorkerInfo("one-more", 1, "http://w:8000", "m", 16), 60.0)
    assert len(await index.workers()) == MAX_SLOT + 1
    await index.drop_worker("w7")  # a freed slot takes the next one
    await index.register(WorkerInfo("one-more", 1, "http://w:8000", "m", 16), 60.0)
