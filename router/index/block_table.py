"""BlockTable: block key -> (which worker slots hold it, per tier; its depth), in numpy.

The in-memory index's storage, kept apart from its policy (memory.py decides who is
alive, what to evict and when). Built for the lookup: a request's 512 keys are found
with a handful of vectorised gathers, so the CPU overlaps the cache misses that a
Python loop over a dict pays one by one.

Layout
- Keys live in buckets of 8 slots (one cache line of uint64). A key may sit in one of
  two buckets, picked by two multiplicative hashes of the key ("two-choice" hashing),
  so a lookup reads at most two cache lines per key and the table fills to ~85%.
- An empty slot holds its bucket's sentinel: a value that hashes to neither of that
  bucket's choices, so it can never equal a key looked up in that bucket. No separate
  occupancy array has to be read.
- Holders: per tier, a (slots x words) uint64 matrix of worker-slot bits (64 workers a
  word). Depth: the block's position in its chain, for eviction order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

_SLOT_BITS = 3
BUCKET_SLOTS = 1 << _SLOT_BITS  # 8 uint64 keys: one cache line
_MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F], dtype=np.uint64)
_MAX_LOAD = 0.85
_INITIAL_BUCKET_BITS = 8

Keys = npt.NDArray[np.uint64]
Slots = npt.NDArray[np.intp]
Masks = npt.NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class _RowOffsets:
    pairs: Slots  # 2 * row: where row's pair of buckets starts in a flattened (n, 2)
    candidates: Slots  # 16 * row: where row's candidates start in a flattened (n, 16)


@lru_cache(maxsize=64)
def _row_offsets(n: int) -> _RowOffsets:
    rows = np.arange(n, dtype=np.intp)
    return _RowOffsets(rows * 2, rows * 2 * BUCKET_SLOTS)


@dataclass(frozen=True, slots=True)
class Found:
    """Where each of a lookup's keys sits: `slots[i]` is valid where `present[i]`."""

    slots: Slots
    present: npt.NDArray[np.bool_]


