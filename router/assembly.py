"""The router assembled: every part of `kvplane router` wired from the settings in one
place, so that what runs the router (the command, the demo, the tests) and what
measures it (benchmarks/router.py) wire the same one.

Wiring only: nothing here binds a port, starts a task or reads the index. router/app.py
does that with the parts; a benchmark calls the planner directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI
from starlette.types import ASGIApp

from kvplane.core.clock import Clock, WallClock
from kvplane.core.config import Settings
from kvplane.core.types import BlocksRemoved, Tier
from router.control_plane.service import ControlPlaneService
from router.control_plane.workers import WorkerView
from router.fleet_api import FleetApi, fleet_page_routes
from router.flow_control import FlowGate
from router.http import create_http_app
from router.index.base import LocationIndex, SharedFlowState
from router.index.instrumented import InstrumentedIndex
from router.lifecycle import AnswerAccounting, RequestFlow
from router.lifecycle.tokens import PromptTokens
from router.metrics import FunnelSample, RouterMetrics, WorkerLoadSample, WorkerWiringSample
from router.probe import WiringProbe
from router.proxy.service import ProxyService
from router.proxy.upstream import Upstream
from router.routes import HotPaths
from router.routing.accuracy import PredictionAccuracy
from router.routing.decide import RoutingPlanner
from router.routing.evictions import RecentEvictions, RecentRemovals
from router.routing.funnel import CacheFunnel
from router.routing.hot_prefixes import HotPrefixes
from router.routing.pool import WorkerPool
from router.routing.predicted import PredictedPrefixes
from router.routing.sight import Sight, WiringSight
from router.routing.token_agreement import TokenCountAgreement
from router.routing.wiring import RoutingMode, is_blind
from router.scoring.policy import configured_policy
from router.tenant_limits import TenantLimiter
from router.tenants import TenantDirectory
from router.tracing import SPANLESS, Tracer
from router.upkeep import follow_scope_generations, reap_forever

REGISTRY_REFRESH_S = 0.25
"""How often the router re-reads the workers' registrations from the index."""

Task = Callable[[], Coroutine[Any, Any, None]]


@dataclass(frozen=True, slots=True)
class RouterParts:
    index: LocationIndex  # the backend, instrumented: its users record no index metrics
    workers: WorkerView
    metrics: RouterMetrics
    tenants: TenantDirectory
    pool: WorkerPool
    planner: RoutingPlanner
    flow: RequestFlow  # a generation request's life, for every front door
    proxy: ProxyService
    fleet_api: FleetApi
    control_plane: ControlPlaneService  # the gRPC Connect stream's handler
    http_app: FastAPI  # the client port's routes
    client_app: ASGIApp  # what the client port serves: http_app behind the proxy's hot paths
    admin_app: FastAPI | None  # the admin port's, where http.admin_port is set
    serving: asyncio.Event  # set while the gRPC server accepts streams
    draining: asyncio.Event  # set: /readyz fails, and the router is about to stop
    upkeep: list[Task]  # the background loops to run while the router does

    async def aclose(self) -> None:
        """Close what the parts hold open (the upstream connections)."""
        await self.proxy.upstream.close()


