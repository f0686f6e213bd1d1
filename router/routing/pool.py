"""The router's picture of its workers, for routing and for the fleet API.

Three sources, each the authority on something:
- the location index: who is registered, their incarnation, address, model, labels,
  and lease (shared by every router replica; re-read every `refresh_s`);
- this router's WorkerView: the load reports of agents streaming to this router,
  engine-down flags, drains, deaths seen before the next re-read;
- this router's own traffic: requests in flight to each worker, and the prefill work
  of those still waiting for their first byte (load reports lag by up to a second).
Operators' drains and connection failures are kept here too (this router's only), and
so are the workers' recent evictions and index suspicion (router/routing/evictions.py,
accuracy.py) as routing reads them.

What routing reads of it is kept as columns in a Roster (router/routing/roster.py),
one row per registered live worker, so that a decision reads a thousand workers' facts
in a few numpy operations (only a tenant's share of the traffic is counted per request,
over the workers with requests in flight). A row is rewritten from its sources whenever
one of them changes for its worker: this router's traffic at once; the view, evictions
and suspicion (which note what changed) before the roster is next read. A registry read
that changes who is registered builds a new roster.

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

import numpy as np

from kvplane.core.clock import Clock
from kvplane.core.types import Incarnation, LoadReport, WorkerInfo
from router.control_plane.workers import WorkerRecord, WorkerView
from router.flow_control.saturation import (
    ANY_MODEL,
    BatchLimit,
    EngineQueues,
    ReplicaTraffic,
    SharedReport,
    learnt_batch_limit,
)
from router.index.base import (
    LocationIndex,
    LocationIndexError,
    WorkerState,
    WorkerStatus,
    index_deadline,
)
from router.routing.accuracy import PredictionAccuracy
from router.routing.evictions import RecentEvictions, capacity_in_router_blocks
from router.routing.roster import Roster, Rows
from router.scoring.score import TIERS, CandidateFacts, queue_estimate

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
    prefilling: bool = True  # until the first byte comes back (see WorkerPool._rewrite)
    ended: bool = False
    handed_off: bool = False  # a gateway carries it: its end is not seen


@dataclass(slots=True)
class WorkerTraffic:
    in_flight: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens of requests before their first byte
    by_tenant: Counter[str] = field(default_factory=Counter)
    _waiting_for_first_byte: set[Ticket] = field(default_factory=set)  # waiting(), answered()
    unstreamed: deque[Ticket] = field(default_factory=deque)  # in the order sent
    handed_off: deque[Ticket] = field(default_factory=deque)  # in the order sent
    handed_off_in_flight: int = 0  # of in_flight
    # prefilling_sent_after()'s last moment and answer, kept up to date as requests come
    # and go: the moment moves once a load report, requests three times each, and a
    # count over every request before its first byte would cost each of those O(n).
    _counted_after: float = 0.0
    _sent_after: int = 0

    @property
    def prefilling(self) -> int:
        return len(self._waiting_for_first_byte)

    def waiting(self, ticket: Ticket) -> None:
        """`ticket`'s request waits for its first byte."""
        self._waiting_for_first_byte.add(ticket)
        if ticket.sent_at > self._counted_after:
            self._sent_after += 1

    def answered(self, ticket: Ticket) -> None:
        """`ticket`'s request has its first byte (or ended without one)."""
        if ticket in self._waiting_for_first_byte:
            self._waiting_for_first_byte.remove(ticket)
            if ticket.sent_at > self._counted_after:
                self._sent_after -= 1

    def prefilling_sent_after(self, moment: float) -> int:
        """Requests before their first byte that were sent after `moment`."""
        if moment != self._counted_after:
            self._counted_after = moment
            self._sent_after = sum(
                1 for ticket in self._waiting_for_first_byte if ticket.sent_at > moment
            )
        return self._sent_after


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker requests can be sent to now, with what the router knows of its load."""

    info: WorkerInfo
    load: LoadReport | None  # the last report this router received; None: none here
    traffic: WorkerTraffic

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class WorkerPool:
    def __init__(
        self,
        index: LocationIndex,
        view: WorkerView,
        *,
        evictions: RecentEvictions,
        accuracy: PredictionAccuracy,
        unreachable_backoff_s: float,
        hand_off_s: float = 1.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self._index = index
        self._view = view
        self.evictions = evictions
        self.accuracy = accuracy
        self._clock = clock
        self._backoff_s = unreachable_backoff_s
        self._hand_off_s = hand_off_s
        self._hand_offs: deque[Ticket] = deque()  # every worker's, in the order sent
        self._statuses: dict[str, WorkerStatus] = {}
        self._traffic: dict[str, WorkerTraffic] = {}
        self._unreachable_until: dict[str, float] = {}
        self._drained: set[str] = set()  # by an operator, through this router
        # Learnt from each incarnation's load reports: a restarted engine may run
        # another batch (and the limit only ever rises).
        self._batch_limits: dict[Incarnation, BatchLimit] = {}
        # The last load report read from each incarnation's agent: when it came, and
        # the replicas' requests in flight there then (kept across rosters: a report
        # read again into a new roster would count as a second one).
        self._reports_read: dict[Incarnation, tuple[float, float]] = {}
        # What other router replicas shared for flow control (shared_engines).
        self._others = ReplicaTraffic({}, {}, {})
        self._roster = Roster([])
        self._live: dict[str, WorkerInfo] = {}  # the roster's workers, as registered
        self.refreshed_at: float | None = None
        self._last_read_failed = False

    # -- the registry --------------------------------------------------------------

    async def refresh(self) -> None:
        """Re-read the registry; on failure keep the last one (routing goes on with it)."""
        try:
            statuses = await self._index.workers()
        except BaseException:  # not answered, whatever the reason; raised on to the caller
            self._last_read_failed = True
            raise
        self._last_read_failed = False
        self._statuses = {status.info.worker_id: status for status in statuses}
        registered = {(status.info.worker_id, status.info.incarnation) for status in statuses}
        for gone in (self._batch_limits.keys() | self._reports_read.keys()) - registered:
            self._batch_limits.pop(gone, None)
            self._reports_read.pop(gone, None)
        self.refreshed_at = self._clock()
        live = {
            status.info.worker_id: status.info
            for status in statuses
            if status.state is WorkerState.LIVE
        }
        if live != self._live:  # (in whatever order the index lists them)
            self._live = live
            self._roster = Roster(list(live.values()))
            for worker_id in live:
                self._rewrite(worker_id)
            if self._shares_engines:
                self._write_shared(self._roster)

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
        """Whether the last registry read answered, recently. A read that failed ends it
        at once: the leases this router saw renewed last may run out within the stale
        window, and the view's guess that they did must not stop routing (module doc)."""
        return (
            self.refreshed_at is not None
            and not self._last_read_failed
            and self._clock() - self.refreshed_at < REGISTRY_STALE_S
        )

    # -- where requests may go -----------------------------------------------------

    @property
    def roster(self) -> Roster:
        """The registered live workers, their rows current (read it before any await:
        a registry read may replace it)."""
        if self._hand_offs:
            self._end_hand_offs()
        for changed in (
            self._view.take_changed(),
            self.evictions.take_changed(),
            self.accuracy.take_changed(),
        ):
            for worker_id in changed:
                self._rewrite(worker_id)
        return self._roster

    def candidate_rows(self, model: str | None = None) -> Rows:
        """The roster's rows of the workers to route to: live in the index and in this
        router's view, not drained, engine up, not refusing connections lately; for
        `model` if given."""
        roster = self.roster
        rows = roster.rows(model)
        held = roster.held_back[rows] | (roster.unreachable_until[rows] > self._clock())
        if self.registry_is_current():  # else the view's deaths are guesses (module doc)
            held |= roster.gone_in_view[rows]
        return rows[~held] if held.any() else rows

    def serving_rows(self, model: str) -> Rows:
        """The candidate_rows() of `model`; of any model if no worker is registered
        under its name: it may be a LoRA adapter, which engines serve under the base
        model's registration (the engine judges whether it serves the model)."""
        rows = self.candidate_rows(model)
        return rows if len(rows) else self.candidate_rows()

    def queue_model(self, model: str) -> str | None:
        """The model whose requests a request for `model` waits among in flow control
        (router/flow_control/gate.py): `model` where workers are registered under it;
        else (an adapter, or a name the engines will judge) the one model the workers
        register, or ANY_MODEL where they register several (so a name a client makes
        up never gets its own queue); None where no worker can take a request."""
        if not len(self.candidate_rows()):
            return None
        if len(self.roster.rows(model)):
            return model
        served = self.roster.models()
        return served[0] if len(served) == 1 else ANY_MODEL

    def candidates(self, model: str | None = None) -> list[Candidate]:
        """The candidate_rows' workers, with their load and this router's traffic."""
        roster = self.roster
        chosen = []
        for row in self.candidate_rows(model):
            info = roster.infos[row]
            record = self._own_record(info)
            load = record.last_load if record is not None else None
            chosen.append(Candidate(info, load, self.traffic(info.worker_id)))
        return chosen

    def facts(self, roster: Roster, rows: Rows, tenant: str | None, now: float) -> CandidateFacts:
        """What scoring reads of `roster`'s `rows`, with nothing matched yet (the planner
        adds each worker's cached prefix); the requests of tenants other than `tenant`
        running on each, for a private tenant's request (None: not counted, zeros)."""
        waiting, running = queue_estimate(
            roster.reported[rows],
            (roster.report_waiting[rows], roster.report_running[rows]),
            roster.sent_since_report[rows],
            roster.in_flight[rows],
            roster.prefilling[rows],
        )
        if tenant is None:
            others = np.zeros(len(rows))
        else:  # a Python step per busy worker: paid by private tenants' requests only
            others = roster.in_flight[rows].copy()
            for position in np.flatnonzero(others):
                worker_id = roster.infos[rows[position]].worker_id
                others[position] -= self.traffic(worker_id).by_tenant[tenant]
        evicted = self.evictions.shares(
            roster.evicted_blocks[rows],
            roster.evicted_as_of[rows],
            roster.capacity_router_blocks[rows],
            now,
        )
        return CandidateFacts(
            worker_ids=roster.worker_ids[rows].tolist(),
            matched_tokens=np.zeros((len(rows), len(TIERS))),
            waiting_requests=waiting,
            running_requests=running,
            load_reported=roster.reported[rows],
            queued_prefill_tokens=roster.prefill_tokens[rows],
            kv_usage=roster.kv_usage[rows],
            evicted_share=evicted,
            other_tenants_running=others,
            suspect=roster.suspect[rows],
            labels=roster.labels[rows].tolist(),
            pools=roster.pools[rows],
            max_model_len=roster.max_model_len[rows],
        )

    def engine_queues(self, rows: Rows) -> EngineQueues:
        """What flow control reads of the roster's `rows`' engines (read the roster and
        its rows together, with no await between): this router's reports, else another
        replica's."""
        roster = self._roster
        own = roster.reported[rows]
        in_flight = roster.in_flight[rows]
        seen_ending = in_flight - roster.handed_off[rows]
        if not self._shares_engines:
            return EngineQueues(
                reported=own,
                running=roster.report_running[rows],
                waiting=roster.report_waiting[rows],
                traffic_since_report=seen_ending - roster.in_flight_at_report[rows],
                batch_limit=roster.batch_limit[rows],
                kv_usage=roster.kv_usage[rows],
                in_flight=in_flight,
            )
        shared = roster.shared_reported[rows] & ~own
        others = roster.others_in_flight[rows]
        in_flight = in_flight + others
        seen_ending = seen_ending + others - roster.others_handed_off[rows]
        return EngineQueues(
            reported=own | shared,
            running=np.where(shared, roster.shared_running[rows], roster.report_running[rows]),
            waiting=np.where(shared, roster.shared_waiting[rows], roster.report_waiting[rows]),
            traffic_since_report=seen_ending
            - np.where(
                shared, roster.shared_in_flight_at_report[rows], roster.in_flight_at_report[rows]
            ),
            batch_limit=np.where(shared, roster.shared_batch_limit[rows], roster.batch_limit[rows]),
            kv_usage=np.where(shared, roster.shared_kv_usage[rows], roster.kv_usage[rows]),
            in_flight=in_flight,
        )

    def row_of(self, worker_id: str) -> int | None:
        """The worker's row in the current roster (None: not in it)."""
        return self.roster.position.get(worker_id)

    def local_engines(self) -> ReplicaTraffic:
        """What this router shares with its replicas: its requests in flight at each
        worker, and the load reports its agents send (with each batch limit learnt)."""
        roster = self.roster
        busy = {worker_id: t for worker_id, t in self._traffic.items() if t.in_flight > 0}
        in_flight = {worker_id: traffic.in_flight for worker_id, traffic in busy.items()}
        handed_off = {
            worker_id: traffic.handed_off_in_flight
            for worker_id, traffic in busy.items()
            if traffic.handed_off_in_flight > 0
        }
        reports = {
            roster.infos[row].worker_id: SharedReport(
                incarnation=roster.infos[row].incarnation,
                running=float(roster.report_running[row]),
                waiting=float(roster.report_waiting[row]),
                kv_usage=float(roster.kv_usage[row]),
                batch_limit=float(roster.batch_limit[row]),
                in_flight_at_report=float(roster.in_flight_at_report[row]),
            )
            for row in np.flatnonzero(roster.reported)
        }
        return ReplicaTraffic(in_flight, handed_off, reports)

    def shared_engines(self, others: ReplicaTraffic) -> None:
        """What the other replicas shared, as of their last exchange (empty: nothing)."""
        self._others = others
        self._write_shared(self._roster)

    @property
    def _shares_engines(self) -> bool:
        return bool(self._others.in_flight or self._others.reports)

    def _write_shared(self, roster: Roster) -> None:
        others = self._others
        ids = roster.worker_ids
        roster.others_in_flight[:] = [others.in_flight.get(worker_id, 0) for worker_id in ids]
        roster.others_handed_off[:] = [others.handed_off.get(worker_id, 0) for worker_id in ids]
        shared = [_report_of(info, others.reports.get(info.worker_id)) for info in roster.infos]
        roster.shared_reported[:] = [report is not None for report in shared]
        for column, field_name in (
            (roster.shared_running, "running"),
            (roster.shared_waiting, "waiting"),
            (roster.shared_kv_usage, "kv_usage"),
            (roster.shared_in_flight_at_report, "in_flight_at_report"),
        ):
            column[:] = [0.0 if r is None else getattr(r, field_name) for r in shared]
        roster.shared_batch_limit[:] = [np.inf if r is None else r.batch_limit for r in shared]

    def drain(self, worker_id: str, *, drained: bool) -> None:
        """An operator's drain (or its end): no new requests go there meanwhile."""
        if drained:
            self._drained.add(worker_id)
        else:
            self._drained.discard(worker_id)
        self._rewrite(worker_id)

    @property
    def drained(self) -> frozenset[str]:
        return frozenset(self._drained)

    def unreachable(self, worker_id: str) -> None:
        """The worker refused a connection: skip it for a while (its lease may still
        have seconds to run)."""
        self._unreachable_until[worker_id] = self._clock() + self._backoff_s
        self._rewrite(worker_id)

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
        traffic.waiting(ticket)
        self._traffic_changed(worker_id)
        return ticket

    def first_byte(self, ticket: Ticket) -> None:
        if ticket.prefilling:
            self._prefilled(ticket)
            self._traffic_changed(ticket.worker_id)

    def finished(self, ticket: Ticket) -> None:
        ticket.ended = True
        if ticket.prefilling:
            self._prefilled(ticket)
        traffic = self.traffic(ticket.worker_id)
        while traffic.unstreamed and not traffic.unstreamed[0].prefilling:
            traffic.unstreamed.popleft()
        traffic.in_flight -= 1
        if ticket.handed_off:
            traffic.handed_off_in_flight -= 1
        traffic.by_tenant[ticket.tenant] -= 1
        if traffic.by_tenant[ticket.tenant] <= 0:
            del traffic.by_tenant[ticket.tenant]
        self._traffic_changed(ticket.worker_id)

    def handed_off(self, ticket: Ticket) -> None:
        """The request went on without this router (a gateway moves its bytes, and says
        nothing of its answer): it counts as this router's traffic until the worker's
        first load report after it was sent, whose figures hold it from then on, and
        `hand_off_s` at most (no report reaches a replica the worker's agent does not
        stream to)."""
        traffic = self.traffic(ticket.worker_id)
        traffic.handed_off.append(ticket)
        traffic.handed_off_in_flight += 1
        ticket.handed_off = True
        self._hand_offs.append(ticket)
        self._traffic_changed(ticket.worker_id)

    def _end_hand_offs(self) -> None:
        """Those handed off `hand_off_s` ago or more, that no report has ended yet."""
        sent_before = self._clock() - self._hand_off_s
        while self._hand_offs and self._hand_offs[0].sent_at <= sent_before:
            ticket = self._hand_offs.popleft()
            if ticket.ended:  # by a report; its worker's queue let it go then
                continue
            # The oldest of its worker's queue too: everything sent before it has ended.
            queue = self.traffic(ticket.worker_id).handed_off
            if queue and queue[0] is ticket:
                queue.popleft()
            self.finished(ticket)

    def _prefilled(self, ticket: Ticket) -> None:
        ticket.prefilling = False
        traffic = self.traffic(ticket.worker_id)
        traffic.answered(ticket)
        traffic.prefill_tokens -= ticket.prefill_tokens

    # -- the roster's rows ---------------------------------------------------------

    def _rewrite(self, worker_id: str) -> None:
        """The worker's row, from every source, if the roster has one."""
        roster = self._roster
        row = roster.position.get(worker_id)
        if row is None:
            return
        info = roster.infos[row]
        record = self._own_record(info)
        load = record.last_load if record is not None else None
        received_at = record.last_heartbeat_at if record is not None else None
        traffic = self.traffic(worker_id)
        if received_at is not None:
            self._prefilled_by_report(traffic, received_at)
        roster.held_back[row] = worker_id in self._drained or (
            load is not None and load.engine_down
        )
        roster.gone_in_view[row] = record is not None and record.state is not WorkerState.LIVE
        roster.unreachable_until[row] = self._unreachable_until.get(worker_id, 0.0)
        roster.reported[row] = load is not None and received_at is not None
        incarnation = (worker_id, info.incarnation)
        read = self._reports_read.get(incarnation)
        if (
            load is not None
            and received_at is not None
            and (read is None or read[0] != received_at)
        ):
            others = self._others
            read = self._reports_read[incarnation] = (
                received_at,
                traffic.in_flight
                - traffic.handed_off_in_flight
                + others.in_flight.get(worker_id, 0)
                - others.handed_off.get(worker_id, 0),
            )
            self._batch_limits[incarnation] = learnt_batch_limit(
                self._batch_limits.get(incarnation, BatchLimit()), load.running, load.waiting
            )
        roster.in_flight_at_report[row] = 0.0 if read is None else read[1]
        roster.batch_limit[row] = self._batch_limits.get(incarnation, BatchLimit()).limit
        roster.report_waiting[row] = load.waiting if load is not None else 0
        roster.report_running[row] = load.running if load is not None else 0
        roster.kv_usage[row] = load.kv_usage if load is not None else 0.0
        roster.report_received_at[row] = received_at if received_at is not None else 0.0
        wiring = load.wiring if load is not None else None
        roster.capacity_router_blocks[row] = capacity_in_router_blocks(
            info.kv_capacity_blocks,
            wiring.engine_block_size if wiring is not None else None,
            info.block_size,
        )
        roster.evicted_blocks[row], roster.evicted_as_of[row] = self.evictions.recorded(worker_id)
        roster.suspect[row] = self.accuracy.is_suspect(worker_id, info.incarnation)
        self._write_traffic(row, traffic)

    def _traffic_changed(self, worker_id: str) -> None:
        """Only the traffic columns of the worker's row: what a request's start, first
        byte and end change (three times a request, on the proxy's path)."""
        row = self._roster.position.get(worker_id)
        if row is not None:
            self._write_traffic(row, self.traffic(worker_id))

    def _write_traffic(self, row: int, traffic: WorkerTraffic) -> None:
        roster = self._roster
        roster.in_flight[row] = traffic.in_flight
        roster.handed_off[row] = traffic.handed_off_in_flight
        roster.prefilling[row] = traffic.prefilling
        roster.prefill_tokens[row] = traffic.prefill_tokens
        roster.sent_since_report[row] = (
            traffic.prefilling_sent_after(float(roster.report_received_at[row]))
            if roster.reported[row]
            else 0
        )

    def _own_record(self, info: WorkerInfo) -> WorkerRecord | None:
        """This router's view of the registered incarnation (None for an older or
        newer one's record: the registry is the authority on incarnations)."""
        record = self._view.get(info.worker_id)
        return record if record is not None and record.incarnation == info.incarnation else None

    def _prefilled_by_report(self, traffic: WorkerTraffic, received_at: float) -> None:
        """A non-streamed answer says nothing until it is complete, so its prefill
        is counted until the first load report after it was sent: from then on the
        engine's own figures (waiting, running) include it."""
        while traffic.unstreamed and traffic.unstreamed[0].sent_at < received_at:
            ticket = traffic.unstreamed.popleft()
            if ticket.prefilling:
                self._prefilled(ticket)
        while traffic.handed_off and traffic.handed_off[0].sent_at < received_at:
            ticket = traffic.handed_off.popleft()
            if not ticket.ended:
                self.finished(ticket)


def _report_of(info: WorkerInfo, report: SharedReport | None) -> SharedReport | None:
    """Another replica's report of the worker, where it is of the incarnation in this
    roster (-1: shared by a router too old to say, taken as before)."""
    if report is None or report.incarnation not in (-1, info.incarnation):
        return None
    return report
