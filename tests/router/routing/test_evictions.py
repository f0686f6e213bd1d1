"""Recent evictions: a worker's removed device blocks, decayed, as a share of its cache;
and the keys of the latest removals, bounded."""

from __future__ import annotations

import math

import pytest

from kvplane.core.keys import BlockKey
from router.routing.evictions import RecentEvictions, RecentRemovals

HORIZON_S = 10.0


def test_a_worker_that_evicted_nothing_is_under_no_pressure() -> None:
    evictions = RecentEvictions(HORIZON_S)
    assert evictions.share("w1", capacity_blocks=512, now=0.0) == 0.0
    evictions.record("w1", 0, now=0.0)
    assert evictions.share("w1", capacity_blocks=512, now=0.0) == 0.0


def test_evicted_blocks_add_up_as_a_share_of_the_cache_capped_at_whole() -> None:
    evictions = RecentEvictions(HORIZON_S)
    evictions.record("w1", 128, now=5.0)
    evictions.record("w1", 128, now=5.0)
    assert evictions.share("w1", capacity_blocks=512, now=5.0) == pytest.approx(0.5)
    assert evictions.share("w2", capacity_blocks=512, now=5.0) == 0.0  # per worker
    evictions.record("w1", 1024, now=5.0)
    assert evictions.share("w1", capacity_blocks=512, now=5.0) == 1.0


def test_what_was_evicted_fades_with_the_horizon() -> None:
    evictions = RecentEvictions(HORIZON_S)
    evictions.record("w1", 256, now=0.0)
    later = evictions.share("w1", capacity_blocks=512, now=HORIZON_S)
    assert later == pytest.approx(0.5 * math.exp(-1))
    evictions.record("w1", 256, now=HORIZON_S)  # the old count decays before adding
    assert evictions.share("w1", 512, now=HORIZON_S) == pytest.approx(later + 0.5)
    assert evictions.share("w1", 512, now=HORIZON_S * 10) < 0.01


def test_an_unknown_capacity_or_a_zero_horizon_counts_for_nothing() -> None:
    evictions = RecentEvictions(HORIZON_S)
    evictions.record("w1", 256, now=0.0)
    assert evictions.share("w1", capacity_blocks=0, now=0.0) == 0.0
    off = RecentEvictions(0.0)
    off.record("w1", 256, now=0.0)
    assert off.share("w1", capacity_blocks=512, now=0.0) == 0.0


def test_a_cleared_cache_is_forgotten() -> None:
    evictions = RecentEvictions(HORIZON_S)
    evictions.record("w1", 512, now=0.0)
    evictions.forget("w1")
    evictions.forget("never-seen")
    assert evictions.share("w1", capacity_blocks=512, now=0.0) == 0.0


def keys(first: int, count: int) -> list[BlockKey]:
    return [BlockKey(key) for key in range(first, first + count)]


def remembered(removals: RecentRemovals, among: list[BlockKey]) -> list[BlockKey]:
    return [key for key in among if removals.removed_run([key], 0, 1, before=math.inf)]


def test_a_run_of_removed_keys_stops_at_the_first_not_removed() -> None:
    removals = RecentRemovals(capacity=100)
    prompt = keys(0, 10)
    removals.record([prompt[i] for i in (2, 3, 4, 6, 7)], now=0.0)
    assert removals.removed_run(prompt, 2, 10, before=0.0) == 3  # 5 was not: 6, 7 do not count
    assert removals.removed_run(prompt, 2, 4, before=0.0) == 2  # no further than asked
    assert removals.removed_run(prompt, 0, 10, before=0.0) == 0
    assert removals.removed_run(prompt, 6, 10, before=0.0) == 2
    assert removals.removed_run(prompt, 10, 10, before=0.0) == 0


def test_a_run_counts_only_what_was_removed_before_the_request() -> None:
    removals = RecentRemovals(capacity=100)
    prompt = keys(0, 4)
    removals.record(prompt[:2], now=1.0)
    removals.record(prompt[2:], now=5.0)  # the request's own blocks, after it went
    assert removals.removed_run(prompt, 0, 4, before=0.5) == 0
    assert removals.removed_run(prompt, 0, 4, before=2.0) == 2
    assert removals.removed_run(prompt, 0, 4, before=5.0) == 4


def test_the_oldest_removals_are_forgotten_first_within_the_capacity() -> None:
    removals = RecentRemovals(capacity=10)
    everything = keys(0, 40)
    for first in range(0, 40, 3):  # batches of 3 (the last of 1), oldest first
        removals.record(everything[first : first + 3], now=float(first))
    newest_kept(removals, everything)
    # A batch larger than the capacity keeps its last keys.
    removals.record(keys(100, 25), now=50.0)
    assert newest_kept(removals, [*everything, *keys(100, 25)])[0] >= 100


def newest_kept(removals: RecentRemovals, oldest_first: list[BlockKey]) -> list[BlockKey]:
    """The keys remembered, checked to be the newest: at least half the capacity (10)
    and at most all of it, none older forgotten before them."""
    kept = remembered(removals, oldest_first)
    assert 5 <= len(kept) <= 10
    assert kept == oldest_first[-len(kept) :]
    return kept


def test_a_key_removed_again_is_refreshed() -> None:
    removals = RecentRemovals(capacity=10)
    removals.record(keys(0, 5), now=0.0)
    for first in range(5, 15, 5):
        removals.record(keys(0, 1), now=float(first))  # key 0 again, each time
        removals.record(keys(first, 5), now=float(first))
    assert remembered(removals, keys(0, 2)) == [BlockKey(0)]  # its batch-mates are gone
    # Its earliest time still remembered is the one that counts.
    assert removals.removed_run(keys(0, 1), 0, 1, before=9.0) == 0
    assert removals.removed_run(keys(0, 1), 0, 1, before=10.0) == 1


def test_a_key_in_the_older_generation_keeps_its_earlier_time() -> None:
    removals = RecentRemovals(capacity=4)  # two generations of 2 keys
    removals.record(keys(0, 2), now=1.0)  # fills the newer: it becomes the older
    removals.record(keys(0, 1), now=2.0)  # key 0 again
    assert removals.removed_run(keys(0, 1), 0, 1, before=1.0) == 1
    removals.record(keys(10, 1), now=3.0)  # full again: the time-1 generation goes
    assert removals.removed_run(keys(0, 1), 0, 1, before=1.0) == 0
    assert removals.removed_run(keys(0, 1), 0, 1, before=2.0) == 1
    assert remembered(removals, keys(1, 1)) == []


def test_no_capacity_remembers_nothing() -> None:
    for capacity in (0, 1):
        removals = RecentRemovals(capacity)
        removals.record(keys(0, 4), now=0.0)
        assert removals.removed_run(keys(0, 4), 0, 4, before=1.0) == 0
