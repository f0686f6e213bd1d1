"""This router's view of the workers whose agents connect to it.

The location index is the authority on registrations, leases and entries (router
replicas that share a backend agree through it). What only this router knows lives
here: the highest sequence applied per incarnation (so a reconnecting agent learns
where to resume), which stream currently speaks for a worker, and the last load and
event times, for metrics and routing.

All times are seconds on the router's clock (kvplane/core/clock.py), which the caller
reads and passes in, except LoadReport.timestamp_ms (agent wall clock).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvplane.core.types import LoadReport, WorkerInfo
from router.index.base import WorkerState

DEAD_RETENTION_LEASES = 12
"""How long (in leases) a dead worker stays in the view, so that a late Register with
the incarnation that died is still recognised as stale, before it is forgotten."""


@dataclass(slots=True)
class WorkerRecord:
    info: WorkerInfo
    state: WorkerState
    applied: int  # highest sequence applied for info.incarnation
    lease_deadline: float  # this router's estimate of the index's lease
    renewed_at: float  # last register or renew this router sent to the index
    stream: int | None  # id of the stream that speaks for the worker; None: disconnected
    last_event_at: float | None = None
    last_heartbeat_at: float | None = None
    last_load: LoadReport | None = None
    dead_since: float | None = None

    @property
    def incarnation(self) -> int:
        return self.info.incarnation


class RegisterVerdict(enum.Enum):
    NEW = "new"  # an incarnation this router holds nothing for
    RECONNECT = "reconnect"  # the incarnation this router knows
    STALE = "stale"  # a higher incarnation is known: Reject


def classify_register(record: WorkerRecord | None, incarnation: int) -> RegisterVerdict:
    """Whether a reconnect kept its entries is the index's to say, not this view's (the
    sequence its register returns: 0 when its lease ran out and they went): the worker
    may have renewed its lease through another router since this one last saw it."""
    if record is None or incarnation > record.incarnation:
        return RegisterVerdict.NEW
    if incarnation < record.incarnation:
        return RegisterVerdict.STALE
    return RegisterVerdict.RECONNECT


def needs_renewal(record: WorkerRecord, now: float, lease_s: float) -> bool:
    """Whether a KvEvents batch or a Load should also renew the lease: either counts as
    liveness, but renewing on every one would double the index writes (a quarter lease
    apart leaves three reports' margin at the agent's default interval)."""
    return now - record.renewed_at >= lease_s / 4


class WorkerView:
    """Records by worker id. Methods that take an incarnation ignore calls for any
    other than the recorded one: a slow stream of an older incarnation must not
    overwrite what a newer one did meanwhile.

    The workers whose record changed in a way routing reads (incarnation, state, load)
    are noted until `take_changed()`: the router's WorkerPool re-reads only those."""

    def __init__(self) -> None:
        self._records: dict[str, WorkerRecord] = {}
        self._changed: set[str] = set()

    def take_changed(self) -> set[str]:
        """The workers whose record changed since the last call (one reader only)."""
        changed, self._changed = self._changed, set()
        return changed

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._records.get(worker_id)

    def records(self) -> list[WorkerRecord]:
        """Copies, so callers can read them across awaits."""
        return [replace(record) for record in self._records.values()]

    def counts_by_state(self) -> dict[WorkerState, int]:
        counts = Counter(record.state for record in self._records.values())
        return {state: counts[state] for state in WorkerState}

    def registered(
        self, info: WorkerInfo, *, stream: int, now: float, lease_s: float, applied: int
    ) -> WorkerRecord:
        """The index accepted `info`, and records batches up to `applied` for it;
        `stream` now speaks for the worker."""
        self._changed.add(info.worker_id)
        record = self._records.get(info.worker_id)
        if record is None or record.incarnation != info.incarnation:
            record = WorkerRecord(
                info=info,
                state=WorkerState.LIVE,
                applied=applied,
                lease_deadline=now + lease_s,
                renewed_at=now,
                stream=stream,
            )
            self._records[info.worker_id] = record
            return record
        record.applied = applied
        record.info = info
        if record.state is WorkerState.DEAD:  # the index holds it again, from `applied`
            record.state, record.dead_since = WorkerState.LIVE, None
        record.lease_deadline = now + lease_s
        record.renewed_at = now
        record.stream = stream
        return record

    def applied(
        self, worker_id: str, incarnation: int, sequence: int, events_at: float | None
    ) -> None:
        """Batches up to `sequence` are applied; `events_at` is now, or None for a batch
        that carried no event."""
        record = self._current(worker_id, incarnation)
        if record is not None:
            record.applied = max(record.applied, sequence)
            if events_at is not None:
                record.last_event_at = events_at

    def renewed(
        self, worker_id: str, incarnation: int, *, now: float, lease_s: float, draining: bool
    ) -> None:
        record = self._current(worker_id, incarnation)
        if record is not None:
            record.lease_deadline = now + lease_s
            record.renewed_at = now
            self._changed.add(worker_id)
            if draining:
                record.state = WorkerState.DRAINING
            elif record.state is WorkerState.DEAD:
                # The index renewed a lease this router had guessed ran out.
                record.state = WorkerState.LIVE
                record.dead_since = None

    def load(self, worker_id: str, incarnation: int, report: LoadReport, now: float) -> None:
        record = self._current(worker_id, incarnation)
        if record is not None:
            record.last_load = report
            record.last_heartbeat_at = now
            self._changed.add(worker_id)

    def dead(self, worker_id: str, now: float) -> None:
        """The worker's entries are gone (dropped, purged or expired)."""
        record = self._records.get(worker_id)
        if record is not None and record.state is not WorkerState.DEAD:
            record.state = WorkerState.DEAD
            record.dead_since = now
            self._changed.add(worker_id)

    def disconnected(self, worker_id: str, stream: int) -> None:
        record = self._records.get(worker_id)
        if record is not None and record.stream == stream:
            record.stream = None

    def sweep(self, purged: Iterable[str], now: float, lease_s: float) -> None:
        """Mark purged and expired workers dead, and forget long-dead ones."""
        for worker_id in purged:
            self.dead(worker_id, now)
        for record in list(self._records.values()):
            if record.state is not WorkerState.DEAD and record.lease_deadline <= now:
                self.dead(record.info.worker_id, now)
        forget_before = now - DEAD_RETENTION_LEASES * lease_s
        for worker_id, record in list(self._records.items()):
            if record.dead_since is not None and record.dead_since < forget_before:
                del self._records[worker_id]
                self._changed.add(worker_id)

    def _current(self, worker_id: str, incarnation: int) -> WorkerRecord | None:
        record = self._records.get(worker_id)
        if record is None or record.incarnation != incarnation:
            return None
        return record
