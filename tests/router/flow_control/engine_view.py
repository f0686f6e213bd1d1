"""A view of the engines that a test sets, for the gate's tests that need no real
engines (the view is the gate's input there, not under test)."""

from __future__ import annotations

import numpy as np

from router.flow_control.saturation import EngineQueues, ReplicaTraffic, Rows
from router.tenants import Tenant


class OneEngine:
    """One worker whose engine holds `held` requests, of a batch of one."""

    def __init__(self) -> None:
        self.held = 0.0

    def serving_rows(self, model: str) -> Rows:
        return np.array([0], dtype=np.intp)

    def queue_model(self, model: str) -> str:
        return model

    def engine_queues(self, rows: Rows) -> EngineQueues:
        one = np.ones(1)
        return EngineQueues(
            reported=np.ones(1, dtype=np.bool_),
            running=one * min(self.held, 1.0),
            waiting=one * max(self.held - 1.0, 0.0),
            traffic_since_report=np.zeros(1),
            batch_limit=one,
            kv_usage=np.zeros(1),
            in_flight=np.zeros(1),
        )

    def row_of(self, worker_id: str) -> int | None:
        return 0

    def local_engines(self) -> ReplicaTraffic:
        return ReplicaTraffic({}, {}, {})

    def shared_engines(self, others: ReplicaTraffic) -> None:
        pass


def tenant(name: str) -> Tenant:
    return Tenant(name=name, cache_scope=name, cache_salt=None, max_priority=5)
