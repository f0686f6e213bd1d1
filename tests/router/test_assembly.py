"""The router assembled in one place (router/assembly.py), and what it says at start it
exposes, and to whom (router/exposure.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import SecretStr

from kvplane.core.config import (
    ControlPlaneSettings,
    HttpSettings,
    PickerSettings,
    Settings,
    TenantSettings,
    TenantSpec,
)
from kvplane.core.types import BlocksStored, Tier, WorkerInfo
from router.app import running_router
from router.assembly import assemble_router
from router.exposure import Exposure, Ports, Reach, exposure
from router.index.memory import MemoryLocationIndex
from router.tenants import ANONYMOUS_TENANT, TenantDirectory, api_key_digest

PORTS = Ports(http=8080, grpc=50051, admin=None)
SECRET = SecretStr("s" * 40)
TENANTS = TenantSettings(
    tenants=[TenantSpec(name="acme", api_key_sha256=[api_key_digest("sk-acme")])],
    cache_salt_secret=SecretStr("salt"),
)


def seen(settings: Settings, ports: Ports = PORTS) -> Exposure:
    """The exposure as the router judges it, anonymous access as its tenants decide."""
    anonymous = TenantDirectory.from_settings(settings.tenants).allow_anonymous
    return exposure(settings, ports, anonymous=anonymous)


def surfaces(exposed: Exposure) -> dict[str, tuple[Reach, str]]:
    return {
        opening.surface.split(":")[0]: (opening.reach, opening.fix) for opening in exposed.openings
    }


def test_open_defaults_say_what_is_open_to_this_machine_and_how_to_close_it() -> None:
    exposed = seen(Settings(http=HttpSettings(), control_plane=ControlPlaneSettings()))
    assert exposed.listeners == [
        "HTTP 127.0.0.1:8080 (this machine only): the OpenAI API (no API key needed), "
        "/healthz, /readyz and /openapi.json (no credential), the fleet API (off: no admin "
        "token), /metrics (no credential)",
        "gRPC 127.0.0.1:50051 (this machine only): the agents' control plane (no credential, "
        "plaintext)",
    ]
    opened = surfaces(exposed)
    assert set(opened) == {
        "the OpenAI API and the tenants' locality query without an API key",
        "/metrics without the admin token",
        "the agents' gRPC stream without a token or certificate",
    }
    assert {reach for reach, _ in opened.values()} == {Reach.MACHINE}
    assert not exposed.open_to_network
    assert (
        "KVPLANE_TENANTS__TENANTS_FILE"
        in opened["the OpenAI API and the tenants' locality query without an API key"][1]
    )
    assert "KVPLANE_HTTP__ADMIN_TOKEN" in opened["/metrics without the admin token"][1]
    grpc_fix = opened["the agents' gRPC stream without a token or certificate"][1]
    assert "KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET" in grpc_fix
    assert "KVPLANE_CONTROL_PLANE__AGENT_TOKEN" in grpc_fix
    assert all(line.startswith("open to this machine only: ") for line in exposed.lines()[2:])


def test_open_surfaces_on_every_interface_are_open_to_the_network() -> None:
    exposed = seen(
        Settings(
            http=HttpSettings(host="0.0.0.0"), control_plane=ControlPlaneSettings(grpc_host="::")
        )
    )
    assert exposed.listeners[1].startswith("gRPC [::]:50051 (the network: every interface)")
    opened = surfaces(exposed)
    assert {reach for reach, _ in opened.values()} == {Reach.NETWORK}
    assert exposed.open_to_network
    # Off loopback, a plaintext control plane is an opening of its own, closed by TLS.
    assert (
        "KVPLANE_CONTROL_PLANE__TLS_CERT_FILE"
        in opened["the control plane's traffic in plaintext"][1]
    )


def test_a_locked_down_router_says_nothing_is_open() -> None:
    settings = Settings(
        http=HttpSettings(host="0.0.0.0", admin_token=SecretStr("admin")),
        control_plane=ControlPlaneSettings(
            grpc_host="0.0.0.0",
            worker_credential_secret=SECRET,
            tls_cert_file=Path("/etc/kvplane/tls.crt"),
            tls_key_file=Path("/etc/kvplane/tls.key"),
        ),
        tenants=TENANTS,
    )
    exposed = seen(settings)
    assert exposed.openings == []
    assert not exposed.open_to_network
    assert exposed.lines() == [
        "HTTP 0.0.0.0:8080 (the network: every interface): the OpenAI API (tenant keys), "
        "/healthz, /readyz and /openapi.json (no credential), the fleet API (admin token), "
        "/metrics (admin token)",
        "gRPC 0.0.0.0:50051 (the network: every interface): the agents' control plane "
        "(worker tokens, TLS)",
        "nothing answers without a credential but /healthz, /readyz and /openapi.json",
    ]


@pytest.mark.parametrize(
    ("control_plane", "credentials"),
    [
        (ControlPlaneSettings(agent_token=SecretStr("agents")), "the agent token"),
        (ControlPlaneSettings(worker_credential_secret=SECRET), "worker tokens"),
        # Worker credentials replace the shared token: it is not named.
        (
            ControlPlaneSettings(agent_token=SecretStr("agents"), worker_credential_secret=SECRET),
            "worker tokens",
        ),
        (
            ControlPlaneSettings(
                tls_cert_file=Path("tls.crt"),
                tls_key_file=Path("tls.key"),
                tls_client_ca_file=Path("ca.crt"),
            ),
            "client certificates",
        ),
    ],
    ids=["agent-token", "worker-credentials", "both", "mtls"],
)
def test_any_agent_credential_closes_the_grpc_stream(
    control_plane: ControlPlaneSettings, credentials: str
) -> None:
    exposed = seen(Settings(control_plane=control_plane))
    assert f"the agents' control plane ({credentials}, " in exposed.listeners[-1]
    assert not any("gRPC stream" in opening.surface for opening in exposed.openings)


def test_with_an_admin_port_the_fleet_api_is_there_and_metrics_are_open_by_design() -> None:
    settings = Settings(http=HttpSettings(admin_token=SecretStr("admin"), admin_port=9090))
    exposed = seen(settings, Ports(http=8080, grpc=50051, admin=9090))
    assert exposed.listeners[:2] == [
        "HTTP 127.0.0.1:8080 (this machine only): the OpenAI API (no API key needed), "
        "/healthz, /readyz and /openapi.json (no credential)",
        "HTTP admin 127.0.0.1:9090 (this machine only): the fleet API (admin token), "
        "/metrics (no credential)",
    ]
    assert "firewall port 9090" in surfaces(exposed)["/metrics on the admin port (by design)"][1]


def test_anonymous_access_turned_on_beside_tenants_is_closed_by_turning_it_off() -> None:
    tenants = TENANTS.model_copy(update={"allow_anonymous": True})
    opened = surfaces(seen(Settings(tenants=tenants)))
    fix = opened["the OpenAI API and the tenants' locality query without an API key"][1]
    assert fix.startswith("KVPLANE_TENANTS__ALLOW_ANONYMOUS=false")


async def test_the_assembled_planner_decides_over_the_index_it_was_given() -> None:
    backend = MemoryLocationIndex()
    parts = assemble_router(Settings(control_plane=ControlPlaneSettings(block_size=4)), backend)
    try:
        assert parts.admin_app is None  # no admin port: the operators' routes share the client's
        tokens = list(range(17))  # four whole blocks, and the token the engine computes
        keys = parts.planner.keys("m", "", tokens)
        await backend.register(WorkerInfo("w1", 1, "http://127.0.0.1:1", "m", 4), 60.0)
        await backend.apply("w1", 1, [BlocksStored(keys=list(keys), tier=Tier.DEVICE)])
        await parts.pool.refresh()
        decision = await parts.planner.decide(
            model="m", tenant=ANONYMOUS_TENANT, cache_scope="", tokens=tokens
        )
        assert decision.ranked[0].worker_id == "w1"
        assert decision.matched("w1") == {Tier.DEVICE: len(keys)}
    finally:
        await parts.aclose()
        await backend.close()


async def test_a_started_router_logs_what_it_exposes_in_one_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = Settings(
        http=HttpSettings(port=0, admin_token=SecretStr("admin")),
        control_plane=ControlPlaneSettings(grpc_port=0),
    )
    with caplog.at_level(logging.INFO, logger="router.app"):
        async with running_router(settings) as router:
            pass
    records = [r for r in caplog.records if "what it exposes" in r.getMessage()]
    assert len(records) == 1
    assert records[0].levelno == logging.INFO  # loopback only: nothing open to the network
    lines = records[0].getMessage().splitlines()
    assert lines[0] == "router serving, index memory; what it exposes, and to whom:"
    assert lines[1].startswith(f"  HTTP 127.0.0.1:{router.http_port} (this machine only): ")
    assert "/metrics (admin token)" in lines[1]
    assert lines[2].startswith(f"  gRPC 127.0.0.1:{router.grpc_port} (this machine only): ")
    assert not any("/metrics without the admin token" in line for line in lines)
    assert any("the agents' gRPC stream without a token or certificate" in line for line in lines)


def test_the_picker_is_a_listener_and_open_to_the_network_only_in_plaintext() -> None:
    ports = Ports(http=8080, grpc=50051, admin=None, picker=9002)
    loopback = seen(Settings(picker=PickerSettings(port=9002)), ports)
    assert (
        "gRPC picker 127.0.0.1:9002 (this machine only): the gateway's endpoint picker "
        "(no API key needed, plaintext)"
    ) in loopback.listeners
    assert not any("picker" in opening.surface for opening in loopback.openings)
    network = seen(Settings(picker=PickerSettings(host="0.0.0.0", port=9002)), ports)
    (opening,) = [o for o in network.openings if "picker" in o.surface]
    assert opening.reach is Reach.NETWORK
    assert opening.fix.startswith("KVPLANE_PICKER__TLS_CERT_FILE")
    assert network.open_to_network
    unpicked = seen(Settings(), PORTS)
    assert not any("picker" in listener for listener in unpicked.listeners)
