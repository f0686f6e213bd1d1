"""The embedded location index: everything in this process, nothing else to run.

Layout, chosen for the lookup walk:
- one table per tier, block key -> packed int: (mask of worker slots) << DEPTH_BITS | depth.
  Every live worker gets a slot (a bit), so one walk over the request's keys narrows
  the mask of candidate workers with a single AND per key, however many workers match.
- per worker and tier, the set of keys it holds, so dropping a worker touches only its
  own entries.
- a histogram of entries by depth, so eviction can find the deepest entries without
  sorting anything.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from router.index.base import (
    MAX_POSITION,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    IndexStats,
    KvEvent,
    PrefixMatch,
    StaleIncarnation,
    Tier,
    UnknownWorker,
    WorkerInfo,
    WorkerState,
    WorkerStatus,
)

DEPTH_BITS = 16
_DEPTH_MASK = (1 << DEPTH_BITS) - 1
_PURGE_CHUNK = 50_000  # entries dropped between two yields to the event loop
_EVICT_HEADROOM = 0.9  # evict down to this share of max_entries, so eviction is rare


@dataclass(eq=False, slots=True)
class _Worker:
    info: WorkerInfo
    slot: int
    lease_deadline: float
    draining: bool = False
    keys: dict[Tier, set[int]] = field(default_factory=lambda: {tier: set() for tier in Tier})

    @property
    def entries(self) -> int:
        return sum(len(keys) for keys in self.keys.values())


class MemoryLocationIndex:
    """LocationIndex kept in this process's memory; the default for a single router."""

    def __init__(
        self,
        *,
        max_entries: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries is not None and max_entries < 1:
            raise ValueError("max_entries must be positive")
        self._max_entries = max_entries
        self._clock = clock
        self._tables: dict[Tier, dict[int, int]] = {tier: {} for tier in Tier}
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: list[_Worker | None] = []
        self._free_slots: list[int] = []
        self._entries_at_depth = [0] * (MAX_POSITION + 1)
        self._entries = 0

    # -- workers ---------------------------------------------------------------------

    async def register(self, info: WorkerInfo, lease_s: float) -> None:
        current = self._workers.get(info.worker_id)
        if current is not None:
            if info.incarnation < current.info.incarnation:
                raise StaleIncarnation(
                    info.worker_id, info.incarnation, current.info.incarnation
                )
            if info.incarnation == current.info.incarnation and self._is_live(current):
                current.info = info
                current.lease_deadline = self._clock() + lease_s
                return
            await self._drop(current)
        worker = _Worker(info=info, slot=self._take_slot(), lease_deadline=0.0)
        worker.lease_deadline = self._clock() + lease_s
        self._slot_owner[worker.slot] = worker
        self._workers[info.worker_id] = worker

    async def renew(
        self, worker_id: str, incarnation: int, lease_s: float, *, draining: bool = False
    ) -> None:
        worker = self._live_worker(worker_id, incarnation)
        worker.lease_deadline = self._clock() + lease_s
        worker.draining = worker.draining or draining

    async def drop_worker(self, worker_id: str) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None:
            await self._drop(worker)

    async def purge_expired(self) -> list[str]:
        expired = [w for w in self._workers.values() if not self._is_live(w)]
        for worker in expired:
            await self._drop(worker)
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
        return len(self._slot_owner) - 1

    async def _drop(self, worker: _Worker) -> None:
        # Unlink first: from here on the worker scores nothing and takes no writes, so
        # its key sets stay untouched while the purge yields to other tasks.
        if self._workers.get(worker.info.worker_id) is worker:
            del self._workers[worker.info.worker_id]
        removed = 0
        for tier, keys in worker.keys.items():
            while keys:
                self._remove_entry(self._tables[tier], worker, keys.pop())
                removed += 1
                if removed % _PURGE_CHUNK == 0:
                    await asyncio.sleep(0)
        self._slot_owner[worker.slot] = None
        self._free_slots.append(worker.slot)

    # -- events ----------------------------------------------------------------------

    async def apply(self, worker_id: str, incarnation: int, events: Sequence[KvEvent]) -> None:
        worker = self._live_worker(worker_id, incarnation)
        for event in events:
            if isinstance(event, BlocksStored):
                self._store(worker, event)
            elif isinstance(event, BlocksRemoved):
                table = self._tables[event.tier]
                held = worker.keys[event.tier]
                for key in event.keys:
                    if key in held:
                        held.discard(key)
                        self._remove_entry(table, worker, key)
            elif isinstance(event, AllBlocksCleared):
                for tier, keys in worker.keys.items():
                    table = self._tables[tier]
                    while keys:
                        self._remove_entry(table, worker, keys.pop())
        if self._max_entries is not None and self._entries > self._max_entries:
            await self._evict(self._entries - int(self._max_entries * _EVICT_HEADROOM))

    def _store(self, worker: _Worker, event: BlocksStored) -> None:
        table = self._tables[event.tier]
        held = worker.keys[event.tier]
        bit = 1 << (worker.slot + DEPTH_BITS)
        entries_at_depth = self._entries_at_depth
        depth = event.first_position
        added = 0
        for key in event.keys:
            packed = table.get(key)
            if packed is None:
                table[key] = bit | min(depth, MAX_POSITION)
                entries_at_depth[min(depth, MAX_POSITION)] += 1
                held.add(key)
                added += 1
            elif not packed & bit:
                table[key] = packed | bit
                entries_at_depth[packed & _DEPTH_MASK] += 1
                held.add(key)
                added += 1
            depth += 1
        self._entries += added

    def _remove_entry(self, table: dict[int, int], worker: _Worker, key: int) -> None:
        """Clear the worker's bit on a key the caller has taken out of its key set."""
        packed = table[key]
        remaining = packed & ~(1 << (worker.slot + DEPTH_BITS))
        if remaining >> DEPTH_BITS:
            table[key] = remaining
        else:
            del table[key]
        self._entries_at_depth[packed & _DEPTH_MASK] -= 1
        self._entries -= 1

    async def _evict(self, count: int) -> None:
        """Remove at least `count` entries: dead workers' first, then the deepest."""
        count -= sum(w.entries for w in self._workers.values() if not self._is_live(w))
        await self.purge_expired()
        if count <= 0:
            return
        # The shallowest depth such that entries at it or deeper cover `count`.
        threshold, deeper = MAX_POSITION, 0
        while threshold > 0 and deeper + self._entries_at_depth[threshold] < count:
            deeper += self._entries_at_depth[threshold]
            threshold -= 1
        for tier, table in self._tables.items():
            victims = []
            for key, packed in table.items():
                if packed & _DEPTH_MASK >= threshold:
                    victims.append(key)
                    count -= (packed >> DEPTH_BITS).bit_count()
                    if count <= 0:
                        break
            for key in victims:
                for worker in self._owners(table[key]):
                    worker.keys[tier].discard(key)
                    self._remove_entry(table, worker, key)
            if count <= 0:
                return

    def _owners(self, packed: int) -> Iterable[_Worker]:
        mask = packed >> DEPTH_BITS
        while mask:
            low = mask & -mask
            owner = self._slot_owner[low.bit_length() - 1]
            if owner is not None:
                yield owner
            mask ^= low

    # -- lookups ---------------------------------------------------------------------

    async def lookup(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        now = self._clock()
        live_mask = 0
        for worker in self._workers.values():
            if worker.lease_deadline > now:
                live_mask |= 1 << worker.slot
        tables = [(tier, table) for tier, table in self._tables.items() if table]
        if not live_mask or not keys or not tables:
            return {}
        # (length, workers that matched exactly `length` blocks) pairs, as the walk
        # narrows the candidate mask.
        ends: list[tuple[int, int]] = []
        mask = live_mask
        if len(tables) == 1:
            get = tables[0][1].get
            for position, key in enumerate(keys):
                held = get(key, 0) >> DEPTH_BITS & mask
                if held != mask:
                    ends.append((position, mask ^ held))
                    mask = held
                    if not mask:
                        break
        else:
            getters = [table.get for _, table in tables]
            for position, key in enumerate(keys):
                held = 0
                for get in getters:
                    held |= get(key, 0) >> DEPTH_BITS
                held &= mask
                if held != mask:
                    ends.append((position, mask ^ held))
                    mask = held
                    if not mask:
                        break
        if mask:
            ends.append((len(keys), mask))

        matches: dict[str, PrefixMatch] = {}
        for length, workers_mask in ends:
            if length == 0:
                continue
            for worker in self._owners(workers_mask << DEPTH_BITS):
                matches[worker.info.worker_id] = PrefixMatch(
                    worker_id=worker.info.worker_id,
                    incarnation=worker.info.incarnation,
                    blocks=length,
                    by_tier=self._count_by_tier(tables, worker, keys[:length]),
                )
        return matches

    @staticmethod
    def _count_by_tier(
        tables: list[tuple[Tier, dict[int, int]]], worker: _Worker, keys: Sequence[int]
    ) -> dict[Tier, int]:
        if len(tables) == 1:
            return {tables[0][0]: len(keys)}
        counts: dict[Tier, int] = {}
        for key in keys:
            tier = next(t for t in Tier if key in worker.keys[t])
            counts[tier] = counts.get(tier, 0) + 1
        return counts

    # -- introspection ---------------------------------------------------------------

    async def stats(self) -> IndexStats:
        tables = [table for table in self._tables.values() if table]
        keys = len(tables[0]) if len(tables) == 1 else len(set().union(*tables))
        return IndexStats(
            keys=keys,
            entries=self._entries,
            workers=len(self._workers),
            bytes=self._estimate_bytes(),
        )

    def _estimate_bytes(self) -> int:
        # Container sizes are exact; the int objects are estimated at their usual size
        # (a 64-bit key: 36 bytes, a packed mask: 28 + 4 per 30 bits), not walked.
        total = sum(sys.getsizeof(table) for table in self._tables.values())
        mask_int_size = 28 + 4 * ((len(self._slot_owner) + DEPTH_BITS) // 30 + 1)
        total += sum(len(table) for table in self._tables.values()) * (36 + mask_int_size)
        for worker in self._workers.values():
            total += sum(sys.getsizeof(keys) for keys in worker.keys.values())
        return total

    async def close(self) -> None:
        return None
