"""How much of each worker's cache it evicted lately, from its own removal events.

An engine reports its KV usage as the blocks its running requests hold (vLLM's
`kv_cache_usage_perc`): a cache full of prefixes that nobody runs right now reads as
nearly empty, though every new block stored there evicts one of them. What a worker
evicted tells the router what its usage cannot: a worker that turned over its whole
cache in the last few seconds is evicting prefixes that are still being reused, and
a request sent there with many new tokens evicts more of them.

The count decays exponentially with a time constant of `horizon_s`, so that it weighs
the last `horizon_s` seconds most and a worker that stopped evicting is soon
forgotten. Only device-tier removals count: a block moved to a slower tier is still
reusable.

Removals are counted in router blocks (`control_plane.block_size` tokens), while an
agent registers its engine's capacity in the engine's own blocks, which may be smaller
(SGLang's pages are often one token): `capacity_in_router_blocks` puts the two in one
unit.

`RecentRemovals` keeps the removed keys themselves, a bounded number of the latest: the
cache-loss funnel tells by them how much of a prompt the fleet had held and evicted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvplane.core.keys import BlockKey

Column = npt.NDArray[np.float64]


def capacity_in_router_blocks(
    engine_blocks: int, engine_block_size: int | None, router_block_size: int
) -> float:
    """A worker's KV capacity in router blocks, from its engine's count of its own blocks
    and their size as its agent reports it. Only a size that divides the router's is
    taken (the agent keys events only then); any other, or none, is read as the
    router's, so that no report makes a cache look larger than its registered count."""
    if not engine_block_size or router_block_size <= 0 or router_block_size % engine_block_size:
        return float(engine_blocks)
    return engine_blocks * engine_block_size / router_block_size


class RecentEvictions:
    """Workers whose count changed are noted until `take_changed()`: the router's
    WorkerPool keeps the counts as columns (`recorded()`) and re-reads only those; `shares()`
    reads such columns."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._evicted: dict[str, tuple[float, float]] = {}  # worker -> (blocks, as of)
        self._changed: set[str] = set()

    def record(self, worker_id: str, blocks: int, now: float) -> None:
        if self.horizon_s <= 0 or blocks <= 0:
            return
        self._evicted[worker_id] = (self._decayed(worker_id, now) + blocks, now)
        self._changed.add(worker_id)

    def forget(self, worker_id: str) -> None:
        """The worker's cache was cleared or it left: what it evicted before is moot."""
        if self._evicted.pop(worker_id, None) is not None:
            self._changed.add(worker_id)

    def recorded(self, worker_id: str) -> tuple[float, float]:
        """(blocks, as of): the worker's count when last recorded, (0.0, 0.0) if none."""
        return self._evicted.get(worker_id, (0.0, 0.0))

    def shares(self, blocks: Column, as_of: Column, capacity_blocks: Column, now: float) -> Column:
        """share() of workers whose recorded() counts and capacities are columns."""
        shares = np.zeros(len(blocks))
        if self.horizon_s <= 0 or not blocks.any():  # a fleet that never evicted: no work
            return shares
        decayed = blocks * np.exp(np.minimum(as_of - now, 0.0) / self.horizon_s)
        np.divide(decayed, capacity_blocks, out=shares, where=capacity_blocks > 0)
        return np.minimum(shares, 1.0, out=shares)

    def take_changed(self) -> set[str]:
        """The workers whose count was recorded or forgotten since the last call (one
        reader only)."""
        changed, self._changed = self._changed, set()
        return changed

    def share(self, worker_id: str, capacity_blocks: int, now: float) -> float:
        """The recently evicted blocks as a share of the worker's cache, 0.0 to 1.0
        (1.0: it turned over its whole cache within about `horizon_s`); 0.0 when its
        capacity is unknown."""
        blocks, as_of = self.recorded(worker_id)
        columns = np.array([blocks]), np.array([as_of]), np.array([float(capacity_blocks)])
        return float(self.shares(*columns, now)[0])

    def _decayed(self, worker_id: str, now: float) -> float:
        blocks, as_of = self._evicted.get(worker_id, (0.0, now))
        return blocks * math.exp(-max(0.0, now - as_of) / self.horizon_s)


class RecentRemovals:
    """The keys of the latest device-tier removals in the fleet, at most `capacity` of
    them (under 2: none), each with when it was last removed.

    Two generations of at most `capacity // 2` keys each: a removal goes into the newer,
    a full newer one becomes the older and the older one is forgotten whole. So the
    oldest are forgotten first, and a key removed again moves to the newer (refreshed)
    while the older keeps its earlier time until it goes. A batch's keys share one time,
    so that a key costs its dict entry and its int (about 80 bytes a key with both
    generations full, measured) and a batch one dict update in C."""

    def __init__(self, capacity: int) -> None:
        self._generation = capacity // 2
        self._newer: dict[BlockKey, float] = {}
        self._older: dict[BlockKey, float] = {}

    def record(self, keys: Sequence[BlockKey], now: float) -> None:
        """Some worker removed `keys` from its device tier at `now`."""
        if not self._generation:
            return
        start = 0
        while start < len(keys):  # a batch larger than the room left spans generations
            room = self._generation - len(self._newer)
            self._newer.update(dict.fromkeys(keys[start : start + room], now))
            start += room
            if len(self._newer) >= self._generation:
                self._older, self._newer = self._newer, {}

    def removed_run(self, keys: Sequence[BlockKey], start: int, stop: int, before: float) -> int:
        """How many of `keys[start:stop]`, from the first, were removed at or before
        `before`: it stops at the first key that was not. A key's older time is its
        earlier one; a key removed before and again after `before` within one generation
        keeps only its later time, and is missed."""
        newer, older = self._newer, self._older
        run = 0
        for position in range(start, stop):
            key = keys[position]
            removed_at = older.get(key)
            if removed_at is None:
                removed_at = newer.get(key)
            if removed_at is None or removed_at > before:
                break
            run += 1
        return run
