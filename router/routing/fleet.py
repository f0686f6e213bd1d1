"""The router's picture of its workers, for routing and for the fleet API.

Three sources, each the authority on something:
- the location index: who is registered, their incarnation, address, model, labels,
  and lease (shared by every router replica; re-read every `refresh_s`);
- this router's WorkerView: the load reports of agents streaming to this router,
  engine-down flags, drains, deaths seen before the next re-read;
- this router's own traffic: requests in flight to each worker, and the prefill work
  of those still waiting for their first byte (load reports lag by up to a second).
Operators' drains and connection failures are kept here too (this router's only).

While the index does not answer, the last registry read stands: no agent can renew
its lease then, and the view's guesses that leases ran out must not stop routing to a
healthy fleet (a worker that really died costs a failover, not a failed request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from kvplane.core.clock import Clock
from kvplane.core.types import LoadReport, WorkerInfo
from router.control_plane.workers import WorkerView
from router.index.base import (
    LocationIndex,
    LocationIndexError,
    WorkerState,
    WorkerStatus,
    index_deadline,
)

log = logging.getLogger(__name__)

REGISTRY_STALE_S = 1.0
"""A registry read older than this means the index is not answering."""


@dataclass(slots=True, eq=False)  # hashed by identity: one per request
class Ticket:
    """One request this router sent to a worker, until it ends."""

    worker_id: str
    tenant: str
    prefill_tokens: int  # uncached prompt tokens: the worker's prefill work for it
    sent_at: float  # on the fleet's clock
    streamed: bool = True
    prefilling: bool = True  # until the first byte comes back (see Fleet.candidates)


@dataclass(slots=True)
class WorkerTraffic:
    in_flight: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens of requests before their first byte
    by_tenant: Counter[str] = field(default_factory=Counter)
    waiting_for_first_byte: set[Ticket] = field(default_factory=set)
    unstreamed: deque[Ticket] = field(default_factory=deque)  # in the order sent

    @property
    def prefilling(self) -> int:
        return len(self.waiting_for_first_byte)

    def prefilling_sent_after(self, moment: float) -> int:
        """Requests before their first byte that were sent after `moment`."""
        return sum(1 for ticket in self.waiting_for_first_byte if ticket.sent_at > moment)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker requests can be sent to now, with what the router knows of its load."""

    info: WorkerInfo
    load: LoadReport | None  # the last report this router received; None: none here
    load_received_at: float | None  # on the fleet's clock
    traffic: WorkerTraffic

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class Fleet:
    def __init__(
        self,
        index: LocationIndex,
        view: WorkerView,
        *,
        unreachable_backoff_s: float,
        clock: Clock = time.monotonic,
    ) -> None:
        self._index = index
        self._view = view
        self._clock = clock
        self._backoff_s = unreachable_backoff_s
        self._statuses: dict[str, WorkerStatus] = {}
        self._traffic: dict[str, WorkerTraffic] = {}
        self._unreachable_until: dict[str, float] = {}
        self.drained: set[str] = set()  # by an operator, through this router
        self.refreshed_at: float | None = None

    # -- the registry --------------------------------------------------------------

    async def refresh(self) -> None:
        """Re-read the registry; on failure keep the last one (routing goes on with it)."""
        statuses = await self._index.workers()
        self._statuses = {status.info.worker_id: status for status in statuses}
        self.refreshed_at = self._clock()

    async def refresh_forever(self, period_s: float, timeout_s: float) -> None:
        while True:
            try:
                async with index_deadline(timeout_s):
                    await self.refresh()
            except LocationIndexError as error:  # the index is down: keep the last picture
                log.debug("worker registry refresh failed (%s)", type(error).__name__)
            except Exception:  # a task's edge: a bug raised further is never seen, so log it
                log.exception("worker registry refresh failed")
            await asyncio.sleep(period_s)

    def statuses(self) -> list[WorkerStatus]:
        return list(self._statuses.values())

    def status(self, worker_id: str) -> WorkerStatus | None:
        return self._statuses.get(worker_id)

    def models(self) -> list[str]:
        return sorted({candidate.info.model for candidate in self.candidates()})

    def registry_is_current(self) -> bool:
        return (
            self.refreshed_at is not None and self._clock() - self.refreshed_at < REGISTRY_STALE_S
        )

    def candidates(self, model: str | None = None) -> list[Candidate]:
        """Workers to route to: live in the index and in this router's view, not
        drained, engine up, not refusing connections lately; for `model` if given."""
        now = self._clock()
        trust_view = self.registry_is_current()
        chosen = []
        for worker_id, status in self._statuses.items():
            if status.state is not WorkerState.LIVE or worker_id in self.drained:
                continue
            if model is not None and status.info.model != model:
                continue
            if self._unreachable_until.get(worker_id, 0.0) > now:
                continue
            record = self._view.get(worker_id)
            load, received_at = None, None
            traffic = self.traffic(worker_id)
            if record is not None and record.incarnation == status.info.incarnation:
                if record.state is not WorkerState.LIVE and trust_view:
                    continue  # died or began draining since the last re-read
                load, received_at = record.last_load, record.last_heartbeat_at
                if load is not None and load.engine_down:
                    continue
                if received_at is not None:
                    self._prefilled_by_report(traffic, received_at)
            chosen.append(Candidate(status.info, load, received_at, traffic))
        return chosen

    # -- this router's traffic -----------------------------------------------------

    def traffic(self, worker_id: str) -> WorkerTraffic:
        traffic = self._traffic.get(worker_id)
        if traffic is None:
            traffic = self._traffic[worker_id] = WorkerTraffic()
        return traffic

    def sent(
        self, worker_id: str, tenant: str, prefill_tokens: int, *, streamed: bool = True
    ) -> Ticket:
        traffic = self.traffic(worker_id)
        ticket = Ticket(worker_id, tenant, prefill_tokens, sent_at=self._clock(), streamed=streamed)
        if not streamed:
            traffic.unstreamed.append(ticket)
        traffic.in_flight += 1
        traffic.prefill_tokens += prefill_tokens
        traffic.by_tenant[tenant] += 1
        traffic.waiting_for_first_byte.add(ticket)
        return ticket

    def first_byte(self, ticket: Ticket) -> None:
        if ticket.prefilling:
            ticket.prefilling = False
            traffic = self.traffic(ticket.worker_id)
            traffic.waiting_for_first_byte.discard(ticket)
            traffic.prefill_tokens -= ticket.prefill_tokens

    def finished(self, ticket: Ticket) -> None:
        self.first_byte(ticket)
        traffic = self.traffic(ticket.worker_id)
        while traffic.unstreamed and not traffic.unstreamed[0].prefilling:
            traffic.unstreamed.popleft()
        traffic.in_flight -= 1
        traffic.by_tenant[ticket.tenant] -= 1
        if traffic.by_tenant[ticket.tenant] <= 0:
            del traffic.by_tenant[ticket.tenant]

    def _prefilled_by_report(self, traffic: WorkerTraffic, received_at: float) -> None:
        """A non-streamed answer says nothing until it is complete, so its prefill
        is counted until the first load report after it was sent: from then on the
        engine's own figures (waiting, running) include it."""
        while traffic.unstreamed and traffic.unstreamed[0].sent_at < received_at:
            self.first_byte(traffic.unstreamed.popleft())

    def unreachable(self, worker_id: str) -> None:
        """The worker refused a connection: skip it for a while (its lease may still
        have seconds to run)."""
        self._unreachable_until[worker_id] = self._clock() + self._backoff_s
