"""Hit-rate bounds: hand-made workloads with known answers, LRU order, the Mooncake figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations.fleet_sim.bounds import infinite_cache_hit_rate, pooled_cache_hit_rate
from simulations.fleet_sim.requests import TraceRequest, Workload
from simulations.fleet_sim.workloads import load_mooncake, multi_turn, shared_prefix

TRACES = Path(__file__).resolve().parents[3] / "simulations" / "traces"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"


def workload(*prompts: tuple[tuple[int, ...], int], block_tokens: int = 4) -> Workload:
    """Requests one second apart, each (blocks, prompt tokens)."""
    return Workload(
        name="hand-made",
        block_tokens=block_tokens,
        requests=tuple(
            TraceRequest(
                request_id=i,
                arrival_s=float(i),
                blocks=blocks,
                prompt_tokens=tokens,
                output_tokens=1,
            )
            for i, (blocks, tokens) in enumerate(prompts)
        ),
    )


HAND_MADE = workload(
    ((1, 2), 6),  # miss, miss
    ((1, 2), 6),  # the whole prompt: 6 tokens (5 with the last token recomputed)
    ((1, 3, 4), 10),  # block 1 only: 4 tokens
    ((9, 2), 6),  # block 2 follows a miss: nothing
    ((1, 3, 5), 12),  # blocks 1 and 3: 8 tokens
)
TOTAL = 6 + 6 + 10 + 6 + 12


def test_infinite_cache_on_a_hand_made_workload() -> None:
    assert infinite_cache_hit_rate(HAND_MADE, cap_last_token=False) == (6 + 4 + 8) / TOTAL
    assert infinite_cache_hit_rate(HAND_MADE) == (5 + 4 + 8) / TOTAL


def test_bounds_replay_in_arrival_order() -> None:
    longer = TraceRequest(0, 0.0, (1, 2, 3), 12, 1)
    shorter = TraceRequest(1, 1.0, (1, 2), 8, 1)
    listed_late_first = Workload("out-of-order", 4, (shorter, longer))
    # Replayed by arrival: the shorter prompt comes second, fully cached, and recomputes
    # its last token (7 of 8). Replayed as listed, the longer one would hit 8 of 12.
    assert infinite_cache_hit_rate(listed_late_first) == 7 / 20
    assert pooled_cache_hit_rate(listed_late_first, 100) == 7 / 20


def test_empty_and_one_token_prompts() -> None:
    assert infinite_cache_hit_rate(workload()) == 0.0
    assert pooled_cache_hit_rate(workload(), 100) == 0.0
    ones = workload(((7,), 1), ((7,), 1))
    assert infinite_cache_hit_rate(ones) == 0.0  # the only token is always recomputed
    assert infinite_cache_hit_rate(ones, cap_last_token=False) == 0.5


def test_pooled_cache_with_room_for_everything_equals_the_infinite_cache() -> None:
    for cap in (True, False):
        infinite = infinite_cache_hit_rate(HAND_MADE, cap_last_token=cap)
        assert pooled_cache_hit_rate(HAND_MADE, 10**6, cap_last_token=cap) == infinite
    generated = multi_turn(sessions=30, turns=4)
    assert pooled_cache_hit_rate(generated, 10**9) == infinite_cache_hit_rate(generated)
    assert pooled_cache_hit_rate(generated, 0) == 0.0
    assert pooled_cache_hit_rate(generated, 63) == 0.0  # less than one block of 64


def test_pooled_cache_evicts_the_least_recently_used_block() -> None:
    full = 4  # every prompt one full block
    trace = workload(
        ((1,), full),  # miss; cache [1]
        ((2,), full),  # miss; cache [1, 2]
        ((1,), full),  # hit, refreshes 1; cache [2, 1]
        ((3,), full),  # miss, evicts 2 (least recently used); cache [1, 3]
        ((1,), full),  # hit; cache [3, 1]
        ((2,), full),  # miss: 2 was evicted; evicts 3; cache [1, 2]
        ((3,), full),  # miss; evicts 1; cache [2, 3]
        ((2,), full),  # hit
    )
    hits = 3 * full
    assert pooled_cache_hit_rate(trace, 8, cap_last_token=False) == hits / (8 * full)
    assert pooled_cache_hit_rate(trace, 11, cap_last_token=False) == hits / (8 * full)  # 2 blocks
    assert pooled_cache_hit_rate(trace, 12, cap_last_token=False) == 5 / 8  # 3 blocks: all stay


def test_pooled_cache_counts_only_the_longest_cached_prefix() -> None:
    trace = workload(
        ((1, 2, 3), 12),  # cache [1, 2, 3]
        ((4,), 4),  # evicts 1; cache [2, 3, 4]
        ((1, 2, 3), 12),  # 1 is gone: 2 and 3 are cached but follow a miss
    )
    assert pooled_cache_hit_rate(trace, 12, cap_last_token=False) == 0.0
    assert pooled_cache_hit_rate(trace, 16, cap_last_token=False) == 12 / 28


def test_a_request_longer_than_the_cache_evicts_its_own_first_blocks() -> None:
    trace = workload(((1, 2, 3), 12), ((1, 2, 3), 12))
    assert pooled_cache_hit_rate(trace, 8, cap_last_token=False) == 0.0
    assert pooled_cache_hit_rate(trace, 12, cap_last_token=False) == 0.5


def test_shared_prefix_bounds() -> None:
    generated = shared_prefix()
    # 64 first prompts miss; every other prompt hits its group's 2,048 system tokens.
    expected = (64 * 16 - 64) * 2048 / (64 * 16 * 2176)
    assert infinite_cache_hit_rate(generated) == pytest.approx(expected)
    # Room for one group's system prompt: the shuffled groups keep evicting each other.
    assert pooled_cache_hit_rate(generated, 2048 + 128) < expected / 4


@pytest.fixture(scope="module")
def mooncake() -> Workload:
    return load_mooncake(MOONCAKE)


def test_mooncake_reuse_ceiling_matches_the_published_figure(mooncake: Workload) -> None:
    # ../shared/traces/README.md: 37.36% of tokens, the last token not recomputed.
    uncapped = infinite_cache_hit_rate(mooncake, cap_last_token=False)
    assert uncapped == pytest.approx(0.3736, abs=0.001)
    capped = infinite_cache_hit_rate(mooncake)
    assert uncapped - 0.0001 < capped <= uncapped


@pytest.mark.parametrize(
    ("capacity_tokens", "published"),
    [(10**5, 0.042), (10**6, 0.054), (3 * 10**6, 0.138), (10**7, 0.291), (5 * 10**7, 0.371)],
)
def test_mooncake_pooled_lru_matches_the_published_figures(
    mooncake: Workload, capacity_tokens: int, published: float
) -> None:
    rate = pooled_cache_hit_rate(mooncake, capacity_tokens, cap_last_token=False)
    assert rate == pytest.approx(published, abs=0.01)
    assert pooled_cache_hit_rate(mooncake, capacity_tokens) <= rate
