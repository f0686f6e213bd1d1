"""Flow control shared by router replicas on one Redis index: the tenants' virtual
counters, which tenants wait where, and what each replica has in flight at each worker
(with the load reports of the agents streaming to it), exchanged every
`shared_refresh_s` in one round trip (router/index/redis.py `exchange_flow`).

With it, two routers behind one load balancer keep the configured shares whatever
traffic each receives: a replica lets a tenant's request through only while no tenant
waiting at another replica, in the same band, has been served less (by more than
`fairness_slack_tokens`), or waits in a higher band; the room it leaves is seen, and
taken, by the replica where that tenant waits. A replica whose state is older than its
time to live is forgotten (it stopped, or cannot reach Redis).

Another replica's state is checked as it is decoded: a state that does not decode is
skipped (and counted), never trusted in part.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from router.flow_control.counters import ServiceCounters
from router.flow_control.saturation import ReplicaTraffic, SharedReport
from router.index.base import CounterChanges, CounterStep, FlowExchanged, SharedFlowState

log = logging.getLogger(__name__)

STATE_TTL_INTERVALS = 20  # a replica's state outlives this many of its exchanges


class _Report(msgspec.Struct, array_like=True, frozen=True):
    running: float
    waiting: float
    kv_usage: float
    batch_limit: float  # -1: not learnt (msgpack has no infinity to spare)
    in_flight_at_report: float  # the replicas' requests there when it came
    incarnation: int = -1  # the engine the report is of; -1: shared by an older router


class _ReplicaState(msgspec.Struct, array_like=True, frozen=True):
    in_flight: dict[str, int]  # worker -> requests
    reports: dict[str, _Report]  # worker -> its agent's last report here
    backlog: dict[str, dict[int, dict[str, int]]]  # model -> band -> tenant -> waiting
    handed_off: dict[str, int]  # worker -> of its requests, those handed off


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_ReplicaState).decode


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """What the other replicas shared, as of the last exchange."""

    backlog: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)
    # (model, band) -> tenant -> requests waiting at other replicas

    def waiting(self, model: str, band: int) -> dict[str, int]:
        return self.backlog.get((model, band), {})

    def higher_band_waits(self, model: str, band: int) -> bool:
        return any(m == model and b > band for m, b in self.backlog)


class SharedCounters(ServiceCounters):
    """The counters as Redis last had them, plus this router's changes since (each
    tenant's in order: a clamp applies to what was charged before it, not after)."""

    def __init__(self) -> None:
        super().__init__()
        self._steps: dict[str, list[CounterStep]] = {}  # model -> clamps, with adds before
        self._adds: dict[str, dict[str, float]] = {}  # model -> tenant -> added since

    def charge(self, model: str, tenant: str, amount: float) -> None:
        super().charge(model, tenant, amount)
        if amount:
            adds = self._adds.setdefault(model, {})
            adds[tenant] = adds.get(tenant, 0.0) + amount

    def clamp(self, model: str, tenant: str, low: float, high: float) -> None:
        super().clamp(model, tenant, low, high)
        added = self._adds.get(model, {}).pop(tenant, 0.0)
        self._steps.setdefault(model, []).append(CounterStep(tenant, added, low, high))

    def take_changes(self, models: Iterable[str]) -> dict[str, CounterChanges]:
        """The changes to send, for `models` and every model changed (then forgotten)."""
        changes: dict[str, CounterChanges] = {
            model: self._pending(model) for model in set(models) | self._changed()
        }
        self._steps, self._adds = {}, {}
        return changes

    def restore(self, changes: Mapping[str, CounterChanges]) -> None:
        """Changes an exchange that failed did not deliver: sent with the next, first."""
        for model, steps in changes.items():
            pending = self._pending(model)
            self._steps[model] = [*steps, *pending]
            self._adds.pop(model, None)

    def absorb(self, counters: Mapping[str, dict[str, float]]) -> None:
        """Redis's counters after the exchange, with the changes made while it ran."""
        for model, values in counters.items():
            for step in self._pending(model):
                values[step.tenant] = values.get(step.tenant, 0.0) + step.add
                if step.low is not None and step.high is not None:
                    values[step.tenant] = min(max(values[step.tenant], step.low), step.high)
            self._values[model] = values

    def _changed(self) -> set[str]:
        return {model for model, steps in self._steps.items() if steps} | {
            model for model, adds in self._adds.items() if adds
        }

    def _pending(self, model: str) -> list[CounterStep]:
        adds = self._adds.get(model, {})
        return [
            *self._steps.get(model, []),
            *(CounterStep(tenant, amount) for tenant, amount in adds.items()),
        ]


