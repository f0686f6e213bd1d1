"""Which workers the router can see into: router/routing/wiring.py's checks, fed with
what this router knows of each worker (its agent's wiring report, the token counts its
engine answered with, whether its index entries vouched for its hits)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from kvplane.core.types import WorkerInfo
from router.control_plane.workers import WorkerView
from router.routing.accuracy import PredictionAccuracy
from router.routing.token_agreement import TokenCountAgreement
from router.routing.wiring import (
    Check,
    RoutingMode,
    WorkerWiringFacts,
    is_blind,
    model_routing,
    worker_checks,
)


@dataclass(frozen=True, slots=True)
class Sight:
    checks: dict[str, list[Check]]  # by worker id
    routing: dict[str, RoutingMode]  # by model, over the routable workers


class WiringSight:
    def __init__(
        self,
        view: WorkerView,
        accuracy: PredictionAccuracy,
        agreement: TokenCountAgreement,
        block_size: int,
    ) -> None:
        self.view = view
        self.accuracy = accuracy
        self.agreement = agreement
        self.block_size = block_size

    def checks(self, info: WorkerInfo) -> list[Check]:
        record = self.view.get(info.worker_id)
        own = record is not None and record.incarnation == info.incarnation
        report = None
        if own and record is not None and record.last_load is not None:
            report = record.last_load.wiring
        hits, vouched = self.accuracy.vouching(info.worker_id, info.incarnation)
        return worker_checks(
            WorkerWiringFacts(
                report=report,
                stream_here=own and record is not None and record.stream is not None,
                router_block_size=self.block_size,
                agreement=self.agreement.of((info.worker_id, info.incarnation)),
                recent_hits=hits,
                vouched_hits=vouched,
            )
        )

    def see(self, workers: Iterable[WorkerInfo], routable: Collection[str]) -> Sight:
        """Each worker's checks; per model of the `routable` workers (ids), whether it
        is routed cache-aware or on this router's predictions only."""
        workers = list(workers)
        checks = {info.worker_id: self.checks(info) for info in workers}
        routing = model_routing(
            (info.model, is_blind(checks[info.worker_id]))
            for info in workers
            if info.worker_id in routable
        )
        return Sight(checks, routing)
