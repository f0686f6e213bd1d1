"""An Envoy v3 bootstrap that puts kvplane's endpoint picker in front of a fleet.

`kvplane envoy-config --endpoint IP:PORT ...` prints it as JSON (Envoy reads a JSON
bootstrap from a `.json` or `.yaml` file: YAML is a superset). What it sets up, each
part checked against a real Envoy 1.40 by tests/picker/test_envoy_config.py:

- One listener (`--listen`), an HTTP connection manager (codec AUTO), then three HTTP
  filters in this order:
  1. `envoy.filters.http.header_mutation` removes any `x-gateway-destination-endpoint`
     (and `-served`) a client sent, so that no client steers its own request, even
     while every picker is down and `--fail-open` lets requests through unpicked;
  2. `envoy.filters.http.ext_proc`, the picker: request headers sent, the request body
     `FULL_DUPLEX_STREAMED` (the default, llm-d's mode; Envoy 1.40 refuses it unless
     request trailers are sent too) or `BUFFERED` (`--body-mode buffered`); the
     response phase skipped (headers SKIP, body NONE). `failure_mode_allow` is
     `--fail-open` (the InferencePool's FailOpen; otherwise a dead picker gives a 500).
     The picker's dynamic metadata in the `envoy.lb` namespace is accepted
     (`metadata_options.receiving_namespaces`). `message_timeout` (30 s) bounds each
     answer in BUFFERED mode (a 504, or the request let through under fail-open);
     Envoy applies no timeout at all to a FULL_DUPLEX_STREAMED picker, so a picker
     that hangs holds its requests;
  3. the router, with a retry policy (`connect-failure,refused-stream,reset`, two
     retries), no route timeout (completions stream for minutes), and request bodies
     buffered up to 32 MiB (kvplane's `proxy.max_body_bytes`; Envoy's default of 1 MiB
     turns a retried larger body into a 507, and a larger BUFFERED body into a 413).
- The workers' cluster: STATIC endpoints from `--endpoint`, load-balanced by
  `envoy.load_balancing_policies.override_host`: the hosts named by the request header
  `x-gateway-destination-endpoint`, then by the metadata `envoy.lb` /
  `x-gateway-destination-endpoint`, in order, one host an attempt, so a retry goes to
  the picker's next choice; with no usable name left (the picker down under
  fail-open, an answer that named nothing or only hosts that are not endpoints), round
  robin among the endpoints.
  What this costs against the `ORIGINAL_DST` cluster other gateways use: the picker can
  only name a listed endpoint (an unknown name is ignored), so this file lists the
  fleet; in return fail-open reaches a replica, and the fallbacks work. A name must be
  Envoy's form of the address: `IP:PORT`, IPv6 as `[ADDR]:PORT` in compressed form
  (the form this module writes the endpoints in). Envoy reads both sources and joins
  them: a picker that sets both (as the protocol asks) has its list tried twice before
  round robin, so with two retries, a list of two refusing hosts ends in a 503.
- The picker's cluster: HTTP/2, one or several pickers (`--picker`, active-active,
  round robin; a host name makes it STRICT_DNS), optionally over TLS without
  verification (`--picker-tls`, as gateways do). Each picker is health-checked over
  gRPC every second: the picker must report the service
  `envoy.service.ext_proc.v3.ExternalProcessor` SERVING, or it gets no requests. A
  picker that refuses or drops a connection is passed over at once (outlier
  detection). No panic routing: with every picker down the ext_proc stream fails
  before it starts, which is what lets fail-open work in FULL_DUPLEX_STREAMED mode
  (Envoy fails open there only until the first body chunk went to the picker, so a
  picker found dead only once the body was on its way gives a 500 even under
  fail-open). Circuit breakers are raised to 40,000 as llm-d does (Envoy's default
  1,024 turns load into 500s); the workers' cluster gets the same.
- An admin interface on 127.0.0.1 (`--admin-port`): `/ready` for readiness, `/stats`;
  a cap of 50,000 client connections (Envoy warns at start without one).

What a bootstrap cannot set: the command line. On a small machine run
`envoy -c FILE --concurrency 1` (a second worker thread only slowed things on two
cores); to run several Envoys side by side add `--disable-hot-restart` (or a distinct
`--base-id` each).

What the picker must know: in BUFFERED mode the whole body comes in one gRPC message
(raise the server's `grpc.max_receive_message_length` above gRPC's 4 MiB), and Envoy
keeps the stream open until the HTTP exchange is over unless the picker ends it after
its answer (in FULL_DUPLEX_STREAMED mode Envoy ends it right after the last answer).
"""