class FlowExchange:
    """This router's side of the exchange."""

    def __init__(self, store: SharedFlowState, refresh_s: float) -> None:
        self._store = store
        self.router_id = uuid.uuid4().hex
        self.ttl_s = refresh_s * STATE_TTL_INTERVALS
        self.undecodable = 0  # other replicas' states skipped

    async def exchange(
        self,
        traffic: ReplicaTraffic,
        backlog: dict[str, dict[int, dict[str, int]]],
        changes: Mapping[str, CounterChanges],
    ) -> tuple[FlowExchanged, Elsewhere, ReplicaTraffic]:
        """Put this router's state, apply its counter changes; returns the exchange and
        the other replicas' backlog and traffic: requests in flight and handed off (per
        worker, summed) and reports (of workers whose agents report to them, not here)."""
        reports = traffic.reports
        state = _ReplicaState(
            traffic.in_flight,
            {
                worker: _Report(
                    r.running,
                    r.waiting,
                    r.kv_usage,
                    -1.0 if math.isinf(r.batch_limit) else r.batch_limit,
                    r.in_flight_at_report,
                    r.incarnation,
                )
                for worker, r in reports.items()
            },
            backlog,
            traffic.handed_off,
        )
        exchanged = await self._store.exchange_flow(
            self.router_id, _encode(state), self.ttl_s, changes
        )
        others_in_flight: dict[str, int] = {}
        others_handed_off: dict[str, int] = {}
        others_reports: dict[str, SharedReport] = {}
        others_backlog: dict[tuple[str, int], dict[str, int]] = {}
        for router_id, raw in exchanged.states.items():
            if router_id == self.router_id:
                continue
            try:
                other = _decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.undecodable += 1
                log.warning("router replica %s shared a flow state that does not decode", router_id)
                continue
            for worker, count in other.in_flight.items():
                others_in_flight[worker] = others_in_flight.get(worker, 0) + max(0, count)
            for worker, count in other.handed_off.items():
                handed_off = max(0, min(count, other.in_flight.get(worker, 0)))
                others_handed_off[worker] = others_handed_off.get(worker, 0) + handed_off
            for worker, r in other.reports.items():
                if worker not in reports and _sane(r):
                    limit = math.inf if r.batch_limit < 0 else r.batch_limit
                    others_reports[worker] = SharedReport(
                        r.incarnation,
                        r.running,
                        r.waiting,
                        r.kv_usage,
                        limit,
                        r.in_flight_at_report,
                    )
            for model, bands in other.backlog.items():
                for band, tenants in bands.items():
                    waiting = others_backlog.setdefault((model, band), {})
                    for tenant, count in tenants.items():
                        if count > 0:
                            waiting[tenant] = waiting.get(tenant, 0) + count
        others = ReplicaTraffic(others_in_flight, others_handed_off, others_reports)
        return exchanged, Elsewhere(others_backlog), others


def _sane(report: _Report) -> bool:
    """A report another replica shared, as a load report would be checked."""
    return (
        report.running >= 0
        and report.waiting >= 0
        and 0 <= report.kv_usage <= 1
        and (report.batch_limit == -1 or report.batch_limit > 0)
        and report.in_flight_at_report >= 0
        and report.incarnation >= -1
        and all(map(math.isfinite, (report.running, report.waiting, report.in_flight_at_report)))
    )
