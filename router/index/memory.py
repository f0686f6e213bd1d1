"""The embedded location index: everything in this process, nothing else to run.

Storage is a LocationTable (_table.c): block key -> the worker slots holding it, per
tier, and the block's depth. Every registered worker owns a slot; this module decides
who is alive (leases, incarnations), turns event batches into the table's runs and
evicts when over budget.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.core.clock import Clock
from kvplane.core.types import (
    MAX_CHAIN_END,
    AllBlocksCleared,
    BlocksStored,
    KvEvent,
    Tier,
    WorkerInfo,
)
from router.index._table import MAX_SLOT, RUN_CLEAR, RUN_REMOVE, RUN_STORE, LocationTable
from router.index.base import (
    IndexStats,
    LocationIndexError,
    PrefixMatch,
    SequenceMismatch,
    StaleIncarnation,
    UnknownWorker,
    WorkerState,
    WorkerStatus,
    blocks_by_tier,
)

_TIERS = list(Tier)  # table tier i is _TIERS[i]; fastest first
_TIER_INDEX = {tier: index for index, tier in enumerate(_TIERS)}
_EVICT_HEADROOM = 0.9  # evict down to this share of max_entries, so eviction is rare


@dataclass(eq=False, slots=True)
class _Worker:
    info: WorkerInfo
    slot: int
    lease_deadline: float
    draining: bool = False
    applied: int = 0  # the last batch sequence applied for info.incarnation


@dataclass(frozen=True, slots=True)
class _Live:
    """The live workers by slot, valid until the first lease runs out."""

    names: list[tuple[str, int] | None]  # by slot: (worker id, incarnation); None: not live
    valid_until: float
    empty: bool  # no worker is live


def _as_list(keys: Sequence[int]) -> list[int]:
    """Keys as the table takes them: a list (most already are one: not copied again)."""
    return keys if isinstance(keys, list) else list(keys)


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
        # A secret seed: keys come from agents, and with a known one a handful of chosen
        # keys could share one cluster of the table.
        self._table = LocationTable(
            len(_TIERS), secrets.randbits(64), match=PrefixMatch, by_tier=blocks_by_tier
        )
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: list[_Worker | None] = []
        self._free_slots: list[int] = []
        self._live: _Live | None = None
        self._scope_generations: dict[str, int] = {}

    # -- workers ---------------------------------------------------------------------

    async def register(self, info: WorkerInfo, lease_s: float) -> int:
        current = self._workers.get(info.worker_id)
        if current is not None:
            if info.incarnation < current.info.incarnation:
                raise StaleIncarnation(info.worker_id, info.incarnation, current.info.incarnation)
            if info.incarnation == current.info.incarnation:  # until purged: see base.py
                current.info = info
                current.lease_deadline = self._clock() + lease_s
                self._live = None
                return current.applied
            self._drop(current)
        elif not self._free_slots and len(self._slot_owner) > MAX_SLOT:
            raise LocationIndexError(
                f"the in-memory index holds at most {MAX_SLOT + 1} workers at once; "
                f"worker {info.worker_id!r} was not registered"
            )
        worker = _Worker(info=info, slot=self._take_slot(), lease_deadline=self._clock() + lease_s)
        self._slot_owner[worker.slot] = worker
        self._workers[info.worker_id] = worker
        self._live = None
        return 0

    async def renew(
        self,
        worker_id: str,
        incarnation: int,
        lease_s: float,
        *,
        draining: bool = False,
        applied: int | None = None,
    ) -> None:
        worker = self._live_worker(worker_id, incarnation)
        if applied is not None and applied != worker.applied:
            raise SequenceMismatch(worker_id, applied, worker.applied)
        worker.lease_deadline = self._clock() + lease_s
        worker.draining = worker.draining or draining
        # A heartbeat leaves the live view as it is (in a large fleet, one arrives before
        # almost every lookup, and rebuilding the view costs a step per worker): a
        # worker in it whose lease now ends no sooner than the view expires changes
        # nothing the view says. (Draining workers are looked up like the others.)
        live = self._live
        if (
            live is None
            or live.names[worker.slot] is None
            or worker.lease_deadline < live.valid_until
        ):
            self._live = None

    async def drop_worker(self, worker_id: str, incarnation: int | None = None) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None and incarnation in (None, worker.info.incarnation):
            self._drop(worker)

    async def purge_expired(self, grace_s: float = 0.0) -> list[str]:
        now = self._clock()
        expired = [w for w in self._workers.values() if w.lease_deadline + grace_s <= now]
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
                entries=self._table.slot_entries(w.slot),
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

    def _drop(self, worker: _Worker) -> None:
        if self._workers.get(worker.info.worker_id) is worker:
            del self._workers[worker.info.worker_id]
        self._table.clear(worker.slot)
        self._slot_owner[worker.slot] = None
        self._free_slots.append(worker.slot)
        self._live = None

    def _live_view(self) -> _Live:
        now = self._clock()
        if self._live is not None and now < self._live.valid_until:
            return self._live
        live = [w for w in self._workers.values() if w.lease_deadline > now]
        valid_until = min((w.lease_deadline for w in live), default=float("inf"))
        names: list[tuple[str, int] | None] = [None] * len(self._slot_owner)
        for worker in live:
            names[worker.slot] = (worker.info.worker_id, worker.info.incarnation)
        self._live = _Live(names, valid_until, not live)
        return self._live

    # -- events ----------------------------------------------------------------------

    async def apply(
        self,
        worker_id: str,
        incarnation: int,
        events: Sequence[KvEvent],
        *,
        sequence: int | None = None,
    ) -> None:
        worker = self._live_worker(worker_id, incarnation)
        if sequence is not None and sequence - 1 != worker.applied:
            raise SequenceMismatch(worker_id, sequence - 1, worker.applied)
        # The table checks every run's keys before it applies the first: all or nothing.
        self._table.apply(worker.slot, self._runs(events))
        if sequence is not None:
            worker.applied = sequence
        if self._max_entries is not None and self._table.entries > self._max_entries:
            await self._evict(self._table.entries - int(self._max_entries * _EVICT_HEADROOM))

    @staticmethod
    def _runs(events: Sequence[KvEvent]) -> list[tuple[int, int, list[int], int]]:
        """The batch as the table's runs: (kind, tier, keys, first position)."""
        runs: list[tuple[int, int, list[int], int]] = []
        for event in events:
            if isinstance(event, AllBlocksCleared):
                runs.append((RUN_CLEAR, 0, [], 0))
            elif isinstance(event, BlocksStored):
                first = event.first_position
                if not 0 <= first <= MAX_CHAIN_END - len(event.keys):
                    raise ValueError(f"first_position {first} is outside 0..{MAX_CHAIN_END}")
                runs.append((RUN_STORE, _TIER_INDEX[event.tier], _as_list(event.keys), first))
            else:
                runs.append((RUN_REMOVE, _TIER_INDEX[event.tier], _as_list(event.keys), 0))
        return runs

    async def _evict(self, count: int) -> None:
        """Remove at least `count` entries: dead workers' first, then the deepest."""
        dead = [w for w in self._workers.values() if not self._is_live(w)]
        count -= sum(self._table.slot_entries(w.slot) for w in dead)
        await self.purge_expired()
        if count > 0:
            self._table.evict_deepest(count)

    # -- lookups ---------------------------------------------------------------------

    @property
    def lookup_never_waits(self) -> bool:
        # Its own lookup awaits nothing; a subclass's may (a test's stuck index).
        return type(self).lookup is MemoryLocationIndex.lookup

    async def lookup(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        live = self._live_view()
        if not keys or live.empty:
            return {}
        # The table builds the PrefixMatch records itself (see __init__).
        return self._table.lookup(_as_list(keys), live.names)

    # -- introspection ---------------------------------------------------------------

    async def stats(self) -> IndexStats:
        return IndexStats(
            keys=self._table.keys,
            entries=self._table.entries,
            workers=len(self._workers),
            bytes=self._table.nbytes,
        )

    async def scope_generations(self) -> dict[str, int]:
        return dict(self._scope_generations)

    async def bump_scope_generation(self, scope: str) -> int:
        generation = self._scope_generations.get(scope, 0) + 1
        self._scope_generations[scope] = generation
        return generation

    async def close(self) -> None:
        return None
