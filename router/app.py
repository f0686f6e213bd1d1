"""`kvplane router`: the gRPC control plane, the OpenAI proxy, the fleet API and the
operators' endpoints in one event loop.

running_router() starts everything on the configured ports (0 picks free ones) and
yields the bound ports, which the tests and the demo use; serve() runs it until
SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.routing import BaseRoute
from starlette.types import ASGIApp

from kvplane.core.clock import Clock, WallClock
from kvplane.core.config import ControlPlaneSettings, Settings
from kvplane.core.serving import (
    bind_http,
    cancel_task,
    freeze_startup_heap,
    serving_http,
    wait_for_stop_signal,
)
from kvplane.core.types import BlocksRemoved, Tier
from router.auth import AdminToken
from router.control_plane.service import ControlPlaneService
from router.control_plane.workers import WorkerView
from router.fleet_api import FleetApi
from router.fleet_api.page import fleet_page_routes
from router.http import create_http_app
from router.index import open_index
from router.index.base import LocationIndex, LocationIndexError, index_deadline
from router.index.instrumented import InstrumentedIndex
from router.metrics import FunnelSample, RouterMetrics, WorkerLoadSample, WorkerWiringSample
from router.probe import WiringProbe
from router.proxy.service import ProxyService
from router.proxy.upstream import Upstream
from router.routes import HotPaths
from router.routing.accuracy import PredictionAccuracy
from router.routing.decide import RoutingPlanner
from router.routing.evictions import RecentEvictions
from router.routing.funnel import CacheFunnel
from router.routing.hot_prefixes import HotPrefixes
from router.routing.pool import WorkerPool
from router.routing.predicted import PredictedPrefixes
from router.routing.sight import Sight, WiringSight
from router.routing.token_agreement import TokenCountAgreement
from router.routing.wiring import is_blind
from router.scoring.policy import configured_policy
from router.tenant_limits import TenantLimiter
from router.tenants import TenantDirectory
from router.tracing import open_tracing

log = logging.getLogger(__name__)

_GRPC_STOP_GRACE_S = 1.0
STUCK_AFTER_DRAIN_S = 10.0
"""A router still running this long after its drain should have ended (a thread that
does not return, a peer that does not close) exits anyway."""
REGISTRY_REFRESH_S = 0.25
"""How often the router re-reads the workers' registrations from the index."""
SCOPE_REFRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class RunningRouter:
    grpc_port: int
    http_port: int
    admin_port: int | None  # the fleet API's and /metrics' own port, when configured
    http_app: FastAPI
    admin_app: FastAPI | None
    index: LocationIndex
    workers: WorkerView
    metrics: RouterMetrics
    pool: WorkerPool
    planner: RoutingPlanner
    tenants: TenantDirectory
    draining: asyncio.Event  # set: /readyz fails, and the router is about to stop


