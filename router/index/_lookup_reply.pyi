from collections.abc import Callable
from typing import Any

RECORD_BYTES: int  # one worker's record in a section of a group without a directory
MEMBER_BYTES: int  # one roster record in a section of a group with a directory

def read_matches(
    reply: bytes,
    groups: list[list[str]],
    out: dict[str, Any],
    match: type[tuple[object, ...]],
    by_tier: Callable[[tuple[int, ...]], object],
) -> None:
    """out[worker id] = match(worker id, incarnation, blocks, by_tier(blocks per tier)) for
    each worker of `groups` (each group's worker ids, in the order lookup.lua was asked)
    that matched a block in `reply` (lookup.lua's: a section per group); ValueError if the
    reply is not one section per group."""
