"""A prompt sharing a prefix with an earlier one gets that prefix's keys from the cache,
and always exactly the keys block_keys computes."""

from __future__ import annotations

import random

import pytest

from kvplane.core.keys import KeyNamespace, block_keys
from router.routing.known_keys import SEGMENT_BLOCKS, KnownPrefixKeys

BLOCK = 16
SEGMENT = SEGMENT_BLOCKS * BLOCK  # tokens
SHARED = KeyNamespace(model="m", block_size=BLOCK)
rng = random.Random(3)


def tokens(count: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(count)]


def test_prompts_sharing_prefixes_of_every_length_get_exactly_block_keys() -> None:
    known = KnownPrefixKeys(max_blocks=100_000)
    base = tokens(5 * SEGMENT + 7)
    for shared in (0, 1, BLOCK, SEGMENT - 1, SEGMENT, SEGMENT + 5, 3 * SEGMENT, len(base)):
        for tail in (0, 3, BLOCK, SEGMENT + 1):
            prompt = base[:shared] + tokens(tail)
            assert known.keys(prompt, SHARED) == block_keys(prompt, SHARED)


def test_a_known_prefix_is_keyed_once_and_its_new_blocks_only_after() -> None:
    known = KnownPrefixKeys(max_blocks=100_000)
    history = tokens(10 * SEGMENT)
    known.keys(history, SHARED)
    assert (known.reused_blocks, known.keyed_blocks) == (0, 10 * SEGMENT_BLOCKS)

    turn = history + tokens(2 * BLOCK + 3)
    assert known.keys(turn, SHARED) == block_keys(turn, SHARED)
    assert known.reused_blocks == 10 * SEGMENT_BLOCKS
    assert known.keyed_blocks == 10 * SEGMENT_BLOCKS + 2


def test_a_prefix_known_in_one_scope_is_not_found_from_another() -> None:
    known = KnownPrefixKeys(max_blocks=100_000)
    prompt = tokens(4 * SEGMENT)
    known.keys(prompt, KeyNamespace(model="m", block_size=BLOCK, cache_scope="tenant:a"))
    other = KeyNamespace(model="m", block_size=BLOCK, cache_scope="tenant:b")
    assert known.keys(prompt, other) == block_keys(prompt, other)
    assert known.reused_blocks == 0


def test_the_cache_keeps_its_budget_and_forgets_the_least_recently_used() -> None:
    known = KnownPrefixKeys(max_blocks=4 * SEGMENT_BLOCKS)
    old, recent = tokens(2 * SEGMENT), tokens(2 * SEGMENT)
    known.keys(old, SHARED)
    known.keys(recent, SHARED)
    known.keys(recent, SHARED)  # recent is used again, old is not
    known.keys(tokens(2 * SEGMENT), SHARED)  # two more segments: old's go
    assert len(known) == 4
    reused = known.reused_blocks
    known.keys(recent, SHARED)
    assert known.reused_blocks == reused + 2 * SEGMENT_BLOCKS
    known.keys(old, SHARED)
    assert known.reused_blocks == reused + 2 * SEGMENT_BLOCKS


def test_without_a_budget_nothing_is_kept_and_keys_are_still_right() -> None:
    known = KnownPrefixKeys(max_blocks=0)
    prompt = tokens(3 * SEGMENT)
    assert known.keys(prompt, SHARED) == block_keys(prompt, SHARED)
    assert known.keys(prompt, SHARED) == block_keys(prompt, SHARED)
    assert (len(known), known.reused_blocks) == (0, 0)


def test_token_ids_that_are_not_token_ids_are_refused_as_block_keys_refuses_them() -> None:
    known = KnownPrefixKeys(max_blocks=1_000)
    with pytest.raises(ValueError, match="token ids"):
        known.keys([1, 2, -3], SHARED)
    with pytest.raises(ValueError, match="token ids"):
        block_keys([1, 2, -3], SHARED)


def test_a_full_cache_gives_up_a_prompts_deepest_segments_first() -> None:
    known = KnownPrefixKeys(max_blocks=3 * SEGMENT_BLOCKS)
    prompt = tokens(4 * SEGMENT)
    known.keys(prompt, SHARED)  # four segments for room for three: the last one goes
    assert known.keys(prompt, SHARED) == block_keys(prompt, SHARED)
    assert known.reused_blocks == 3 * SEGMENT_BLOCKS
