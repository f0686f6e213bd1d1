"""Recent evictions: a worker's removed device blocks, decayed, as a share of its cache."""

from __future__ import annotations

import math

import pytest

from router.routing.evictions import RecentEvictions

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