@contextlib.asynccontextmanager
async def running_router(
    settings: Settings,
    *,
    span_exporter: SpanExporter | None = None,
    clock: Clock = time.monotonic,
    wall_clock: WallClock = time.time,
) -> AsyncIterator[RunningRouter]:
    """The router on the configured ports; `span_exporter` receives its spans, and
    every decision that reads time reads `clock` (tests drive both by hand)."""
    cp, proxy_settings, http = settings.control_plane, settings.proxy, settings.http
    async with contextlib.AsyncExitStack() as stack:
        # Unwound in reverse: readiness fails first, then HTTP stops (the requests in
        # progress, streams included, get http.drain_timeout_s to finish), the upstream
        # connections and the background tasks, then gRPC (streams still open are
        # cancelled after a grace period; their clean-up, dropping drained workers, needs
        # the index), and the index closes last.
        # The ports are bound first: one in use fails the start at once, before the
        # tokenizers load.
        public_listener = stack.enter_context(contextlib.closing(bind_http(http.host, http.port)))
        admin_listener = (
            None
            if http.admin_port is None
            else stack.enter_context(contextlib.closing(bind_http(http.host, http.admin_port)))
        )
        grpc_server = grpc.aio.server(options=_grpc_options(cp))
        grpc_port = _bind_grpc(grpc_server, cp)
        stack.push_async_callback(grpc_server.stop, None)  # a start that fails unbinds it
        backend = open_index(settings.index, clock)
        stack.push_async_callback(backend.close)
        tracer, tracer_provider = open_tracing(settings.tracing, span_exporter)
        if tracer_provider is not None:
            stack.callback(tracer_provider.shutdown)
        view = WorkerView()
        metrics = RouterMetrics()
        metrics.index_max_entries.set(settings.index.max_entries)
        # Every user of the index below gets it instrumented: they record no index
        # metrics or spans of their own.
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
        pool = WorkerPool(
            index,
            view,
            evictions=evictions,
            accuracy=accuracy,
            unreachable_backoff_s=proxy_settings.unreachable_backoff_s,
            clock=clock,
        )
        agreement = TokenCountAgreement()
        funnel = CacheFunnel()
        metrics.funnel.source = functools.partial(_funnel_samples, funnel)
        hot_prefixes = HotPrefixes()
        sight = WiringSight(view, accuracy, agreement, cp.block_size)
        planner = RoutingPlanner(
            index=index,
            pool=pool,
            predicted=predicted,
            policy=configured_policy(settings.scoring),
            block_size=cp.block_size,
            index_timeout_s=proxy_settings.index_timeout_s,
            tracer=tracer,
            clock=clock,
        )
        with contextlib.suppress(LocationIndexError):  # the index is down: the tasks below retry
            async with index_deadline(proxy_settings.index_timeout_s * 4):
                tenants.apply_generations(await index.scope_generations())
                await pool.refresh()
        reaper = asyncio.create_task(
            reap_forever(
                index,
                view,
                cp.lease_s,
                clock,
                after_sweep=functools.partial(_forget_the_gone, pool, agreement, funnel, metrics),
            )
        )
        stack.push_async_callback(cancel_task, reaper)
        refresher = asyncio.create_task(
            pool.refresh_forever(REGISTRY_REFRESH_S, proxy_settings.index_timeout_s * 4)
        )
        stack.push_async_callback(cancel_task, refresher)
        generations = asyncio.create_task(follow_scope_generations(index, tenants))
        stack.push_async_callback(cancel_task, generations)
        upstream = Upstream(proxy_settings)
        stack.push_async_callback(upstream.close)
        proxy = ProxyService(
            settings=proxy_settings,
            tenants=tenants,
            pool=pool,
            planner=planner,
            accuracy=accuracy,
            agreement=agreement,
            upstream=upstream,
            metrics=metrics,
            tracer=tracer,
            limiter=TenantLimiter(clock, busy_retry_after_s=proxy_settings.retry_after_s),
            funnel=funnel,
            hot_prefixes=hot_prefixes,
            clock=clock,
        )
        await asyncio.to_thread(proxy.prompt_tokens.tokenizers.preload)
        admin_token = settings.http.admin_token
        fleet_api = FleetApi(
            admin_token=None if admin_token is None else admin_token.get_secret_value(),
            index=index,
            view=view,
            pool=pool,
            planner=planner,
            accuracy=accuracy,
            tenants=tenants,
            prompt_tokens=proxy.prompt_tokens,
            sight=sight,
            probe=WiringProbe(
                upstream=upstream,
                prompt_tokens=proxy.prompt_tokens,
                planner=planner,
                index=index,
                agreement=agreement,
                first_byte_timeout_s=proxy_settings.first_byte_timeout_s,
                clock=clock,
            ),
            max_body_bytes=proxy_settings.max_body_bytes,
            prompt_length=proxy.prompt_length,
            limiter=proxy.limiter,
            funnel=funnel,
            hot_prefixes=hot_prefixes,
            clock=clock,
        )

        serving = asyncio.Event()  # set while the gRPC server accepts streams
        draining = asyncio.Event()

        def see_routable() -> Sight:
            candidates = [c.info for c in pool.candidates()]
            return sight.see(candidates, {info.worker_id for info in candidates})

        def before_scrape() -> None:
            metrics.set_routing_view(
                degraded=not (planner.index_answering and pool.registry_is_current()),
                suspect_workers=len(accuracy.suspects()),
                credit_withdrawn=accuracy.withdrawn(),
                loads=(
                    WorkerLoadSample(
                        c.worker_id, c.traffic.in_flight, c.traffic.prefill_tokens, c.load
                    )
                    for c in pool.candidates()
                ),
            )
            seen = see_routable()
            metrics.set_wiring(
                (
                    WorkerWiringSample(
                        worker_id, [(c.name, c.status.value) for c in checks], is_blind(checks)
                    )
                    for worker_id, checks in seen.checks.items()
                ),
                {model: mode == "predictions_only" for model, mode in seen.routing.items()},
            )
            metrics.set_tokenisation(**dataclasses.asdict(proxy.prompt_tokens.stats()))
            metrics.event_loop_tasks.set(len(asyncio.all_tasks()))

        def http_app(
            routes: Sequence[BaseRoute],
            *,
            serve_metrics: bool,
            metrics_guard: AdminToken | None = None,
        ) -> FastAPI:
            return create_http_app(
                index=index,
                view=view,
                metrics=metrics,
                grpc_serving=serving.is_set,
                draining=draining.is_set,
                routes=routes,
                before_scrape=before_scrape,
                model_routing=lambda: see_routable().routing,
                serve_metrics=serve_metrics,
                metrics_guard=metrics_guard,
            )

        # Tenants reach their own routes on the client port. With an admin port the
        # operators' routes and /metrics are there only; without one they share the
        # client port, where /metrics then needs the admin token when one is set.
        separate_admin = admin_listener is not None
        operator_routes = [*fleet_api.admin_routes(), *fleet_page_routes()]
        public_routes = [
            *proxy.routes(),
            *fleet_api.tenant_routes(),
            *([] if separate_admin else operator_routes),
        ]
        public_app = http_app(
            public_routes,
            serve_metrics=not separate_admin,
            metrics_guard=None if admin_token is None else fleet_api.admin_token,
        )
        # The gRPC server stops after HTTP: agents keep the picture current while the
        # requests in progress drain.
        stack.push_async_callback(grpc_server.stop, _GRPC_STOP_GRACE_S)
        admin_app = (
            None if admin_listener is None else http_app(operator_routes, serve_metrics=True)
        )
        http_servers: list[tuple[ASGIApp, socket.socket]] = [
            (HotPaths(public_app, public_routes), public_listener)
        ]
        if admin_app is not None and admin_listener is not None:
            http_servers.append((admin_app, admin_listener))
        http_port, *admin_ports = await stack.enter_async_context(
            serving_http(*http_servers, stop_grace_s=http.drain_timeout_s)
        )
        admin_port = admin_ports[0] if admin_ports else None

        grpc_server.add_generic_rpc_handlers(
            [
                ControlPlaneService(
                    index,
                    view,
                    metrics,
                    cp,
                    on_removed=_removals_heard(predicted, accuracy, evictions, clock),
                    clock=clock,
                    wall_clock=wall_clock,
                ).rpc_handler()
            ]
        )
        await grpc_server.start()
        serving.set()
        stack.callback(serving.clear)

        yield RunningRouter(
            grpc_port=grpc_port,
            http_port=http_port,
            admin_port=admin_port,
            http_app=public_app,
            admin_app=admin_app,
            index=index,
            workers=view,
            metrics=metrics,
            pool=pool,
            planner=planner,
            tenants=tenants,
            draining=draining,
        )