class BlockTable:
    def __init__(self, tiers: int, *, bucket_bits: int = _INITIAL_BUCKET_BITS) -> None:
        self._tiers = tiers
        self._words = 1
        self._generation = 0  # bumped whenever growing moves the keys
        self._allocate(bucket_bits)

    # -- shape -----------------------------------------------------------------------

    def _allocate(self, bucket_bits: int) -> None:
        self._bucket_bits = bucket_bits
        buckets = 1 << bucket_bits
        self._shift = np.uint64(64 - bucket_bits)
        self._sentinels = self._pick_sentinels(buckets)
        self._keys: Keys = np.repeat(self._sentinels, BUCKET_SLOTS).reshape(buckets, BUCKET_SLOTS)
        self._flat_keys: Keys = self._keys.reshape(-1)
        self._holders: list[Masks] = [
            np.zeros((buckets * BUCKET_SLOTS, self._words), dtype=np.uint64)
            for _ in range(self._tiers)
        ]
        self._depth = np.zeros(buckets * BUCKET_SLOTS, dtype=np.uint32)
        self._used = 0

    def _pick_sentinels(self, buckets: int) -> Keys:
        # Every bucket but the (at most two) that 0 hashes to uses 0; those use a value
        # that hashes elsewhere. Either way no key looked up in a bucket equals its
        # sentinel, since a key is only looked up in the buckets it hashes to.
        zero_buckets = self._buckets_of(np.zeros(1, dtype=np.uint64))
        sentinels = np.zeros(buckets, dtype=np.uint64)
        candidate = np.uint64(1)
        while True:
            candidate_buckets = self._buckets_of(np.array([candidate], dtype=np.uint64))
            if not np.isin(candidate_buckets, zero_buckets).any():
                break
            candidate += np.uint64(1)
        sentinels[zero_buckets.ravel()] = candidate
        return sentinels

    def _buckets_of(self, keys: Keys) -> Slots:
        """(n, 2) bucket choices per key."""
        # The shifted products are below 2**bucket_bits: viewing them as intp is exact.
        return ((keys[:, None] * _MULTIPLIERS) >> self._shift).view(np.intp)

    @property
    def capacity(self) -> int:
        return int(self._flat_keys.size)

    @property
    def used(self) -> int:
        """Occupied slots: distinct keys held by anyone."""
        return self._used

    @property
    def words(self) -> int:
        return self._words

    def nbytes(self) -> int:
        arrays: list[npt.NDArray[np.generic]] = [self._keys, self._depth, self._sentinels]
        return int(sum(a.nbytes for a in arrays + self._holders))

    def ensure_worker_slots(self, count: int) -> None:
        """Make room for worker slots 0..count-1 (adds mask words as needed)."""
        words = (count + 63) // 64
        if words > self._words:
            extra = words - self._words
            self._holders = [
                np.hstack([h, np.zeros((h.shape[0], extra), dtype=np.uint64)])
                for h in self._holders
            ]
            self._words = words

    # -- finding and inserting -------------------------------------------------------

    def find(self, keys: Keys) -> Found:
        # Each numpy call costs microseconds whatever its size, so this is written for
        # few calls: `take` (much faster than fancy indexing for row gathers), and
        # offsets into flattened arrays instead of 2-D indexing.
        n = keys.size
        buckets = self._buckets_of(keys)
        candidates = self._keys.take(buckets, axis=0)  # (n, 2, 8): both buckets' rows
        matches = (candidates == keys[:, None, None]).reshape(n, 2 * BUCKET_SLOTS)
        first = matches.argmax(axis=1)
        offsets = _row_offsets(n)
        slots = buckets.ravel().take(offsets.pairs + (first >> _SLOT_BITS)) * BUCKET_SLOTS + (
            first & (BUCKET_SLOTS - 1)
        )
        return Found(slots, matches.ravel().take(offsets.candidates + first))

    def find_or_insert(self, keys: Keys, depths: npt.NDArray[np.uint32]) -> Slots:
        """Slots of `keys`, inserting the missing ones with their depth. Duplicates in
        `keys` get the same slot (and the first one's depth)."""
        found = self.find(keys)
        if found.present.all():
            return found.slots
        missing = np.flatnonzero(~found.present)
        new_keys, first, inverse = np.unique(keys[missing], return_index=True, return_inverse=True)
        generation = self._generation
        if self._used + new_keys.size > _MAX_LOAD * self.capacity:
            self._grow(self._used + new_keys.size)
        new_slots = self._insert(new_keys, depths[missing][first])
        if self._generation != generation:
            # Growing moved every key: the slots found before are stale.
            return self.find(keys).slots
        slots = found.slots.copy()
        slots[missing] = new_slots[inverse]
        return slots

    def _insert(self, keys: Keys, depths: npt.NDArray[np.uint32]) -> Slots:
        while True:
            slots = self._try_insert(keys)
            if slots is not None:
                self._depth[slots] = depths
                self._used += keys.size
                return slots
            self._grow(self.capacity)  # a bucket pair was full: rare; double

    def _try_insert(self, keys: Keys) -> Slots | None:
        """Place keys known to be absent; None (and nothing written) if one can't fit."""
        choices = self._buckets_of(keys)
        free_1 = self._free_counts(choices[:, 0])
        free_2 = self._free_counts(choices[:, 1])
        preferred = np.where(free_1 >= free_2, 0, 1)
        slots = np.full(keys.size, -1, dtype=np.intp)
        pending = np.arange(keys.size)
        written: list[Slots] = []
        for choice_of in (preferred, 1 - preferred):
            if not pending.size:
                break
            buckets = choices[pending, choice_of[pending]]
            placed = self._place(buckets, keys[pending])
            ok = placed >= 0
            slots[pending[ok]] = placed[ok]
            written.append(placed[ok])
            pending = pending[~ok]
        if pending.size:
            for done in written:  # undo, so a retry after growing starts clean
                self._flat_keys[done] = self._sentinels[done // BUCKET_SLOTS]
            return None
        return slots

    def _free_counts(self, buckets: Slots) -> npt.NDArray[np.intp]:
        free: npt.NDArray[np.intp] = (self._keys[buckets] == self._sentinels[buckets, None]).sum(
            axis=1
        )
        return free

    def _place(self, buckets: Slots, keys: Keys) -> Slots:
        """Write each key into a free slot of its bucket; -1 where the bucket is full.
        Keys sharing a bucket take its free slots in turn (rank within the bucket)."""
        order = np.argsort(buckets, kind="stable")
        sorted_buckets = buckets[order]
        group_start = np.searchsorted(sorted_buckets, sorted_buckets, side="left")
        rank = np.empty(keys.size, dtype=np.intp)
        rank[order] = np.arange(keys.size) - group_start
        free = self._keys[buckets] == self._sentinels[buckets, None]
        nth_free = (np.cumsum(free, axis=1) == (rank + 1)[:, None]) & free
        fits = nth_free.view(np.uint64).ravel() != 0
        placed = np.full(keys.size, -1, dtype=np.intp)
        placed[fits] = buckets[fits] * BUCKET_SLOTS + nth_free[fits].argmax(axis=1)
        self._flat_keys[placed[fits]] = keys[fits]
        return placed

    def _grow(self, needed: int) -> None:
        self._generation += 1
        occupied = self.occupied_slots()
        keys = self._flat_keys[occupied].copy()
        depths = self._depth[occupied].copy()
        holders = [h[occupied].copy() for h in self._holders]
        bucket_bits = self._bucket_bits
        while (
            needed > _MAX_LOAD * (1 << (bucket_bits + 3)) * 0.999
            or bucket_bits == self._bucket_bits
        ):
            bucket_bits += 1
        while True:
            self._allocate(bucket_bits)
            slots = self._try_insert(keys)
            if slots is not None:
                break
            bucket_bits += 1
        self._used = keys.size
        self._depth[slots] = depths
        for tier, tier_holders in enumerate(holders):
            self._holders[tier][slots] = tier_holders

    # -- holders ---------------------------------------------------------------------

    def holders(self, tier: int) -> Masks:
        return self._holders[tier]

    def depth(self, slots: Slots) -> npt.NDArray[np.uint32]:
        return self._depth[slots]

    def occupied_slots(self) -> Slots:
        buckets_sentinels = np.repeat(self._sentinels, BUCKET_SLOTS)
        return np.flatnonzero(self._flat_keys != buckets_sentinels)

    def key_at(self, slots: Slots) -> Keys:
        return self._flat_keys[slots]

    def release_unheld(self, slots: Slots) -> int:
        """Free the slots among `slots` that no worker holds on any tier any more."""
        if not slots.size:
            return 0
        slots = np.unique(slots)
        held = np.zeros(slots.size, dtype=np.bool_)
        for tier_holders in self._holders:
            held |= tier_holders[slots].any(axis=1)
        empty = slots[~held]
        self._flat_keys[empty] = self._sentinels[empty // BUCKET_SLOTS]
        self._depth[empty] = 0
        self._used -= int(empty.size)
        return int(empty.size)
