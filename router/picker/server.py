"""The picker's gRPC server: Envoy's ext_proc service and the standard health service
(the services `liveness`, `readiness` and the processor's own name, as GAIE's gateways
and GKE probe them) on `picker.port`, beside the agents' control plane.

Readiness follows the router's: NOT_SERVING until it serves and again once it drains,
so that a gateway stops choosing this replica first. Liveness stays SERVING until the
process ends.
"""

from __future__ import annotations

import asyncio

import grpc.aio
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as async_health

from kvplane.core.config import PickerSettings
from router.grpc_ports import bind_grpc, server_credentials
from router.lifecycle import RequestFlow
from router.picker.service import EndpointPicker

PROCESSOR_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

_ENVELOPE_BYTES = 1 << 20  # a message's room beyond its body


def _options(max_body_bytes: int) -> list[tuple[str, int]]:
    return [
        # Envoy opens one HTTP/2 connection and multiplexes every request's stream on
        # it: the default of 100 concurrent streams would queue requests.
        ("grpc.max_concurrent_streams", 1 << 20),
        # A BUFFERED body comes whole in one message (gRPC's default cap is 4 MiB).
        ("grpc.max_receive_message_length", max_body_bytes + _ENVELOPE_BYTES),
        ("grpc.max_send_message_length", max_body_bytes + _ENVELOPE_BYTES),
        ("grpc.so_reuseport", 0),
    ]


class PickerHealth:
    """The health service's statuses, moved as the router starts and drains."""

    def __init__(self) -> None:
        self.servicer = async_health.HealthServicer()

    async def starting(self) -> None:
        await self.servicer.set(LIVENESS, _SERVING)
        await self.servicer.set(READINESS, _NOT_SERVING)
        await self.servicer.set(PROCESSOR_SERVICE, _NOT_SERVING)

    async def ready(self) -> None:
        await self.servicer.set(READINESS, _SERVING)
        await self.servicer.set(PROCESSOR_SERVICE, _SERVING)

    async def follow_drain(self, draining: asyncio.Event) -> None:
        """Not ready from the moment the router drains."""
        await draining.wait()
        await self.servicer.set(READINESS, _NOT_SERVING)
        await self.servicer.set(PROCESSOR_SERVICE, _NOT_SERVING)


class PickerServer:
    """The picker's gRPC server: bound first (a port in use fails the router's start at
    once), started once the router's parts are assembled."""

    def __init__(self, settings: PickerSettings, max_body_bytes: int) -> None:
        self.settings = settings
        self.health = PickerHealth()
        self.server = grpc.aio.server(options=_options(max_body_bytes))
        self._drain_watch: asyncio.Task[None] | None = None

    def bind(self) -> int:
        settings = self.settings
        return bind_grpc(
            self.server,
            settings.host,
            settings.port or 0,
            server_credentials(settings.tls_cert_file, settings.tls_key_file),
            serves="the endpoint picker",
        )

    async def start(self, flow: RequestFlow, draining: asyncio.Event) -> None:
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            EndpointPicker(flow), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.server)
        await self.health.starting()
        await self.server.start()
        await self.health.ready()
        self._drain_watch = asyncio.create_task(self.health.follow_drain(draining))

    async def stop(self, grace_s: float | None) -> None:
        if self._drain_watch is not None:
            self._drain_watch.cancel()
        await self.server.stop(grace_s)