async def serve(settings: Settings) -> None:
    """Run the router until SIGINT or SIGTERM, then drain: readiness fails at once, new
    requests are still served for http.drain_delay_s (load balancers take that long to
    stop sending them), then the ports close and the requests in progress, streams
    included, get http.drain_timeout_s to finish. A second signal stops it at once."""
    async with running_router(settings) as router:
        log.info(
            "router serving: gRPC control plane on %s:%d, HTTP on %s:%d, index %s",
            settings.control_plane.grpc_host,
            router.grpc_port,
            settings.http.host,
            router.http_port,
            settings.index.backend,
        )
        freeze_startup_heap()
        await wait_for_stop_signal()
        drain = settings.http
        router.draining.set()
        log.info(
            "draining: /readyz fails; new requests are served for %g s, then those in "
            "progress get %g s to finish",
            drain.drain_delay_s,
            drain.drain_timeout_s,
        )
        _exit_if_still_running_after(
            drain.drain_delay_s + drain.drain_timeout_s + STUCK_AFTER_DRAIN_S
        )
        await asyncio.sleep(drain.drain_delay_s)
        log.info("stopping")


def _exit_if_still_running_after(seconds: float) -> None:
    """Exit the process `seconds` from now if it is still running: the last word of a
    drain, whatever holds it up (a tokeniser thread the event loop's shutdown waits for,
    a connection that never closes)."""

    def exit_now() -> None:
        log.error("still running %g s after the stop signal; exiting", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()


async def follow_scope_generations(index: LocationIndex, tenants: TenantDirectory) -> None:
    """Keep the tenants' salts on the scope generations in the index: a purge through
    another router replica takes effect here within SCOPE_REFRESH_S."""
    while True:
        try:
            tenants.apply_generations(await index.scope_generations())
        except LocationIndexError as error:  # the index is down: keep the salts we have
            log.debug("reading scope generations failed (%s)", type(error).__name__)
        except Exception:  # a task's edge: a bug raised further is never seen, so log it
            log.exception("reading scope generations failed")
        await asyncio.sleep(SCOPE_REFRESH_S)


async def reap_forever(
    index: LocationIndex,
    view: WorkerView,
    lease_s: float,
    clock: Clock,
    after_sweep: Callable[[], None] = lambda: None,
) -> None:
    """Purge expired workers about four times per lease, so a dead worker's entries
    outlive its lease by a quarter of one at most; then `after_sweep()`."""
    while True:
        await asyncio.sleep(lease_s / 4)
        try:
            await reap_once(index, view, lease_s, clock)
            after_sweep()
        except Exception:  # a task's edge: a bug raised further is never seen, so log it
            log.exception("reaping expired workers failed")


async def reap_once(index: LocationIndex, view: WorkerView, lease_s: float, clock: Clock) -> None:
    try:
        purged = await index.purge_expired()
    except LocationIndexError as error:  # the reaper outlives index outages and tries again
        # No sweep either: while the index is down no agent can renew its lease, and
        # expiring them all here would stop routing to a healthy fleet. A worker that
        # really died meanwhile costs a failover, not a failed request.
        log.warning("purging expired workers failed (%s)", type(error).__name__)
        return
    view.sweep(purged, clock(), lease_s)
    if purged:
        log.info("purged %d expired workers: %s", len(purged), ", ".join(purged))


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
        )
        for (model, tenant), totals in sorted(funnel.totals().items())
    ]


