"""The location index contract: which live worker holds which block, and on which tier.

Every backend (router/index/memory.py, router/index/redis.py) implements LocationIndex
and passes the one conformance suite in tests/router/index/. The index also keeps each
worker's registration, incarnation and lease, because router replicas that share a
backend must agree on who is alive.

Semantics every backend keeps:
- Fencing. Each worker has one current incarnation. register() with a higher one
  replaces the record and drops every entry of the old one; any call carrying a lower
  incarnation than the current one raises StaleIncarnation and changes nothing.
- Leases. register() and renew() set the lease to now + lease_s. Once the lease has
  run out the worker is dead: lookup() ignores it at once, workers() reports it as
  dead, and purge_expired() (or the backend's own expiry) removes it and its entries.
- Batches. apply() applies a batch's events in order, all of them or none.
- Lookups walk the request's keys from the first and, per live worker, stop at the
  first key the worker does not hold: the longest consecutive matched prefix.
- Bounded size. With max_entries, a backend evicts entries of dead workers first, then
  the deepest blocks. How exactly is the backend's: the memory index evicts globally
  by depth; Redis caps each worker at its share and evicts sampled deepest blocks.
- A worker registered through another router replica is seen by lookups within about
  a second (Redis refreshes its worker list at least that often).
- Scope generations are plain counters, shared like the registrations.

Errors. A backend raises LocationIndexError subclasses for everything its store could
not do (each backend maps its client's errors at one place), so callers catch those
alone, and any other exception (a bug) is not mistaken for an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import NamedTuple, Protocol, runtime_checkable

from kvplane.core.keys import BlockKey
from kvplane.core.types import KvEvent, Tier, WorkerInfo


class WorkerState(enum.Enum):
    LIVE = "live"
    DRAINING = "draining"
    DEAD = "dead"


MAX_POSITION = 2**16 - 1
"""Deepest block position an entry records exactly; deeper ones are stored at this
depth (only eviction order reads it)."""


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    info: WorkerInfo
    state: WorkerState
    lease_remaining_s: float
    entries: int


class PrefixMatch(NamedTuple):
    """One worker's longest consecutive matched prefix for a lookup.

    by_tier counts the matched blocks per tier; a block held on several tiers counts
    once, on its fastest. (A NamedTuple: lookups build one per matching worker, and
    this is the cheapest immutable record to build.)
    """

    worker_id: str
    incarnation: int
    blocks: int
    by_tier: Mapping[Tier, int]


_TIERS = tuple(Tier)  # fastest first; iterating the enum itself is slow


@lru_cache(maxsize=4096)
def blocks_by_tier(counts: tuple[int, ...]) -> Mapping[Tier, int]:
    """A match's blocks per tier (`counts[i]` on the i-th tier, fastest first) as
    PrefixMatch carries them; shared and read-only, since most matches repeat a few
    shapes (every block on the device tier)."""
    return MappingProxyType({_TIERS[t]: n for t, n in enumerate(counts) if n})


@dataclass(frozen=True, slots=True)
class IndexStats:
    keys: int  # distinct block keys
    entries: int  # (key, worker, tier) locations
    workers: int  # registered workers, dead ones not yet purged included
    bytes: int  # the backend's own estimate of the memory it uses
    # The fullest server's used memory over its limit (Redis: used_memory / maxmemory of
    # each primary); None where no server has a limit, or the index is in this process.
    server_memory_used: float | None = None


class LocationIndexError(Exception):
    """Base of the index's errors."""


class StaleIncarnation(LocationIndexError):
    def __init__(self, worker_id: str, incarnation: int, current: int) -> None:
        super().__init__(
            f"worker {worker_id!r}: incarnation {incarnation} is older than the current "
            f"incarnation {current}"
        )
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.current = current


class UnknownWorker(LocationIndexError):
    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker {worker_id!r} is not registered (or its lease ran out)")
        self.worker_id = worker_id


class SequenceMismatch(LocationIndexError):
    """The index does not record the batch sequence this router applied for the
    worker's incarnation: it lost writes (a Redis failover promoted a replica that had
    not received them yet), or another router applied batches of it since. Either way
    its entries cannot be vouched for: the worker must send its whole state again."""

    def __init__(self, worker_id: str, expected: int, recorded: int) -> None:
        super().__init__(
            f"worker {worker_id!r}: the index records batches up to sequence {recorded}, "
            f"this router applied up to {expected}"
        )
        self.worker_id = worker_id
        self.expected = expected
        self.recorded = recorded


class IndexUnavailable(LocationIndexError):
    """The backend cannot be reached; callers degrade (e.g. to load-only routing)."""


class IndexTimeout(IndexUnavailable):
    """No answer in time: the backend's own deadline ran out, or the caller's (see
    index_deadline)."""