from __future__ import annotations

import enum
import ipaddress
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

DEFAULT_LISTEN = "127.0.0.1:10000"
DEFAULT_PICKER = "127.0.0.1:9002"
DEFAULT_ADMIN_PORT = 9901

LISTENER = "kvplane"
WORKERS_CLUSTER = "kvplane_workers"
PICKER_CLUSTER = "kvplane_picker"

CIRCUIT_BREAKER_LIMIT = 40_000  # llm-d's; Envoy's default of 1,024 sheds load as 500s
MAX_CLIENT_CONNECTIONS = 50_000
MAX_BODY_BYTES = 32 * 1024 * 1024  # kvplane's proxy.max_body_bytes
RETRY_ON = "connect-failure,refused-stream,reset"

_TYPE = "type.googleapis.com/"


class EnvoyConfigError(ValueError):
    """An option the bootstrap cannot be built from; the message names it."""


class BodyMode(enum.StrEnum):
    """How Envoy sends the request body to the picker."""

    FULL_DUPLEX = "full-duplex"  # FULL_DUPLEX_STREAMED: chunks as they come (llm-d)
    BUFFERED = "buffered"  # BUFFERED: the whole body in one message


@dataclass(frozen=True, slots=True)
class HostPort:
    """An address from the command line, checked."""

    host: str  # an IP literal (IPv6 in compressed form, no brackets) or a DNS name
    port: int

    @property
    def is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def __str__(self) -> str:
        """As Envoy writes an address (what the picker must name)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_host_port(text: str, what: str, *, ip_only: bool) -> HostPort:
    """`HOST:PORT` (`[IPv6]:PORT`); `ip_only` refuses a DNS name. Raises
    EnvoyConfigError naming `what` (the flag it came from)."""

    def refuse(why: str) -> EnvoyConfigError:
        return EnvoyConfigError(f"{what} {text!r}: {why}")

    raw = text.strip()
    if raw.startswith("["):
        host, bracket, rest = raw[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise refuse("expected [IPV6]:PORT")
        port_text = rest[1:]
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            raise refuse(f"{host!r} is not an IPv6 address") from None
        host = address.compressed
    else:
        host, colon, port_text = raw.rpartition(":")
        if not colon or not host:
            raise refuse("expected HOST:PORT")
        if ":" in host:
            raise refuse("an IPv6 address goes in brackets: [IPV6]:PORT")
        try:
            host = str(ipaddress.IPv4Address(host))
        except ValueError:
            if ip_only:
                raise refuse(f"{host!r} is not an IP address") from None
            if not _is_dns_name(host):
                raise refuse(f"{host!r} is not a host name") from None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise refuse(f"{port_text!r} is not a port (1-65535)")
    return HostPort(host, int(port_text))


def _is_dns_name(host: str) -> bool:
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(
        0 < len(label) <= 63
        and label[0] != "-"
        and label[-1] != "-"
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        for label in labels
    )


def build_bootstrap(
    *,
    endpoints: Sequence[str],
    listen: str = DEFAULT_LISTEN,
    pickers: Sequence[str] = (DEFAULT_PICKER,),
    body_mode: BodyMode = BodyMode.FULL_DUPLEX,
    fail_open: bool = False,
    admin_port: int = DEFAULT_ADMIN_PORT,
    picker_tls: bool = False,
    message_timeout_s: float = 30.0,
    retries: int = 2,
    health_check_interval_s: float = 1.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    response_body: bool = False,
) -> dict[str, Any]:
    """The bootstrap (Envoy's v3 JSON form) for a fleet: pure, and strict about its
    input (EnvoyConfigError names the flag). `message_timeout_s` bounds each picker
    answer in BUFFERED mode (Envoy applies none in FULL_DUPLEX_STREAMED mode)."""
    listen_at = parse_host_port(listen, "--listen", ip_only=True)
    workers = [parse_host_port(text, "--endpoint", ip_only=True) for text in endpoints]
    picker_hosts = [parse_host_port(text, "--picker", ip_only=False) for text in pickers]
    if not workers:
        raise EnvoyConfigError("no --endpoint: name every worker (IP:PORT) Envoy may send to")
    if not picker_hosts:
        raise EnvoyConfigError("no --picker: name at least one picker (HOST:PORT)")
    for what, addresses in (("--endpoint", workers), ("--picker", picker_hosts)):
        seen: set[HostPort] = set()
        for address in addresses:
            if address in seen:
                raise EnvoyConfigError(f"{what} {address} is given twice")
            seen.add(address)
    if not 1 <= admin_port <= 65535:
        raise EnvoyConfigError(f"--admin-port {admin_port}: not a port (1-65535)")
    if admin_port == listen_at.port and listen_at.host in ("127.0.0.1", "0.0.0.0"):
        raise EnvoyConfigError(f"--admin-port {admin_port} is the listener's port")
    for name, seconds in (
        ("message timeout", message_timeout_s),
        ("health check interval", health_check_interval_s),
    ):
        if not (math.isfinite(seconds) and seconds >= 0.001):
            raise EnvoyConfigError(f"{name} {seconds}: not a time of at least 1 ms")
    if retries < 0:
        raise EnvoyConfigError(f"retries {retries}: not a count")
    if max_body_bytes < 1:
        raise EnvoyConfigError(f"max body bytes {max_body_bytes}: not a size")
    return {
        "node": {"id": "kvplane-envoy", "cluster": "kvplane"},
        "admin": {"address": _socket_address(HostPort("127.0.0.1", admin_port))},
        "overload_manager": _overload_manager(),
        "static_resources": {
            "listeners": [
                _listener(
                    listen_at,
                    body_mode,
                    fail_open,
                    message_timeout_s,
                    retries,
                    max_body_bytes,
                    response_body,
                )
            ],
            "clusters": [
                _workers_cluster(workers),
                _picker_cluster(picker_hosts, picker_tls, health_check_interval_s),
            ],
        },
    }


def render(bootstrap: dict[str, Any]) -> str:
    """The bootstrap as Envoy reads it (JSON, which a `.yaml` file may hold too)."""
    return json.dumps(bootstrap, indent=2) + "\n"


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _socket_address(address: HostPort) -> dict[str, Any]:
    return {"socket_address": {"address": address.host, "port_value": address.port}}


def _typed(name: str, type_name: str, config: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": _TYPE + type_name, **config}}


def _overload_manager() -> dict[str, Any]:
    """A cap on client connections (Envoy warns at start without one)."""
    monitor = _typed(
        "envoy.resource_monitors.global_downstream_max_connections",
        "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
        {"max_active_downstream_connections": MAX_CLIENT_CONNECTIONS},
    )
    return {"resource_monitors": [monitor]}


def _listener(
    address: HostPort,
    body_mode: BodyMode,
    fail_open: bool,
    message_timeout_s: float,
    retries: int,
    max_body_bytes: int,
    response_body: bool,
) -> dict[str, Any]:
    strip_client_headers = _typed(
        "envoy.filters.http.header_mutation",
        "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        {
            "mutations": {
                "request_mutations": [
                    {"remove": DESTINATION_HEADER},
                    {"remove": SERVED_HEADER},
                ]
            }
        },
    )
    full_duplex = body_mode is BodyMode.FULL_DUPLEX
    picker = _typed(
        "envoy.filters.http.ext_proc",
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        {
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
            "failure_mode_allow": fail_open,
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED" if full_duplex else "BUFFERED",
                # Envoy 1.40 refuses FULL_DUPLEX_STREAMED without the trailers: the
                # picker learns from them that a body ended without end_of_stream.
                "request_trailer_mode": "SEND" if full_duplex else "SKIP",
                # The response phase: skipped, or (`response_body`) every response
                # chunk through the picker, as llm-d runs, for the answers' usage and the
                # served endpoint. Streamed, never buffered: answers stream to clients.
                "response_header_mode": "SEND" if response_body else "SKIP",
                "response_body_mode": (
                    ("FULL_DUPLEX_STREAMED" if full_duplex else "STREAMED")
                    if response_body
                    else "NONE"
                ),
                "response_trailer_mode": "SEND" if response_body and full_duplex else "SKIP",
            },
            "message_timeout": _duration(message_timeout_s),
            "metadata_options": {
                "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
                # What the gateway's filters and load balancer say: the subset hint, and
                # (in the response phase) the endpoint served.
                "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, LB_NAMESPACE]},
            },
        },
    )
    router = _typed(
        "envoy.filters.http.router", "envoy.extensions.filters.http.router.v3.Router", {}
    )
    route = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": WORKERS_CLUSTER,
            "timeout": "0s",  # none: a completion streams for as long as it takes
            "retry_policy": {"retry_on": RETRY_ON, "num_retries": retries},
        },
        "request_body_buffer_limit": max_body_bytes,
    }
    manager = _typed(
        "envoy.filters.network.http_connection_manager",
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        {
            "stat_prefix": LISTENER,
            "codec_type": "AUTO",
            "route_config": {
                "name": LISTENER,
                "virtual_hosts": [{"name": "fleet", "domains": ["*"], "routes": [route]}],
            },
            "http_filters": [strip_client_headers, picker, router],
        },
    )
    return {
        "name": LISTENER,
        "address": _socket_address(address),
        "filter_chains": [{"filters": [manager]}],
    }


def _circuit_breakers() -> dict[str, Any]:
    limits = {
        "max_connections": CIRCUIT_BREAKER_LIMIT,
        "max_pending_requests": CIRCUIT_BREAKER_LIMIT,
        "max_requests": CIRCUIT_BREAKER_LIMIT,
        "max_retries": CIRCUIT_BREAKER_LIMIT,
    }
    return {"thresholds": [{"priority": "DEFAULT", **limits}, {"priority": "HIGH", **limits}]}


def _load_assignment(cluster: str, addresses: Sequence[HostPort]) -> dict[str, Any]:
    return {
        "cluster_name": cluster,
        "endpoints": [
            {
                "lb_endpoints": [
                    {"endpoint": {"address": _socket_address(address)}} for address in addresses
                ]
            }
        ],
    }


def _workers_cluster(workers: Sequence[HostPort]) -> dict[str, Any]:
    round_robin = _typed(
        "envoy.load_balancing_policies.round_robin",
        "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
        {},
    )
    override_host = _typed(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        {
            "override_host_sources": [
                {"header": DESTINATION_HEADER},
                {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
            ],
            "fallback_policy": {"policies": [{"typed_extension_config": round_robin}]},
            # The endpoint used, as GAIE's gateways report it (the picker reads it in
            # the response phase, where Envoy sends one).
            "selected_host_key": {"key": LB_NAMESPACE, "path": [{"key": SERVED_HEADER}]},
        },
    )
    return {
        "name": WORKERS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_balancing_policy": {"policies": [{"typed_extension_config": override_host}]},
        "circuit_breakers": _circuit_breakers(),
        "load_assignment": _load_assignment(WORKERS_CLUSTER, workers),
    }


def _picker_cluster(
    pickers: Sequence[HostPort], tls: bool, health_check_interval_s: float
) -> dict[str, Any]:
    interval = _duration(health_check_interval_s)
    cluster: dict[str, Any] = {
        "name": PICKER_CLUSTER,
        "type": "STATIC" if all(picker.is_ip for picker in pickers) else "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "circuit_breakers": _circuit_breakers(),
        "health_checks": [
            {
                "timeout": "1s",
                "interval": interval,
                "no_traffic_interval": interval,  # Envoy's default: once a minute
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
            }
        ],
        # A picker that refuses or drops a connection (or answers UNAVAILABLE) is
        # passed over at once for a while, before its health checks fail.
        "outlier_detection": {
            "consecutive_gateway_failure": 1,
            "enforcing_consecutive_gateway_failure": 100,
            "enforcing_consecutive_5xx": 0,  # a picker's own error is no reason
            "enforcing_success_rate": 0,
            "interval": "1s",
            "base_ejection_time": "2s",
            "max_ejection_percent": 100,
        },
        "load_assignment": _load_assignment(PICKER_CLUSTER, pickers),
    }
    if tls:
        # No validation context: the picker's certificate is not verified (llm-d's
        # picker serves a self-signed one; Envoy AI Gateway and Istio skip the check).
        context: dict[str, Any] = {"common_tls_context": {"alpn_protocols": ["h2"]}}
        names = {picker.host for picker in pickers if not picker.is_ip}
        if len(names) == 1:
            context["sni"] = names.pop()
        cluster["transport_socket"] = _typed(
            "envoy.transport_sockets.tls",
            "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            context,
        )
    return cluster
