from collections.abc import Callable
from typing import Any

RECORD_BYTES: int  # one worker's record in lookup.lua's reply

def read_matches(
    reply: bytes,
    worker_ids: list[str],
    out: dict[str, Any],
    match: type[tuple[object, ...]],
    by_tier: Callable[[tuple[int, ...]], object],
) -> None:
    """out[worker id] = match(worker id, incarnation, blocks, by_tier(blocks per tier)) for
    each worker of `worker_ids` whose record in `reply` (lookup.lua's, in that order)
    matched a block; ValueError if the reply is not one record per worker."""