def _removals_heard(
    predicted: PredictedPrefixes,
    accuracy: PredictionAccuracy,
    evictions: RecentEvictions,
    clock: Clock,
) -> Callable[[str, BlocksRemoved | None], None]:
    def on_removed(worker_id: str, removal: BlocksRemoved | None) -> None:
        if removal is None:
            predicted.forget_worker(worker_id)
            accuracy.forget(worker_id)
            evictions.forget(worker_id)
            return
        predicted.removed(worker_id, removal.keys)
        if removal.tier is Tier.DEVICE:
            evictions.record(worker_id, len(removal.keys), clock())

    return on_removed


def _grpc_options(cp: ControlPlaneSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", cp.max_message_bytes),
        ("grpc.max_send_message_length", cp.max_message_bytes),
        # Without this a second router on the same port would share it silently.
        ("grpc.so_reuseport", 0),
    ]


def _bind_grpc(server: grpc.aio.Server, cp: ControlPlaneSettings) -> int:
    host = f"[{cp.grpc_host}]" if ":" in cp.grpc_host else cp.grpc_host
    address = f"{host}:{cp.grpc_port}"
    credentials = _server_credentials(cp)
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:  # gRPC says only that binding failed
        raise OSError(
            f"cannot listen on {address} for gRPC: in use, or not an address of this machine"
        ) from None


def _server_credentials(cp: ControlPlaneSettings) -> grpc.ServerCredentials | None:
    if cp.tls_cert_file is None or cp.tls_key_file is None:
        return None
    files = _CertificateFiles(cp.tls_cert_file, cp.tls_key_file, cp.tls_client_ca_file)
    return grpc.dynamic_ssl_server_credentials(
        files.configuration(),
        files.changed_configuration,  # type: ignore[arg-type]  # None is allowed: gRPC's docs
        require_client_authentication=cp.tls_client_ca_file is not None,
    )


class _CertificateFiles:
    """The router's certificate, key and client CA, read again when a file changes:
    cert-manager renews certificates in place, and a router that kept the first would
    serve an expired one. gRPC asks before each new connection's handshake."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self._paths = [path for path in (cert, key, client_ca) if path is not None]
        self._cert, self._key, self._client_ca = cert, key, client_ca
        self._stamps = self._stat()

    def _stat(self) -> list[tuple[int, int]]:
        return [(stat.st_mtime_ns, stat.st_size) for stat in map(os.stat, self._paths)]

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(self._key.read_bytes(), self._cert.read_bytes())],
            root_certificates=None if self._client_ca is None else self._client_ca.read_bytes(),
        )

    def changed_configuration(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when a file changed since the last read; else None (keep
        the current one), also when the files cannot be read right now (mid-rotation)."""
        try:
            stamps = self._stat()
            if stamps == self._stamps:
                return None
            configuration = self.configuration()
        except OSError as error:
            log.warning("the control plane's TLS files cannot be read (%s)", error.strerror)
            return None
        self._stamps = stamps
        log.info("the control plane's TLS certificate files changed: reloaded")
        return configuration