def assemble_router(
    settings: Settings,
    backend: LocationIndex,
    *,
    tracer: Tracer = SPANLESS,
    clock: Clock = time.monotonic,
    wall_clock: WallClock = time.time,
    rng: np.random.Generator | None = None,
) -> RouterParts:
    """The router's parts over the opened index `backend`. Every decision that reads
    time reads `clock`; agents' timestamps are compared with `wall_clock`; `rng` breaks
    the scores' ties (a seeded one makes a run repeatable)."""
    cp, proxy_settings = settings.control_plane, settings.proxy
    view = WorkerView()
    metrics = RouterMetrics()
    metrics.index_max_entries.set(settings.index.max_entries)
    index = InstrumentedIndex(backend, metrics, tracer)
    tenants = TenantDirectory.from_settings(settings.tenants)
    predicted = PredictedPrefixes(proxy_settings.predicted_ttl_s)
    accuracy = PredictionAccuracy(
        proxy_settings.suspect_after_misses,
        tolerance_tokens=cp.block_size,
        withdraw_after_suspicions=proxy_settings.withdraw_credit_after_suspicions,
        suspicion_window_s=proxy_settings.suspicion_window_s,
        withdrawal_s=proxy_settings.credit_withdrawal_s,
        clock=clock,
        on_suspect=lambda worker_id: metrics.worker_suspicions.labels(worker=worker_id).inc(),
    )
    evictions = RecentEvictions(settings.scoring.eviction_horizon_s)
    removals = RecentRemovals(settings.scoring.recent_removals_keys)
    pool = WorkerPool(
        index,
        view,
        evictions=evictions,
        accuracy=accuracy,
        unreachable_backoff_s=proxy_settings.unreachable_backoff_s,
        hand_off_s=settings.picker.hand_off_s,
        clock=clock,
    )
    agreement = TokenCountAgreement()
    funnel = CacheFunnel()
    metrics.funnel.source = functools.partial(_funnel_samples, funnel)
    hot_prefixes = HotPrefixes()
    planner = RoutingPlanner(
        index=index,
        pool=pool,
        predicted=predicted,
        policy=configured_policy(settings.scoring),
        block_size=cp.block_size,
        index_timeout_s=proxy_settings.index_timeout_s,
        tracer=tracer,
        disaggregation=settings.disaggregation,
        rng=rng,
        clock=clock,
    )
    upstream = Upstream(proxy_settings)
    gate = (
        FlowGate(
            settings.flow_control,
            pool,
            metrics,
            shared=backend if isinstance(backend, SharedFlowState) else None,
            clock=clock,
        )
        if settings.flow_control.enabled
        else None
    )
    flow = RequestFlow(
        settings=proxy_settings,
        tenants=tenants,
        pool=pool,
        planner=planner,
        limiter=TenantLimiter(clock, busy_retry_after_s=proxy_settings.retry_after_s),
        accounting=AnswerAccounting(
            pool=pool,
            accuracy=accuracy,
            agreement=agreement,
            funnel=funnel,
            removals=removals,
            hot_prefixes=hot_prefixes,
            metrics=metrics,
        ),
        metrics=metrics,
        tracer=tracer,
        gate=gate,
        clock=clock,
    )
    proxy = ProxyService(flow=flow, pool=pool, upstream=upstream, metrics=metrics)
    sight = WiringSight(view, accuracy, agreement, cp.block_size)
    admin_token = settings.http.admin_token
    fleet_api = FleetApi(
        admin_token=None if admin_token is None else admin_token.get_secret_value(),
        index=index,
        view=view,
        pool=pool,
        planner=planner,
        accuracy=accuracy,
        tenants=tenants,
        prompt_tokens=flow.prompt_tokens,
        sight=sight,
        probe=WiringProbe(
            upstream=upstream,
            prompt_tokens=flow.prompt_tokens,
            planner=planner,
            index=index,
            agreement=agreement,
            first_byte_timeout_s=proxy_settings.first_byte_timeout_s,
            clock=clock,
        ),
        max_body_bytes=proxy_settings.max_body_bytes,
        prompt_length=flow.prompt_length,
        limiter=flow.limiter,
        funnel=funnel,
        gate=gate,
        hot_prefixes=hot_prefixes,
        clock=clock,
    )
    control_plane = ControlPlaneService(
        index,
        view,
        metrics,
        cp,
        on_removed=_removals_heard(predicted, accuracy, evictions, removals, clock),
        clock=clock,
        wall_clock=wall_clock,
    )
    serving, draining = asyncio.Event(), asyncio.Event()
    readout = _Readout(metrics, planner, pool, accuracy, sight, flow.prompt_tokens)
    make_app = functools.partial(
        create_http_app,
        index=index,
        view=view,
        metrics=metrics,
        grpc_serving=serving.is_set,
        draining=draining.is_set,
        before_scrape=readout.before_scrape,
        model_routing=readout.model_routing,
    )
    # Tenants reach their own routes on the client port. With an admin port the
    # operators' routes and /metrics are there only; without one they share the client
    # port, where /metrics then needs the admin token when one is set.
    separate_admin = settings.http.admin_port is not None
    operator_routes = [*fleet_api.admin_routes(), *fleet_page_routes()]
    client_routes = [
        *proxy.routes(),
        *fleet_api.tenant_routes(),
        *([] if separate_admin else operator_routes),
    ]
    http_app = make_app(
        routes=client_routes,
        serve_metrics=not separate_admin,
        metrics_guard=None if admin_token is None else fleet_api.admin_token,
    )
    forget_the_gone = functools.partial(_forget_the_gone, pool, agreement, funnel, metrics)
    return RouterParts(
        index=index,
        workers=view,
        metrics=metrics,
        tenants=tenants,
        pool=pool,
        planner=planner,
        flow=flow,
        proxy=proxy,
        fleet_api=fleet_api,
        control_plane=control_plane,
        http_app=http_app,
        client_app=HotPaths(http_app, client_routes),
        admin_app=make_app(routes=operator_routes, serve_metrics=True) if separate_admin else None,
        serving=serving,
        draining=draining,
        upkeep=[
            functools.partial(
                reap_forever, index, view, cp.lease_s, clock, after_sweep=forget_the_gone
            ),
            functools.partial(
                pool.refresh_forever, REGISTRY_REFRESH_S, proxy_settings.index_timeout_s * 4
            ),
            functools.partial(follow_scope_generations, index, tenants),
            *([] if gate is None else [gate.run_forever]),
        ],
    )


