"""A router in front of simulated workers, all in the test's event loop, over loopback."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from opentelemetry.sdk.trace.export import SpanExporter

from kvplane.core.config import (
    ControlPlaneSettings,
    HttpSettings,
    IndexSettings,
    ProxySettings,
    Settings,
    TenantSettings,
    TenantSpec,
)
from router.app import RunningRouter, running_router
from router.tenants import api_key_digest
from simulations.local_workers import LocalWorker, local_workers
from tests.waiting import wait_until

MODEL = "kvplane-tiny"
ADMIN_TOKEN = "admin-secret"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
TENANT_KEYS = {"acme": "sk-acme", "globex": "sk-globex"}


def tenant_settings(**overrides: Any) -> TenantSettings:
    specs = [
        TenantSpec(name=name, api_key_sha256=[api_key_digest(key)])
        for name, key in TENANT_KEYS.items()
    ]
    return TenantSettings(tenants=specs, cache_salt_secret="test-secret", **overrides)


def router_settings(
    index: IndexSettings | None = None,
    *,
    lease_s: float = 2.0,
    tenants: TenantSettings | None = None,
    proxy: Mapping[str, Any] | None = None,
) -> Settings:
    return Settings(
        index=index or IndexSettings(),
        control_plane=ControlPlaneSettings(grpc_port=0, lease_s=lease_s),
        http=HttpSettings(port=0, admin_token=ADMIN_TOKEN),
        proxy=ProxySettings(**(proxy or {})),
        tenants=tenants or tenant_settings(),
    )


@dataclass
class RoutedFleet:
    router: RunningRouter
    workers: list[LocalWorker]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.http_port}"

    def openai(self, tenant: str = "acme") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=TENANT_KEYS[tenant], max_retries=0
        )

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30)

    def worker(self, worker_id: str) -> LocalWorker:
        return next(worker for worker in self.workers if worker.worker_id == worker_id)


@contextlib.asynccontextmanager
async def routed_fleet(
    count: int = 2,
    settings: Settings | None = None,
    *,
    sim_options: Mapping[str, Any] | None = None,
    worker_sim_options: Mapping[str, Mapping[str, Any]] | None = None,
    labels: Mapping[str, Mapping[str, str]] | None = None,
    span_exporter: SpanExporter | None = None,
) -> AsyncIterator[RoutedFleet]:
    settings = settings or router_settings()
    secret = settings.control_plane.worker_credential_secret  # each agent gets its token
    options = {"time_scale": 0.0, "num_gpu_blocks_override": 256, **(sim_options or {})}
    async with (
        running_router(settings, span_exporter=span_exporter) as router,
        local_workers(
            count,
            grpc_port=router.grpc_port,
            sim_options=options,
            worker_sim_options=worker_sim_options,
            labels=labels,
            worker_credential_secret=None if secret is None else secret.get_secret_value(),
        ) as workers,
    ):

        def all_routable() -> bool:
            return len(router.pool.candidates(MODEL)) == count

        await wait_until("every worker is routable", all_routable)
        yield RoutedFleet(router, workers)
