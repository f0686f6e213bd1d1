"""What a router exposes, and to whom: each address it listens on, whether other machines
reach it or this one only, and each surface that answers without a credential with the
setting that closes it (docs/security.md). Pure; router/app.py logs it at start."""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

from kvplane.core.config import ControlPlaneSettings, Settings

_PUBLIC = "/healthz, /readyz and /openapi.json"  # open by design: no data of the fleet's


class Reach(enum.Enum):
    MACHINE = "this machine only"
    NETWORK = "the network"


@dataclass(frozen=True, slots=True)
class Ports:
    """The ports a router listens on, as bound (port 0 picks one)."""

    http: int
    grpc: int
    admin: int | None
    picker: int | None = None


@dataclass(frozen=True, slots=True)
class Opening:
    """A surface that answers without a credential."""

    surface: str
    reach: Reach
    fix: str


@dataclass(frozen=True, slots=True)
class Exposure:
    listeners: list[str]  # each address, who reaches it, what it serves with which credential
    openings: list[Opening]

    @property
    def open_to_network(self) -> bool:
        return any(opening.reach is Reach.NETWORK for opening in self.openings)

    def lines(self) -> list[str]:
        openings = [
            f"open to {opening.reach.value}: {opening.surface}; fix: {opening.fix}"
            for opening in self.openings
        ]
        return [
            *self.listeners,
            *(openings or [f"nothing answers without a credential but {_PUBLIC}"]),
        ]


def exposure(settings: Settings, ports: Ports, *, anonymous: bool) -> Exposure:
    """`anonymous`: whether the proxy takes requests without an API key, as the tenant
    directory decided (a tenants file may name tenants or none)."""
    http, cp = settings.http, settings.control_plane
    http_reach, grpc_reach = _reach(http.host), _reach(cp.grpc_host)
    admin_token = "admin token" if http.admin_token is not None else None
    fleet_api = f"the fleet API ({admin_token or 'off: no admin token'})"
    client = [
        f"the OpenAI API ({'no API key needed' if anonymous else 'tenant keys'})",
        f"{_PUBLIC} (no credential)",
    ]
    if ports.admin is None:
        metrics = f"/metrics ({admin_token or 'no credential'})"
        listeners = [_listener("HTTP", http.host, ports.http, [*client, fleet_api, metrics])]
    else:
        listeners = [
            _listener("HTTP", http.host, ports.http, client),
            _listener(
                "HTTP admin", http.host, ports.admin, [fleet_api, "/metrics (no credential)"]
            ),
        ]
    agent_credentials = _agent_credentials(cp)
    transport = "plaintext" if cp.tls_cert_file is None else "TLS"
    control_plane = (
        f"the agents' control plane ({' and '.join(agent_credentials) or 'no credential'}, "
        f"{transport})"
    )
    listeners.append(_listener("gRPC", cp.grpc_host, ports.grpc, [control_plane]))
    picker = settings.picker
    if ports.picker is not None:
        picker_transport = "plaintext" if picker.tls_cert_file is None else "TLS"
        keys = "no API key needed" if anonymous else "tenant keys"
        listeners.append(
            _listener(
                "gRPC picker",
                picker.host,
                ports.picker,
                [f"the gateway's endpoint picker ({keys}, {picker_transport})"],
            )
        )
    openings = []
    if anonymous:
        openings.append(
            Opening(
                "the OpenAI API and the tenants' locality query without an API key",
                http_reach,
                "KVPLANE_TENANTS__ALLOW_ANONYMOUS=false, with tenants' API keys (--tenants-file)"
                if settings.tenants.allow_anonymous
                else "tenants' API keys (--tenants-file or KVPLANE_TENANTS__TENANTS_FILE): "
                "anonymous access ends with the first tenant",
            )
        )
    if ports.admin is not None:
        openings.append(
            Opening(
                "/metrics on the admin port (by design)",
                http_reach,
                f"firewall port {ports.admin} to operators and Prometheus (the chart's "
                "NetworkPolicy does)",
            )
        )
    elif admin_token is None:
        openings.append(
            Opening(
                "/metrics without the admin token",
                http_reach,
                "KVPLANE_HTTP__ADMIN_TOKEN (Prometheus scrapes with it), or --admin-port "
                "(KVPLANE_HTTP__ADMIN_PORT) behind a firewall",
            )
        )
    if not agent_credentials:
        openings.append(
            Opening(
                "the agents' gRPC stream without a token or certificate: whoever reaches it "
                "can register a worker and be sent requests",
                grpc_reach,
                "KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET (each agent its own token: "
                "kvplane worker-token), KVPLANE_CONTROL_PLANE__AGENT_TOKEN, or mutual TLS "
                "(KVPLANE_CONTROL_PLANE__TLS_CLIENT_CA_FILE)",
            )
        )
    # On loopback only this machine's root could read the traffic: TLS adds nothing there.
    if cp.tls_cert_file is None and grpc_reach is Reach.NETWORK:
        openings.append(
            Opening(
                "the control plane's traffic in plaintext: its tokens and the KV events "
                "readable on the way",
                grpc_reach,
                "KVPLANE_CONTROL_PLANE__TLS_CERT_FILE and KVPLANE_CONTROL_PLANE__TLS_KEY_FILE",
            )
        )
    if (
        ports.picker is not None
        and picker.tls_cert_file is None
        and _reach(picker.host) is Reach.NETWORK
    ):
        openings.append(
            Opening(
                "the endpoint picker's traffic in plaintext: the requests Envoy streams to it, "
                "API keys and prompts, readable on the way",
                Reach.NETWORK,
                "KVPLANE_PICKER__TLS_CERT_FILE and KVPLANE_PICKER__TLS_KEY_FILE (gateways "
                "connect with TLS without verifying it), or a network policy",
            )
        )
    return Exposure(listeners, openings)


def _agent_credentials(cp: ControlPlaneSettings) -> list[str]:
    """What an agent must present on the gRPC stream (none: anyone may speak)."""
    credentials = []
    # Worker credentials replace the shared token (router/control_plane/service.py).
    if cp.worker_credential_secret is not None:
        credentials.append("worker tokens")
    elif cp.agent_token is not None:
        credentials.append("the agent token")
    if cp.tls_client_ca_file is not None:
        credentials.append("client certificates")
    return credentials


def _listener(kind: str, host: str, port: int, surfaces: list[str]) -> str:
    reach = _reach(host).value + (": every interface" if _is_unspecified(host) else "")
    return f"{kind} {_address(host, port)} ({reach}): {', '.join(surfaces)}"


def _reach(host: str) -> Reach:
    """Who reaches an address: a name may resolve to any interface."""
    if host == "localhost":
        return Reach.MACHINE
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return Reach.NETWORK
    return Reach.MACHINE if address.is_loopback else Reach.NETWORK


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
