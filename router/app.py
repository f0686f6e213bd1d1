"""`kvplane router`: the gRPC control plane and the HTTP endpoints in one event loop.

running_router() starts everything on the configured ports (0 picks free ones) and
yields the bound ports, which the tests and the demo use; serve() runs it until
SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio

from kvplane.config import ControlPlaneSettings, Settings
from kvplane.serving import cancel_task, serving_http, wait_for_stop_signal
from router.control_plane.service import ControlPlaneService
from router.control_plane.workers import WorkerView
from router.http import create_http_app
from router.index import open_index
from router.index.base import LocationIndex
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

_GRPC_STOP_GRACE_S = 1.0
_HTTP_STOP_GRACE_S = 2


@dataclass(frozen=True, slots=True)
class RunningRouter:
    grpc_port: int
    http_port: int
    index: LocationIndex
    workers: WorkerView
    metrics: RouterMetrics


@contextlib.asynccontextmanager
async def running_router(settings: Settings) -> AsyncIterator[RunningRouter]:
    cp = settings.control_plane
    async with contextlib.AsyncExitStack() as stack:
        # Unwound in reverse: readiness fails first, then gRPC stops (streams still open
        # are cancelled after a grace period; their clean-up, dropping drained workers,
        # needs the index), then HTTP and the reaper, and the index closes last.
        index = open_index(settings.index)
        stack.push_async_callback(index.close)
        view = WorkerView()
        metrics = RouterMetrics()
        reaper = asyncio.create_task(reap_forever(index, view, cp.lease_s))
        stack.push_async_callback(cancel_task, reaper)

        serving = asyncio.Event()  # set while the gRPC server accepts streams
        http_app = create_http_app(
            index=index, view=view, metrics=metrics, grpc_serving=serving.is_set
        )
        http_port = await stack.enter_async_context(
            serving_http(
                http_app, settings.http.host, settings.http.port, stop_grace_s=_HTTP_STOP_GRACE_S
            )
        )

        grpc_server = grpc.aio.server(options=_grpc_options(cp))
        grpc_server.add_generic_rpc_handlers(
            [ControlPlaneService(index, view, metrics, cp).rpc_handler()]
        )
        grpc_port = _bind_grpc(grpc_server, cp)
        await grpc_server.start()
        stack.push_async_callback(grpc_server.stop, _GRPC_STOP_GRACE_S)
        serving.set()
        stack.callback(serving.clear)

        yield RunningRouter(
            grpc_port=grpc_port,
            http_port=http_port,
            index=index,
            workers=view,
            metrics=metrics,
        )


async def serve(settings: Settings) -> None:
    """Run the router until SIGINT or SIGTERM."""
    async with running_router(settings) as router:
        log.info(
            "router serving: gRPC control plane on %s:%d, HTTP on %s:%d, index %s",
            settings.control_plane.grpc_host,
            router.grpc_port,
            settings.http.host,
            router.http_port,
            settings.index.backend,
        )
        await wait_for_stop_signal()
        log.info("stopping")


async def reap_forever(index: LocationIndex, view: WorkerView, lease_s: float) -> None:
    """Purge expired workers about four times per lease, so a dead worker's entries
    outlive its lease by a quarter of one at most."""
    while True:
        await asyncio.sleep(lease_s / 4)
        await reap_once(index, view, lease_s)


async def reap_once(index: LocationIndex, view: WorkerView, lease_s: float) -> None:
    try:
        purged = await index.purge_expired()
    except Exception as error:  # the reaper outlives index outages and tries again
        log.warning("purging expired workers failed (%s)", type(error).__name__)
        purged = []
    view.sweep(purged, time.monotonic(), lease_s)
    if purged:
        log.info("purged %d expired workers: %s", len(purged), ", ".join(purged))


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
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def _server_credentials(cp: ControlPlaneSettings) -> grpc.ServerCredentials | None:
    if cp.tls_cert_file is None or cp.tls_key_file is None:
        return None
    client_ca = None if cp.tls_client_ca_file is None else cp.tls_client_ca_file.read_bytes()
    return grpc.ssl_server_credentials(
        [(cp.tls_key_file.read_bytes(), cp.tls_cert_file.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
