"""BlockTable: block key -> (which worker slots hold it, per tier; its depth), in numpy.

The in-memory index's storage, kept apart from its policy (memory.py decides who is
alive, what to evict and when). Built for the lookup: a request's 512 keys are found
with a handful of vectorised gathers, so the CPU overlaps the cache misses that a
Python loop over a dict pays one by one.

Layout
- Keys live in buckets of 8 slots (one cache line of uint64). A key may sit in one of
  two buckets, picked by two multiplicative hashes of the key with secret random
  multipliers ("two-choice" hashing), so a lookup reads at most two cache lines per
  key and the table fills to 75% before it doubles.
- An empty slot holds its bucket's sentinel: a value that hashes to neither of that
  bucket's choices, so it can never equal a key looked up in that bucket. No separate
  occupancy array has to be read.
- Holders: per tier, a (slots x words) uint64 matrix of worker-slot bits (64 workers a
  word). Depth: the block's position in its chain, for eviction order.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

_SLOT_BITS = 3
BUCKET_SLOTS = 1 << _SLOT_BITS  # 8 uint64 keys: one cache line
_MAX_LOAD = 0.75
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
        # Secret, random odd multipliers: keys come from agents, and with fixed public
        # ones a handful of chosen keys could share both buckets at every table size,
        # forcing the table to double again and again.
        self._multipliers = np.array(
            [secrets.randbits(64) | 1, secrets.randbits(64) | 1], dtype=np.uint64
        )
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
        return ((keys[:, None] * self._multipliers) >> self._shift).view(np.intp)

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
        """Slots of `keys` (distinct), inserting the missing ones with their depth."""
        found = self.find(keys)
        if found.present.all():
            return found.slots
        missing = np.flatnonzero(~found.present)
        generation = self._generation
        if self._used + missing.size > _MAX_LOAD * self.capacity:
            self._grow(self._used + missing.size)
        new_slots = self._insert(keys[missing], depths[missing])
        if self._generation != generation:
            return self.find(keys).slots  # growing moved every key found before
        slots = found.slots.copy()
        slots[missing] = new_slots
        return slots

    def _insert(self, keys: Keys, depths: npt.NDArray[np.uint32]) -> Slots:
        """Place distinct keys known to be absent; return their slots.

        In rounds: each pending key picks the emptier of its two buckets, and the keys
        that picked the same bucket take its free slots in turn (by rank). Keys left
        over go again, when the bucket they picked has filled. A key whose two buckets
        are both full makes room by moving an occupant to its other bucket, or, when
        none can move, doubles the table.
        """
        generation = self._generation
        slots = np.empty(keys.size, dtype=np.intp)
        pending = np.arange(keys.size)
        while pending.size:
            buckets = self._buckets_of(keys[pending])
            free = self._keys.take(buckets, axis=0) == self._sentinels.take(buckets)[:, :, None]
            counts = free.sum(axis=2)
            both_full = ~counts.any(axis=1)
            if both_full.any():
                # Rare below the load limit, but a table of millions meets it: move an
                # occupant to its other bucket (cuckoo style) and put the key in its
                # place at once; double the table only when no occupant can move.
                placed_rows = []
                for row in np.flatnonzero(both_full).tolist():
                    freed = self._make_room(buckets[row].tolist())
                    if freed is None:
                        break
                    key_index = pending[row]
                    self._flat_keys[freed] = keys[key_index]
                    self._depth[freed] = depths[key_index]
                    slots[key_index] = freed
                    self._used += 1
                    placed_rows.append(row)
                stuck = len(placed_rows) < int(both_full.sum())
                pending = np.delete(pending, placed_rows)
                if stuck:
                    self._grow(self.capacity + 1)
                continue
            rows = np.arange(pending.size)
            # The emptier bucket; on a tie (always, in an empty table) a bit of the key
            # decides, so a round does not pile every key into its first bucket.
            tie_break = (keys[pending] & np.uint64(1)).astype(np.intp)
            choice = np.where(counts[:, 1] == counts[:, 0], tie_break, counts[:, 1] > counts[:, 0])
            chosen = buckets[rows, choice]
            chosen_free = free[rows, choice]
            order = np.argsort(chosen, kind="stable")
            ordered = chosen[order]
            rank = np.empty(pending.size, dtype=np.intp)
            rank[order] = rows - np.searchsorted(ordered, ordered, side="left")
            nth_free = (np.cumsum(chosen_free, axis=1) == (rank + 1)[:, None]) & chosen_free
            fits = nth_free.any(axis=1)
            claimed = chosen[fits] * BUCKET_SLOTS + nth_free[fits].argmax(axis=1)
            placed = pending[fits]
            self._flat_keys[claimed] = keys[placed]
            self._depth[claimed] = depths[placed]
            slots[placed] = claimed
            self._used += claimed.size
            pending = pending[~fits]
        if self._generation != generation:
            return self.find(keys).slots  # a growth moved the keys placed before it
        return slots

    def _make_room(self, pair: list[int]) -> int | None:
        """Move one key out of the full buckets `pair` into a free slot of its other
        bucket and return the slot it left; None if no occupant of either can move."""
        for bucket in pair:
            occupants = self._keys[bucket]
            choices = self._buckets_of(occupants)
            others = np.where(choices[:, 0] == bucket, choices[:, 1], choices[:, 0])
            free = self._keys[others] == self._sentinels[others][:, None]
            movable = np.flatnonzero(free.any(axis=1))
            if not movable.size:
                continue
            mover = int(movable[0])
            source = bucket * BUCKET_SLOTS + mover
            target = int(others[mover]) * BUCKET_SLOTS + int(free[mover].argmax())
            self._flat_keys[target] = self._flat_keys[source]
            self._depth[target] = self._depth[source]
            for tier_holders in self._holders:
                tier_holders[target] = tier_holders[source]
                tier_holders[source] = 0
            self._flat_keys[source] = self._sentinels[bucket]
            self._depth[source] = 0
            self._generation += 1  # a key moved: slots found before are stale
            return source
        return None

    def _grow(self, needed: int) -> None:
        """Reallocate with enough buckets for `needed` keys and insert them all again."""
        self._generation += 1
        occupied = self.occupied_slots()
        keys = self._flat_keys[occupied]
        depths = self._depth[occupied]
        holders = [tier_holders[occupied] for tier_holders in self._holders]
        bucket_bits = self._bucket_bits + 1
        while needed > _MAX_LOAD * BUCKET_SLOTS * (1 << bucket_bits):
            bucket_bits += 1
        self._allocate(bucket_bits)
        slots = self._insert(keys, depths)
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