@contextlib.asynccontextmanager
async def index_deadline(timeout_s: float) -> AsyncIterator[None]:
    """Give the index calls inside at most timeout_s: past it they are cancelled and
    IndexTimeout is raised, so that a caller's own deadline reaches it as one more
    LocationIndexError. A TimeoutError from inside the calls is not this deadline's and
    goes on unchanged."""
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            yield
    except TimeoutError:
        if deadline.expired():
            raise IndexTimeout(
                f"the location index gave no answer within {timeout_s:g} s"
            ) from None
        raise


@dataclass(frozen=True, slots=True)
class CounterStep:
    """One change to a tenant's virtual counter: `add`, then bring it within
    [low, high] where those are given."""

    tenant: str
    add: float
    low: float | None = None
    high: float | None = None


CounterChanges = Sequence[CounterStep]
"""One model's changes to flow control's counters since the last exchange, in order."""


@dataclass(frozen=True, slots=True)
class FlowExchanged:
    """What router replicas share for flow control, as of one exchange."""

    states: dict[str, bytes]  # router id -> the state it last put (this one's included)
    counters: dict[str, dict[str, float]]  # model -> tenant -> virtual counter


@runtime_checkable
class SharedFlowState(Protocol):
    """A store router replicas exchange flow control's state through (router/
    flow_control/shared.py): the Redis index is one; an index in one process is not."""

    async def exchange_flow(
        self,
        router_id: str,
        state: bytes,
        ttl_s: float,
        changes: Mapping[str, CounterChanges],
    ) -> FlowExchanged:
        """Put this router's `state` (kept `ttl_s` unless put again) and apply its
        counter `changes` (model -> changes), in one step; returns every live router's
        state and the counters of the models `changes` names."""


class LocationIndex(Protocol):
    async def register(self, info: WorkerInfo, lease_s: float) -> int:
        """Record a worker's incarnation and start its lease; return the highest batch
        sequence recorded for it (0 for a fresh one): where its agent resumes, through
        whichever router it reconnects to.

        The same incarnation again refreshes the lease and keeps the entries and the
        sequence (a reconnect), its lease running or run out (nothing is lost until it
        is purged: the sequence tells the agent so); a higher one drops the old
        incarnation's entries first; a lower one raises StaleIncarnation.
        """

    async def renew(
        self,
        worker_id: str,
        incarnation: int,
        lease_s: float,
        *,
        draining: bool = False,
        applied: int | None = None,
    ) -> None:
        """Extend the lease (the heartbeat); draining marks the worker as draining.

        Raises UnknownWorker when the worker is not registered or its lease already ran
        out (it must register again), StaleIncarnation for an older incarnation, and
        SequenceMismatch when `applied` (the last sequence the caller applied) is given
        and is not the one recorded. A lease_s of 0 ends the lease now.
        """

    async def apply(
        self,
        worker_id: str,
        incarnation: int,
        events: Sequence[KvEvent],
        *,
        sequence: int | None = None,
    ) -> None:
        """Apply one batch in order, whole or not at all.

        Raises UnknownWorker or StaleIncarnation (applying nothing). Removing a key the
        worker does not hold is a no-op; storing one it holds already is too. With the
        batch's `sequence` (an empty batch's too), the index records it, and raises
        SequenceMismatch (applying nothing) unless the sequence recorded was the one
        before; None writes without a sequence (tools that have no stream).
        """

    async def drop_worker(self, worker_id: str, incarnation: int | None = None) -> None:
        """Forget the worker and all its entries (no-op when unknown).

        With an incarnation, only while that is still the worker's current one: a router
        acting on an old stream must not drop the newer incarnation another router has
        registered since.
        """

    async def purge_expired(self, grace_s: float = 0.0) -> list[str]:
        """Drop every worker whose lease ran out more than `grace_s` ago; return their
        ids."""

    async def lookup(self, keys: Sequence[BlockKey]) -> dict[str, PrefixMatch]:
        """Longest consecutive prefix of `keys` per live worker that matched one block
        or more (draining workers included, dead ones never)."""

    @property
    def lookup_never_waits(self) -> bool:
        """Whether lookup() answers without waiting on anything (an index in this
        process): a deadline around it could never fire, and every request would pay
        for setting one (a timer, about 6 µs)."""

    async def workers(self) -> list[WorkerStatus]:
        """Every registered worker, dead ones not yet purged included (in no particular
        order)."""

    async def scope_generations(self) -> dict[str, int]:
        """Each cache scope's generation, for the scopes whose generation was ever
        bumped (the others are at 0). Routers derive a scope's cache salt from it."""

    async def bump_scope_generation(self, scope: str) -> int:
        """Start a new generation of `scope` and return it. Shared by every router on
        this backend: the scope's salt changes, so its old entries (and the engines'
        old blocks) are never matched again."""

    async def stats(self) -> IndexStats: ...

    async def close(self) -> None: ...
