"""The Redis index's lookup reply reader (_lookup_reply.c): lookup.lua's sections, as the
script packs them, into the matches the memory index builds."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import pytest

from kvplane.core.types import Tier
from router.index._lookup_reply import MEMBER_BYTES, RECORD_BYTES, read_matches
from router.index.base import PrefixMatch, blocks_by_tier

RECORD = struct.Struct(">IIIII20s")  # as lookup.lua packs one: blocks, per tier, incarnation
MEMBER = struct.Struct(">HdB20s")  # a roster's member record (common.lua)
NOW = 1_000_000.0  # the server's clock in a 'D' section, microseconds
LIVE, EXPIRED = NOW + 5e6, NOW - 1.0  # lease deadlines
ABSENT = bytes(MEMBER.size)  # a worker not in the roster


def digits(incarnation: int | bytes) -> bytes:
    return incarnation if isinstance(incarnation, bytes) else b"%020d" % incarnation


def record(blocks: int, by_tier: tuple[int, int, int, int], incarnation: int | bytes) -> bytes:
    return RECORD.pack(blocks, *by_tier, digits(incarnation))


def member(index: int, deadline: float, search_tier: int, incarnation: int | bytes) -> bytes:
    return MEMBER.pack(index, deadline, search_tier, digits(incarnation))


def bit_set(*indexes: int) -> bytes:
    """Members' bits as the directory keeps them: lowest index in the lowest bit of the
    first byte, trailing zero bytes dropped."""
    value = sum(1 << index for index in indexes)
    return value.to_bytes((value.bit_length() + 7) // 8, "little")


def directory_section(
    members: list[bytes],
    ends: list[tuple[int, bytes, bytes]],
    walked: Sequence[tuple[int, bytes]] = (),
    now: float = NOW,
) -> bytes:
    parts = [b"D", struct.pack(">d", now), *members, struct.pack(">I", len(ends))]
    for position, held, after in ends:
        parts += [
            struct.pack(">IH", position, len(held)),
            held,
            struct.pack(">H", len(after)),
            after,
        ]
    parts.append(struct.pack(">I", len(walked)))
    parts += [struct.pack(">I", place) + counts for place, counts in walked]
    return b"".join(parts)


def read(reply: bytes, groups: list[list[str]]) -> dict[str, PrefixMatch]:
    matches: dict[str, PrefixMatch] = {}
    read_matches(reply, groups, matches, PrefixMatch, blocks_by_tier)
    return matches


def test_records_become_the_matches_of_the_workers_that_hold_a_block() -> None:
    assert RECORD.size == RECORD_BYTES
    reply = b"".join(
        [
            b"R",
            record(12, (12, 0, 0, 0), 3),
            record(0, (0, 0, 0, 0), 0),  # holds not even the first key
            record(9, (4, 5, 0, 0), 2**64 - 1),
            record(7, (0, 0, 2, 5), 1),
        ]
    )
    matches = read(reply, [["a", "b", "c", "d"]])
    assert matches == {
        "a": PrefixMatch("a", 3, 12, {Tier.DEVICE: 12}),
        "c": PrefixMatch("c", 2**64 - 1, 9, {Tier.DEVICE: 4, Tier.HOST: 5}),
        "d": PrefixMatch("d", 1, 7, {Tier.DISK: 2, Tier.REMOTE: 5}),
    }
    assert all(type(match) is PrefixMatch for match in matches.values())


def test_a_directory_section_gives_each_live_member_the_end_its_bit_marks() -> None:
    assert MEMBER.size == MEMBER_BYTES
    members = [
        member(0, LIVE, 1, 10),  # ends at 3 of 8
        member(1, LIVE, 2, 11),  # holds all 8, on the host
        member(2, LIVE, 1, 12),  # holds not even the first key
        member(3, EXPIRED, 1, 13),  # ends at 3, but its lease ran out
        ABSENT,
        member(9, LIVE, 1, 2**64 - 1),  # ends at 1: a bit in the second byte
        member(4, LIVE, 0, 14),  # no search tier: walked
        member(5, LIVE, 0, 15),  # no search tier, holds not even the first key: not walked
    ]
    ends = [
        (8, bit_set(1), b""),
        (3, bit_set(0, 1, 3), bit_set(1)),
        (1, bit_set(0, 1, 3, 4, 9), bit_set(0, 1, 3, 4)),
    ]
    reply = directory_section(members, ends, [(6, RECORD.pack(5, 2, 3, 0, 0, b"")[:20])])
    names = ["m0", "m1", "m2", "m3", "absent", "m9", "walker", "m5"]
    assert read(reply, [names]) == {
        "m0": PrefixMatch("m0", 10, 3, {Tier.DEVICE: 3}),
        "m1": PrefixMatch("m1", 11, 8, {Tier.HOST: 8}),
        "m9": PrefixMatch("m9", 2**64 - 1, 1, {Tier.DEVICE: 1}),
        "walker": PrefixMatch("walker", 14, 5, {Tier.DEVICE: 2, Tier.HOST: 3}),
    }


def test_stray_bits_neither_move_an_end_nor_reach_past_the_live_members() -> None:
    # Bits of members not asked about (a retiring member's being swept, a walked one's
    # gaps) may make a member's bit change at several ends: the lowest is its end. Bits
    # above every live searched member's index are skipped, not written past the ends.
    ends = [
        (6, bit_set(0, 1, 40), bit_set(1)),
        (2, bit_set(0, 3, 7, 40), bit_set(3, 40)),
        (4, bit_set(0, 1, 9, 60), bit_set(1, 9)),
    ]
    members = [member(0, LIVE, 1, 1), member(7, LIVE, 0, 2), member(9, EXPIRED, 1, 3)]
    walked = [(0, RECORD.pack(9, 9, 0, 0, 0, b"")[:20])]  # names a searched member: ignored
    assert read(directory_section(members, ends, walked), [["a", "walker", "expired"]]) == {
        "a": PrefixMatch("a", 1, 2, {Tier.DEVICE: 2})
    }


def test_a_reply_holds_a_section_per_group_in_order() -> None:
    reply = b"".join(
        [
            b"R",
            record(2, (2, 0, 0, 0), 1),
            directory_section([member(0, LIVE, 1, 2)], [(4, bit_set(0), b"")]),
            b"R",
            record(0, (0, 0, 0, 0), 0),
            record(1, (1, 0, 0, 0), 3),
        ]
    )
    assert read(reply, [["a"], ["b"], ["c", "d"]]) == {
        "a": PrefixMatch("a", 1, 2, {Tier.DEVICE: 2}),
        "b": PrefixMatch("b", 2, 4, {Tier.DEVICE: 4}),
        "d": PrefixMatch("d", 3, 1, {Tier.DEVICE: 1}),
    }


def test_matches_are_added_to_those_of_other_nodes() -> None:
    matches = {"x": PrefixMatch("x", 1, 1, {Tier.DEVICE: 1})}
    reply = b"R" + record(2, (2, 0, 0, 0), 5)
    read_matches(reply, [["y"]], matches, PrefixMatch, blocks_by_tier)
    assert set(matches) == {"x", "y"}


ONE = record(1, (1, 0, 0, 0), 1)
SEARCHED = directory_section([member(0, LIVE, 1, 1)], [(2, bit_set(0), b"")])


@pytest.mark.parametrize(
    ("reply", "groups", "error"),
    [
        (b"R" + ONE, [["a", "b"]], "ends within a section"),
        (b"R" + ONE[:-1], [["a"]], "ends within a section"),
        (b"R" + ONE + b"R", [["a"]], "1 bytes past its sections"),
        (b"X" + ONE, [["a"]], "starts with byte 88"),
        (b"R" + record(1, (1, 0, 0, 0), b"0" * 19 + b"x"), [["a"]], "not a uint64"),
        (b"R" + record(1, (1, 0, 0, 0), b"%020d" % 2**64), [["a"]], "not a uint64"),
        (b"R" + record(1, (2**31, 0, 0, 0), 1), [["a"]], "out of range"),
        (SEARCHED[:-1], [["a"]], "ends within a section"),
        (SEARCHED, [["a", "b"]], "ends within a section"),
        (directory_section([member(0, LIVE, 1, 1)], [(0, bit_set(0), b"")]), [["a"]], "position 0"),
        (directory_section([member(0, LIVE, 5, 1)], []), [["a"]], "names no tier"),
        (directory_section([ABSENT], [], [(1, bytes(20))]), [["a"]], "was not asked"),
        (
            directory_section([member(0, LIVE, 1, b"9" * 20)], [(2, bit_set(0), b"")]),
            [["a"]],
            "not a uint64",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_reply_that_is_not_a_section_per_group_is_refused(
    reply: bytes, groups: list[list[str]], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        read(reply, groups)


def test_arguments_of_the_wrong_kind_are_refused() -> None:
    with pytest.raises(TypeError):
        read_matches("text", [], {}, PrefixMatch, blocks_by_tier)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="by group"):
        read_matches(b"R" + ONE, [["a"], "b"], {}, PrefixMatch, blocks_by_tier)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="tuple type"):
        read_matches(b"", [], {}, dict, blocks_by_tier)  # type: ignore[arg-type]
