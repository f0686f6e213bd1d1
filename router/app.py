"""`kvplane router`: the gRPC control plane, the OpenAI proxy, the fleet API and the
operators' endpoints in one event loop.

running_router() binds the configured ports (0 picks free ones), starts the parts
router/assembly.py wires and yields them with the bound ports, which the tests and the
demo use; serve() runs it until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SpanExporter
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
from router.assembly import RouterParts, assemble_router
from router.control_plane.workers import WorkerView
from router.exposure import Ports, exposure
from router.grpc_ports import bind_grpc, server_credentials
from router.index import open_index
from router.index.base import LocationIndex, LocationIndexError, index_deadline
from router.metrics import RouterMetrics
from router.picker.server import PickerServer
from router.routing.decide import RoutingPlanner
from router.routing.pool import WorkerPool
from router.tenants import TenantDirectory
from router.tracing import open_tracing

log = logging.getLogger(__name__)

_GRPC_STOP_GRACE_S = 1.0
STUCK_AFTER_DRAIN_S = 10.0
"""A router still running this long after its drain should have ended (a thread that
does not return, a peer that does not close) exits anyway."""


@dataclass(frozen=True, slots=True)
class RunningRouter:
    grpc_port: int
    http_port: int
    admin_port: int | None  # the fleet API's and /metrics' own port, when configured
    picker_port: int | None  # the gateway's endpoint picker's, when configured
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
    cp, http = settings.control_plane, settings.http
    async with contextlib.AsyncExitStack() as stack:
        # Unwound in reverse: readiness fails first, then HTTP stops (the requests in
        # progress, streams included, get http.drain_timeout_s to finish), the background
        # tasks and the upstream connections, then gRPC (streams still open are
        # cancelled after a grace period; their clean-up, dropping drained workers, needs
        # the index), and the index closes last.
        # The ports are bound first: one in use fails the start at once, before the
        # tokenizers load.
        client_listener = stack.enter_context(contextlib.closing(bind_http(http.host, http.port)))
        admin_listener = (
            None
            if http.admin_port is None
            else stack.enter_context(contextlib.closing(bind_http(http.host, http.admin_port)))
        )
        grpc_server = grpc.aio.server(options=_control_plane_options(cp))
        grpc_port = bind_grpc(
            grpc_server,
            cp.grpc_host,
            cp.grpc_port,
            server_credentials(cp.tls_cert_file, cp.tls_key_file, cp.tls_client_ca_file),
            serves="gRPC",
        )
        stack.push_async_callback(grpc_server.stop, None)  # a start that fails unbinds it
        picker = (
            None
            if settings.picker.port is None
            else PickerServer(settings.picker, settings.proxy.max_body_bytes)
        )
        picker_port = None if picker is None else picker.bind()
        if picker is not None:
            stack.push_async_callback(picker.stop, None)
        backend = open_index(settings.index, clock)
        stack.push_async_callback(backend.close)
        tracer, tracer_provider = open_tracing(settings.tracing, span_exporter)
        if tracer_provider is not None:
            stack.callback(tracer_provider.shutdown)
        parts = assemble_router(
            settings, backend, tracer=tracer, clock=clock, wall_clock=wall_clock
        )
        stack.push_async_callback(parts.aclose)
        await _catch_up(parts, settings.proxy.index_timeout_s * 4)
        for loop in parts.upkeep:
            stack.push_async_callback(cancel_task, asyncio.create_task(loop()))
        await asyncio.to_thread(parts.flow.prompt_tokens.tokenizers.preload)
        # The gRPC server stops after HTTP: agents keep the picture current while the
        # requests in progress drain.
        stack.push_async_callback(grpc_server.stop, _GRPC_STOP_GRACE_S)
        http_servers: list[tuple[ASGIApp, socket.socket]] = [(parts.client_app, client_listener)]
        if parts.admin_app is not None and admin_listener is not None:
            http_servers.append((parts.admin_app, admin_listener))
        http_port, *admin_ports = await stack.enter_async_context(
            serving_http(*http_servers, stop_grace_s=http.drain_timeout_s)
        )
        admin_port = admin_ports[0] if admin_ports else None
        grpc_server.add_generic_rpc_handlers([parts.control_plane.rpc_handler()])
        await grpc_server.start()
        if picker is not None:
            # Stopped with the HTTP port's grace: Envoy's streams are requests in progress.
            stack.push_async_callback(picker.stop, http.drain_timeout_s)
            await picker.start(parts.flow, parts.draining)
        parts.serving.set()
        stack.callback(parts.serving.clear)
        _log_exposure(settings, Ports(http_port, grpc_port, admin_port, picker_port), parts.tenants)

        yield RunningRouter(
            grpc_port=grpc_port,
            http_port=http_port,
            admin_port=admin_port,
            picker_port=picker_port,
            http_app=parts.http_app,
            admin_app=parts.admin_app,
            index=parts.index,
            workers=parts.workers,
            metrics=parts.metrics,
            pool=parts.pool,
            planner=parts.planner,
            tenants=parts.tenants,
            draining=parts.draining,
        )


async def _catch_up(parts: RouterParts, timeout_s: float) -> None:
    """Read the scope generations and the workers' registry before serving; with the
    index down the router starts anyway, and the upkeep loops retry."""
    with contextlib.suppress(LocationIndexError):
        async with index_deadline(timeout_s):
            parts.tenants.apply_generations(await parts.index.scope_generations())
            await parts.pool.refresh()


def _log_exposure(settings: Settings, ports: Ports, tenants: TenantDirectory) -> None:
    """One record of what the router exposes and to whom; a warning where something
    answers the network without a credential."""
    seen = exposure(settings, ports, anonymous=tenants.allow_anonymous)
    log.log(
        logging.WARNING if seen.open_to_network else logging.INFO,
        "router serving, index %s; what it exposes, and to whom:\n  %s",
        settings.index.backend,
        "\n  ".join(seen.lines()),
    )


async def serve(settings: Settings) -> None:
    """Run the router until SIGINT or SIGTERM, then drain: readiness fails at once, new
    requests are still served for http.drain_delay_s (load balancers take that long to
    stop sending them), then the ports close and the requests in progress, streams
    included, get http.drain_timeout_s to finish. A second signal stops it at once."""
    async with running_router(settings) as router:
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


def _control_plane_options(cp: ControlPlaneSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", cp.max_message_bytes),
        ("grpc.max_send_message_length", cp.max_message_bytes),
        # Without this a second router on the same port would share it silently.
        ("grpc.so_reuseport", 0),
    ]
