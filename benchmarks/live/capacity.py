"""The `noisy-tenant` situation's C: the request rate the fleet sustains for the
situation's request shape, measured once per sitting on a fleet of the situation's own
engines, and every rate of its workloads a fraction of it.

A closed loop, not a search of offered rates: `CONCURRENCY_PER_SLOT` clients for every
running slot of the fleet, each sending its next request as soon as its last one is
answered, through kvplane without flow control (the router whose throughput the
situation's target is set against), so that every engine always has requests waiting;
C is the requests completed a second once the caches are warm. A mean over some
hundreds of completions moves a few per cent from one sitting to the next on a 2-core
machine, where a search for the highest rate whose TTFT p90 stays under a bound reads a
tail that moves by tens of per cent (`docs/benchmarks.md`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.live.client import Outcome, Traffic, run_closed_loop
from benchmarks.live.engines import MODEL, EngineShape, start_engines
from benchmarks.live.processes import Children
from benchmarks.live.routers import RouterSpec, api_key
from benchmarks.live.workloads import (
    NOISY_TENANT,
    WELL_BEHAVED_TENANTS,
    Conversation,
    RequestShape,
    Workload,
    tenant_conversations,
)

CAPACITY_ROUTER = "kvplane kvplane"  # kvplane without flow control
CONCURRENCY_PER_SLOT = 2  # clients per running slot: a queue as long again at every engine
WARMUP_S = 5.0  # the caches fill and the queues build: not counted
MEASURE_S = 15.0
CALIBRATION_REQUESTS = 1000  # distinct requests, more than a loop sends (then round again)


@dataclass(frozen=True, slots=True)
class Capacity:
    """C, and how it was measured (kept in the run's JSON, so that a resumed run and a
    report read from it use the same)."""

    requests_per_s: float
    completed: int  # in the measured window
    measured_s: float
    concurrency: int
    router: str
    time_scale: float  # the engines' (1: the timing model's own pace)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> Capacity:
        return cls(**document)


def calibration_requests(count: int = CALIBRATION_REQUESTS) -> list[Conversation]:
    """The situation's request shape from all five of its tenants in turn: their own
    prompts, as the flood sends them, so the caches hold what they will hold then."""
    tenants = (*WELL_BEHAVED_TENANTS, NOISY_TENANT)
    per_tenant = [
        tenant_conversations(tenant, iter([0.0] * (count // len(tenants))), RequestShape(), seed=-1)
        for tenant in tenants
    ]
    return [request for turn in zip(*per_tenant, strict=True) for request in turn]


def completed_rate(outcomes: Sequence[Outcome], started_at: float, since_s: float,
                   until_s: float) -> tuple[int, float]:  # fmt: skip
    """The requests answered between `since_s` and `until_s` after `started_at` (wall
    clock seconds), and how many a second."""
    done = sum(
        outcome.ok
        and outcome.latency_s is not None
        and since_s <= outcome.sent_at + outcome.latency_s - started_at < until_s
        for outcome in outcomes
    )
    return done, done / (until_s - since_s)


def measure_capacity(router: RouterSpec, shape: EngineShape, log_dir: Path) -> Capacity:
    """C on a fresh fleet of `shape` behind `router` (one replica), every process
    stopped after."""
    children = Children(log_dir)
    concurrency = CONCURRENCY_PER_SLOT * shape.engines * shape.max_num_seqs
    requests = calibration_requests()
    tenants = tuple(dict.fromkeys(request.tenant or "" for request in requests))
    try:
        fleet = start_engines(children, shape)
        # The tenants file names the five tenants (each request's key and salt its own).
        deployment = router.start(router, fleet, children, 1, Workload("calibration", (), tenants))
        started_at = time.time()
        outcomes = asyncio.run(
            run_closed_loop(
                requests,
                Traffic(deployment.urls),
                model=MODEL,
                api_key=lambda tenant: api_key(tenant or "anonymous"),
                concurrency=concurrency,
                duration_s=WARMUP_S + MEASURE_S,
            )
        )
    finally:
        children.stop_all()
    completed, rate = completed_rate(outcomes, started_at, WARMUP_S, WARMUP_S + MEASURE_S)
    scale = 1.0 if shape.time_scale is None else shape.time_scale
    return Capacity(rate, completed, MEASURE_S, concurrency, router.name, scale)
