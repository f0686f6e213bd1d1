"""Metrics and spans around any LocationIndex, so that the backends know of neither.

InstrumentedIndex is a decorator over the protocol (the llm-d kv-cache indexer's
instrumented_index.go does the same): each call goes to the backend unchanged, and
what it cost or raised is recorded on the way back.

- Every call that raises counts in `kvplane_index_errors_total{operation, error}`, the
  error by its class (StaleIncarnation and UnknownWorker included: they are how the
  index refuses; CancelledError: the caller stopped waiting, e.g. at its deadline).
- A batch applied counts its events and blocks by kind, and its time; a lookup answered,
  its time. Failed calls are in the errors only, so the latencies are those of answers.
- A call made inside a recording span (a request's `kvplane.route`) gets a child span
  `kvplane.<operation>`. Calls outside any (the agents' streams, the background loops)
  get none: each would start a trace of its own, several a second, that explains no
  request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

from opentelemetry import trace
from opentelemetry.util.types import Attributes
from prometheus_client import Counter, Histogram

from kvplane.core.keys import BlockKey
from kvplane.core.types import KvEvent, WorkerInfo
from router.index.base import IndexStats, LocationIndex, PrefixMatch, WorkerStatus
from router.tracing import Tracer

_T = TypeVar("_T")


class IndexMetrics(Protocol):
    """The series the wrapper records, as router/metrics.py's RouterMetrics has them
    (named here, not imported: router.metrics reads the index's types)."""

    @property
    def lookup_seconds(self) -> Histogram: ...

    @property
    def index_errors(self) -> Counter: ...  # labels: operation, error

    def batch_applied(self, events: Sequence[KvEvent], seconds: float) -> None: ...


class InstrumentedIndex:
    """A LocationIndex that records `metrics` and `tracer` spans for `index`'s calls."""

    def __init__(self, index: LocationIndex, metrics: IndexMetrics, tracer: Tracer) -> None:
        self._index = index
        self._metrics = metrics
        self._tracer = tracer

    async def register(self, info: WorkerInfo, lease_s: float) -> int:
        return await self._observed(
            "register", self._index.register(info, lease_s), {"kvplane.worker": info.worker_id}
        )

    async def renew(
        self,
        worker_id: str,
        incarnation: int,
        lease_s: float,
        *,
        draining: bool = False,
        applied: int | None = None,
    ) -> None:
        await self._observed(
            "renew",
            self._index.renew(worker_id, incarnation, lease_s, draining=draining, applied=applied),
            {"kvplane.worker": worker_id},
        )

    async def apply(
        self,
        worker_id: str,
        incarnation: int,
        events: Sequence[KvEvent],
        *,
        sequence: int | None = None,
    ) -> None:
        started = time.perf_counter()
        await self._observed(
            "apply",
            self._index.apply(worker_id, incarnation, events, sequence=sequence),
            {"kvplane.worker": worker_id, "kvplane.events": len(events)},
        )
        if events:  # an empty batch only records its sequence
            self._metrics.batch_applied(events, time.perf_counter() - started)

    async def drop_worker(self, worker_id: str, incarnation: int | None = None) -> None:
        await self._observed(
            "drop_worker",
            self._index.drop_worker(worker_id, incarnation),
            {"kvplane.worker": worker_id},
        )

    async def purge_expired(self, grace_s: float = 0.0) -> list[str]:
        return await self._observed("purge_expired", self._index.purge_expired(grace_s))

    async def lookup(self, keys: Sequence[BlockKey]) -> dict[str, PrefixMatch]:
        started = time.perf_counter()
        matches = await self._observed(
            "lookup", self._index.lookup(keys), {"kvplane.blocks": len(keys)}
        )
        self._metrics.lookup_seconds.observe(time.perf_counter() - started)
        return matches

    @property
    def lookup_never_waits(self) -> bool:
        return self._index.lookup_never_waits

    async def workers(self) -> list[WorkerStatus]:
        return await self._observed("workers", self._index.workers())

    async def scope_generations(self) -> dict[str, int]:
        return await self._observed("scope_generations", self._index.scope_generations())

    async def bump_scope_generation(self, scope: str) -> int:
        return await self._observed(
            "bump_scope_generation", self._index.bump_scope_generation(scope)
        )

    async def stats(self) -> IndexStats:
        return await self._observed("stats", self._index.stats())

    async def close(self) -> None:
        await self._index.close()

    async def _observed(
        self, operation: str, call: Awaitable[_T], attributes: Attributes = None
    ) -> _T:
        """`call`'s result; what it raised is counted, and raised unchanged."""
        try:
            if not trace.get_current_span().is_recording():
                return await call
            with self._tracer.start_as_current_span(f"kvplane.{operation}", attributes=attributes):
                return await call
        except BaseException as error:  # counted and raised again, whatever it is
            self._metrics.index_errors.labels(operation=operation, error=type(error).__name__).inc()
            raise
