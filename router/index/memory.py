"""The embedded location index: everything in this process, nothing else to run.

Storage is a BlockTable (block_table.py): one row per distinct block key, with a bit per
worker slot per tier. Every registered worker owns a slot; this module decides who is
alive (leases, incarnations), applies event batches and evicts when over budget.

A lookup ANDs the holder masks of the request's keys cumulatively: the first key where
a worker's bit drops out is where its consecutive prefix ends, for all workers at once.
"""

from __future__ import annotations

import array
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from kvplane.core.clock import Clock
from kvplane.core.types import (
    MAX_CHAIN_END,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    Tier,
    WorkerInfo,
)
from router.index.base import (
    MAX_POSITION,
    IndexStats,
    PrefixMatch,
    StaleIncarnation,
    UnknownWorker,
    WorkerState,
    WorkerStatus,
)
from router.index.block_table import BlockTable, Masks, Slots

_TIERS = list(Tier)  # table tier i is _TIERS[i]; fastest first
_EVICT_HEADROOM = 0.9  # evict down to this share of max_entries, so eviction is rare


@dataclass(eq=False, slots=True)
class _Worker:
    info: WorkerInfo
    slot: int
    lease_deadline: float
    draining: bool = False
    entries: int = 0
    word: int = field(init=False)
    bit: np.uint64 = field(init=False)

    def __post_init__(self) -> None:
        self.word, bit = divmod(self.slot, 64)
        self.bit = np.uint64(1 << bit)


@dataclass(frozen=True, slots=True)
class _Live:
    """The live workers and their slot mask, valid until the first lease runs out."""

    workers: dict[int, _Worker]  # by slot
    names: dict[int, tuple[str, int]]  # by slot: (worker id, incarnation), for results
    mask: Masks  # (words,) uint64
    valid_until: float


Keys = npt.NDArray[np.uint64]
Depths = npt.NDArray[np.uint32]
_NO_DEPTHS: Depths = np.zeros(0, dtype=np.uint32)

# A run of a batch, converted to arrays: (kind, tier index, keys, depths).
_Prepared = tuple[type[KvEvent], int, Keys, Depths]


def _as_keys(keys: Sequence[int]) -> Keys:
    try:
        # array('Q') refuses anything but ints in range (numpy would parse "7" and
        # truncate 7.5), and is the fastest way from a list of ints to a buffer.
        return np.frombuffer(array.array("Q", keys), dtype=np.uint64)
    except (OverflowError, TypeError):
        raise ValueError("block keys must be unsigned 64-bit integers") from None