class _Readout:
    """What the router shows of its routing when asked: the routing view, the workers'
    wiring and the tokenisation in /metrics (brought up to date before each scrape), and
    each model's routing mode in /readyz."""

    def __init__(
        self,
        metrics: RouterMetrics,
        planner: RoutingPlanner,
        pool: WorkerPool,
        accuracy: PredictionAccuracy,
        sight: WiringSight,
        prompt_tokens: PromptTokens,
    ) -> None:
        self._metrics = metrics
        self._planner = planner
        self._pool = pool
        self._accuracy = accuracy
        self._sight = sight
        self._prompt_tokens = prompt_tokens

    def routable(self) -> Sight:
        candidates = [c.info for c in self._pool.candidates()]
        return self._sight.see(candidates, {info.worker_id for info in candidates})

    def model_routing(self) -> dict[str, RoutingMode]:
        return self.routable().routing

    def before_scrape(self) -> None:
        metrics, pool = self._metrics, self._pool
        metrics.set_routing_view(
            degraded=not (self._planner.index_answering and pool.registry_is_current()),
            suspect_workers=len(self._accuracy.suspects()),
            credit_withdrawn=self._accuracy.withdrawn(),
            loads=(
                WorkerLoadSample(c.worker_id, c.traffic.in_flight, c.traffic.prefill_tokens, c.load)
                for c in pool.candidates()
            ),
        )
        seen = self.routable()
        metrics.set_wiring(
            (
                WorkerWiringSample(
                    worker_id, [(c.name, c.status.value) for c in checks], is_blind(checks)
                )
                for worker_id, checks in seen.checks.items()
            ),
            {model: mode == "predictions_only" for model, mode in seen.routing.items()},
        )
        metrics.set_tokenisation(**dataclasses.asdict(self._prompt_tokens.stats()))
        metrics.event_loop_tasks.set(len(asyncio.all_tasks()))


def _forget_the_gone(
    pool: WorkerPool, agreement: TokenCountAgreement, funnel: CacheFunnel, metrics: RouterMetrics
) -> None:
    statuses = pool.statuses()
    # Token counts of workers that are gone, or restarted, tell nothing now.
    agreement.retain((s.info.worker_id, s.info.incarnation) for s in statuses)
    workers = {s.info.worker_id for s in statuses}
    funnel.retain_workers(workers)
    metrics.retain_workers(workers)


def _funnel_samples(funnel: CacheFunnel) -> list[FunnelSample]:
    return [
        FunnelSample(
            model,
            tenant,
            {stage.value: tokens for stage, tokens in totals.stages.items()},
            {loss.value: tokens for loss, tokens in totals.losses.items()},
            totals.reported_prompt_tokens,
            totals.copied_tokens,
        )
        for (model, tenant), totals in sorted(funnel.totals().items())
    ]


def _removals_heard(
    predicted: PredictedPrefixes,
    accuracy: PredictionAccuracy,
    evictions: RecentEvictions,
    removals: RecentRemovals,
    clock: Clock,
) -> Callable[[str, BlocksRemoved | None], None]:
    def on_removed(worker_id: str, removal: BlocksRemoved | None) -> None:
        # A cleared cache (or a new incarnation) leaves `removals` as they are: it names
        # no keys, and the removals marked before it did happen.
        if removal is None:
            predicted.forget_worker(worker_id)
            accuracy.forget(worker_id)
            evictions.forget(worker_id)
            return
        predicted.removed(worker_id, removal.keys)
        if removal.tier is Tier.DEVICE:
            now = clock()
            evictions.record(worker_id, len(removal.keys), now)
            removals.record(removal.keys, now)

    return on_removed
