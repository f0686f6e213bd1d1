"""The Redis index's lookup reply reader (_lookup_reply.c): lookup.lua's records, as the
script packs them, into the matches the memory index builds."""

from __future__ import annotations

import struct

import pytest

from kvplane.core.types import Tier
from router.index._lookup_reply import RECORD_BYTES, read_matches
from router.index.base import PrefixMatch, blocks_by_tier

RECORD = struct.Struct(">IIIII20s")  # as lookup.lua packs one: blocks, per tier, incarnation


def record(blocks: int, by_tier: tuple[int, int, int, int], incarnation: int | bytes) -> bytes:
    digits = incarnation if isinstance(incarnation, bytes) else b"%020d" % incarnation
    return RECORD.pack(blocks, *by_tier, digits)


def read(reply: bytes, worker_ids: list[str]) -> dict[str, PrefixMatch]:
    matches: dict[str, PrefixMatch] = {}
    read_matches(reply, worker_ids, matches, PrefixMatch, blocks_by_tier)
    return matches


def test_records_become_the_matches_of_the_workers_that_hold_a_block() -> None:
    assert RECORD.size == RECORD_BYTES
    reply = b"".join(
        [
            record(12, (12, 0, 0, 0), 3),
            record(0, (0, 0, 0, 0), 0),  # holds not even the first key
            record(9, (4, 5, 0, 0), 2**64 - 1),
            record(7, (0, 0, 2, 5), 1),
        ]
    )
    matches = read(reply, ["a", "b", "c", "d"])
    assert matches == {
        "a": PrefixMatch("a", 3, 12, {Tier.DEVICE: 12}),
        "c": PrefixMatch("c", 2**64 - 1, 9, {Tier.DEVICE: 4, Tier.HOST: 5}),
        "d": PrefixMatch("d", 1, 7, {Tier.DISK: 2, Tier.REMOTE: 5}),
    }
    assert all(type(match) is PrefixMatch for match in matches.values())


def test_matches_are_added_to_those_of_other_nodes() -> None:
    matches = {"x": PrefixMatch("x", 1, 1, {Tier.DEVICE: 1})}
    read_matches(record(2, (2, 0, 0, 0), 5), ["y"], matches, PrefixMatch, blocks_by_tier)
    assert set(matches) == {"x", "y"}


@pytest.mark.parametrize(
    ("reply", "worker_ids", "error"),
    [
        (record(1, (1, 0, 0, 0), 1), ["a", "b"], "40 bytes for 2 workers"),
        (record(1, (1, 0, 0, 0), 1)[:-1], ["a"], "39 bytes for 1 workers"),
        (record(1, (1, 0, 0, 0), b"0" * 19 + b"x"), ["a"], "not a uint64"),
        (record(1, (1, 0, 0, 0), b"%020d" % 2**64), ["a"], "not a uint64"),
        (record(1, (2**31, 0, 0, 0), 1), ["a"], "out of range"),
    ],
)
def test_a_reply_that_is_not_one_record_per_worker_is_refused(
    reply: bytes, worker_ids: list[str], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        read(reply, worker_ids)


def test_arguments_of_the_wrong_kind_are_refused() -> None:
    with pytest.raises(TypeError):
        read_matches("text", [], {}, PrefixMatch, blocks_by_tier)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tuple type"):
        read_matches(b"", [], {}, dict, blocks_by_tier)  # type: ignore[arg-type]