class MemoryLocationIndex:
    """LocationIndex kept in this process's memory; the default for a single router."""

    def __init__(
        self,
        *,
        max_entries: int | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if max_entries is not None and max_entries < 1:
            raise ValueError("max_entries must be positive")
        self._max_entries = max_entries
        self._clock = clock
        self._table = BlockTable(len(_TIERS))
        self._tier_entries = [0] * len(_TIERS)
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: list[_Worker | None] = []
        self._free_slots: list[int] = []
        self._live: _Live | None = None
        self._scope_generations: dict[str, int] = {}

    # -- workers ---------------------------------------------------------------------

    async def register(self, info: WorkerInfo, lease_s: float) -> None:
        current = self._workers.get(info.worker_id)
        if current is not None:
            if info.incarnation < current.info.incarnation:
                raise StaleIncarnation(info.worker_id, info.incarnation, current.info.incarnation)
            if info.incarnation == current.info.incarnation and self._is_live(current):
                current.info = info
                current.lease_deadline = self._clock() + lease_s
                self._live = None
                return
            self._drop(current)
        worker = _Worker(info=info, slot=self._take_slot(), lease_deadline=self._clock() + lease_s)
        self._slot_owner[worker.slot] = worker
        self._workers[info.worker_id] = worker
        self._live = None

    async def renew(
        self, worker_id: str, incarnation: int, lease_s: float, *, draining: bool = False
    ) -> None:
        worker = self._live_worker(worker_id, incarnation)
        worker.lease_deadline = self._clock() + lease_s
        worker.draining = worker.draining or draining
        self._live = None

    async def drop_worker(self, worker_id: str, incarnation: int | None = None) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None and incarnation in (None, worker.info.incarnation):
            self._drop(worker)

    async def purge_expired(self) -> list[str]:
        expired = [w for w in self._workers.values() if not self._is_live(w)]
        for worker in expired:
            self._drop(worker)
        return [w.info.worker_id for w in expired]

    async def workers(self) -> list[WorkerStatus]:
        now = self._clock()
        return [
            WorkerStatus(
                info=w.info,
                state=self._state(w, now),
                lease_remaining_s=max(0.0, w.lease_deadline - now),
                entries=w.entries,
            )
            for w in self._workers.values()
        ]

    def _is_live(self, worker: _Worker) -> bool:
        return worker.lease_deadline > self._clock()

    @staticmethod
    def _state(worker: _Worker, now: float) -> WorkerState:
        if worker.lease_deadline <= now:
            return WorkerState.DEAD
        return WorkerState.DRAINING if worker.draining else WorkerState.LIVE

    def _live_worker(self, worker_id: str, incarnation: int) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(worker_id)
        if incarnation < worker.info.incarnation:
            raise StaleIncarnation(worker_id, incarnation, worker.info.incarnation)
        if incarnation > worker.info.incarnation or not self._is_live(worker):
            raise UnknownWorker(worker_id)
        return worker

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._slot_owner.append(None)
        self._table.ensure_worker_slots(len(self._slot_owner))
        return len(self._slot_owner) - 1

    def _drop(self, worker: _Worker) -> None:
        if self._workers.get(worker.info.worker_id) is worker:
            del self._workers[worker.info.worker_id]
        self._clear(worker)
        self._slot_owner[worker.slot] = None
        self._free_slots.append(worker.slot)
        self._live = None

    def _live_view(self) -> _Live:
        now = self._clock()
        if self._live is not None and now < self._live.valid_until:
            return self._live
        live = {w.slot: w for w in self._workers.values() if w.lease_deadline > now}
        mask = np.zeros(self._table.words, dtype=np.uint64)
        for worker in live.values():
            mask[worker.word] |= worker.bit
        valid_until = min((w.lease_deadline for w in live.values()), default=float("inf"))
        names = {slot: (w.info.worker_id, w.info.incarnation) for slot, w in live.items()}
        self._live = _Live(live, names, mask, valid_until)
        return self._live

    # -- events ----------------------------------------------------------------------

    async def apply(self, worker_id: str, incarnation: int, events: Sequence[KvEvent]) -> None:
        worker = self._live_worker(worker_id, incarnation)
        for kind, tier, keys, depths in self._prepare(events):
            if kind is BlocksStored:
                self._store(worker, tier, keys, depths)
            elif kind is BlocksRemoved:
                self._remove(worker, tier, keys)
            else:
                self._clear(worker)
        if self._max_entries is not None and self._entries() > self._max_entries:
            await self._evict(self._entries() - int(self._max_entries * _EVICT_HEADROOM))

    @staticmethod
    def _prepare(events: Sequence[KvEvent]) -> list[_Prepared]:
        """Convert a batch to arrays (failing before anything is applied), merging
        consecutive events of the same kind and tier into one run: the table's cost is
        per call, not per key, and runs keep the batch's order where it matters. Keys
        within a run are made distinct (the first occurrence's depth wins)."""
        runs: list[tuple[type[KvEvent], int, list[int], list[int]]] = []
        for event in events:
            if isinstance(event, AllBlocksCleared):
                runs.append((AllBlocksCleared, 0, [], []))
                continue
            kind, tier = type(event), _TIERS.index(event.tier)
            if not runs or runs[-1][0] is not kind or runs[-1][1] != tier:
                runs.append((kind, tier, [], []))
            runs[-1][2].extend(event.keys)
            if isinstance(event, BlocksStored):
                first = event.first_position
                if not 0 <= first <= MAX_CHAIN_END - len(event.keys):
                    raise ValueError(f"first_position {first} is outside 0..{MAX_CHAIN_END}")
                runs[-1][3].extend(range(first, first + len(event.keys)))
        prepared: list[_Prepared] = []
        for run_kind, run_tier, keys, positions in runs:
            if run_kind is BlocksStored:
                # Later duplicates overwrite earlier ones, so reversing keeps the first.
                first_positions = dict(zip(reversed(keys), reversed(positions), strict=True))
                depths = np.minimum(
                    np.fromiter(first_positions.values(), np.int64, len(first_positions)),
                    MAX_POSITION,
                ).astype(np.uint32)
                prepared.append((run_kind, run_tier, _as_keys(list(first_positions)), depths))
            else:
                distinct = _as_keys(list(dict.fromkeys(keys)))
                prepared.append((run_kind, run_tier, distinct, _NO_DEPTHS))
        return prepared

    def _store(
        self,
        worker: _Worker,
        tier: int,
        keys: npt.NDArray[np.uint64],
        depths: npt.NDArray[np.uint32],
    ) -> None:
        if not keys.size:
            return
        slots = self._table.find_or_insert(keys, depths)
        holders = self._table.holders(tier)  # after the insert: growing replaces it
        new = slots[(holders[slots, worker.word] & worker.bit) == 0]
        holders[new, worker.word] |= worker.bit
        worker.entries += new.size
        self._tier_entries[tier] += new.size

    def _remove(self, worker: _Worker, tier: int, keys: npt.NDArray[np.uint64]) -> None:
        found = self._table.find(keys)
        holders = self._table.holders(tier)
        slots = found.slots[found.present]
        slots = slots[(holders[slots, worker.word] & worker.bit) != 0]
        self._release(worker, tier, slots)

    def _clear(self, worker: _Worker) -> None:
        for tier in range(len(_TIERS)):
            if self._tier_entries[tier]:
                holders = self._table.holders(tier)
                self._release(worker, tier, np.flatnonzero(holders[:, worker.word] & worker.bit))

    def _release(self, worker: _Worker, tier: int, slots: Slots) -> None:
        """Clear the worker's bit on `slots` (which it holds) and free emptied rows."""
        self._table.holders(tier)[slots, worker.word] &= ~worker.bit
        worker.entries -= slots.size
        self._tier_entries[tier] -= slots.size
        self._table.release_unheld(slots)

    def _entries(self) -> int:
        return sum(self._tier_entries)

    async def _evict(self, count: int) -> None:
        """Remove at least `count` entries: dead workers' first, then the deepest."""
        count -= sum(w.entries for w in self._workers.values() if not self._is_live(w))
        await self.purge_expired()
        if count <= 0:
            return
        occupied = self._table.occupied_slots()
        per_slot = np.zeros(occupied.size, dtype=np.int64)
        for tier in range(len(_TIERS)):
            if self._tier_entries[tier]:
                per_slot += np.bitwise_count(self._table.holders(tier)[occupied]).sum(
                    axis=1, dtype=np.int64
                )
        depth = self._table.depth(occupied)
        # Entries at each depth, then the shallowest depth whose deeper entries cover count.
        at_depth = np.bincount(depth, weights=per_slot)
        deeper_or_equal = np.cumsum(at_depth[::-1])[::-1]
        threshold = int(np.flatnonzero(deeper_or_equal >= count).max(initial=0))
        victims = occupied[depth > threshold]
        taken = int(per_slot[depth > threshold].sum())
        if taken < count:  # take what is missing from the threshold depth itself
            at_threshold = np.flatnonzero(depth == threshold)
            enough = np.searchsorted(np.cumsum(per_slot[at_threshold]), count - taken) + 1
            victims = np.concatenate([victims, occupied[at_threshold[:enough]]])
        for worker in self._slot_owner:
            if worker is None:
                continue
            for tier in range(len(_TIERS)):
                if self._tier_entries[tier]:
                    holders = self._table.holders(tier)
                    held = victims[(holders[victims, worker.word] & worker.bit) != 0]
                    self._release(worker, tier, held)

    # -- lookups ---------------------------------------------------------------------

    async def lookup(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        live = self._live_view()
        tiers = [t for t in range(len(_TIERS)) if self._tier_entries[t]]
        if not live.workers or not len(keys) or not tiers:
            return {}
        found = self._table.find(_as_keys(keys))
        held = self._table.holders(tiers[0]).take(found.slots, axis=0)
        for tier in tiers[1:]:
            held |= self._table.holders(tier).take(found.slots, axis=0)
        held &= live.mask
        held[~found.present] = 0
        # Row i: the live workers holding keys 0..i. A worker's prefix ends at the first
        # row its bit is missing from; rows where nothing drops out are skipped.
        still = np.bitwise_and.accumulate(held, axis=0)
        lengths = (np.flatnonzero((still[1:] != still[:-1]).any(axis=1)) + 1).tolist()
        groups = [(length, still[length - 1] & ~still[length]) for length in lengths]
        if still[-1].any():
            groups.append((len(keys), still[-1]))
        matches: dict[str, PrefixMatch] = {}
        for length, ended in groups:
            ended_slots = np.flatnonzero(np.unpackbits(ended.view(np.uint8), bitorder="little"))
            if len(tiers) == 1:
                counts = MappingProxyType({_TIERS[tiers[0]]: length})  # shared, read-only
                for slot in ended_slots.tolist():
                    worker_id, incarnation = live.names[slot]
                    matches[worker_id] = PrefixMatch(worker_id, incarnation, length, counts)
            else:
                for slot in ended_slots.tolist():
                    worker = live.workers[slot]
                    by_tier = self._count_by_tier(worker, tiers, found.slots[:length])
                    worker_id, incarnation = live.names[slot]
                    matches[worker_id] = PrefixMatch(worker_id, incarnation, length, by_tier)
        return matches

    def _count_by_tier(self, worker: _Worker, tiers: list[int], slots: Slots) -> dict[Tier, int]:
        counts: dict[Tier, int] = {}
        counted = np.zeros(slots.size, dtype=np.bool_)
        for tier in tiers:  # fastest first: a block counts once, on its fastest tier
            on_tier = (self._table.holders(tier)[slots, worker.word] & worker.bit) != 0
            fresh = on_tier & ~counted
            if fresh.any():
                counts[_TIERS[tier]] = int(fresh.sum())
            counted |= on_tier
        return counts

    # -- introspection ---------------------------------------------------------------

    async def stats(self) -> IndexStats:
        return IndexStats(
            keys=self._table.used,
            entries=self._entries(),
            workers=len(self._workers),
            bytes=self._table.nbytes(),
        )

    async def scope_generations(self) -> dict[str, int]:
        return dict(self._scope_generations)

    async def bump_scope_generation(self, scope: str) -> int:
        generation = self._scope_generations.get(scope, 0) + 1
        self._scope_generations[scope] = generation
        return generation

    async def close(self) -> None:
        return None
