"""BlockTable (the in-memory index's storage) against a dict, from a tiny table up, so
bucket overflow, the second choice and growth all happen."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from router.index.block_table import BlockTable

# Few distinct values, so batches repeat keys; 0 and 2**64-1 included on purpose.
key_values = st.one_of(st.integers(0, 300), st.sampled_from([0, 2**64 - 1, 2**63]))


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.booleans(), st.lists(key_values, min_size=1, max_size=60)), max_size=12
    )
)
def test_table_agrees_with_a_dict(steps: list[tuple[bool, list[int]]]) -> None:
    table = BlockTable(tiers=1, bucket_bits=1)
    model: dict[int, int] = {}  # key -> depth it was first inserted with
    for insert, values in steps:
        if insert:
            distinct = list(dict.fromkeys(values))  # the table takes distinct keys
            depths = np.arange(len(distinct), dtype=np.uint32)
            slots = table.find_or_insert(np.array(distinct, dtype=np.uint64), depths)
            table.holders(0)[slots, 0] |= np.uint64(1)
            for depth, key in enumerate(distinct):
                model.setdefault(key, depth)
            assert len(set(slots.tolist())) == len(distinct)
        else:
            found = table.find(np.array(values, dtype=np.uint64))
            present_slots = found.slots[found.present]
            table.holders(0)[present_slots, 0] = 0
            table.release_unheld(present_slots)
            for key in values:
                model.pop(key, None)
        found = table.find(np.array([*range(301), 2**64 - 1, 2**63], dtype=np.uint64))
        assert table.used == len(model)
        present = {int(k) for k in table.key_at(found.slots[found.present])}
        assert present == set(model)
        for key in model:
            match = table.find(np.array([key], dtype=np.uint64))
            assert match.present[0]
            assert int(table.depth(match.slots)[0]) == model[key]


def test_growth_keeps_holders_and_depths() -> None:
    table = BlockTable(tiers=2, bucket_bits=1)
    table.ensure_worker_slots(130)
    keys = np.arange(1, 20_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    slots = table.find_or_insert(keys[:10], np.arange(10, dtype=np.uint32))
    table.holders(1)[slots, 2] |= np.uint64(4)  # worker slot 130 on tier 1
    table.find_or_insert(keys, np.zeros(keys.size, dtype=np.uint32))

    found = table.find(keys[:10])
    assert found.present.all()
    assert (table.holders(1)[found.slots, 2] == 4).all()
    assert table.depth(found.slots).tolist() == list(range(10))
    assert table.used == keys.size
    assert table.capacity >= keys.size


def test_the_table_doubles_only_at_its_load_limit() -> None:
    # Keys whose two buckets are both full are rare but certain among many keys; they
    # must make room by moving an occupant, not double a mostly empty table.
    table = BlockTable(tiers=1)
    rng = np.random.default_rng(5)
    for _ in range(380):  # 380,000 keys: 72% of 2**19 slots
        keys = np.unique(rng.integers(0, 2**63, size=1000, dtype=np.uint64))
        table.find_or_insert(keys, np.zeros(keys.size, dtype=np.uint32))
    assert table.used == len(set(table.key_at(table.occupied_slots()).tolist()))
    assert table.capacity == 2**19
